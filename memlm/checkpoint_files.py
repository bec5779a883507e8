"""Reading a saved checkpoint folder with errors a user can act on: used by the `memlm` command and by fine-tuning,
which both load models (here, below both, so that neither imports the other)."""

import math
from pathlib import Path


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
