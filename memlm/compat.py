"""The one place that knows which 🤗 Transformers (and torch) release is installed.

memlm runs on every release `setup.cfg` allows. Where those releases differ, the difference is handled here and
nowhere else; the model files ask this module.

- 🤗 Transformers 5.24 renamed the memory argument of `forward` and `generate`, and the matching field of the model
  outputs, from `past_key_values` to `cache` (🤗's own models keep the old name as a deprecated alias). memlm's models
  take `cache` and still take `past_key_values` on every release; their outputs carry the memory in the field the
  installed 🤗 reads (`cache` from 5.24, `past_key_values` before) and answer to `.cache` on every release, so one
  spelling works everywhere.
- Assisted and prompt-lookup decoding drive the cache the same way from 5.21 to 5.24 (`activate_past_recording`
  before the prefill, `crop(-n)` after each verification, the assistant's cache cropped by its candidate generator);
  5.24 also asks `cache.is_croppable` after the prefill. The cache sits in `generate`'s model kwargs under the
  release's name (`CACHE_NAME`), where memlm puts its own before the prefill.
- 🤗 5.23 named activation checkpointing `activation_checkpointing_enable` / `_disable` / `is_activation_checkpointing`
  (the older `gradient_checkpointing_*` names warn from 5.24); 5.21 and 5.22 know only the older names.
- The model outputs are built by `model_output` as 🤗's `ModelOutput` constructor builds them (an ordered dict of the
  fields that are set, every field an attribute), without its per-field checks; tested against the constructor under
  the oldest and the newest release.
- torch before 2.13: Dynamo answers `torch.compiler.is_exporting()` with True under `torch.compile` too, so code that
  refuses to be exported refused to be compiled; `is_exporting` here reads the flag torch.export sets, on every torch.
"""

import collections
import dataclasses
import functools
import inspect
import warnings
from dataclasses import dataclass

import torch
from transformers import GenerationMixin, modeling_outputs

# The name the installed 🤗 gives the memory in `forward`, `generate` and the outputs: read from what 🤗 declares,
# not from its version number, so a pre-release or a backport is judged by what it does.
CACHE_NAME = "cache" if "cache" in modeling_outputs.BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
# Every name under which a memory can reach a model or leave it (Trainer's `keys_to_ignore_at_inference`, the device
# map's `_skip_keys_device_placement`).
CACHE_NAMES = ["cache", "past_key_values"]


def resolve_cache_argument(cache, past_key_values, owner: str):
    """The memory given to `owner.forward` as `cache` or, under its name before 🤗 5.24, as `past_key_values`."""
    if past_key_values is None:
        return cache
    if cache is not None and cache is not past_key_values:
        raise ValueError(
            f"{owner}.forward() got both cache and past_key_values; they name the same memory (past_key_values is "
            "its name before 🤗 Transformers 5.24). Pass it once, as cache."
        )
    if CACHE_NAME == "cache":
        warnings.warn(
            f"past_key_values is deprecated for {owner}.forward() as for 🤗 Transformers' own models since 5.24 (🤗 "
            "announces its removal for 5.40). Use cache instead.",
            FutureWarning,
            stacklevel=3,
        )
    return past_key_values


def cache_keyword(model) -> str:
    """The name under which `model.forward` takes its memory on the installed 🤗: `cache` for every model from 5.24;
    before, `past_key_values`, or `cache_params` for 🤗 Mamba."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "cache_params", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(f"{type(model).__name__}.forward() takes no cache argument.")


def output_cache(outputs):
    """The memory a model's output (or a `generate` output) carries, whatever the installed 🤗 calls the field.

    Example:
        >>> import torch
        >>> from memlm import FeedbackTransformerConfig, FeedbackTransformerForCausalLM
        >>> from memlm.compat import output_cache
        >>> model = FeedbackTransformerForCausalLM(FeedbackTransformerConfig(vocab_size=258, hidden_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2)).eval()
        >>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False,
        ...                      return_dict_in_generate=True)
        >>> type(output_cache(out)).__name__
        'FeedbackCache'
    """
    for name in ("cache", "past_key_values", "cache_params"):
        if name in getattr(type(outputs), "__dataclass_fields__", {}):
            return getattr(outputs, name)
    return None


def _with_cache_alias(output_class):
    """`output_class` under 🤗 before 5.24, with `.cache` reading its `past_key_values` field."""

    @dataclass
    class WithCacheAlias(output_class):
        @property
        def cache(self):
            return self.past_key_values

    WithCacheAlias.__name__ = WithCacheAlias.__qualname__ = output_class.__name__
    WithCacheAlias.__doc__ = output_class.__doc__
    return WithCacheAlias


if CACHE_NAME == "cache":
    BaseModelOutputWithPast = modeling_outputs.BaseModelOutputWithPast
    CausalLMOutputWithPast = modeling_outputs.CausalLMOutputWithPast
else:
    BaseModelOutputWithPast = _with_cache_alias(modeling_outputs.BaseModelOutputWithPast)
    CausalLMOutputWithPast = _with_cache_alias(modeling_outputs.CausalLMOutputWithPast)


def with_cache(cache) -> dict:
    """The keyword argument that sets the memory field of an output class, under the installed 🤗's name."""
    return {CACHE_NAME: cache}


