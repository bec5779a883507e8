"""What memlm's models share around their memories: checking the inputs, the padding mask, and the base of the
cache classes that carry each model's memory (`cache`, SPEC §4)."""

import contextvars
import functools
import inspect
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationMixin
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import logging

from ..compat import CACHE_NAME, CacheNameGeneration, is_exporting, output_cache
from ..kernels import checked_at_every_call, checking_every_call, collecting_unchecked_sums, mark_static

logger = logging.get_logger(__name__)

# Keyword arguments that 🤗 `generate`, `Trainer` and the loss pass to `forward`; anything else is a mistake worth an
# error rather than an option silently swallowed.
# What 🤗's DataCollatorWithFlattening emits beside position_ids with `return_seq_idx` / `return_flash_attn_kwargs`:
# explicit marks of documents packed back to back in a row.
PACKING_KWARGS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
ACCEPTED_EXTRA_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels", "output_attentions", *PACKING_KWARGS)
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
# What `generate` takes for itself but hands on with the model's inputs (`generate(stop_strings=..., tokenizer=...)`,
# `pipeline(...)(prompt, stop_sequence=...)`): 🤗's own models ignore it in their `**kwargs`; memlm's do not take it, so
# it is left out of their inputs here, and `forward(tokenizer=...)` is still refused.
GENERATE_OWN_KWARGS = ("tokenizer",)

# Inside `generate` (`CountsOwnPositions.generate`): a token of the innermost call running in this context, None
# outside. `generate` reads of its forwards only the logits, the cache and the hidden states it is asked for, and its
# steps change no weight.
_GENERATE_CALL = contextvars.ContextVar("memlm_generate_call", default=None)


def auxiliary_outputs_read() -> bool:
    """Whether the caller of a forward may read its auxiliary outputs (an auxiliary loss, statistics such as
    Expire-Span's `memory_size`): always but inside `generate`, where a forward may leave them out (None), and always
    under torch.compile (which cannot read a context variable; a compiled step may be called outside `generate`)."""
    return torch.compiler.is_compiling() or _GENERATE_CALL.get() is None


# Set to 1 to build a model that looks larger than the memory this machine has left (e.g. with swap in mind).
ALLOW_LARGE_MODELS = "MEMLM_ALLOW_LARGE_MODELS"


def memory_available() -> int | None:
    """Bytes this process can still allocate: the kernel's MemAvailable, or less under a cgroup's memory limit;
    None where neither can be read (not Linux)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:  # cgroup v2: the limit minus what the group already uses
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_fits_in_memory(config, weight: torch.Tensor):
    """Refuse, before the layers are built, a model whose weights alone would not fit in the memory left: a slip in
    a size (num_hidden_layers=10**7) would otherwise build layers for minutes until memory runs out. `weight` is the
    first tensor the model made: on the meta device (empty-weight loading) or a GPU nothing is checked here."""
    if weight.device.type != "cpu" or os.environ.get(ALLOW_LARGE_MODELS, "").strip() == "1":
        return
    available = memory_available()
    count = config.estimated_parameters()
    needed = count * weight.element_size()
    if available is not None and needed > available:
        raise ValueError(
            f"{type(config).__name__} describes a model of about {count:.3g} parameters, whose {weight.dtype} weights "
            f"alone need about {needed / 2**30:.3g} GiB; this machine has {available / 2**30:.3g} GiB of memory "
            f"left. Check the sizes (hidden_size={config.hidden_size}, intermediate_size={config.intermediate_size}, "
            f"num_hidden_layers={config.num_hidden_layers}, vocab_size={config.vocab_size}), or set "
            f"{ALLOW_LARGE_MODELS}=1 to build it anyway."
        )


def check_extra_kwargs(kwargs: dict, owner: str):
    unexpected = sorted(set(kwargs) - set(ACCEPTED_EXTRA_KWARGS))
    if unexpected:
        raise TypeError(f"{owner}.forward() got unexpected keyword argument(s): {', '.join(unexpected)}.")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{owner} does not return attention weights (output_attentions=True).")


def causal_lm_loss(model, logits: torch.Tensor, labels: torch.Tensor | None, kwargs: dict) -> torch.Tensor | None:
    """🤗's next-token loss (`model.loss_function`) from `labels` (shifted inside) or from `shift_labels` in `kwargs`
    (already shifted, as context-parallel `Trainer` runs and some collators pass them); None without either. The same
    cross-entropy in float64 for float64 logits."""
    loss_kwargs = {key: kwargs[key] for key in LOSS_KWARGS if key in kwargs}
    targets = loss_kwargs.get("shift_labels")
    if labels is None and targets is None:
        return None
    for name, given in (("labels", labels), ("shift_labels", targets)):
        if given is not None and tuple(given.shape) != tuple(logits.shape[:2]):
            raise ValueError(
                f"{name} must have the shape of the inputs (batch, length) = {tuple(logits.shape[:2])}, got "
                f"{tuple(given.shape)}."
            )
    if loss_kwargs.get("num_items_in_batch") is None:
        # The mean over the predicted tokens as their sum / their count (at least 1): the same number, and a batch
        # whose labels are all ignored gives 0 and a zero gradient instead of 🤗's nan (0 / 0), without a host sync.
        ignored = loss_kwargs.get("ignore_index", -100)
        predicted = targets if targets is not None else labels[:, 1:]
        loss_kwargs["num_items_in_batch"] = (predicted != ignored).sum().clamp(min=1)
    if logits.dtype == torch.float64:
        # 🤗's loss casts the logits to float32; a float64 model (the papers' models checked to 1e-9) keeps float64.
        ignored = loss_kwargs.get("ignore_index", -100)
        if targets is None:
            targets = torch.nn.functional.pad(labels, (0, 1), value=ignored)[..., 1:]
        total = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device), ignore_index=ignored,
            reduction="sum",
        )  # fmt: skip
        return total / torch.as_tensor(loss_kwargs["num_items_in_batch"]).to(total.device)
    return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size, **loss_kwargs)


def embed_inputs(input_ids, inputs_embeds, embedding: torch.nn.Embedding) -> torch.Tensor:
    """The (B, T, D) input embeddings, after checking that exactly one of ids and embeddings is given and is valid."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
    given, name = (input_ids, "input_ids") if input_ids is not None else (inputs_embeds, "inputs_embeds")
    if given.dim() >= 2 and given.shape[0] * given.shape[1] == 0:
        raise ValueError(
            f"{name} holds no tokens (shape {tuple(given.shape)}); give at least one row of at least one token."
        )
    if inputs_embeds is not None:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != embedding.embedding_dim:
            raise ValueError(
                f"inputs_embeds must have shape (batch, length, hidden_size={embedding.embedding_dim}), "
                f"got {tuple(inputs_embeds.shape)}."
            )
        return inputs_embeds
    vocab_size = embedding.num_embeddings
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}.")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}.")
    # Reading the ids' range is data-dependent (a wait for the device): eager runs check it, torch.compile and
    # torch.export leave it out. A CPU embedding checks its indices itself, so there the range is read only when it
    # refused them (a decoding step is spared the read); a GPU's would stop the process with a device assertion.
    if torch.compiler.is_compiling():
        return embedding(input_ids)
    if input_ids.device.type == "cpu":
        try:
            return embedding(input_ids)
        except IndexError:
            pass
    low, high = (int(bound) for bound in torch.aminmax(input_ids))
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"input_ids must lie in [0, vocab_size={vocab_size}); got values from {low} to {high}. Is the "
            "tokenizer the one this model was trained with?"
        )
    return embedding(input_ids)


