"""The 🤗 Trainer trains each memlm model from a real tokenizer and a `datasets` dataset, and saves it loadable."""

import copy

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

from memlm import (
    DeltaNetForCausalLM,
    ExpireSpanConfig,
    ExpireSpanForCausalLM,
    FeedbackTransformerConfig,
    FeedbackTransformerForCausalLM,
)
from tests.conftest import DELTANET_VARIANTS

# 🤗-facing: also run under the newest and the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = pytest.mark.huggingface

MODELS = {
    "deltanet_paper": lambda: DeltaNetForCausalLM(DELTANET_VARIANTS["paper"]()),
    "deltanet_fla": lambda: DeltaNetForCausalLM(DELTANET_VARIANTS["fla"]()),
    "expire_span": lambda: ExpireSpanForCausalLM(
        ExpireSpanConfig(
            vocab_size=258,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_span=32,
            ramp=4,
            block_size=16,
            span_loss_coefficient=1e-4,
            memory_shortening=True,
        )
    ),  # fmt: skip
    "feedback": lambda: FeedbackTransformerForCausalLM(
        FeedbackTransformerConfig(
            vocab_size=258,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            memory_span=16,
        )
    ),  # fmt: skip
}

TEXT = "the delta rule writes what the memory does not yet know. " * 60


@pytest.mark.parametrize("name", list(MODELS))
def test_trainer_lowers_the_loss_and_saves(tmp_path, tokenizer, name):
    model = MODELS[name]()
    ids = tokenizer(TEXT)["input_ids"]
    block = 48
    blocks = [ids[start : start + block] for start in range(0, len(ids) - block, block)]
    dataset = Dataset.from_dict({"input_ids": blocks})
    split = dataset.train_test_split(test_size=8, seed=0)
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, per_device_eval_batch_size=8,
        learning_rate=3e-3, max_steps=40, logging_steps=10, save_strategy="no", report_to=[], seed=0,
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=arguments, train_dataset=split["train"], eval_dataset=split["test"],
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )  # fmt: skip
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < before - 1.0, (before, after)
    trainer.save_model(str(tmp_path / "final"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    sample = torch.tensor([blocks[0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(sample).logits, model.eval()(sample).logits)


TEXTS = ["fast weights remember", "a memory that expires", "feedback from the top layer to the first one"]


def _loss_of_each_alone(model, examples) -> torch.Tensor:
    """The token-weighted mean of each example's loss run alone: what a batch of them must give."""
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            ids = torch.tensor([example["input_ids"]])
            total += model(ids, labels=ids).loss * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


def _train_a_few_steps(model, examples, collator, tmp_path) -> float:
    dataset = Dataset.from_dict({"input_ids": [example["input_ids"] for example in examples] * 8})
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=6, learning_rate=3e-3, max_steps=4,
        save_strategy="no", report_to=[], seed=0, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model.train(), args=arguments, train_dataset=dataset, data_collator=collator)
    return trainer.train().training_loss


@pytest.mark.parametrize("name", list(MODELS))
def test_right_padded_collator_batches_train_like_each_row_alone(tmp_path, tokenizer, name):
    """Examples of different lengths, padded on the right by the collator (the byte-level tokenizer's default side):
    the batch loss is the token-weighted mean of each row's loss alone, and the Trainer trains on such batches."""
    tokenizer = copy.deepcopy(tokenizer)  # the fixture is shared: other tests pad on the left
    tokenizer.padding_side = "right"
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    examples = [{"input_ids": tokenizer(text)["input_ids"]} for text in TEXTS]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    batch = collator(examples)
    assert (batch["attention_mask"] == 0).any() and (batch["labels"] == -100).any()
    with torch.no_grad():
        loss = model(**batch).loss
    torch.testing.assert_close(loss, _loss_of_each_alone(model, examples), atol=1e-5, rtol=1e-5)
    assert _train_a_few_steps(model, examples, collator, tmp_path) > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_flattened_documents_from_the_collator(tmp_path, tokenizer, name):
    """🤗's DataCollatorWithFlattening packs examples into one row with position_ids restarting at 0: DeltaNet keeps
    the documents apart (the loss equals each document alone), the other two models refuse them clearly."""
    from transformers import DataCollatorWithFlattening

    torch.manual_seed(0)
    model = MODELS[name]().eval()
    examples = [{"input_ids": tokenizer(text)["input_ids"]} for text in TEXTS]
    batch = DataCollatorWithFlattening()(examples)
    assert batch["input_ids"].shape[0] == 1 and (batch["position_ids"] == 0).sum() == len(TEXTS)
    if not name.startswith("deltanet"):
        with pytest.raises(ValueError, match="cannot keep packed documents apart"):
            model(**batch)
        return
    with torch.no_grad():
        loss = model(**batch).loss
    torch.testing.assert_close(loss, _loss_of_each_alone(model, examples), atol=1e-5, rtol=1e-5)
    assert _train_a_few_steps(model, examples, DataCollatorWithFlattening(), tmp_path) > 0