_OUTPUT_FIELDS: dict[type, tuple[tuple[str, ...], frozenset]] = {}


def model_output(output_class, **values):
    """`output_class(**values)` for one of 🤗's `ModelOutput` dataclasses, built as its constructor builds it — every
    field an attribute, those not None also its items, in the fields' order — without the constructor's checks:
    🤗 (5.24) walks the class's fields again at every field it sets, a cost that grows with the square of the fields
    (memlm's outputs have up to ten), and a decoding step builds two. The constructor itself under `torch.compile`
    (Dynamo knows it), for a name that is not a field (its error), and when no field but the first is set (🤗 may then
    read a dict or pairs from the first)."""
    known = _OUTPUT_FIELDS.get(output_class)
    if known is None:
        names = tuple(field.name for field in dataclasses.fields(output_class))
        known = _OUTPUT_FIELDS[output_class] = (names, frozenset(names))
    names, allowed = known
    if (
        torch.compiler.is_compiling() or not allowed.issuperset(values)
        or all(values.get(name) is None for name in names[1:])
    ):  # fmt: skip
        return output_class(**values)
    output = output_class.__new__(output_class)
    attributes = output.__dict__
    for name in names:
        value = attributes[name] = values.get(name)
        if value is not None:
            collections.OrderedDict.__setitem__(output, name, value)
    return output


class CacheNameGeneration:
    """Mixed in before `GenerationMixin`: `generate(cache=...)` continues from a memory on every release. 🤗 before
    5.24 knows the memory only as `past_key_values` (a `cache` keyword would reach the model beside it, and `generate`
    would not count the tokens the memory has seen); from 5.24 🤗 itself takes both names."""

    @functools.wraps(GenerationMixin.generate)
    def generate(self, *args, **kwargs):
        if CACHE_NAME != "cache" and "cache" in kwargs:
            if kwargs.get("past_key_values") is not None:
                raise ValueError(
                    "generate() got both cache and past_key_values; they name the same memory. Pass it once, as cache."
                )
            kwargs["past_key_values"] = kwargs.pop("cache")
        return super().generate(*args, **kwargs)


def activation_checkpointing_enable(model, checkpointing_kwargs: dict | None = None):
    """Turn on 🤗's activation (gradient) checkpointing: `activation_checkpointing_enable` from 🤗 5.23 (the old
    `gradient_checkpointing_enable` is deprecated from 5.24), `gradient_checkpointing_enable` before."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)


def activation_checkpointing_disable(model):
    """Turn off what `activation_checkpointing_enable` turned on, under the installed 🤗's name."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def is_activation_checkpointing(model) -> bool:
    """Whether activation checkpointing is on, under the installed 🤗's name."""
    if hasattr(model, "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def is_exporting() -> bool:
    """Whether torch.export is capturing the call (strict or not); False under `torch.compile` on every torch setup.cfg
    allows, where Dynamo before torch 2.13 folds `torch.compiler.is_exporting()` to True in any trace (seen on 2.11).
    The flag is the one that function returns; Dynamo reads a module's global with a guard on its value."""
    if hasattr(torch.compiler, "_is_exporting_flag"):
        return torch.compiler._is_exporting_flag
    return torch.compiler.is_exporting()
