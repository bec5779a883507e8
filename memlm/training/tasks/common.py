"""What every synthetic task shares: a word-level tokenizer over the task's symbols, the example format, the
brute-force check, and a small training loop with accuracy on the scored positions.

An example is a dict with `input_ids` and `labels` of the same length, in 🤗's causal-LM convention: the logits at
position t are scored against `labels[t + 1]`, and positions with label -100 are not scored. Two layouts use it:

- *answer in the stream* (associative retrieval, copy, corridor): the answer tokens follow the prompt in
  `input_ids` and `labels` repeats them there, so plain next-token prediction scores them;
- *separate outputs* (random walk, algorithmic programs, as in the Feedback paper App. 7.1: "the model predicts
  separate output tokens rather than a next token"): the output for input position t is `labels[t + 1]` and never
  appears in `input_ids`, so the model cannot read earlier answers.

Batches are padded on the left (every memlm model and 🤗 Llama accept that), with `attention_mask` 0 and label -100
on the padding.
"""

import random
from collections.abc import Callable, Iterable

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, get_cosine_schedule_with_warmup

PADDING = "<pad>"
IGNORE = -100


def task_tokenizer(symbols: Iterable[str]) -> PreTrainedTokenizerFast:
    """A word-level `PreTrainedTokenizerFast` whose vocabulary is `<pad>` (id 0) then `symbols` in order; text is the
    symbols separated by spaces. It saves and loads like any 🤗 tokenizer."""
    symbols = list(symbols)
    if len(set(symbols)) != len(symbols) or PADDING in symbols:
        raise ValueError(f"Task symbols must be distinct and must not include {PADDING!r}, got {symbols}.")
    if any(not symbol or any(character.isspace() for character in symbol) for symbol in symbols):
        raise ValueError(f"Task symbols must be non-empty and contain no whitespace, got {symbols}.")
    vocabulary = {PADDING: 0, **{symbol: index + 1 for index, symbol in enumerate(symbols)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=PADDING))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PADDING, padding_side="left")


