"""Fine-tune a saved memlm model (or any checkpoint `AutoModelForCausalLM` loads) on text with the 🤗 `Trainer`.

    python training/finetune.py --model runs/tiny-deltanet --output-dir runs/tuned --data notes.txt [--steps 200]

The text comes from the same sources as pretraining (`memlm.training.data`: text files, dataset files or folders,
cached dataset names; the embedded standard-library corpus when no --data is given). It is tokenised with
`datasets.map`, cut into blocks of --length tokens, split into training and evaluation blocks, and trained with the
Trainer (AdamW, warm-up then cosine decay, evaluation at the end). The result is saved with `save_pretrained` (code
and card included) beside its tokenizer, with the evaluation in metrics.json; --push-to-hub uploads it.
"""

import argparse
import json
import math
import sys
from pathlib import Path

from . import TrainingError


def parse_arguments(argv=None, prog: str = "memlm finetune") -> argparse.Namespace:
    from .pretrain import number_option

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a folder written by save_pretrained")
    parser.add_argument("--output-dir", required=True, type=Path, help="where the tuned model goes (not --model)")
    parser.add_argument("--data", nargs="*", default=None)
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--max-bytes", type=number_option(int, 1), default=2_000_000, help="of the embedded corpus")
    parser.add_argument("--length", type=number_option(int, 1), default=128, help="tokens per block (≥ 1)")
    parser.add_argument("--batch-size", type=number_option(int, 1), default=8, help="≥ 1")
    parser.add_argument("--steps", type=number_option(int, 1), default=100, help="≥ 1")
    parser.add_argument("--learning-rate", type=number_option(float, 0.0, inclusive=False), default=1e-3, help="> 0")
    parser.add_argument("--warmup-steps", type=number_option(int, 0), default=10, help="≥ 0")
    parser.add_argument("--eval-blocks", type=number_option(int, 1), default=16, help="blocks held out for evaluation")
    parser.add_argument("--seed", type=number_option(int, 0, maximum=2**32 - 1), default=0)
    parser.add_argument("--push-to-hub", default=None, metavar="REPOSITORY")
    return parser.parse_args(argv)


def check_output_folder(model: Path, output_dir: Path):
    """Refuse an --output-dir that is the source model's folder or inside it: saving would overwrite the model
    being fine-tuned (symbolic links resolved)."""
    source, target = model.resolve(), output_dir.resolve()
    if target == source or source in target.parents:
        where = "is" if target == source else "is inside"
        raise TrainingError(
            f"--output-dir {str(output_dir)!r} {where} the model folder {str(model)!r}: fine-tuning would overwrite "
            "the model it reads. Choose another --output-dir."
        )


def finetune(arguments: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, Trainer, TrainingArguments, default_data_collator

    import memlm  # noqa: F401  (registers memlm's model types)

    from ..checkpoint_files import load_model
    from .callbacks import ClampAdaptiveSpans
    from .data import load_texts

    if not Path(arguments.model).is_dir():
        raise FileNotFoundError(f"--model {arguments.model!r} is not a folder written by save_pretrained.")
    check_output_folder(Path(arguments.model), arguments.output_dir)
    model = load_model(arguments.model)
    tokenizer = AutoTokenizer.from_pretrained(arguments.model)
    documents = Dataset.from_dict({"text": load_texts(arguments.data, arguments.text_column, arguments.max_bytes)})

    def tokenize(batch):
        return {"input_ids": [ids + [tokenizer.eos_token_id] for ids in tokenizer(batch["text"])["input_ids"]]}

    def into_blocks(batch):  # concatenate the documents, then cut blocks of `length` tokens (the tail is dropped)
        ids = [token for document in batch["input_ids"] for token in document]
        blocks = [ids[start : start + arguments.length] for start in range(0, len(ids) - arguments.length + 1,
                                                                            arguments.length)]  # fmt: skip
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    tokenized = documents.map(tokenize, batched=True, remove_columns=["text"])
    blocks = tokenized.map(into_blocks, batched=True, batch_size=1000, remove_columns=tokenized.column_names)
    if len(blocks) <= arguments.eval_blocks:
        raise ValueError(
            f"The data gives {len(blocks)} blocks of {arguments.length} tokens: too few to hold out "
            f"{arguments.eval_blocks} for evaluation. Give more text, a smaller --length or fewer --eval-blocks."
        )
    split = blocks.train_test_split(test_size=arguments.eval_blocks, seed=arguments.seed)
    training_arguments = TrainingArguments(
        output_dir=str(arguments.output_dir / "trainer"), per_device_train_batch_size=arguments.batch_size,
        per_device_eval_batch_size=arguments.batch_size, learning_rate=arguments.learning_rate,
        lr_scheduler_type="cosine", warmup_steps=arguments.warmup_steps, max_steps=arguments.steps,
        logging_steps=max(1, arguments.steps // 10), save_strategy="no", report_to=[], seed=arguments.seed,
        dataloader_num_workers=0, include_num_input_tokens_seen=True,
        dataloader_pin_memory=torch.accelerator.is_available(),  # (pinned memory is for copies to an accelerator)
        disable_tqdm=not sys.stderr.isatty(),  # no progress bar in logs
    )  # fmt: skip
    trainer = Trainer(model=model, args=training_arguments, train_dataset=split["train"], eval_dataset=split["test"],
                      data_collator=default_data_collator, callbacks=[ClampAdaptiveSpans()])  # fmt: skip
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    metrics = {
        "model": str(arguments.model),
        "eval_loss_before": before,
        "eval_loss_after": after,
        "eval_perplexity_after": math.exp(min(after, 50.0)),
        "steps": arguments.steps,
        # what the Trainer did, as it logged it: tokens fed to the model, and the learning rate at each logged step
        "tokens_seen": int(trainer.state.num_input_tokens_seen),
        "learning_rates": {
            entry["step"]: entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry
        },
        "data": "the Python standard library source" if not arguments.data else arguments.data,
    }
    trainer.model.save_pretrained(arguments.output_dir)
    tokenizer.save_pretrained(arguments.output_dir)
    (arguments.output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if arguments.push_to_hub:
        trainer.model.push_to_hub(arguments.push_to_hub)
        tokenizer.push_to_hub(arguments.push_to_hub)
    return metrics


def main(argv=None) -> dict:
    return finetune(parse_arguments(argv))
