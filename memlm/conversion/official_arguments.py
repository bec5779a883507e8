"""What the converters of the papers' official code share: reading the official arguments from a JSON file."""

import json
from pathlib import Path


def read_arguments_file(path: str | Path, script: str) -> dict:
    """The official `script`'s arguments from a JSON file: a dict of argument names and values (the reference data's
    `official_args`), or a dict holding one under "official_args"."""
    try:
        arguments = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}).") from error
    if isinstance(arguments, dict) and isinstance(arguments.get("official_args"), dict):
        arguments = arguments["official_args"]
    if not isinstance(arguments, dict):
        raise ValueError(f"{path} must hold a JSON object of {script}'s argument names and values.")
    return arguments