def check_integer(name: str, value, minimum: int = 1) -> None:
    """Raises `ValueError` naming the option unless `value` is an int (not a bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {wanted}, got {value!r}.")


def examples_to_dataset(examples: list[dict]):
    """A 🤗 `datasets.Dataset` from a list of example dicts (all with the same keys)."""
    from datasets import Dataset

    if not examples:
        raise ValueError("A task dataset needs at least one example.")
    columns = {key: [example[key] for example in examples] for key in examples[0]}
    return Dataset.from_dict(columns)


def make_generator(seed: int) -> random.Random:
    """The task generators draw from Python's `random.Random(seed)`: the same seed gives the same dataset on every
    platform and with any torch version."""
    return random.Random(seed)


def dataset_rows(dataset) -> list[dict]:
    """The examples of a 🤗 `Dataset` (or a list of dicts) as a list of dicts with `input_ids` and `labels`, read from
    Arrow once rather than row by row."""
    if isinstance(dataset, list):
        return dataset
    columns = dataset.select_columns(["input_ids", "labels"])[:]
    return [{"input_ids": ids, "labels": labels} for ids, labels in zip(columns["input_ids"], columns["labels"])]


def scored_positions(labels: torch.Tensor) -> torch.Tensor:
    """Boolean (B, T-1): which logits positions are scored (their next label is not -100)."""
    return labels[:, 1:] != IGNORE


def collate(examples: list[dict], pad_token_id: int = 0) -> dict:
    """Left-pads `input_ids` and `labels` to the longest example; `attention_mask` marks the real tokens."""
    longest = max(len(example["input_ids"]) for example in examples)
    input_ids = torch.full((len(examples), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), longest), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example["input_ids"])
        if len(example["labels"]) != length:
            raise ValueError(f"Example {row} has {length} input ids but {len(example['labels'])} labels.")
        input_ids[row, longest - length :] = torch.tensor(example["input_ids"])
        labels[row, longest - length :] = torch.tensor(example["labels"])
        attention_mask[row, longest - length :] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def solver_accuracy(dataset, solve: Callable[[list[int]], list[int]]) -> float:
    """Fraction of scored targets a brute-force `solve(input_ids) -> predicted labels` gets right. `solve` returns one
    prediction per position in the same convention as `labels` (only the scored positions are compared)."""
    right = total = 0
    for example in dataset_rows(dataset):
        predictions = solve(example["input_ids"])
        for predicted, label in zip(predictions, example["labels"], strict=True):
            if label != IGNORE:
                right += int(predicted == label)
                total += 1
    if total == 0:
        raise ValueError("The dataset has no scored positions.")
    return right / total


@torch.no_grad()
def evaluate_accuracy(model, dataset, batch_size: int = 64) -> dict:
    """Token accuracy (argmax at every scored position) and sequence accuracy (all of an example's targets right)
    of `model` on `dataset`, with the mean loss over the scored positions."""
    rows = dataset_rows(dataset)
    if not rows:
        raise ValueError("Cannot evaluate on an empty dataset.")
    was_training = model.training
    model.eval()
    right = total = sequences_right = 0
    loss_sum = 0.0
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        logits = logits[:, :-1].float()
        targets = batch["labels"][:, 1:]
        scored = targets != IGNORE
        correct = (logits.argmax(-1) == targets) & scored
        right += int(correct.sum())
        total += int(scored.sum())
        sequences_right += int((correct.sum(-1) == scored.sum(-1)).sum())
        loss_sum += float(torch.nn.functional.cross_entropy(logits[scored], targets[scored], reduction="sum"))
    model.train(was_training)
    return {"accuracy": right / total, "sequence_accuracy": sequences_right / len(rows), "loss": loss_sum / total}


def train_on_task(
    model,
    dataset,
    steps: int,
    batch_size: int = 32,
    learning_rate: float = 1e-3,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    seed: int = 0,
    callback: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Trains `model` for `steps` optimizer steps on batches drawn from `dataset` (shuffled, reshuffled at each
    epoch) with AdamW, 🤗's linear warm-up (from 0) then cosine decay, and gradient clipping. The loss is 🤗's
    causal-LM loss on the scored positions plus whatever the model adds (Expire-Span's span loss). Returns the loss
    of every step; `callback(step, loss)` is called after each."""
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be positive, got steps={steps}, batch_size={batch_size}.")
    rows = dataset_rows(dataset)
    if not rows:
        raise ValueError("Cannot train on an empty dataset.")
    order_generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)

    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup_steps, steps)  # as `memlm train` (warm-up from 0)
    model.train()
    order: list[int] = []
    losses = []
    for step in range(steps):
        if len(order) < batch_size:
            order += torch.randperm(len(rows), generator=order_generator).tolist()
        indices, order = order[:batch_size], order[batch_size:]
        batch = collate([rows[index] for index in indices])
        loss = model(**batch, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        if callback is not None:
            callback(step, losses[-1])
    return losses


def across_seeds(values: Iterable[float]) -> dict:
    """The mean, lowest and highest of one measurement repeated over seeds, with the values themselves."""
    values = [float(value) for value in values]
    if not values:
        raise ValueError("across_seeds needs at least one value (one per seed).")
    return {"mean": sum(values) / len(values), "low": min(values), "high": max(values), "values": values}


def format_across_seeds(summary: dict, format_spec: str = ".3f") -> str:
    """'mean (low–high)', or just the value when there was one seed: e.g. '0.951 (0.930–0.972)'."""
    mean = format(summary["mean"], format_spec)
    if len(summary["values"]) == 1:
        return mean
    return f"{mean} ({format(summary['low'], format_spec)}–{format(summary['high'], format_spec)})"


def seeds_problem(seeds: list[int]) -> str | None:
    """What is wrong with a list of seeds for runs repeated over seeds (negative or repeated ones), or None."""
    problems = []
    if negative := sorted({seed for seed in seeds if seed < 0}):
        problems.append(f"negative {negative}")
    if repeated := sorted({seed for seed in seeds if seeds.count(seed) > 1}):
        problems.append(f"repeated {repeated}")
    if not problems:
        return None
    return f"--seeds must be distinct non-negative integers, got {seeds} ({', '.join(problems)})"
