"""Model cards: the templates in `hub_cards/` rendered with a model's real numbers into the README.md of a checkpoint."""

import importlib.resources
import re
from pathlib import Path
from string import Template

from transformers.utils import logging

logger = logging.get_logger(__name__)

# Where memlm's documentation site (docs/, mkdocs.yml's `site_url`) is meant to be published: the model cards link to
# its model pages, `DOCUMENTATION_URL + "models/<model>/"`. Nothing is published there yet.
DOCUMENTATION_URL = "https://memlm.readthedocs.io/en/latest/"


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
    """A count in words a reader takes in at a glance.

    Example:
        >>> human_count(164_416), human_count(3_546_000), human_count(950)
        ('164.4K', '3.5M', '950')
    """
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= size:
            return f"{number / size:.1f}{unit}"
    return str(number)


def render_model_card(model, template_name: str | None, mark: str = "", model_id: str | None = None) -> str | None:
    """The card for `model` from `hub_cards/<template_name>`, or None when the template is not available (as in a
    remote-code bundle, which does not carry the templates). `save_pretrained` writes it as the checkpoint's README.md.

    The template's `$model_name`, `$model_id`, `$parameters`, `$configuration` (the config's `describe()` lines),
    `$mark` and `$documentation_url` (`DOCUMENTATION_URL`) are filled in.

    Example:
        >>> from memlm import FeedbackTransformerConfig, FeedbackTransformerForCausalLM
        >>> model = FeedbackTransformerForCausalLM(FeedbackTransformerConfig(vocab_size=258, hidden_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2))
        >>> card = render_model_card(model, "feedback_transformer.md", model_id="someone/tiny-feedback")
        >>> print(next(line for line in card.splitlines() if line.startswith("# ")))
        # FeedbackTransformerForCausalLM
        >>> DOCUMENTATION_URL + "models/feedback_transformer/" in card
        True
    """
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
        "documentation_url": DOCUMENTATION_URL,
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
