"""The 🤗 Trainer trains a DeltaNet from a real tokenizer and a `datasets` dataset, and saves a loadable model."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

from memlm import DeltaNetForCausalLM
from tests.conftest import DELTANET_VARIANTS

TEXT = "the delta rule writes what the memory does not yet know. " * 60


@pytest.mark.parametrize("name", ["paper", "fla"])
def test_trainer_lowers_the_loss_and_saves(tmp_path, tokenizer, name):
    model = DeltaNetForCausalLM(DELTANET_VARIANTS[name]())
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
