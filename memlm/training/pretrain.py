"""Pretrain a memlm model with 🤗 Accelerate: from a preset (or a preset file) and text to a saved, shareable model.

    python training/train.py --preset tiny-deltanet --output-dir runs/tiny [--data FILE_OR_DATASET ...]
    accelerate launch training/train.py ...      (DDP / FSDP / DeepSpeed, see training/accelerate/)

What a run does: reads the text (the Python standard library's source when no --data is given), tokenises it with
the byte-level tokenizer, holds out --eval-tokens tokens of whole documents (every 20th) for evaluation, and trains
with AdamW, linear warm-up then cosine decay, gradient clipping and accumulation, in `--batch-mode segments`
(consecutive batches continue the same streams and each model's memory — fast weights, span memories, feedback
memory — is carried from batch to batch with its gradient cut, as the papers trained) or `independent`. Every
--save-every steps it writes a checkpoint (`accelerator.save_state`, the carried memory as safetensors, the step and
the run's settings) under OUTPUT/checkpoints/step-N, first to a temporary folder then renamed, so a killed run
leaves complete checkpoints only; a restarted run with the same OUTPUT and the same settings resumes from the last
one and ends with the same weights as an uninterrupted run. At the end OUTPUT holds the model (`save_pretrained`,
with exported code and a model card carrying the evaluation), the tokenizer, metrics.json and loss.png.

What a run refuses (`TrainingError`, one line): an OUTPUT that holds another run (its run marker OUTPUT/run.json
records the settings the weights depend on) or files of no run, unless --overwrite; a resume with other settings
(naming them, old → new); a second run on the same OUTPUT while the first holds OUTPUT/.lock. It stops at the first
non-finite loss or gradient norm, before the optimizer writes it into the weights, keeping its last checkpoint and
writing no final model; and it names a full disk when a checkpoint cannot be written.
"""

import argparse
import contextlib
import errno
import fcntl
import hashlib
import importlib
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import is_dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import TrainingError

PRESET_DIRECTORY = Path(__file__).resolve().parent / "presets"
CHECKPOINT_PREFIX = "step-"
CHECKPOINT_NAME = re.compile(r"step-(\d+)")  # exactly: step-0000300.tmp or step-3.corrupt are not checkpoints
RUN_FILE = "run.json"  # the run marker: the settings of the run that writes into OUTPUT
LOCK_FILE = ".lock"
# Options a resumed run may change: they decide when to evaluate and save, not what the model learns.
FREE_OPTIONS = ("eval_every", "save_every", "keep_checkpoints")


def available_presets() -> list[str]:
    return sorted(path.stem for path in PRESET_DIRECTORY.glob("*.json"))


def load_preset(name_or_path: str) -> dict:
    """A preset by name (see `available_presets`) or a JSON file with the same layout: {"model": {config fields,
    "model_type", optionally "preset"}, "training": {defaults of this script's options}}. Training values are
    checked like the command line's (type and range); model fields are checked by the model's configuration."""
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
    if (
        not isinstance(preset, dict)
        or not isinstance(preset.get("model"), dict)
        or "model_type" not in preset["model"]
    ):
        raise ValueError(f"The preset {path} needs a 'model' object with a 'model_type' (e.g. 'memlm_deltanet').")
    training = preset.setdefault("training", {})
    if not isinstance(training, dict):
        raise ValueError(f"The preset {path}: 'training' must be an object of option values, not {training!r}.")
    unknown = set(training) - set(TRAINING_DEFAULTS)
    if unknown:
        raise ValueError(
            f"The preset {path} sets unknown training options {sorted(unknown)}; known: {sorted(TRAINING_DEFAULTS)}."
        )
    for name, value in training.items():
        try:
            training[name] = check_training_value(name, value)
        except ValueError as error:
            raise ValueError(f"The preset {path}: training option {name!r} {error}") from None
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
BATCH_MODES = ("segments", "independent")
# (type, smallest value, whether the smallest value itself is allowed) of each numeric option.
TRAINING_RANGES = {
    "steps": (int, 1, True),
    "batch_size": (int, 1, True),
    "length": (int, 1, True),
    "learning_rate": (float, 0.0, False),
    "warmup_steps": (int, 0, True),
    "weight_decay": (float, 0.0, True),
    "max_grad_norm": (float, 0.0, False),
    "gradient_accumulation_steps": (int, 1, True),
    "eval_every": (int, 1, True),
    "eval_tokens": (int, 1, True),
    "save_every": (int, 1, True),
    "keep_checkpoints": (int, 0, True),
}


