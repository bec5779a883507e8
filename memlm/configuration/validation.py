"""Checks shared by memlm's configs: every bad value raises ValueError naming the field and what is allowed."""

import difflib


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value) -> bool:
    return is_int(value) and value > 0


def default_intermediate_size(hidden_size: int) -> int:
    """Width of the gated MLP when not given: hidden_size · 4 · 2/3 rounded up to a multiple of 256 (the SwiGLU rule
    flash-linear-attention uses)."""
    return 256 * ((int(hidden_size * 4 * 2 / 3) + 255) // 256)


def _name(config, field: str) -> str:
    return f"{type(config).__name__}.{field}"


def check_positive_ints(config, *fields: str):
    for field in fields:
        value = getattr(config, field)
        if not is_positive_int(value):
            raise ValueError(f"{_name(config, field)} must be a positive integer, got {value!r}.")


def check_bools(config, *fields: str):
    for field in fields:
        value = getattr(config, field)
        if not isinstance(value, bool):
            raise ValueError(f"{_name(config, field)} must be True or False, got {value!r}.")


def check_choice(config, field: str, allowed: tuple[str, ...]):
    value = getattr(config, field)
    if value not in allowed:
        raise ValueError(f"{_name(config, field)} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")


def check_number(config, field: str, *, minimum=None, maximum=None, strict_minimum=False, strict_maximum=False):
    """A real number within the given bounds ([minimum, maximum], or open where `strict_*`)."""
    value = getattr(config, field)
    low = "(" if strict_minimum else "["
    high = ")" if strict_maximum else "]"
    allowed = f"{low}{'-inf' if minimum is None else minimum}, {'inf' if maximum is None else maximum}{high}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok and minimum is not None:
        ok = value > minimum if strict_minimum else value >= minimum
    if ok and maximum is not None:
        ok = value < maximum if strict_maximum else value <= maximum
    if not ok:
        raise ValueError(f"{_name(config, field)} must be a number in {allowed}, got {value!r}.")


def check_token_ids(config):
    for field in ("pad_token_id", "bos_token_id"):
        value = getattr(config, field)
        if value is not None and (not is_int(value) or not 0 <= value < config.vocab_size):
            raise ValueError(
                f"{_name(config, field)} must be None or an id in [0, vocab_size={config.vocab_size}), got {value!r}."
            )
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    for value in eos:
        if value is not None and (not is_int(value) or not 0 <= value < config.vocab_size):
            raise ValueError(
                f"{_name(config, 'eos_token_id')} must be None, an id or a list of ids in [0, vocab_size="
                f"{config.vocab_size}), got {config.eos_token_id!r}."
            )


def reject_misspelled_options(config, extra_options: dict):
    """Extra keyword arguments are kept (as 🤗 configs do, for forward compatibility), except ones that look like a
    misspelled field: those would otherwise be silently ignored."""
    fields = [name for name in type(config).__dataclass_fields__ if not name.startswith("_")]
    for name in extra_options:
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.85)
        if close and close[0] != name:
            raise ValueError(f"{type(config).__name__} got an unknown option {name!r}; did you mean {close[0]!r}?")
