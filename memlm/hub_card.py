"""Model cards: the templates in `hub_cards/` rendered with a model's real numbers into the README.md of a checkpoint."""

import importlib.resources
import re
from pathlib import Path
from string import Template

from transformers.utils import logging

logger = logging.get_logger(__name__)


def _template_text(name: str) -> str | None:
    try:
        resource = importlib.resources.files("memlm.hub_cards").joinpath(name)
        if resource.is_file():
            return resource.read_text(encoding="utf-8")
    except ModuleNotFoundError:
        pass
    # A source checkout: hub_cards/ sits beside the memlm package.
    path = Path(__file__).resolve().parent.parent / "hub_cards" / name
    return path.read_text(encoding="utf-8") if path.is_file() else None


def human_count(number: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= size:
            return f"{number / size:.1f}{unit}"
    return str(number)


def render_model_card(model, template_name: str | None, mark: str = "", model_id: str | None = None) -> str | None:
    """The card for `model` from `hub_cards/<template_name>`, or None when the template is not available (as in a
    remote-code bundle, which does not carry the templates)."""
    text = _template_text(template_name) if template_name else None
    if text is None:
        logger.info(f"No model card template {template_name!r} found; README.md not written.")
        return None
    config = model.config
    values = {
        "mark": mark,
        "model_name": f"{type(model).__name__}",
        "model_id": model_id or "path/to/checkpoint",
        "parameters": human_count(sum(parameter.numel() for parameter in model.parameters())),
        "configuration": "\n".join(f"- {line}" for line in config.describe()),
    }
    return Template(text).substitute(values)


def add_tags(readme: Path, tags: list[str]):
    """Append tags to the card's YAML front matter."""
    text = readme.read_text(encoding="utf-8")
    match = re.search(r"^tags:\n((?:- .*\n)*)", text, flags=re.MULTILINE)
    if match is None:
        return
    present = {line[2:].strip() for line in match.group(1).splitlines()}
    extra = "".join(f"- {tag}\n" for tag in tags if tag not in present)
    readme.write_text(text[: match.end()] + extra + text[match.end() :], encoding="utf-8")