def check_number(value, kind: type, minimum, inclusive: bool = True, maximum=None):
    """`value` when it is a finite number of type `kind` (an int is a float too; a bool is neither) within range,
    else a ValueError saying what is allowed."""
    allowed = f"{'an integer' if kind is int else 'a finite number'} {'≥' if inclusive else '>'} {minimum}"
    allowed += f" and ≤ {maximum}" if maximum is not None else ""
    kinds = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"must be {allowed}, not {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < minimum or (not inclusive and value == minimum):
        raise ValueError(f"must be {allowed}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"must be {allowed}, got {value!r}")
    return kind(value)


def check_training_value(name: str, value):
    """A preset's value for the training option `name`, checked as the command line checks it."""
    default = TRAINING_DEFAULTS[name]
    if name == "batch_mode":
        if value not in BATCH_MODES:
            raise ValueError(f"must be one of {list(BATCH_MODES)}, got {value!r}")
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, not {type(value).__name__} {value!r}")
        return value
    return check_number(value, *TRAINING_RANGES[name])


def number_option(kind: type, minimum, inclusive: bool = True, maximum=None):
    """An argparse `type=` that reads a number and checks its range (a bad value exits with a usage error)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        try:
            return check_number(value, kind, minimum, inclusive, maximum)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


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
        outputs = model(input_ids=inputs, cache=memory, use_cache=True)
        memory = outputs.cache
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
    """Finished checkpoints, oldest first: the folders of OUTPUT/checkpoints named exactly `step-<digits>` (a folder
    still ending in .tmp was cut short; any other name, such as a renamed `step-0000300.corrupt`, is not ours)."""
    folder = output_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = [path for path in folder.iterdir() if path.is_dir() and CHECKPOINT_NAME.fullmatch(path.name)]
    return sorted(found, key=lambda path: int(CHECKPOINT_NAME.fullmatch(path.name).group(1)))


# The carried memory is saved as safetensors: its tensors, and a JSON tree of the objects holding them (memlm's
# cache classes only), so that reading a checkpoint never runs pickled code.
MEMORY_MODULES = ("memlm.modeling.", "memlm.kernels.")


def _memory_tree(value, key: str, tensors: dict):
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().to("cpu").contiguous().clone()  # no shared storage (safetensors refuses it)
        return {"tensor": key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, (list, tuple)):
        return {"list": [_memory_tree(item, f"{key}.{index}", tensors) for index, item in enumerate(value)]}
    kind = type(value)
    if not kind.__module__.startswith(MEMORY_MODULES):
        raise TypeError(f"cannot save a {kind.__module__}.{kind.__qualname__} in a checkpoint's memory")
    state = value.__getstate__() or {}  # a class may leave out what it can rebuild (e.g. a preallocated buffer)
    fields = {name: _memory_tree(item, f"{key}.{name}", tensors) for name, item in state.items()}
    return {"object": f"{kind.__module__}:{kind.__qualname__}", "fields": fields}


def _memory_from_tree(tree: dict, tensors: dict, device):
    if "tensor" in tree:
        return tensors[tree["tensor"]].to(device)
    if "value" in tree:
        return tree["value"]
    if "list" in tree:
        return [_memory_from_tree(item, tensors, device) for item in tree["list"]]
    module_name, _, class_name = tree["object"].partition(":")
    if not module_name.startswith(MEMORY_MODULES) or "." in class_name:
        raise ValueError(f"a checkpoint's memory names {tree['object']!r}, which is not a memlm memory class")
    from ..modeling.memory import MemoryCache, MemoryCacheLayer

    kind = getattr(importlib.import_module(module_name), class_name, None)
    if not isinstance(kind, type) or not (issubclass(kind, (MemoryCache, MemoryCacheLayer)) or is_dataclass(kind)):
        raise ValueError(f"a checkpoint's memory names {tree['object']!r}, which is not a memlm memory class")
    value = kind.__new__(kind)  # fields are set as saved; no constructor or pickled code runs
    value.__dict__.update({name: _memory_from_tree(item, tensors, device) for name, item in tree["fields"].items()})
    return value


def save_memory(memory, path: Path):
    from safetensors.torch import save_file

    tensors = {}
    tree = _memory_tree(memory, "memory", tensors)
    save_file(tensors, str(path), metadata={"memlm_memory": json.dumps(tree)})


def load_memory(path: Path, device):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tree = json.loads(handle.metadata()["memlm_memory"])
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    return _memory_from_tree(tree, tensors, device)


WRITE_FAILURES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                  errno.EFBIG: "file too large for the file system or its size limit"}  # fmt: skip


def _write_failure(error: BaseException, folder: Path) -> str:
    """Why writing into `folder` failed, in words: the errno of the error or of its causes; else (PyTorch's writer
    reports a full disk as `[enforce fail at inline_container.cc] unexpected pos …`, without the errno) the errno of
    a probe write past the size that file reached (removed at once); else the error itself."""
    cause = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in WRITE_FAILURES:
            return WRITE_FAILURES[cause.errno]
        cause = cause.__cause__ or cause.__context__
    text = str(error)
    if "os error 28" in text.lower() or "no space left" in text.lower():
        return WRITE_FAILURES[errno.ENOSPC]
    reached = re.search(r"unexpected pos (\d+)", text)
    probe = folder / ".write-probe"
    try:
        with open(probe, "wb") as handle:
            remaining = (int(reached.group(1)) if reached else 0) + 2**26  # past the failed write (≤ 64 MiB more)
            while remaining > 0:
                remaining -= handle.write(bytes(min(remaining, 2**20)))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as probe_error:
        if probe_error.errno in WRITE_FAILURES:
            return WRITE_FAILURES[probe_error.errno]
    finally:
        probe.unlink(missing_ok=True)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def save_checkpoint(accelerator, output_dir: Path, step: int, memory, history: dict, keep: int, settings: dict):
    """Write checkpoint `step` into a temporary folder, then rename it: a killed or failed write leaves the earlier
    checkpoints as they were. `keep` > 0 keeps that many of the newest; 0 keeps every one."""
    folder = output_dir / "checkpoints"
    final = folder / f"{CHECKPOINT_PREFIX}{step:07d}"
    temporary = folder / f"{final.name}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(temporary), safe_serialization=True)
        # Each process carries the memory of its own rows.
        save_memory(memory, temporary / f"memory-{accelerator.process_index}.safetensors")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            progress = {"step": step, "history": history, "settings": settings}
            (temporary / "progress.json").write_text(json.dumps(progress))
    except Exception as error:
        reason = _write_failure(error, folder)
        shutil.rmtree(temporary, ignore_errors=True)
        earlier = [path for path in complete_checkpoints(output_dir) if path != final]
        kept = f"the previous checkpoint {earlier[-1]} is intact" if earlier else "there is no earlier checkpoint"
        raise TrainingError(
            f"{reason} while writing checkpoint {final}: the run stopped at step {step} and {kept}; free space and "
            "run the same command again to resume."
        ) from error
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step from a run that was cut short
        os.replace(temporary, final)
        if keep > 0:
            for old in complete_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, checkpoint: Path, settings: dict):
    """(step, memory, history) of a checkpoint, after restoring model, optimizer, scheduler and random states.
    Nothing in it is unpickled: model and memory are safetensors, and Accelerate reads optimizer, scheduler and
    random states with `torch.load(weights_only=True)`."""
    try:
        progress = json.loads((checkpoint / "progress.json").read_text())
        saved = progress["settings"] if isinstance(progress, dict) and "settings" in progress else None
    except Exception as error:
        raise TrainingError(
            f"The checkpoint {checkpoint} cannot be read ({type(error).__name__}: {error}). It was left as is: move "
            "it away to resume from the checkpoint before it, or start a fresh run in another --output-dir."
        ) from error
    if saved is None:
        raise TrainingError(
            f"The checkpoint {checkpoint} does not record its run's settings (written by an earlier memlm), so "
            f"resuming from it cannot be checked: start a fresh run in another --output-dir, or with --overwrite."
        )
    differences = setting_differences(saved, settings)
    if differences:
        raise TrainingError(
            f"The checkpoint {checkpoint} was written with other settings ({'; '.join(differences)}): resume with "
            f"the same settings, or start a fresh run in another --output-dir or with --overwrite."
        )
    from accelerate.utils import load

    try:
        # Accelerate ignores random states it cannot read (the resumed run would then draw other numbers): read them
        # first, as it will (weights_only), so that a damaged file stops the run instead.
        load(checkpoint / f"random_states_{accelerator.process_index}.pkl")
        accelerator.load_state(str(checkpoint), load_kwargs={"weights_only": True})
        memory = load_memory(checkpoint / f"memory-{accelerator.process_index}.safetensors", accelerator.device)
    except Exception as error:
        raise TrainingError(
            f"The checkpoint {checkpoint} cannot be read ({type(error).__name__}: {error}). It was left as is: move "
            "it away to resume from the checkpoint before it, or start a fresh run in another --output-dir."
        ) from error
    return progress["step"], memory, progress["history"]


def setting_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`name: old → new` for every setting that differs (model fields as `model.<field>`)."""
    differences = []
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name, "unset"), new.get(name, "unset")
        if isinstance(before, dict) and isinstance(after, dict):
            differences += setting_differences(before, after, f"{prefix}{name}.")
        elif name == "data":  # the text decides (the same file may be named by another path)
            if old.get("text_sha256") != new.get("text_sha256"):
                differences.append(f"data: {before!r} → {after!r}" if before != after else "data: its text changed")
        elif name == "text_sha256":
            continue
        elif before != after:
            differences.append(f"{prefix}{name}: {before!r} → {after!r}")
    return differences