def zero_padding(inputs_embeds: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The embeddings with zeros at padding (`valid` False): padding is skipped, but a NaN or inf there would still
    reach the real tokens through a product with a zero weight (0 · NaN = NaN) in a recurrence or a masked softmax."""
    if valid is None:
        return inputs_embeds
    return inputs_embeds.masked_fill(~valid[..., None], 0.0)


def keeps_non_finite_in_place(forward):
    """Wrap a base model's `forward` so that a NaN or inf stays where it is on every device (issue 33): outputs before a
    non-finite input at position t are what they would be without it, and those from t on are NaN.

    The operations that mix positions (the chunkwise delta rule, the Expire-Span attention) keep a non-finite input in
    place by checking the sums of their output (and spans) at each call (`memlm.kernels.sums_are_finite`), a read-back:
    free for CPU tensors, a stall of the queue at every layer on a GPU. On such a device the wrapped forward collects
    those sums on the device instead (`collecting_unchecked_sums`) and reads them back once, at its end; when one is
    not finite, it runs again, from the memory it was given (`MemoryCache.snapshot`, taken before) and the same random
    state, with every call checked (`checking_every_call`), so it gives what the per-call checks give. A forward of one
    token per row (a decoding step), one that `torch.compile` or `torch.export` traces, or one already inside
    `checking_every_call` runs once, unchecked here: one token has no earlier positions to spoil, and a compiled step
    reads nothing back."""
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def checked(self, *args, **kwargs):
        if torch.compiler.is_compiling() or is_exporting():
            return forward(self, *args, **kwargs)
        if len(args) > 1:
            arguments = signature.bind(self, *args, **kwargs).arguments
        else:  # the usual calls, named arguments after the ids, without binding them
            arguments = {**kwargs, **({"input_ids": args[0]} if args else {})}
        inputs = arguments.get("input_ids")
        if inputs is None:
            inputs = arguments.get("inputs_embeds")
        if (
            not torch.is_tensor(inputs)
            or inputs.dim() < 2
            or inputs.shape[1] < 2
            or checked_at_every_call(inputs.device)
        ):
            return forward(self, *args, **kwargs)
        cache = arguments.get("cache")
        if cache is None:
            cache = arguments.get("past_key_values")
        snapshot = cache.snapshot() if isinstance(cache, MemoryCache) else None
        random_state = _random_state(inputs.device) if self.training else None
        with collecting_unchecked_sums() as sums:
            output = forward(self, *args, **kwargs)
        if not sums or bool(torch.isfinite(torch.stack(sums).sum())):  # the forward's one read-back
            return output
        del output
        if snapshot is not None:
            cache.restore(snapshot)
        if random_state is not None:
            _set_random_state(inputs.device, random_state)
        with checking_every_call():
            return forward(self, *args, **kwargs)

    return checked


def _random_state(device: torch.device):
    """The state of the random generators a forward on `device` draws from (dropout, the model's own draws)."""
    accelerator = getattr(torch, device.type, None) if device.type != "cpu" else None
    return torch.get_rng_state(), accelerator.get_rng_state(device) if accelerator is not None else None


def _set_random_state(device: torch.device, state):
    host, on_device = state
    torch.set_rng_state(host)
    if on_device is not None:
        getattr(torch, device.type).set_rng_state(on_device, device)


@torch.compiler.disable(
    reason="memlm runs a prompt's loop over its steps or blocks outside the graph (unrolled, it took minutes to "
    "compile): compile without fullgraph=True to run prompts; a one-token decoding step compiles to one graph"
)
def run_eagerly(function, *args, **kwargs):
    """`function(*args, **kwargs)` outside any graph torch.compile traces (a graph break: it runs as in eager mode).
    The models run so what a traced forward would otherwise unroll: a prompt's loop over its steps or blocks, whose
    ops, repeated per token or block and per layer, took minutes to compile; a one-token step is compiled whole."""
    return function(*args, **kwargs)


def prompt_loop(function, length: int):
    """`function`, the loop of a forward over `length` tokens, or, traced by torch.compile over more than one token,
    `function` run outside the graph (`run_eagerly`). torch.export captures it whole (an exported program has no
    eager part)."""
    if length > 1 and torch.compiler.is_compiling() and not is_exporting():
        return functools.partial(run_eagerly, function)
    return function


def past_length_to_check(cache: "MemoryCache | None") -> int | None:
    """The tokens `cache` has seen, for a forward's checks of its inputs; None while `torch.compile` traces it: a
    compileable memory counts its tokens in a tensor (`StaticMemoryCacheLayer`), which a compiled step does not read
    back."""
    if cache is None:
        return 0
    return None if torch.compiler.is_compiling() else cache.get_seq_length()


def current_padding_mask(attention_mask, batch_size: int, length: int, past_length: int | None) -> torch.Tensor | None:
    """The (B, T) boolean part of a 2-D padding mask that covers the current tokens (None without a mask). With
    `past_length` None (unknown: `past_length_to_check`), a mask of any width from T on."""
    if attention_mask is None:
        return None
    if past_length is None:
        fits = attention_mask.dim() == 2 and attention_mask.shape[1] >= length
    else:
        fits = attention_mask.dim() == 2 and attention_mask.shape[1] in (length, past_length + length)
    if not fits or attention_mask.shape[0] != batch_size:
        longer = f"past + {length}" if past_length is None else f"past + length={past_length + length}"
        raise ValueError(
            f"attention_mask must be a 2-D padding mask of shape (batch={batch_size}, length={length}) or "
            f"(batch={batch_size}, {longer}); got {tuple(attention_mask.shape)}."
        )
    return attention_mask[:, -length:].bool()


def current_weights_version(model: torch.nn.Module, cache: "MemoryCache | None") -> tuple:
    """`weights_version(model)`, for comparing with `cache.weights_version` (the weights its memories were made with),
    walked once per `generate` call: `generate`'s steps change no weight, so once a step of the call found the cache's
    version current, the later steps take it as it is, the same tuple (a copied cache, or a version set anew, is
    checked again). Outside `generate`, and under torch.compile (which cannot read a context variable), every call
    walks the model."""
    if torch.compiler.is_compiling():
        return weights_version(model)
    call = _GENERATE_CALL.get()
    known = cache.weights_version if cache is not None else None
    checked = cache.weights_checked if cache is not None else None
    if call is not None and known is not None and checked is not None and checked[0] is call and checked[1] is known:
        return known
    version = weights_version(model)
    if known is None or version != known:
        return version
    if call is not None:
        cache.weights_checked = (call, known)
    return known


def weights_version(model: torch.nn.Module) -> tuple:
    """What changes when one of `model`'s weights changes (an optimizer step, a load: every in-place write counts in a
    tensor's `_version`; a weight replaced by another tensor, as `load_state_dict(assign=True)` or an adapter does:
    its identity), for knowing whether memories were computed with the current weights (`current_weights_version`):
    the modules are walked directly (a tied weight counts twice), not through `parameters()`, whose generators took
    4% of a small model's decoding step."""
    versions, modules = [id(model)], [model]
    for module in modules:  # (the list grows as it is read: half the time of a stack and a generator)
        if module is None:
            continue
        for parameter in module._parameters.values():
            if parameter is not None:
                versions += (id(parameter), parameter._version)
        modules += module._modules.values()
    return tuple(versions)


def padding_first(states: torch.Tensor, valid: torch.Tensor, attention_mask) -> tuple:
    """For a model whose steps run in order (a row's padding must write nothing and take no position): each row's
    padding moved first and its real tokens after it in their order (a stable sort). states (B, T, D), valid (B, T) →
    the reordered states and mask, and the order (B, T) that `restore_order` undoes, or None when nothing moves (one
    token per row, as a decoding step, needs no sort: a compiled step then has none; under compilation rows are always
    sorted, as there is no data-dependent branch)."""
    length = states.shape[1]
    if length == 1 or attention_mask is None or not (torch.compiler.is_compiling() or not bool(valid.all())):
        return states, valid, None
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices
    return states.gather(1, order[..., None].expand_as(states)), valid.gather(1, order), order


def restore_order(states: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """(B, T, ...) states of rows reordered by `padding_first` back in the caller's order."""
    if order is None:
        return states
    return states.new_empty(states.shape).scatter(1, order[..., None].expand_as(states), states)


@dataclass
class RecordedForward:
    """One forward read into a cache that records its past (`activate_past_recording`): its length, its padding mask
    (B, T) in the caller's order (None: every token real), and each row's next position before it (None: a fresh
    cache, or a model that counts no positions)."""

    length: int
    valid: torch.Tensor | None
    next_positions: torch.Tensor | None

    def real_tokens(self, first: int) -> torch.Tensor | None:
        """(B,) how many of the forward's first `first` tokens are real in each row (None: all of them)."""
        return None if self.valid is None else self.valid[:, :first].sum(1)


@dataclass
class Rollback:
    """Where `crop` puts a recording cache back to: the recorded forwards since recording started or since the last
    crop (`forwards`), the one the cut falls in (`forward`; `len(forwards)` when nothing is removed) and how many of
    its tokens stay (`kept`, fewer than its length), and each row's next position after the cut (None for models that
    count no positions, or when the cut leaves the cache as fresh as it was)."""

    forwards: list[RecordedForward]
    forward: int
    kept: int
    next_positions: torch.Tensor | None

    @property
    def removes_tokens(self) -> bool:
        return self.forward < len(self.forwards)


class MemoryCacheLayer:
    """Base of a layer's memory in a memlm cache: its tensors all have the batch as first dimension, and it counts
    the tokens it consumed. Subclasses list their tensor attributes in `tensor_names`.

    Rolling back (speculative decoding, 🤗's protocol): after `activate_past_recording`, every forward keeps in
    `recorded` what undoes it (each model keeps its own kind of entry, one per forward); `crop(-n)` puts the memory
    back to what the tokens read before the last n gave (`roll_back`), `crop(0)` keeps everything, and both drop
    what was recorded. Without recording nothing is kept. Each model's layer defines `roll_back(rollback)`, which puts
    the memory back to what it held after the tokens a `Rollback` keeps (called by every crop, also one that removes
    nothing, with what the layer recorded since the last one)."""

    is_compileable = False
    # Whether `crop` can put this memory back once recording is on (every memlm memory can).
    is_croppable = True
    is_sliding = False
    supports_early_init = False
    tensor_names: tuple[str, ...] = ()

    def __init__(self):
        for name in self.tensor_names:
            setattr(self, name, None)
        self.seen_tokens = 0
        self.record_past = False
        self.recorded: list = []

    @property
    def is_initialized(self) -> bool:
        return getattr(self, self.tensor_names[0]) is not None

    def map(self, function):
        """Apply `function` to every tensor of the memory (reorder, repeat or select rows, move devices)."""
        for name in self.tensor_names:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, function(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self.map(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int):
        self.map(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        self.map(lambda tensor: tensor[indices.to(tensor.device) if torch.is_tensor(indices) else indices])

    def reset(self):
        self.__init__()

    def activate_past_recording(self):
        """Keep, from now on, what each forward needs to be undone by `crop` (🤗's name)."""
        self.record_past = True

    def stop_past_recording(self):
        """Stop recording and drop whatever was recorded (generate's end: no recording outlives it)."""
        self.record_past = False
        self.recorded = []

    def snapshot(self):
        """What `restore` needs to put the memory back as it is now, after forwards that may write it in place: copies
        of its tensors, the tokens seen and how many forwards it has recorded (see `MemoryCache.snapshot`)."""
        tensors = {name: getattr(self, name) for name in self.tensor_names}
        copies = {name: None if tensor is None else tensor.clone() for name, tensor in tensors.items()}
        return copies, self.seen_tokens, len(self.recorded)

    def restore(self, snapshot):
        """The memory as it was when `snapshot` was taken."""
        tensors, seen_tokens, recorded = snapshot
        for name, tensor in tensors.items():
            setattr(self, name, tensor)
        self.seen_tokens = seen_tokens
        del self.recorded[recorded:]

    def offload(self):
        self.map(lambda tensor: tensor.to("cpu", non_blocking=True))

    def prefetch(self):
        return None

    def get_max_length(self) -> int:
        return -1

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def count_tokens(self, count: int):
        """Add `count` tokens (padding included) to the tokens the memory has consumed."""
        self.seen_tokens += count

    @property
    def not_compileable_reason(self) -> str | None:
        """Why `generate` cannot compile a decoding step over this memory (None where it can)."""
        return None if self.is_compileable else "This memory cannot be compiled."


def writes_in_place(current: torch.Tensor | None, new: torch.Tensor) -> bool:
    """Whether `new` can be copied into `current` (same shape, dtype and device) rather than replace it: only without
    autograd, since a gradient-checkpointed layer recomputes its forward from the state it was given, and not into an
    inference tensor outside `torch.inference_mode`, which torch forbids (and `torch.compile` does not trace)."""
    return (
        current is not None
        and not torch.is_grad_enabled()
        and current.shape == new.shape
        and current.dtype == new.dtype
        and current.device == new.device
        and (torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or not current.is_inference())
    )


class StaticMemoryCacheLayer(MemoryCacheLayer):
    """Base of a memory whose size does not grow with the context, fixed (DeltaNet's fast weights) or bounded (the
    Feedback Transformer's ring of τ slots), which a compiled decoding step can capture as 🤗's `StaticLayer` and
    `LinearAttentionLayer` are: allocated once at the first write, marked with `torch._dynamo.mark_static_address`
    and then written in place (`store`), so every step reads and writes the same tensors. The number of tokens seen
    is such a tensor too (`token_count`): a Python int would be a constant of the compiled graph, which would then
    compile anew at every step. As 🤗's rule has it, a memory that keeps its past for a rollback (`record_past`) is
    not compileable."""

    record_past = False

    def __init__(self):
        self.token_count = mark_static(torch.zeros((), dtype=torch.long))  # moves to the first state's device
        super().__init__()

    @property
    def is_compileable(self) -> bool:
        return not self.record_past

    @property
    def not_compileable_reason(self) -> str | None:
        if self.is_compileable:
            return None
        return "The memory keeps its past for a rollback (record_past), so its tensors grow and move."

    @property
    def seen_tokens(self) -> int:
        return int(self.token_count)

    @seen_tokens.setter
    def seen_tokens(self, value: int):
        if writes_in_place(self.token_count, self.token_count):
            self.token_count.fill_(value)
        else:
            self.token_count = torch.full_like(self.token_count, value)

    def count_tokens(self, count: int):
        if writes_in_place(self.token_count, self.token_count):
            self.token_count.add_(count)
        else:
            self.token_count = self.token_count + count

    def store(self, name: str, new: torch.Tensor | None):
        """The state `name` becomes `new`: copied into the tensor already there where it can be (`writes_in_place`),
        else a contiguous copy of it (a slice of a larger tensor would keep all of it alive), at a static address
        unless gradients flow through it. The first state also moves the token count to its device, where a compiled
        step adds to it."""
        current = getattr(self, name)
        if new is current:  # written where it lies (DeltaNet's decoding step)
            return
        if new is not None and not self.record_past and writes_in_place(current, new):
            current.copy_(new)
            return
        if new is not None:
            new = new.clone(memory_format=torch.contiguous_format)
            if not new.requires_grad:
                mark_static(new)
            if self.token_count.device != new.device:
                self.token_count = mark_static(self.token_count.to(new.device))
        setattr(self, name, new)

    def map(self, function):
        super().map(lambda tensor: mark_static(function(tensor)))

    def restore(self, snapshot):
        """As `MemoryCacheLayer.restore`, writing the tensors back in place where they are (`store`): a compiled step
        keeps reading the same addresses."""
        tensors, seen_tokens, recorded = snapshot
        for name, tensor in tensors.items():
            self.store(name, tensor) if tensor is not None else setattr(self, name, None)
        self.seen_tokens = seen_tokens
        del self.recorded[recorded:]

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Beam search keeps the batch size: the rows are reordered in place, at the same addresses."""
        for name in self.tensor_names:
            tensor = getattr(self, name)
            if tensor is not None:
                reordered = tensor.index_select(0, beam_idx.to(tensor.device))
                if writes_in_place(tensor, reordered):
                    tensor.copy_(reordered)
                else:
                    setattr(self, name, reordered)


class MemoryCache(Cache):
    """Base of memlm's caches (the `cache` argument of the models): one `MemoryCacheLayer` per model layer, written by
    the layers themselves (not through `update`). `generate` counts tokens through `get_seq_length`, which a 🤗 cache
    made only of linear-attention layers cannot answer, hence this base."""

    layer_class: type[MemoryCacheLayer] = MemoryCacheLayer

    def __init__(self, config):
        super().__init__(layers=[self.layer_class() for _ in range(self.layer_count(config))])
        # (B,) position of each row's next real token, for models that count positions past the padding.
        self.next_positions: torch.Tensor | None = None
        # The forwards read since recording started or since the last crop (see `MemoryCacheLayer`).
        self.recorded_forwards: list[RecordedForward] = []
        # For a model whose memories are recomputed from hidden states: the weights every memory was computed with
        # (`weights_version`), None when unknown. A restored snapshot makes it unknown, and so does a crop when a
        # forward it may reach back into recomputed the memories (set by the model: the memories before it were
        # computed with other weights).
        self.weights_version: tuple | None = None
        # (the `generate` call that found `weights_version` current, and that tuple: `current_weights_version`)
        self.weights_checked: tuple | None = None
        self.recomputed_while_recording = False

    @staticmethod
    def layer_count(config) -> int:
        """How many memory layers the cache holds (one per model layer unless a model shares its memory)."""
        return config.num_hidden_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of tokens (padding included) the memory has consumed."""
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def update(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is written by the model's layers themselves, not through update().")

    @property
    def batch_size(self) -> int:
        if self.next_positions is not None:
            return self.next_positions.shape[0]
        # As 🤗's Cache.batch_size, written out: torch.compile cannot read a property through super().
        sizes = [layer.batch_size for layer in self.layers if hasattr(layer, "batch_size")]
        return sizes[0] if sizes else -1

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        if self.next_positions is not None:
            reordered = self.next_positions.index_select(0, beam_idx.to(self.next_positions.device))
            if writes_in_place(self.next_positions, reordered):
                self.next_positions.copy_(reordered)  # at the same address, for a compiled step
            else:
                self.next_positions = reordered

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        if self.next_positions is not None:
            self.next_positions = self.next_positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        if self.next_positions is not None:
            self.next_positions = self.next_positions[indices]

    def reset(self):
        super().reset()
        self.next_positions = None
        self.weights_version = None
        self.recorded_forwards = []

    @property
    def recording(self) -> bool:
        """Whether the forwards keep what `crop` needs to undo them (`activate_past_recording`)."""
        # len(), not bool(): Dynamo in torch 2.11 cannot trace bool() of a list.
        return len(self.layers) > 0 and all(layer.record_past for layer in self.layers)

    def record_forward(self, length: int, valid: torch.Tensor | None):
        """Called by the model at the start of a forward into a recording cache, before it moves `next_positions`:
        `valid` (B, T) is the forward's padding mask in the caller's order (None: every token real)."""
        self.recorded_forwards.append(RecordedForward(length, valid, self.next_positions))

    def stop_past_recording(self):
        """Stop recording and drop whatever was recorded (generate does this as it returns the cache)."""
        for layer in self.layers:
            layer.stop_past_recording()
        self.recorded_forwards = []
        self.recomputed_while_recording = False

    def snapshot(self):
        """What `restore` needs to put the cache back as it is now: each layer's `snapshot`, each row's next position
        and how many forwards the cache has recorded for a rollback."""
        next_positions = None if self.next_positions is None else self.next_positions.clone()
        return [layer.snapshot() for layer in self.layers], next_positions, len(self.recorded_forwards)

    def restore(self, snapshot):
        """The cache as it was when `snapshot` was taken, as if the forwards since had not run."""
        layers, next_positions, recorded = snapshot
        for layer, layer_snapshot in zip(self.layers, layers):
            layer.restore(layer_snapshot)
        self.next_positions = next_positions
        del self.recorded_forwards[recorded:]
        self.weights_version = None

    def crop(self, tokens_to_remove: int):
        """Remove the last `-tokens_to_remove` tokens (🤗's convention: `crop(-n)`): the memory becomes what the tokens
        before them gave, as if they had never been read; `crop(0)` keeps every token. Both end what was recorded for
        rolling back, so a later `crop` can remove only tokens read after this one. Needs `activate_past_recording`
        before the forwards of the tokens to remove (🤗's `generate` calls it for assisted decoding)."""
        name = type(self).__name__
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(
                f"{name}.crop takes minus the number of tokens to remove: crop(-n) removes the last n, crop(0) keeps "
                f"them all; got crop({tokens_to_remove!r})."
            )
        count = -tokens_to_remove
        if not self.recording:
            if count:
                raise ValueError(
                    f"This {name} records no past, so its last {count} tokens cannot be removed: call "
                    "activate_past_recording() before the forwards to roll back (🤗's generate does it for assisted "
                    "and prompt-lookup decoding)."
                )
            return
        total = sum(forward.length for forward in self.recorded_forwards)
        if count > total:
            raise ValueError(
                f"This {name} can remove at most the {total} tokens read since recording started or since the last "
                f"crop; got crop({tokens_to_remove})."
            )
        rollback = self._rollback(total - count)
        for layer in self.layers:
            if layer.recorded:
                layer.roll_back(rollback)
            layer.seen_tokens -= count
            layer.recorded = []
            if layer.seen_tokens == 0:  # everything the cache had read is gone: as fresh as a new cache
                layer.reset()
                layer.record_past = True
        if rollback.removes_tokens:
            self.next_positions = rollback.next_positions
            if self.recomputed_while_recording:
                self.weights_version = None
        self.recorded_forwards = []
        self.recomputed_while_recording = False

    def _rollback(self, kept_total: int) -> Rollback:
        """Where the first `kept_total` of the recorded tokens end: the forward the cut falls in, its kept tokens and
        each row's next position after them."""
        forwards = self.recorded_forwards
        before = 0
        for index, forward in enumerate(forwards):
            if before + forward.length > kept_total:
                kept = kept_total - before
                next_positions = forward.next_positions
                real = forward.real_tokens(kept)
                if kept and next_positions is None and self.next_positions is not None:
                    next_positions = torch.zeros_like(self.next_positions)  # the cache was fresh before it
                if kept and next_positions is not None:
                    next_positions = next_positions + (kept if real is None else real.to(next_positions.device))
                return Rollback(forwards, index, kept, next_positions)
            before += forward.length
        return Rollback(forwards, len(forwards), 0, self.next_positions)

    @property
    def not_compileable_reason(self) -> str | None:
        """Why `generate` cannot compile a decoding step over this memory (None where it can)."""
        for layer in self.layers:
            if layer.not_compileable_reason is not None:
                return layer.not_compileable_reason
        return None

    def prepare_compiled_decoding(self):
        """Make the memory ready for decoding steps compiled by `torch.compile`, before the prompt runs: `generate`
        calls it when it compiles (`compile_config`); call it yourself when you compile a model's decoding step.
        Most memories have nothing to do (the Feedback Transformer's ring takes its full size at once)."""

    def check_against(self, config, batch_size: int):
        """Raise a ValueError when this cache cannot continue a forward of `batch_size` rows of the model `config`."""
        if len(self.layers) != self.layer_count(config):
            raise ValueError(
                f"The {type(self).__name__} has {len(self.layers)} memory layers but the model needs "
                f"{self.layer_count(config)}."
            )
        if self.batch_size not in (-1, batch_size):
            raise ValueError(
                f"The {type(self).__name__} holds a batch of {self.batch_size} rows but the input has {batch_size}."
            )


def document_starts(
    position_ids, valid: torch.Tensor | None, batch_size: int, length: int, packing: dict | None = None
) -> torch.Tensor | None:
    """Where packed documents start: (B, T) True at the first real token of every document but a row's first. None
    when no row holds more than one document. Only an explicit signal marks documents (🤗's DataCollatorWithFlattening
    emits each): `seq_idx` (B, T), the document of each token; `cu_seq_lens_q` / `cu_seq_lens_k` (S + 1,), where the
    S documents of a single row start; or position_ids that restart at exactly 0 after a non-zero position. A position
    that repeats or falls to another value is not a start: 🤗 `generate` gives the tokens after a right-padded prompt
    positions that repeat earlier ones."""
    packing = packing or {}
    if position_ids is not None and (
        position_ids.dim() != 2 or position_ids.shape[-1] != length or position_ids.shape[0] not in (1, batch_size)
    ):
        raise ValueError(
            f"position_ids must have shape (batch={batch_size}, length={length}) or (1, {length}); got "
            f"{tuple(position_ids.shape)}."
        )
    documents = _document_indices(packing, batch_size, length)
    if (documents is None and position_ids is None) or length < 2:
        return None
    device = (documents if documents is not None else position_ids).device
    if valid is None:
        valid = torch.ones(batch_size, length, dtype=torch.bool, device=device)
    steps = torch.arange(length, device=device).expand(batch_size, length)
    last_real = torch.where(valid, steps, -1).cummax(1).values  # the latest real token at or before each step
    previous = torch.cat([last_real.new_full((batch_size, 1), -1), last_real[:, :-1]], 1)
    if documents is not None:
        changes = documents != documents.gather(1, previous.clamp_min(0))
    else:
        positions = position_ids.long().expand(batch_size, length)
        changes = (positions == 0) & (positions.gather(1, previous.clamp_min(0)) != 0)
    starts = valid & (previous >= 0) & changes
    return starts if bool(starts.any()) else None


def _document_indices(packing: dict, batch_size: int, length: int) -> torch.Tensor | None:
    """(B, T) document index of each token from `seq_idx` or `cu_seq_lens_*`, or None without them."""
    seq_idx = packing.get("seq_idx")
    if seq_idx is not None:
        if seq_idx.dim() != 2 or seq_idx.shape[-1] != length or seq_idx.shape[0] not in (1, batch_size):
            raise ValueError(
                f"seq_idx must have shape (batch={batch_size}, length={length}); got {tuple(seq_idx.shape)}."
            )
        return seq_idx.long().expand(batch_size, length)
    offsets = packing.get("cu_seq_lens_q")
    offsets = offsets if offsets is not None else packing.get("cu_seq_lens_k")
    if offsets is None:
        return None
    if batch_size != 1 or offsets.dim() != 1 or offsets.numel() < 2:
        raise ValueError(
            f"cu_seq_lens_q / cu_seq_lens_k must be the (documents + 1,) offsets of documents packed into one row "
            f"(batch 1, as DataCollatorWithFlattening builds it); got offsets of shape {tuple(offsets.shape)} for a "
            f"batch of {batch_size}."
        )
    steps = torch.arange(length, device=offsets.device)
    return torch.searchsorted(offsets[1:-1].long(), steps, right=True)[None]


def refuse_packed_documents(position_ids, valid, batch_size: int, length: int, owner: str, packing: dict) -> None:
    """Raise `ValueError` if a row holds packed documents (see `document_starts`), which `owner` cannot keep apart."""
    if document_starts(position_ids, valid, batch_size, length, packing) is not None:
        raise ValueError(
            f"A row holds documents packed back to back (position_ids restarting at 0, seq_idx or cu_seq_lens, as "
            f"🤗's DataCollatorWithFlattening builds them). {owner} cannot keep packed documents apart; give one "
            "document per row, padded (e.g. DataCollatorForLanguageModeling), or a continuous stream without "
            "position_ids."
        )


class DeclinesContinuousBatching:
    """🤗's continuous batching (`init_continuous_batching`, `generate_batch`, `transformers serve
    --continuous-batching`) runs the model on a paged cache of keys and values, which memlm's memories are not. The
    entry point is absent, so that `hasattr(model, "init_continuous_batching")` is False: `transformers serve` then
    falls back to `generate` (which batches left-padded prompts), and `generate_batch` raises AttributeError at once
    instead of failing inside the model."""

    @property
    def init_continuous_batching(self):
        raise AttributeError("init_continuous_batching")  # torch's Module.__getattr__ reports it as missing


class CountsOwnPositions(DeclinesContinuousBatching, CacheNameGeneration):
    """For the ForCausalLM classes, before `GenerationMixin`: `generate` passes no position_ids. The models count
    positions from the attention mask and their cache; 🤗's position_ids for the tokens after a right-padded prompt
    repeat the prompt's positions. (`generate(cache=...)` works on every 🤗 release: `CacheNameGeneration`.) Nor
    does it pass on what it keeps for itself (`GENERATE_OWN_KWARGS`), and continuous batching is declined
    (`DeclinesContinuousBatching`).

    Speculative decoding (`assistant_model=`, `prompt_lookup_num_tokens=`): 🤗 verifies the drafted tokens in one
    forward and crops the cache back to the last accepted one, so it needs the cache before the first forward, where
    memlm's models otherwise make their own (`cache_class`). No recording outlives `generate`. Compiled decoding
    (`compile_config=`) needs it before the first forward too: `generate` decides whether to compile from the cache.
    Its forwards may leave out the auxiliary outputs, which it does not read (`auxiliary_outputs_read`)."""

    # The model's cache (a `MemoryCache`); set by each model.
    cache_class: type[MemoryCache] = MemoryCache

    def draft_verification_problem(self) -> str | None:
        """Why this model cannot verify drafted tokens exactly (one forward over several tokens gives other logits than
        reading them one by one), or None when it can."""
        return None

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        if generation_mode == GenerationMode.ASSISTED_GENERATION:
            problem = self.draft_verification_problem()
            if problem is not None:
                raise ValueError(problem)
        return super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)
        speculative = generation_mode == GenerationMode.ASSISTED_GENERATION or generation_config.is_assistant
        compiled = generation_config.compile_config is not None
        if (
            (speculative or compiled)
            and generation_config.use_cache is not False
            and model_kwargs.get(CACHE_NAME) is None
        ):
            model_kwargs[CACHE_NAME] = self.cache_class(self.config)
            if generation_config.is_assistant:  # the drafting model's cache is cropped by its candidate generator
                model_kwargs[CACHE_NAME].activate_past_recording()

    @functools.wraps(GenerationMixin.generate)
    def generate(self, *args, **kwargs):
        outer = _GENERATE_CALL.set(object())  # (see `auxiliary_outputs_read` and `current_weights_version`)
        try:
            output = super().generate(*args, **kwargs)
        finally:
            _GENERATE_CALL.reset(outer)
        generation_config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
        if not getattr(generation_config, "is_assistant", False):  # an assistant's cache lives on between its calls
            for cache in (kwargs.get("cache"), kwargs.get("past_key_values"), output_cache(output)):
                if isinstance(cache, MemoryCache):
                    cache.stop_past_recording()
        return output

    def _valid_auto_compile_criteria(self, model_kwargs: dict, generation_config) -> bool:
        """🤗's rule for compiling the decoding step (a compileable cache, on a GPU or with `_compile_all_devices`),
        applied only when `compile_config` asks for it: 🤗 compiles a static cache on a GPU unasked, but a memlm cache is
        always there and a first compile takes tens of seconds. A memory that cannot be compiled says why."""
        if generation_config.compile_config is None:
            return False
        cache = model_kwargs.get(CACHE_NAME)
        reason = cache.not_compileable_reason if isinstance(cache, MemoryCache) else None
        if reason is not None and not generation_config.disable_compile:
            logger.warning(f"{type(self).__name__} decodes without compiling the step: {reason}")
        compiles = super()._valid_auto_compile_criteria(model_kwargs, generation_config)
        if compiles and isinstance(cache, MemoryCache):
            cache.prepare_compiled_decoding()
        return compiles

    @staticmethod
    def create_masks_for_generate(attention_mask=None, **kwargs):
        """What `generate` passes as the mask with a compileable cache: 🤗 would build a 4-D causal mask over a
        static cache's slots; memlm's models read the 2-D padding mask as it is."""
        return attention_mask

    # The signature is 🤗's, spelled out (`generate` reads it, e.g. to allow inputs_embeds), except the memory: it
    # passes through `kwargs` under the name the installed 🤗 gives it (`cache`, or `past_key_values` before 5.24).
    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs,
    ):
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs,
        )  # fmt: skip
        model_inputs.pop("position_ids", None)
        for name in GENERATE_OWN_KWARGS:
            model_inputs.pop(name, None)
        # The models read only the current tokens' columns of the mask (their memory holds the past): passed alone,
        # the mask keeps one shape from step to step, which a compiled step needs (a growing one would recompile).
        mask = model_inputs.get("attention_mask")
        tokens = model_inputs.get("input_ids")
        tokens = tokens if tokens is not None else model_inputs.get("inputs_embeds")
        if mask is not None and mask.dim() == 2 and tokens is not None and mask.shape[1] > tokens.shape[1]:
            model_inputs["attention_mask"] = mask[:, -tokens.shape[1] :].clone(memory_format=torch.contiguous_format)
        return model_inputs
