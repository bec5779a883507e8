"""Pretrain a memlm model with 🤗 Accelerate: from a preset (or a preset file) and text to a saved, shareable model.

    python training/train.py --preset tiny-deltanet --output-dir runs/tiny [--data FILE_OR_DATASET ...]
    accelerate launch training/train.py ...      (DDP / FSDP / DeepSpeed, see training/accelerate/)

What a run does: reads the text (the Python standard library's source when no --data is given), tokenises it with
the byte-level tokenizer, holds out --eval-tokens tokens of whole documents (every 20th) for evaluation, and trains
with AdamW, linear warm-up then cosine decay, gradient clipping and accumulation, in `--batch-mode segments`
(consecutive batches continue the same streams and each model's memory — fast weights, span memories, feedback
memory — is carried from batch to batch with its gradient cut, as the papers trained) or `independent`. Every
--save-every steps it writes a checkpoint (`accelerator.save_state` plus the carried memory and the step) under
OUTPUT/checkpoints, first to a temporary folder then renamed, so a killed run leaves complete checkpoints only; a
restarted run with the same OUTPUT resumes from the last one and ends with the same weights as an uninterrupted
run. At the end OUTPUT holds the model (`save_pretrained`, with exported code and a model card carrying the
evaluation), the tokenizer, metrics.json and loss.png.
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

PRESET_DIRECTORY = Path(__file__).resolve().parent / "presets"
CHECKPOINT_PREFIX = "step-"


def available_presets() -> list[str]:
    return sorted(path.stem for path in PRESET_DIRECTORY.glob("*.json"))


def load_preset(name_or_path: str) -> dict:
    """A preset by name (see `available_presets`) or a JSON file with the same layout: {"model": {config fields,
    "model_type", optionally "preset"}, "training": {defaults of this script's options}}."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PRESET_DIRECTORY / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(
            f"Unknown preset {name_or_path!r}: neither a preset name ({', '.join(available_presets())}) nor a JSON "
            "file."
        )
    try:
        preset = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"The preset file {path} is not valid JSON: {error}") from error
    if not isinstance(preset.get("model"), dict) or "model_type" not in preset["model"]:
        raise ValueError(f"The preset {path} needs a 'model' object with a 'model_type' (e.g. 'memlm_deltanet').")
    unknown = set(preset.get("training", {})) - set(TRAINING_DEFAULTS)
    if unknown:
        raise ValueError(
            f"The preset {path} sets unknown training options {sorted(unknown)}; known: {sorted(TRAINING_DEFAULTS)}."
        )
    return preset


TRAINING_DEFAULTS = {
    "steps": 200,
    "batch_size": 8,
    "length": 128,
    "batch_mode": "segments",
    "carry_memory": True,
    "learning_rate": 3e-3,
    "warmup_steps": 20,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "gradient_accumulation_steps": 1,
    "eval_every": 100,
    "eval_tokens": 16384,
    "save_every": 100,
    "keep_checkpoints": 2,
}


def build_config(preset: dict, tokenizer):
    """The model configuration of a preset, with the tokenizer's vocabulary and special tokens."""
    from transformers import AutoConfig

    import memlm  # noqa: F401  (registers the memlm model types)

    fields = dict(preset["model"])
    model_type = fields.pop("model_type")
    named_preset = fields.pop("preset", None)
    fields.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config_class = type(AutoConfig.for_model(model_type))
    return config_class.from_preset(named_preset, **fields) if named_preset else config_class(**fields)


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """UTF-8 bytes of text behind each token id (byte-level tokens: one character per byte; special tokens: 0)."""
    special = set(tokenizer.all_special_ids)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return torch.tensor([0 if index in special else len(token) for index, token in enumerate(tokens)])


def detach_memory(cache):
    """Cut the gradient of a carried memory (truncated back-propagation through time): every tensor of every
    layer of a memlm cache is replaced by its detached value."""
    if cache is None:
        return None
    for layer in cache.layers:
        for name in type(layer).tensor_names:
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                setattr(layer, name, value.detach())
    return cache