def run_settings(arguments, documents: list[str], processes: int) -> dict:
    """What a run means: the settings its weights depend on (model, data, tokenizer, schedule, batches, seed).
    Stored in OUTPUT/run.json and in each checkpoint; a resumed run must have the same ones."""
    text = hashlib.sha256()
    for document in documents:
        text.update(hashlib.sha256(document.encode("utf-8")).digest())
    settings = {
        "model": arguments.preset_content["model"],
        **{name: getattr(arguments, name) for name in TRAINING_DEFAULTS if name not in FREE_OPTIONS},
        "tokenizer": arguments.tokenizer,
        "vocab_size": arguments.vocab_size if arguments.tokenizer == "bpe" else None,
        "seed": arguments.seed,
        "mixed_precision": arguments.mixed_precision,
        "processes": processes,
        "data": "the Python standard library source" if not arguments.data else [str(item) for item in arguments.data],
        "text_sha256": text.hexdigest(),
    }
    return json.loads(json.dumps(settings))  # as read back from JSON (tuples become lists)


# What a run writes into OUTPUT: what --overwrite deletes (other files are left alone).
RUN_OUTPUTS = ("checkpoints", "tokenizer", "tokenizer.tmp", RUN_FILE, "metrics.json", "loss.png", "README.md",
               "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja")  # fmt: skip
