"""The two task commands behind `training/tasks/make_dataset.py` and `training/tasks/train_task.py`.

    python training/tasks/make_dataset.py corridor --output-dir data/corridor --option max_length=64
    python training/tasks/train_task.py --data data/corridor --model expire-span --output-dir runs/corridor \
        --config '{"max_span": 128, "ramp": 16}' --steps 600
    memlm plot-memory runs/corridor --text "colour1 cell3 cell0 <door>" --output spans.png

`make_dataset` writes a 🤗 `DatasetDict` (train / validation / test, drawn with seeds s, s+1, s+2) with
`save_to_disk`, the task's tokenizer beside it and `task.json` (the task and its options), after checking that the
brute-force solver gets every target right. `train_task` trains a memlm model (or a same-size 🤗 Llama) on it with
`common.train_on_task` and saves it with its tokenizer and `metrics.json` (accuracy before and after).
"""

import argparse
import json
from pathlib import Path

from . import TASKS, task
from .common import evaluate_accuracy, solver_accuracy, train_on_task

SPLITS = ("train", "validation", "test")
MODELS = ("deltanet", "expire-span", "feedback", "llama")
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def _parse_options(pairs: list[str], allowed: dict, name: str) -> dict:
    """`key=value` strings into a dict; values are read as JSON (numbers, true/false) or else kept as text."""
    options = {}
    for pair in pairs:
        key, separator, text = pair.partition("=")
        if not separator or key not in allowed:
            raise ValueError(
                f"--option {pair!r} is not KEY=VALUE with a KEY of the {name} task; its options (with defaults): "
                + ", ".join(f"{option}={default!r}" for option, default in allowed.items())
            )
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    return options


def make_dataset(argv=None) -> Path:
    parser = argparse.ArgumentParser(description="Write a synthetic task's dataset and tokenizer to a folder.")
    parser.add_argument("task", choices=list(TASKS))
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--train", type=int, default=4000, help="examples in the training split")
    parser.add_argument("--validation", type=int, default=500, help="examples in the validation split")
    parser.add_argument("--test", type=int, default=500, help="examples in the test split")
    parser.add_argument(
        "--seed", type=int, default=0, help="the train split is drawn with it, validation seed+1, test seed+2"
    )
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the task's generator (repeatable); a bad key lists them")  # fmt: skip
    arguments = parser.parse_args(argv)
    from datasets import DatasetDict

    chosen = task(arguments.task)
    allowed = {key: value for key, value in chosen.options().items() if key != "seed"}  # splits draw seed, seed+1, …
    options = _parse_options(arguments.option, allowed, arguments.task)
    sizes = {"train": arguments.train, "validation": arguments.validation, "test": arguments.test}
    splits = DatasetDict({
        split: chosen.dataset(sizes[split], **options, seed=arguments.seed + offset)
        for offset, split in enumerate(SPLITS)
    })  # fmt: skip
    solve = chosen.solver_for(**options)
    for split in SPLITS:
        accuracy = solver_accuracy(splits[split], solve)
        if accuracy != 1.0:  # a generator bug, never the user's
            raise RuntimeError(f"The brute-force solver gets {accuracy:.2%} of the {split} targets: a generator bug.")
    arguments.output_dir.mkdir(parents=True, exist_ok=True)
    splits.save_to_disk(str(arguments.output_dir))
    chosen.tokenizer_for(**options).save_pretrained(str(arguments.output_dir / "tokenizer"))
    description = {"task": arguments.task, "options": options, "seed": arguments.seed, "sizes": sizes}
    (arguments.output_dir / "task.json").write_text(json.dumps(description, indent=2))
    print(f"wrote {arguments.task} to {arguments.output_dir}: " + ", ".join(f"{sizes[s]} {s}" for s in SPLITS)
          + "; the brute-force solver gets 100% of every split")  # fmt: skip
    return arguments.output_dir


def build_model(kind: str, vocab_size: int, overrides: dict):
    """A model of `kind` (one of MODELS) with the small default SIZES, the task's vocabulary and `overrides` (any
    config field; DeltaNet also takes `"preset"`: "paper" or "fla")."""
    import memlm

    fields = {**SIZES, "vocab_size": vocab_size, "pad_token_id": 0, **overrides}
    if kind == "deltanet":
        preset = fields.pop("preset", "paper")
        return memlm.DeltaNetForCausalLM(memlm.DeltaNetConfig.from_preset(preset, **fields))
    if kind == "expire-span":
        fields = {"max_span": 256, "ramp": 16, "block_size": 256, **fields}
        return memlm.ExpireSpanForCausalLM(memlm.ExpireSpanConfig(**fields))
    if kind == "feedback":
        return memlm.FeedbackTransformerForCausalLM(memlm.FeedbackTransformerConfig(**{"memory_span": 256, **fields}))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        fields = {"max_position_embeddings": 4096, "num_key_value_heads": fields["num_attention_heads"], **fields}
        return LlamaForCausalLM(LlamaConfig(**fields))
    raise ValueError(f"Unknown model {kind!r}; choose one of {', '.join(MODELS)}.")


def train_task(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="Train a model on a task folder written by make_dataset.py.")
    parser.add_argument("--data", required=True, type=Path, help="a folder written by make_dataset.py")
    parser.add_argument("--model", required=True, choices=MODELS)
    parser.add_argument("--config", default="{}", help="JSON object of config fields overriding the small defaults")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)
    import torch
    from datasets import load_from_disk
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    if not (arguments.data / "task.json").is_file():
        raise FileNotFoundError(f"--data {str(arguments.data)!r} holds no task.json: write it with make_dataset.py.")
    try:
        overrides = json.loads(arguments.config)
    except json.JSONDecodeError as error:
        raise ValueError(f"--config must be a JSON object, got {arguments.config!r} ({error}).") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--config must be a JSON object, got {arguments.config!r}.")
    splits = load_from_disk(str(arguments.data))
    tokenizer = AutoTokenizer.from_pretrained(str(arguments.data / "tokenizer"))
    torch.manual_seed(arguments.seed)
    model = build_model(arguments.model, len(tokenizer), overrides)
    before = evaluate_accuracy(model, splits["validation"])
    progress = tqdm(total=arguments.steps, desc="training", disable=None)  # no bar when not a terminal

    def report(step: int, loss: float) -> None:
        progress.update(1)
        progress.set_postfix(loss=f"{loss:.3f}")

    losses = train_on_task(model, splits["train"], steps=arguments.steps, batch_size=arguments.batch_size,
                           learning_rate=arguments.learning_rate, warmup_steps=arguments.warmup_steps,
                           seed=arguments.seed, callback=report)  # fmt: skip
    progress.close()
    after = evaluate_accuracy(model, splits["validation"])
    test = evaluate_accuracy(model, splits["test"])
    metrics = {
        "task": json.loads((arguments.data / "task.json").read_text()),
        "model": arguments.model,
        "config": overrides,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "steps": arguments.steps,
        "validation_before": before,
        "validation_after": after,
        "test_after": test,
        "losses": losses,
    }
    arguments.output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(arguments.output_dir))
    tokenizer.save_pretrained(str(arguments.output_dir))
    (arguments.output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"validation accuracy {before['accuracy']:.1%} -> {after['accuracy']:.1%}; test {test['accuracy']:.1%} "
          f"(sequences {test['sequence_accuracy']:.1%}); saved to {arguments.output_dir}")  # fmt: skip
    return metrics