def language_model_loss(outputs, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of every position (labels are already the next tokens), plus the model's auxiliary
    loss when it has one (Expire-Span's span loss, in training)."""
    logits = outputs.logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    auxiliary = getattr(outputs, "span_loss", None)
    return loss + auxiliary if auxiliary is not None and torch.is_grad_enabled() else loss


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, length: int, rows: int, byte_lengths: torch.Tensor, device) -> dict:
    """Held-out loss as bits per byte and perplexity per token, reading `tokens` as `rows` contiguous streams in
    segments of `length` with the memory carried, as the model reads text in generation. Training evaluates one
    stream: every stream starts with an empty memory, and the papers' models are meant to read long contexts."""
    was_training = model.training
    model.eval()
    stream_length = len(tokens) // rows
    streams = tokens[: rows * stream_length].view(rows, stream_length).to(device)
    total_nats, total_tokens, total_bytes, memory = 0.0, 0, 0, None
    for start in range(0, stream_length - 1, length):
        window = streams[:, start : start + length + 1]
        inputs, targets = window[:, :-1], window[:, 1:]
        outputs = model(input_ids=inputs, past_key_values=memory, use_cache=True)
        memory = outputs.past_key_values
        logits = outputs.logits.float()
        total_nats += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        ).item()
        total_tokens += targets.numel()
        total_bytes += int(byte_lengths[targets.cpu()].sum())
    model.train(was_training)
    nats_per_token = total_nats / max(total_tokens, 1)
    return {
        "loss": nats_per_token,
        "perplexity": math.exp(min(nats_per_token, 50.0)),
        "bits_per_byte": total_nats / math.log(2) / max(total_bytes, 1),
        "tokens": total_tokens,
    }


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest first (a folder still ending in .tmp was cut short and is ignored)."""
    folder = output_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = [path for path in folder.iterdir() if path.is_dir() and path.name.startswith(CHECKPOINT_PREFIX)]
    return sorted((path for path in found if not path.name.endswith(".tmp")), key=lambda path: path.name)


def save_checkpoint(accelerator, output_dir: Path, step: int, memory, history: dict, keep: int):
    folder = output_dir / "checkpoints"
    final = folder / f"{CHECKPOINT_PREFIX}{step:07d}"
    temporary = folder / f"{final.name}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(temporary))
    # Each process carries the memory of its own rows.
    torch.save(memory, temporary / f"memory-{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (temporary / "progress.json").write_text(json.dumps({"step": step, "history": history}))
        os.replace(temporary, final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, checkpoint: Path):
    """(step, memory, history) of a checkpoint, after restoring model, optimizer, scheduler and random states."""
    try:
        progress = json.loads((checkpoint / "progress.json").read_text())
        accelerator.load_state(str(checkpoint))
        memory = torch.load(checkpoint / f"memory-{accelerator.process_index}.pt", weights_only=False)
    except Exception as error:
        raise RuntimeError(
            f"The checkpoint {checkpoint} cannot be read ({type(error).__name__}: {error}). It was left as is: move "
            "it away to resume from the checkpoint before it, or start a fresh run in another --output-dir."
        ) from error
    return progress["step"], memory, progress["history"]


def save_loss_curve(history: dict, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path.name} not written (pip install matplotlib).", file=sys.stderr)
        return
    figure, axis = plt.subplots(figsize=(6, 4))
    steps, losses = zip(*history["train"]) if history["train"] else ((), ())
    axis.plot(steps, losses, label="training loss (nats/token)")
    if history["eval"]:
        axis.plot([entry["step"] for entry in history["eval"]], [entry["loss"] for entry in history["eval"]], "o-",
                  label="held-out loss (nats/token)")  # fmt: skip
    axis.set_xlabel("step")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, help=f"one of {', '.join(available_presets())}, or a JSON file")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--data", nargs="*", default=None, help="text files, dataset files/folders or cached names")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--max-bytes", type=int, default=8_000_000, help="of the embedded corpus")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    parser.add_argument("--push-to-hub", default=None, metavar="REPOSITORY")
    parser.add_argument(
        "--tokenizer",
        choices=["bytes", "bpe"],
        default="bytes",
        help="bytes: 256 byte tokens, nothing to train; bpe: a byte-level BPE trained on the text",
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="of the BPE tokenizer")
    for name, default in TRAINING_DEFAULTS.items():
        option = "--" + name.replace("_", "-")
        if name == "batch_mode":
            parser.add_argument(option, choices=["segments", "independent"], default=None)
        elif isinstance(default, bool):
            parser.add_argument(option, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(option, type=type(default), default=None)
    arguments = parser.parse_args(argv)
    preset = load_preset(arguments.preset)
    for name, default in TRAINING_DEFAULTS.items():  # command line > preset > default
        if getattr(arguments, name) is None:
            setattr(arguments, name, preset.get("training", {}).get(name, default))
    arguments.preset_content = preset
    return arguments


def train(arguments: argparse.Namespace) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

    from ..tokenization import byte_level_tokenizer, train_byte_level_bpe
    from .data import TokenStream, load_texts, split_held_out

    # The schedule counts optimizer steps, whatever the number of processes (Accelerate would step it once each).
    accelerator = Accelerator(mixed_precision=arguments.mixed_precision, step_scheduler_with_optimizer=False)
    set_seed(arguments.seed)
    output_dir = arguments.output_dir
    documents = load_texts(arguments.data, arguments.text_column, arguments.max_bytes)
    tokenizer_folder = output_dir / "tokenizer"
    if (tokenizer_folder / "tokenizer.json").is_file():  # a resumed run reads the text with the same tokenizer
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    elif arguments.tokenizer == "bpe":
        tokenizer = train_byte_level_bpe(documents, arguments.vocab_size)
    else:
        tokenizer = byte_level_tokenizer()
    if accelerator.is_main_process and not (tokenizer_folder / "tokenizer.json").is_file():
        tokenizer.save_pretrained(tokenizer_folder)
    train_tokens, eval_tokens = split_held_out(documents, tokenizer, arguments.eval_tokens, seed=arguments.seed)
    config = build_config(arguments.preset_content, tokenizer)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=arguments.learning_rate, weight_decay=arguments.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, arguments.warmup_steps, arguments.steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    rows = arguments.batch_size
    stream = TokenStream(train_tokens, rows * accelerator.num_processes, arguments.length, arguments.batch_mode,
                         arguments.seed)  # fmt: skip
    own_rows = slice(accelerator.process_index * rows, (accelerator.process_index + 1) * rows)
    byte_lengths = token_byte_lengths(tokenizer)
    # Memory is carried from batch to batch only where batches continue the same streams.
    carry = arguments.batch_mode == "segments" and arguments.carry_memory

    start_step, memory, history = 0, None, {"train": [], "eval": [], "optimizer": []}
    checkpoints = complete_checkpoints(output_dir)
    if checkpoints:
        start_step, memory, history = load_checkpoint(accelerator, checkpoints[-1])
        accelerator.print(f"Resuming from {checkpoints[-1]} (step {start_step}).")
    elif accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    unwrapped = accelerator.unwrap_model(model)
    if start_step == 0:
        before = evaluate(unwrapped, eval_tokens, arguments.length, 1, byte_lengths, accelerator.device)
        history["eval"].append({"step": 0, **before})
        accelerator.print(f"held-out bits per byte before training: {before['bits_per_byte']:.3f}")

    progress = tqdm(range(start_step, arguments.steps), initial=start_step, total=arguments.steps,
                    disable=not accelerator.is_local_main_process, desc="training")  # fmt: skip
    started = time.perf_counter()
    model.train()
    for step in progress:
        total = 0.0
        for micro in range(arguments.gradient_accumulation_steps):
            index = step * arguments.gradient_accumulation_steps + micro
            if not carry or stream.starts_pass(index):
                memory = None
            inputs, labels = (tensor[own_rows].to(accelerator.device) for tensor in stream.batch(index))
            last = micro == arguments.gradient_accumulation_steps - 1
            with accelerator.no_sync(model) if not last else contextlib.nullcontext():
                with accelerator.autocast():  # the forward only: backward runs outside autocast
                    outputs = model(input_ids=inputs, past_key_values=memory, use_cache=carry)
                    loss = language_model_loss(outputs, labels)
                accelerator.backward(loss / arguments.gradient_accumulation_steps)
            memory = detach_memory(outputs.past_key_values) if carry else None
            total += loss.item() / arguments.gradient_accumulation_steps
        gradient_norm = accelerator.clip_grad_norm_(model.parameters(), arguments.max_grad_norm)
        learning_rate = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # The mean over processes: the loss of the global batch, as a single process would log it.
        total = accelerator.reduce(torch.tensor(total, device=accelerator.device), reduction="mean").item()
        history["train"].append((step + 1, total))
        history["optimizer"].append(
            {"step": step + 1, "learning_rate": learning_rate, "gradient_norm": float(gradient_norm)}
        )  # before clipping
        progress.set_postfix(loss=f"{total:.3f}")
        if (step + 1) % arguments.eval_every == 0 and step + 1 < arguments.steps:
            result = evaluate(unwrapped, eval_tokens, arguments.length, 1, byte_lengths, accelerator.device)
            history["eval"].append({"step": step + 1, **result})
            accelerator.print(f"step {step + 1}: held-out bits per byte {result['bits_per_byte']:.3f}")
        if (step + 1) % arguments.save_every == 0 and step + 1 < arguments.steps:
            save_checkpoint(accelerator, output_dir, step + 1, memory, history, arguments.keep_checkpoints)
    seconds = time.perf_counter() - started

    after = evaluate(unwrapped, eval_tokens, arguments.length, 1, byte_lengths, accelerator.device)
    history["eval"].append({"step": arguments.steps, **after})
    accelerator.print(f"held-out bits per byte after training: {after['bits_per_byte']:.3f}")
    # A checksum of every process's weights (DDP keeps them identical; the tests check it).
    checksum = torch.stack([parameter.detach().double().sum() for parameter in unwrapped.parameters()]).sum()
    checksums = accelerator.gather(checksum.reshape(1).to(accelerator.device)).tolist()
    metrics = {
        "model_type": config.model_type,
        "processes": accelerator.num_processes,
        "weight_checksums": checksums,
        "parameters": sum(parameter.numel() for parameter in unwrapped.parameters()),
        "steps": arguments.steps,
        "tokens_per_step": rows * accelerator.num_processes * arguments.length * arguments.gradient_accumulation_steps,
        "training_seconds_this_run": seconds,
        "eval_before": history["eval"][0] if history["eval"][0]["step"] == 0 else None,
        "eval_after": after,
        "history": history,
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(arguments).items()},
        "data": "the Python standard library source" if not arguments.data else arguments.data,
    }
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        write_training_card(output_dir, metrics, arguments)
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        save_loss_curve(history, output_dir / "loss.png")
        if arguments.push_to_hub:
            # The card pushed is rendered for the repository: it needs the training and evaluation sections too.
            name = arguments.push_to_hub.split("/")[-1]
            unwrapped.push_to_hub(
                arguments.push_to_hub, edit_card=lambda folder: write_training_card(folder, metrics, arguments, name)
            )
            tokenizer.push_to_hub(arguments.push_to_hub)
    accelerator.wait_for_everyone()
    return metrics


def write_training_card(output_dir: Path, metrics: dict, arguments, model_name: str | None = None):
    """Add how the model was trained and what it scored to the model card `save_pretrained` wrote; `model_name`
    (by default the folder's name) names the model in the model-index metadata."""
    readme = output_dir / "README.md"
    if not readme.is_file():
        return
    after, before = metrics["eval_after"], metrics["eval_before"]
    data = (
        metrics["data"]
        if isinstance(metrics["data"], str)
        else ", ".join(Path(source).name for source in metrics["data"])
    )
    lines = [
        "",
        "## Training",
        "",
        f"- Data: {data}; {arguments.eval_tokens} tokens of whole documents (every 20th) held out for evaluation.",
        f"- {metrics['steps']} steps of {metrics['tokens_per_step']} tokens ({arguments.batch_mode} batches of "
        f"{arguments.length} tokens), AdamW at {arguments.learning_rate} with {arguments.warmup_steps} warm-up steps "
        f"and cosine decay, seed {arguments.seed}.",
        f"- Command: `python training/train.py --preset {arguments.preset} --steps {arguments.steps}`",
        "",
        "## Evaluation",
        "",
        "| held-out text | bits per byte | perplexity (per token) |",
        "| --- | ---: | ---: |",
    ]
    if before is not None:
        lines.append(f"| before training | {before['bits_per_byte']:.3f} | {before['perplexity']:.2f} |")
    lines.append(f"| after training | {after['bits_per_byte']:.3f} | {after['perplexity']:.2f} |")
    readme.write_text(readme.read_text(encoding="utf-8").rstrip("\n") + "\n" + "\n".join(lines) + "\n")
    # The same numbers as Hub metadata (model-index), which the Hub shows as evaluation results.
    from huggingface_hub import EvalResult, ModelCard

    card = ModelCard.load(readme)
    card.data.model_name = card.data.model_name or model_name or output_dir.name
    card.data.eval_results = [
        EvalResult(task_type="text-generation", dataset_type="held-out text", dataset_name=f"held-out part of {data}",
                   metric_type="bits_per_byte", metric_name="bits per byte", metric_value=round(after["bits_per_byte"], 4)),
        EvalResult(task_type="text-generation", dataset_type="held-out text", dataset_name=f"held-out part of {data}",
                   metric_type="perplexity", metric_name="perplexity per token", metric_value=round(after["perplexity"], 4)),
    ]  # fmt: skip
    card.save(readme)


def main(argv=None) -> dict:
    return train(parse_arguments(argv))