RUN_OUTPUT_PATTERNS = ("model*.safetensors", "model.safetensors.index.json", "configuration_*.py", "modeling_*.py",
                       "memlm_*.py")  # fmt: skip


def _run_outputs(output_dir: Path) -> list[Path]:
    found = [output_dir / name for name in RUN_OUTPUTS if (output_dir / name).exists()]
    for pattern in RUN_OUTPUT_PATTERNS:
        found += [path for path in output_dir.glob(pattern) if path.is_file()]
    return found


def claim_output(output_dir: Path, settings: dict, overwrite: bool):
    """Make OUTPUT this run's (main process): take its lock, refuse another run's folder (unless `overwrite`, which
    first deletes that run's files) or a resume with other settings, and write the run marker. Returns the open
    lock file, held until the run ends."""
    output_dir.mkdir(parents=True, exist_ok=True)
    lock = open(output_dir / LOCK_FILE, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise TrainingError(
            f"Another run is writing into {output_dir} (it holds {output_dir / LOCK_FILE}): wait for it to end, or "
            "choose another --output-dir."
        ) from None
    try:
        marker_path = output_dir / RUN_FILE
        if overwrite:
            for path in _run_outputs(output_dir):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        elif marker_path.is_file():
            try:
                marker = json.loads(marker_path.read_text())
                saved = marker["settings"]
            except (ValueError, KeyError, TypeError) as error:
                raise TrainingError(
                    f"The run marker {marker_path} cannot be read ({type(error).__name__}: {error}): start a fresh "
                    "run with --overwrite, or in another --output-dir."
                ) from None
            differences = setting_differences(saved, settings)
            if differences:
                raise TrainingError(
                    f"{output_dir} holds a run with other settings ({'; '.join(differences)}): run again with the "
                    "same settings to resume it, or start a fresh run in another --output-dir or with --overwrite "
                    "(which deletes that run's checkpoints, tokenizer, model and metrics)."
                )
            return lock
        else:
            others = sorted(path.name for path in output_dir.iterdir() if path.name != LOCK_FILE)
            if others:
                shown = ", ".join(others[:5]) + (", …" if len(others) > 5 else "")
                raise TrainingError(
                    f"{output_dir} is not empty ({shown}) and holds no run marker ({RUN_FILE}) of memlm train: "
                    "choose another --output-dir, or --overwrite to replace the run there (deletes its checkpoints, "
                    "tokenizer, model, card and metrics; other files are left)."
                )
        temporary = marker_path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps({"settings": settings}, indent=2))
        os.replace(temporary, marker_path)
    except BaseException:
        lock.close()
        raise
    return lock


