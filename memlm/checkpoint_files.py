"""Reading a saved checkpoint folder with errors a user can act on: used by the `memlm` command (`memlm serve`
included) and by fine-tuning, which both load models (here, below both, so that neither imports the other)."""

import json
import math
from pathlib import Path

# Files any of which makes a folder hold a tokenizer AutoTokenizer can load without converting a slow one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def read_weights(folder: Path) -> tuple[dict[str, int], dict[str, str]]:
    """Each `*.safetensors` file of `folder` that opens, with its number of parameters, and each that does not, with
    the reason in one line."""
    from safetensors import SafetensorError, safe_open

    counts, unreadable = {}, {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                counts[file.name] = sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
        except (SafetensorError, OSError, ValueError) as error:
            unreadable[file.name] = one_line(error)
    return counts, unreadable


def load_model(folder):
    """`AutoModelForCausalLM.from_pretrained(folder)`, with a weights file that cannot be read (cut short, damaged)
    named in a `ValueError` instead of safetensors' bare header error."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(folder)
    except SafetensorError as error:
        broken = list(read_weights(Path(folder))[1])
        raise ValueError(
            f"{folder}: {', '.join(broken) or 'a weights file'} cannot be read ({one_line(error)}): damaged or cut "
            "short; save the model again, or take an earlier checkpoint."
        ) from error


def one_line(error: BaseException) -> str:
    """An error's message on one line (🤗 and others write some over several)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def checkpoint_folder(path: str) -> tuple[Path, dict]:
    """The folder of a saved model and its config.json, or a clear error: the folder does not exist, holds no
    config.json, or names a model type neither memlm nor 🤗 Transformers knows (🤗 would otherwise ask to trust remote
    code)."""
    from memlm.configuration.validation import CONVERTIBLE_MODEL_TYPES, MEMLM_MODEL_TYPES

    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"the folder {path!r} does not exist; give a folder written by save_pretrained.")
    if not folder.is_dir():
        raise NotADirectoryError(f"{path!r} is a file, not a folder written by save_pretrained.")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{path!r} holds no config.json: not a folder written by save_pretrained.")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON ({error}).") from error
    if not isinstance(config, dict):
        raise ValueError(f"{folder / 'config.json'} holds {type(config).__name__}, not a JSON object.")
    model_type = config.get("model_type")
    if model_type is None:
        raise ValueError(f"{folder / 'config.json'} names no model_type; memlm's are {', '.join(MEMLM_MODEL_TYPES)}.")
    if model_type in MEMLM_MODEL_TYPES:
        return folder, config
    if model_type in CONVERTIBLE_MODEL_TYPES:
        raise ValueError(f"{path!r} is {CONVERTIBLE_MODEL_TYPES[model_type]}.")
    from transformers import CONFIG_MAPPING

    if model_type.startswith("memlm_") or model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"unknown model type {model_type!r} in {folder / 'config.json'}; known: {', '.join(MEMLM_MODEL_TYPES)} "
            "(memlm) and 🤗 Transformers' own model types."
        )
    return folder, config


def check_tokenizer(folder: Path):
    """A clear error when no tokenizer was saved beside the model (🤗 would ask for sentencepiece or tiktoken)."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer found in {str(folder)!r}: it needs tokenizer.json (or a sentencepiece tokenizer.model, or "
            "vocab.json with merges.txt) beside the model; save one there with tokenizer.save_pretrained(folder)."
        )