def prepare_tokenizer(arguments, documents, tokenizer_folder: Path):
    """The run's tokenizer (main process). OUTPUT/tokenizer holds it from the run's start (a resumed run reads with
    it); it is written whole (temporary folder, then renamed). An unreadable one is made again when no checkpoint
    depends on it; a run resuming from checkpoints that were trained with it stops and says what to do."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    from ..tokenization import byte_level_tokenizer, train_byte_level_bpe

    if tokenizer_folder.is_dir():
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
            if tokenizer.eos_token_id is None:  # e.g. tokenizer.json without its tokenizer_config.json
                raise ValueError("it has no end-of-text token; is tokenizer_config.json missing?")
            return tokenizer
        except Exception as error:
            reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
            if complete_checkpoints(tokenizer_folder.parent):
                raise ValueError(
                    f"The tokenizer in {tokenizer_folder} cannot be read ({reason}), and the checkpoints of this run "
                    "were trained with it: restore the folder from a copy, or delete it to have it made again from "
                    "the same text and settings (the byte-level tokenizer, or a BPE trained on the same text, comes "
                    "out the same), then resume; or start over with --overwrite."
                ) from error
            logging.get_logger(__name__).warning(
                f"The tokenizer in {tokenizer_folder} cannot be read ({reason}); no checkpoint depends on it: it is "
                "made again."
            )
    tokenizer = train_byte_level_bpe(documents, arguments.vocab_size) if arguments.tokenizer == "bpe" else (
        byte_level_tokenizer()
    )  # fmt: skip
    temporary = tokenizer_folder.with_name(tokenizer_folder.name + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    tokenizer.save_pretrained(temporary)
    shutil.rmtree(tokenizer_folder, ignore_errors=True)
    os.replace(temporary, tokenizer_folder)
    return tokenizer


@contextlib.contextmanager
def progress_bars_only_in_a_terminal():
    """Turn 🤗's progress bars (such as save_pretrained's "Writing model shards") off while stderr is not a terminal,
    as the training bar is: logs get no bar lines."""
    from transformers.utils import logging

    turn_off = logging.is_progress_bar_enabled() and not sys.stderr.isatty()
    if turn_off:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if turn_off:
            logging.enable_progress_bar()


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


def parse_arguments(argv=None, prog: str = "memlm train") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, help=f"one of {', '.join(available_presets())}, or a JSON file")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in OUTPUT even if it holds another run (or one with other settings): deletes that "
        "run's checkpoints/, tokenizer/, model, card, metrics.json and loss.png first (other files are left). Without "
        "it, a run refuses a non-empty OUTPUT that is not its own, and resumes its own from the last checkpoint if "
        "the settings are the same (only --eval-every, --save-every and --keep-checkpoints may change)",
    )
    parser.add_argument("--data", nargs="*", default=None, help="text files, dataset files/folders or cached names")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--max-bytes", type=number_option(int, 1), default=8_000_000, help="of the embedded corpus")
    parser.add_argument("--seed", type=number_option(int, 0, maximum=2**32 - 1), default=0)
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    parser.add_argument("--push-to-hub", default=None, metavar="REPOSITORY")
    parser.add_argument(
        "--tokenizer",
        choices=["bytes", "bpe"],
        default="bytes",
        help="bytes: 256 byte tokens, nothing to train; bpe: a byte-level BPE trained on the text",
    )
    parser.add_argument("--vocab-size", type=number_option(int, 258), default=4096, help="of the BPE tokenizer")
    helps = {"keep_checkpoints": "how many of the newest checkpoints to keep; 0 keeps every one",
             "max_grad_norm": "clip the gradient norm to this",
             "eval_tokens": "tokens of whole documents held out for evaluation",
             "gradient_accumulation_steps": "micro-batches per optimizer step"}  # fmt: skip
    for name, default in TRAINING_DEFAULTS.items():
        option = "--" + name.replace("_", "-")
        if name == "batch_mode":
            parser.add_argument(option, choices=list(BATCH_MODES), default=None)
        elif isinstance(default, bool):
            parser.add_argument(option, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind, minimum, inclusive = TRAINING_RANGES[name]
            allowed = f"{'≥' if inclusive else '>'} {minimum}"
            text = f"{helps[name]}; " if name in helps else ""
            parser.add_argument(option, type=number_option(kind, minimum, inclusive), default=None,
                                help=f"{text}{allowed} (default: the preset's, else {default})")  # fmt: skip
    arguments = parser.parse_args(argv)
    preset = load_preset(arguments.preset)
    for name, default in TRAINING_DEFAULTS.items():  # command line > preset > default
        if getattr(arguments, name) is None:
            setattr(arguments, name, preset.get("training", {}).get(name, default))
    arguments.preset_content = preset
    return arguments


def train(arguments: argparse.Namespace) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import broadcast_object_list, set_seed

    from .data import load_texts

    # The schedule counts optimizer steps, whatever the number of processes (Accelerate would step it once each).
    accelerator = Accelerator(mixed_precision=arguments.mixed_precision, step_scheduler_with_optimizer=False)
    set_seed(arguments.seed)
    output_dir = arguments.output_dir
    documents = load_texts(arguments.data, arguments.text_column, arguments.max_bytes)
    settings = run_settings(arguments, documents, accelerator.num_processes)
    # The main process claims OUTPUT (lock, run marker); every process learns whether it may go on.
    lock, refusal = None, [None]
    if accelerator.is_main_process:
        try:
            lock = claim_output(output_dir, settings, arguments.overwrite)
        except TrainingError as error:
            refusal = [str(error)]
    refusal = broadcast_object_list(refusal)
    if refusal[0] is not None:
        raise TrainingError(refusal[0])
    try:
        return _train(arguments, accelerator, documents, settings)
    finally:
        if lock is not None:
            lock.close()  # releases the lock


def _train(arguments, accelerator, documents: list[str], settings: dict) -> dict:
    """The run itself, in an OUTPUT this run holds (see `train`)."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

    from ..modeling.modeling_feedback_transformer import clamp_adaptive_spans
    from .data import TokenStream, split_held_out

    output_dir = arguments.output_dir
    tokenizer_folder = output_dir / "tokenizer"
    if accelerator.is_main_process:
        tokenizer = prepare_tokenizer(arguments, documents, tokenizer_folder)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
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
        start_step, memory, history = load_checkpoint(accelerator, checkpoints[-1], settings)
        accelerator.print(f"Resuming from {checkpoints[-1]} (step {start_step}).")
    unwrapped = accelerator.unwrap_model(model)
    if start_step == 0:
        before = evaluate(unwrapped, eval_tokens, arguments.length, 1, byte_lengths, accelerator.device)
        history["eval"].append({"step": 0, **before})
        accelerator.print(f"held-out bits per byte before training: {before['bits_per_byte']:.3f}")

    # No bar when the output is not a terminal (logs): tqdm's disable=None.
    progress = tqdm(range(start_step, arguments.steps), initial=start_step, total=arguments.steps,
                    disable=None if accelerator.is_local_main_process else True, desc="training")  # fmt: skip
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
                    outputs = model(input_ids=inputs, cache=memory, use_cache=carry)
                    loss = language_model_loss(outputs, labels)
                accelerator.backward(loss / arguments.gradient_accumulation_steps)
            memory = detach_memory(outputs.cache) if carry else None
            total += loss.item() / arguments.gradient_accumulation_steps
        gradient_norm = accelerator.clip_grad_norm_(model.parameters(), arguments.max_grad_norm)
        # The mean over processes: the loss of the global batch, as a single process would log it.
        total = accelerator.reduce(torch.tensor(total, device=accelerator.device), reduction="mean").item()
        if not (math.isfinite(total) and math.isfinite(float(gradient_norm))):
            # Stop before the optimizer writes non-finite weights: checkpoints so far hold finite ones.
            earlier = complete_checkpoints(output_dir)
            kept = f"the last checkpoint, {earlier[-1]}, is kept" if earlier else "no checkpoint was written yet"
            raise TrainingError(
                f"Training diverged at step {step + 1}: loss {total}, gradient norm {float(gradient_norm)}. The run "
                f"stopped without saving a final model ({kept}); try a lower --learning-rate (it was "
                f"{arguments.learning_rate}), more --warmup-steps or a lower --max-grad-norm."
            )
        learning_rate = scheduler.get_last_lr()[0]
        optimizer.step()
        clamp_adaptive_spans(unwrapped)  # the Feedback Transformer's adaptive spans, as the official trainer does
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
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
            save_checkpoint(accelerator, output_dir, step + 1, memory, history, arguments.keep_checkpoints, settings)
    progress.close()
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
        try:
            with progress_bars_only_in_a_terminal():
                unwrapped.save_pretrained(output_dir)
            tokenizer.save_pretrained(output_dir)
            write_training_card(output_dir, metrics, arguments)
            (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        except Exception as error:
            reason = _write_failure(error, output_dir)
            if reason not in WRITE_FAILURES.values():
                raise
            checkpoints = complete_checkpoints(output_dir)
            resume = f"from {checkpoints[-1]}" if checkpoints else "from the start (no checkpoint was written)"
            raise TrainingError(
                f"{reason} while writing the final model into {output_dir}: the training finished but the model is "
                f"not saved; free space and run the same command again, which resumes {resume} and writes it."
            ) from error
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
