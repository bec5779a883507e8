"""The memory of the Feedback recurrence in preallocated buffers (the fast path of `memlm.kernels.feedback`).

- `_RingStore`: when no gradient is needed (prefill, decoding): up to τ slots per row, slot = position mod τ, written
  in place; the cache's own buffers, so a decoded token costs O(τ) whatever the context length. The ring holds as
  many slots as the context needs, doubling as it grows, up to τ.
- `_Tape`: in training: one slot per step, written once. With autograd through every step, its gradients are routed
  by hand (`_TapeWrite`, `_TapeRead`), because autograd forbids reading a buffer that later steps write into.

A store answers the step function's three calls: `window` (positions and validity of the slots a step may read),
`read` (attention of the step's queries over them) and `write` (the step's new memory).

The ring lives in a cache layer's tensors (`FeedbackCacheLayer`): `allocate_ring` gives it one, `grow_ring` widens it.
A cache layer whose `undo_steps` is a list (a cache recording its past, for speculative decoding) gets from the ring,
per step, what the step's write overwrote, from which `roll_back_layer` rolls the ring back.
"""

import types
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from memlm.kernels import mark_static

# A growing ring gets at least this many slots (decoding from a short prompt would otherwise double it often).
LEAST_RING_SLOTS = 16


def ring_slots(current: int | None, needed: int, memory_span: int) -> int:
    """How many slots a ring holds after a call that needs `needed` of them: a new ring (`current` None) exactly as
    many; a ring of `current` slots keeps them when they suffice, else doubles (at least `LEAST_RING_SLOTS`), up to
    τ = `memory_span`."""
    if current is None:
        return needed
    if current >= needed:
        return current
    return min(memory_span, max(needed, 2 * current, LEAST_RING_SLOTS))


def attention_weights(query: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Softmax weights of one query per (row, head) over a window of memories: query (N, d), keys (N, W, d), bias
    (N, W) additive (−inf: not visible) → (N, W). A query that sees no memory gets all-zero weights: the paper's
    "no attention term" before the first memory."""
    # (1, d) · (d, W) per row: MKL runs this orientation ~7× faster than (W, d) · (d, 1) on this CPU.
    scores = torch.bmm(query.unsqueeze(1), keys.transpose(1, 2)).squeeze(1)
    weights = torch.softmax(torch.add(bias, scores, alpha=query.shape[-1] ** -0.5), dim=-1)
    return weights.masked_fill_(bias.amax(-1, keepdim=True) == float("-inf"), 0.0)  # its softmax was 0/0


def allocate_ring(layer, batch_size: int, config, dtype, device, slots: int | None = None) -> None:
    """Give a cache layer (`FeedbackCacheLayer`) an empty ring of `slots` slots per row (default τ; fewer while the
    context is shorter than τ): keys and values (B, H, slots, d), positions and validity (B, slots), and with
    `memory_carry="hidden_states"` the memories' hidden states (B, slots, D), each at an address a compiled step
    keeps."""
    layer.ring = True
    slots = config.memory_span if slots is None else slots
    shape = (batch_size, config.num_attention_heads, slots, config.head_dim)
    layer.keys = mark_static(torch.zeros(shape, dtype=dtype, device=device))
    layer.values = mark_static(torch.zeros(shape, dtype=dtype, device=device))
    layer.positions = mark_static(torch.zeros(batch_size, slots, dtype=torch.long, device=device))
    layer.valid = mark_static(torch.zeros(batch_size, slots, dtype=torch.bool, device=device))
    layer.hidden = None
    if config.memory_carry == "hidden_states":  # the memories' hidden states, in the same slots
        layer.hidden = mark_static(torch.zeros(batch_size, slots, config.hidden_size, dtype=dtype, device=device))
    if layer.token_count.device != layer.keys.device:
        layer.token_count = mark_static(layer.token_count.to(device))


def grow_ring(layer, slots: int) -> None:
    """Widen a cache layer's ring to `slots` slots per row, its memories in the same slots: while a ring holds fewer
    than τ slots no position has reached its end, so slot = position mod τ = position."""
    size = layer.keys.shape[2]
    for name in ("keys", "values", "positions", "valid", "hidden"):
        old = getattr(layer, name)
        if old is None:  # no hidden states (`memory_carry="keys_values"`)
            continue
        dim = 2 if old.dim() == 4 else 1  # the slots of keys and values (B, H, W, d), the others' (B, W, ...)
        new = old.new_zeros(*old.shape[:dim], slots, *old.shape[dim + 1 :])
        new.narrow(dim, 0, size).copy_(old)
        setattr(layer, name, mark_static(new))


def roll_back_layer(layer, rollback) -> None:
    """Roll a cache layer back to what a forward over the kept tokens alone would have left (`rollback` a
    `memory.Rollback`, the layer's `recorded` a `FeedbackRecord` per forward): a forward that wrote the ring in place
    is undone write by write (`undo_ring_writes`); one that left a window (the official layouts' step loop) gives back
    the layer as it was before it, or, when some of its tokens are kept, the memories of its first token's window that
    the token after the cut sees (within the record's reach)."""
    if not rollback.removes_tokens:
        return
    record = layer.recorded[rollback.forward]
    if record.window is None:
        undo_ring_writes(layer, rollback)
    elif rollback.kept == 0:
        layer.keys, layer.values, layer.positions, layer.valid, layer.hidden, layer.ring = record.before
    else:
        keys, values, positions, valid, hidden = record.window
        distance = rollback.next_positions[:, None] - positions
        valid = valid & (distance >= 1) & (distance <= record.reach)
        kept = valid.any(0).nonzero()[:, 0]
        layer.keys, layer.values = keys[:, :, kept], values[:, :, kept]
        layer.positions, layer.valid = positions[:, kept], valid[:, kept]
        layer.hidden = None if hidden is None else hidden[:, kept]


def undo_ring_writes(layer, rollback) -> None:
    """Roll a cache layer's ring back (`FeedbackCacheLayer.roll_back`, `rollback` a `memory.Rollback`): write back what
    the removed tokens' steps overwrote (`undo_steps`, which `_RingStore.write` fills), newest first, then give the ring
    the slots a forward over the kept tokens would have left (it may have grown for the removed ones)."""
    rows = torch.arange(layer.keys.shape[0], device=layer.keys.device)
    for index in range(len(layer.recorded) - 1, rollback.forward - 1, -1):
        forward, steps = rollback.forwards[index], layer.recorded[index].undo_steps
        removed = forward.length
        if index == rollback.forward:  # a row's removed real tokens are its last steps (padding runs first)
            real = forward.valid[:, rollback.kept :].sum(1) if forward.valid is not None else None
            removed = forward.length - rollback.kept if real is None else real.to(rows.device)
        for step in range(len(steps) - 1, -1, -1):
            undone = torch.as_tensor(step >= len(steps) - removed, device=rows.device).expand(rows.shape[0])
            if not bool(undone.any()):
                break
            slots, keys, values, positions, valid = steps[step]
            layer.keys[rows, :, slots] = torch.where(undone[:, None, None], keys, layer.keys[rows, :, slots])
            layer.values[rows, :, slots] = torch.where(undone[:, None, None], values, layer.values[rows, :, slots])
            layer.positions[rows, slots] = torch.where(undone, positions, layer.positions[rows, slots])
            layer.valid[rows, slots] = torch.where(undone, valid, layer.valid[rows, slots])
    record = layer.recorded[rollback.forward]
    width = record.ring_width
    if rollback.kept:
        needed = min(record.memory_span, max(int(rollback.next_positions.max()), 1))
        width = ring_slots(width, needed, record.memory_span)
    if width is not None and width < layer.keys.shape[2]:
        layer.keys, layer.values = layer.keys[:, :, :width].clone(), layer.values[:, :, :width].clone()
        layer.positions, layer.valid = layer.positions[:, :width].clone(), layer.valid[:, :width].clone()


class _RingStore:
    """The memory when no gradient is needed: up to τ slots per row, slot = position mod τ, written in place. The
    cache's own buffers, so decoding a token costs O(τ) whatever the context length, with no copying; the ring holds
    the slots the context needs and doubles (capped at τ) when a call needs more (`grow_ring`)."""

    adds_positions_to_keys = True  # (`scores.keys_take_positions`)

    def __init__(self, cache_layers: list, next_positions: torch.Tensor, config, like, positions=None):
        """`positions` (B, T): the positions this call writes (−1 for padding); the ring grows to hold them."""
        self.layers = cache_layers
        self.memory_span = config.memory_span
        self._blind_bias = self._blind = None  # the last bias `read` saw, and its rows that see no memory
        # Slots at or beyond `filled` hold nothing yet (slot = position mod τ and positions start at 0): skip them.
        # Counting them reads tensors, which torch.compile cannot trace: compiled, the ring has τ slots from the start
        # and every slot is read (empty ones are masked out, so the output is the same). A `full_ring` (compiled
        # decoding after an eager prompt) has τ slots from its first allocation on.
        compiling = torch.compiler.is_compiling()
        self.filled = config.memory_span
        needed = config.memory_span
        # The official zero initial memory sits at positions −τ … −1, in every slot of a ring of τ from the start.
        if not compiling and config.initial_memory != "zeros":
            self.filled = min(config.memory_span, int(next_positions.max()) if next_positions.numel() else 0)
            last = int(positions.max()) + 1 if positions is not None and positions.numel() else 0
            if not cache_layers[0].full_ring:
                needed = min(config.memory_span, max(self.filled, last, 1))
        window = None
        self.undo = [None] * len(cache_layers)  # the window's layout below is no step of this call: nothing to undo
        if not cache_layers[0].ring:
            # An empty cache, or the window a training forward left: lay it out as a ring.
            if cache_layers[0].keys is not None:
                window = [(layer.keys, layer.values) for layer in cache_layers]
                window_positions, window_valid = cache_layers[0].positions, cache_layers[0].valid
                window_hidden = getattr(cache_layers[0], "hidden", None)
            for layer in cache_layers:
                allocate_ring(layer, next_positions.shape[0], config, like.dtype, like.device,
                              ring_slots(None, needed, config.memory_span))  # fmt: skip
            for layer in cache_layers[1:]:  # one set of hidden states for every key/value set, kept by the first
                layer.hidden = None
        elif cache_layers[0].keys.shape[2] < needed:  # a longer context: double the ring (at most τ slots)
            slots = ring_slots(cache_layers[0].keys.shape[2], needed, config.memory_span)
            for layer in cache_layers:
                grow_ring(layer, slots)
        if window is not None:
            keys = torch.stack([pair[0] for pair in window])
            values = torch.stack([pair[1] for pair in window])
            for index in range(keys.shape[3]):
                hidden = window_hidden[:, index] if window_hidden is not None else None
                self.write(index, keys[:, :, :, index], values[:, :, :, index], window_positions[:, index],
                           window_valid[:, index], hidden)  # fmt: skip
        self.undo = [getattr(layer, "undo_steps", None) for layer in cache_layers]

    def window(self, group: int, step: int):
        layer = self.layers[group]
        return None, None, layer.positions[:, : self.filled], layer.valid[:, : self.filled]

    def read(self, group: int, step: int, query: torch.Tensor, bias: torch.Tensor | None, transform=None,
             terms=None, key_positions: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """`transform`: a `WeightsTransform` of the softmax weights (the official layouts' adaptive span), whose mask
        covers the `window`'s slots; `terms` (a `ScoreTerms`): what builds the bias and the transform instead;
        `key_positions` (B, 1, W, d): the learned relative positions' row of each slot, added to its key
        (`scores.keys_take_positions`)."""
        if self.filled == 0:
            return torch.zeros_like(query)  # no memory yet: the attention term is zero
        blind_from = None
        if terms is not None:
            bias, transform = terms(query)
            blind_from = terms.blind_from
        layer = self.layers[group]
        batch_size, num_heads, _, head_dim = layer.keys.shape
        keys, values = layer.keys, layer.values  # (B, H, W, d)
        if self.filled < keys.shape[2]:  # a full ring (long contexts) is read whole, without slicing
            keys, values = keys[:, :, : self.filled], values[:, :, : self.filled]
        if key_positions is not None:  # q·k_i + q·p_{t−i} = q·(k_i + p_{t−i})
            keys = keys + key_positions
        if transform is not None:  # the weights themselves are needed: softmax, transform, then the values
            weights = transform(attention_weights(query, keys.flatten(0, 1), bias))
            return torch.bmm(weights.unsqueeze(1), values.flatten(0, 1)).squeeze(1)
        # One fused op for softmax(q·Kᵀ/√d + bias)·V (~30% faster than `attend`'s five for one query over 2K slots).
        context = F.scaled_dot_product_attention(query.reshape(batch_size, num_heads, 1, head_dim), keys, values,
                                                 attn_mask=bias.view(batch_size, num_heads, 1, -1))  # fmt: skip
        # A query that sees no memory gets a zero attention term, whatever the backend makes of an all −inf row. The
        # layers of a step often share one bias (the same tensor): its rows that see nothing are found once.
        blind_from = bias if blind_from is None else blind_from
        if blind_from is not self._blind_bias:
            blind = blind_from.amax(-1, keepdim=True) == float("-inf")
            if not torch.compiler.is_compiling() and not bool(blind.any()):
                blind = None  # every row sees a memory (decoding): nothing to fill
            self._blind_bias, self._blind = blind_from, blind
        context = context.view_as(query)
        return context if self._blind is None else context.masked_fill(self._blind, 0.0)

    def write(self, step: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
              hidden: torch.Tensor | None = None):  # fmt: skip
        """keys/values (G, B, H, d) of the new memory, positions (B,), valid (B,), and its hidden state (B, D) when the
        memory carries them: padding writes nothing (its slot gets its old contents back, so no row count depends on
        the data and torch.compile traces it)."""
        span = self.memory_span  # a ring of fewer slots holds no position ≥ its size, so `slots` fits it
        rows = torch.arange(positions.shape[0], device=positions.device)
        # (Padding has position −1 and writes nothing: slot 0; the zero initial memory's negative positions wrap.)
        slots = torch.where(valid, positions, 0) % span
        first = self.layers[0]
        if hidden is not None:  # one set of hidden states for every key/value set (the first layer holds it)
            kept = hidden.to(first.hidden.dtype)
            if torch.compiler.is_compiling() or not bool(valid.all()):
                kept = torch.where(valid[:, None], kept, first.hidden[rows, slots])
            first.hidden[rows, slots] = kept
        for layer, undo in zip(self.layers, self.undo):
            if undo is not None:  # what this write overwrites (indexing copies), for rolling back
                undo.append((slots, layer.keys[rows, :, slots], layer.values[rows, :, slots],
                             layer.positions[rows, slots], layer.valid[rows, slots]))  # fmt: skip
        if not torch.compiler.is_compiling():  # padding has position −1, so an all-padding step changes nothing
            self.filled = max(self.filled, min(span, int(positions.max()) + 1))
        if not torch.compiler.is_compiling() and bool(valid.all()):  # no padding (decoding): plain writes
            for group, layer in enumerate(self.layers):
                layer.keys[rows, :, slots] = keys[group].to(layer.keys.dtype)
                layer.values[rows, :, slots] = values[group].to(layer.values.dtype)
                layer.positions[rows, slots] = positions
                layer.valid[rows, slots] = True
            return
        keep = valid[:, None, None]
        for group, layer in enumerate(self.layers):
            layer.keys[rows, :, slots] = torch.where(
                keep, keys[group].to(layer.keys.dtype), layer.keys[rows, :, slots]
            )
            layer.values[rows, :, slots] = torch.where(
                keep, values[group].to(layer.values.dtype), layer.values[rows, :, slots]
            )
            layer.positions[rows, slots] = torch.where(valid, positions, layer.positions[rows, slots])
            layer.valid[rows, slots] = valid | layer.valid[rows, slots]


class ProjectedMemories:
    """The memories a training forward starts from as hidden states (B, W, D) at `positions` (B, W), whose keys and
    values (G, B, H, W, d) `project(hidden, positions)` computes: with autograd when a path reads them (`stacked`;
    once, then kept), or without it for the hand-written backward, which copies them into its tape and
    differentiates the projection itself (so no projection nor its graph stays alive through the steps)."""

    def __init__(self, project: Callable, hidden: torch.Tensor, positions: torch.Tensor):
        self.project, self.hidden, self.positions = project, hidden, positions
        self._stacked = None

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values; without gradients a projection of its own, which is not kept."""
        if self._stacked is not None:
            return self._stacked
        stacked = self.project(self.hidden, self.positions)
        if torch.is_grad_enabled():
            self._stacked = stacked
        return stacked

    def sets(self, groups: int, valid: torch.Tensor, hidden: torch.Tensor | None) -> list:
        """The `groups` key/value sets, read as cache layers (`ProjectedSet`); `valid` (B, W) the memories' validity,
        `hidden`: the hidden states the forward carries on (None: none)."""
        return [ProjectedSet(self, group, valid, hidden) for group in range(groups)]


class ProjectedSet:
    """A key/value set of `ProjectedMemories`, read as a cache layer is (keys and values (B, H, W, d), positions,
    validity, the carried hidden states)."""

    ring = False

    def __init__(self, memories: ProjectedMemories, group: int, valid: torch.Tensor, hidden: torch.Tensor | None):
        self.memories, self.group = memories, group
        self.positions, self.valid, self.hidden = memories.positions, valid, hidden

    @property
    def keys(self) -> torch.Tensor:
        # (unbind: the gradients of the sets come back as one stack, where indexing would give each set's gradient
        # the size of all of them)
        return self.memories.stacked()[0].unbind(0)[self.group]

    @property
    def values(self) -> torch.Tensor:
        return self.memories.stacked()[1].unbind(0)[self.group]


def stacked_memories(cache_layers: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values (G, B, H, W, d) of the cache's key/value sets: those of `ProjectedMemories` as projected,
    else the sets' stacked."""
    first = cache_layers[0]
    if isinstance(first, ProjectedSet):
        return first.memories.stacked()
    return torch.stack([layer.keys for layer in cache_layers]), torch.stack([layer.values for layer in cache_layers])


class _Tape:
    """The memory in training: one slot per step (after a prefix carried from the cache), written once, never
    overwritten, with gradient buffers that the reads fill and the writes hand back to autograd."""

    def __init__(self, cache_layers, steps: int, config, like: torch.Tensor, padding_steps: int = 0):
        """`padding_steps`: the most padding steps of a row (all before its real tokens), which the windows widen by
        so that every row still sees its last τ real memories."""
        first = cache_layers[0]
        groups = len(cache_layers)
        batch_size, num_heads, head_dim = like.shape[0], config.num_attention_heads, config.head_dim
        dtype, device, memory_span = like.dtype, like.device, config.memory_span
        if first.keys is None:  # an empty cache: nothing carried
            empty = torch.zeros(batch_size, num_heads, 0, head_dim, dtype=dtype, device=device)
            nothing = types.SimpleNamespace(
                keys=empty,
                values=empty,
                positions=empty.new_zeros(batch_size, 0, dtype=torch.long),
                valid=empty.new_zeros(batch_size, 0, dtype=torch.bool),
            )
            cache_layers = [nothing] * groups
            first = cache_layers[0]
        # The prefix: the cache's slots in their order (a window carried by a forward holds the memories some row
        # still sees; a ring, the slots the context has filled), so that the memories carried on are laid out as the
        # step loop's reference lays them out.
        prefix = first.valid.shape[1]
        size = prefix + steps
        self.prefix = prefix
        self.memory_span = memory_span
        self.reach = memory_span + padding_steps
        self.keys = torch.zeros(groups, batch_size, num_heads, size, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        prefix_keys, prefix_values = stacked_memories(cache_layers)
        prefix_keys, prefix_values = prefix_keys.to(dtype), prefix_values.to(dtype)
        self.positions = torch.cat([first.positions, first.positions.new_zeros(batch_size, steps)], 1)
        self.valid = torch.cat([first.valid, first.valid.new_zeros(batch_size, steps)], dim=1)
        # With `memory_carry="hidden_states"`: the memories' hidden states, carried (detached) to the next forward.
        self.hidden = None
        if config.memory_carry == "hidden_states":
            self.hidden = torch.zeros(batch_size, size, config.hidden_size, dtype=dtype, device=device)
            carried = getattr(first, "hidden", None)
            if carried is not None:
                self.hidden[:, :prefix] = carried.detach()
        self._gradients = None
        # Every write takes the previous anchor and makes the next: reads of step t hang on the anchor of step t−1,
        # so the backward of a write runs only after every read of the memory it wrote.
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        if torch.is_grad_enabled() and (prefix_keys.requires_grad or prefix_values.requires_grad):
            # Keys and values computed in this forward (`memory_carry="hidden_states"`, the zero initial memory): the
            # reads' gradients flow back to them, and through them to the projections.
            self.anchor = _TapeWrite.apply(prefix_keys, prefix_values, self.anchor, self, slice(0, prefix))
        else:
            self.keys[:, :, :, :prefix] = prefix_keys
            self.values[:, :, :, :prefix] = prefix_values

    def release(self):
        """The step loop is over: drop the last write's anchor, whose autograd node holds this tape (in its context)
        while the tape held the node — a cycle through the graph that Python's garbage collector cannot see, which
        kept every training forward's tape and graph alive (memory grew with every step of a training run)."""
        self.anchor = None

    def gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient buffers of the keys and values, made at the first read's backward (autograd through the steps)."""
        if self._gradients is None:
            self._gradients = (torch.zeros_like(self.keys), torch.zeros_like(self.values))
        return self._gradients

    def bounds(self, step: int) -> tuple[int, int]:
        """The tape slice that step `step` may read: the prefix (in no particular order) while it is within τ, then
        the last τ steps (τ + the padding steps, when rows are padded). Visibility is decided by positions, so a wider
        slice is harmless."""
        end = self.prefix + step
        return (0, end) if step < self.reach else (end - self.reach, end)

    def window(self, group: int, step: int):
        start, end = self.bounds(step)
        return None, None, self.positions[:, start:end], self.valid[:, start:end]

    def read(self, group: int, step: int, query: torch.Tensor, bias: torch.Tensor | None, transform=None,
             terms: "ScoreTerms | None" = None) -> torch.Tensor:  # fmt: skip
        """`transform`: a `WeightsTransform` of the softmax weights (the official layouts' adaptive span, dropout on
        the weights), whose mask covers this step's window. `terms` (then `bias` and `transform` are None): what
        builds them from the tensors that learn, which a read with gradients calls again in its backward rather than
        keep the step's (B·H, W) bias and mask."""
        start, end = self.bounds(step)
        self.last_weights = self.last_kept = None
        if start == end:
            return torch.zeros_like(query)  # no memory yet: the attention term is zero
        if terms is not None and torch.is_grad_enabled():
            return _TapeTermsRead.apply(query, terms.table, terms.span_ratio, self.anchor, self, group, start, end,
                                        terms.build, terms.prepared)  # fmt: skip
        if terms is not None:
            bias, transform = terms(query)
        if torch.is_grad_enabled():
            mask = None if transform is None or transform.mask is None else transform.mask.to(query.dtype)
            return _TapeRead.apply(query, bias, self.anchor, mask, self, group, start, end, transform)
        # Recorded for the hand-written backward (`_ThroughTime`), which runs the forward without autograd: the
        # softmax weights, and the dropout's kept entries (bool) when the transform drops some.
        output, self.last_weights, _, self.last_kept = _read_forward(self, group, start, end, query, bias, transform)
        return output

    def write(self, step: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
              hidden: torch.Tensor | None = None):  # fmt: skip
        index = self.prefix + step
        self.positions[:, index] = positions
        self.valid[:, index] = valid
        if hidden is not None:
            self.hidden[:, index] = hidden.detach()
        if torch.is_grad_enabled():
            self.anchor = _TapeWrite.apply(keys, values, self.anchor, self, index)
        else:
            self.keys[:, :, :, index] = keys
            self.values[:, :, :, index] = values

    def last_memories(self):
        """keys, values (G, B, H, W, d), positions, valid (B, W) of the slice the next step would read, and their
        hidden states (B, W, D) when the tape keeps them."""
        start, end = self.bounds(self.keys.shape[3] - self.prefix)
        window = (self.keys[:, :, :, start:end], self.values[:, :, :, start:end], self.positions[:, start:end],
                  self.valid[:, start:end])  # fmt: skip
        return window if self.hidden is None else (*window, self.hidden[:, start:end])


class _TapeWrite(torch.autograd.Function):
    """Store a step's keys/values (or the prefix's, `index` a slice) on the tape; in the backward, return the gradient
    the later reads accumulated."""

    @staticmethod
    def forward(ctx, keys, values, anchor, tape, index):
        with torch.no_grad():
            tape.keys[:, :, :, index] = keys
            tape.values[:, :, :, index] = values
        ctx.tape, ctx.index = tape, index
        return anchor.detach().clone()

    @staticmethod
    def backward(ctx, grad_anchor):
        tape, index = ctx.tape, ctx.index
        grad_keys, grad_values = tape.gradients()
        return (
            grad_keys[:, :, :, index].clone(),
            grad_values[:, :, :, index].clone(),
            grad_anchor,
            None,
            None,
        )


def renormalizer(masked: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Σ p·m + ε of masked weights p·m (N, W), 1 where it is 0 (such a row reads nothing)."""
    denominator = masked.sum(-1, keepdim=True).add_(epsilon)
    return denominator.masked_fill_(denominator == 0, 1.0)


def _read_forward(tape, group, start, end, query, bias, transform):
    """A step's attention over the tape slice [start, end) without autograd: the output, the softmax weights p, the
    renormalisation's denominator and the dropout's kept entries (bool), the latter two None when not used (the kept
    entries also when the transform's mask is seeded: the backward draws it again)."""
    keys = tape.keys[group, :, :, start:end].flatten(0, 1)  # (B·H, W, d), a view
    weights = attention_weights(query, keys, bias)  # p = softmax(s)
    read, denominator, kept = weights, None, None
    mask = None if transform is None or transform.mask is None else transform.mask.to(query.dtype)
    if mask is not None:  # r = p·m / (Σ p·m + ε); 0 where that sum is 0
        read = weights * mask
        denominator = renormalizer(read, transform.epsilon)
        read = read.div_(denominator)
    if transform is not None:
        kept = transform.dropout_mask(read)
        if kept is not None:  # w = r · dropout mask
            read = read * kept
            # A seeded mask is drawn again by the backward; another is kept as bool (a quarter of the memory).
            kept = kept > 0 if transform.seed is None else None
    output = torch.bmm(read.unsqueeze(1), tape.values[group, :, :, start:end].flatten(0, 1)).squeeze(1)
    return output, weights, denominator, kept


def transform_backward(grad_read, weights, mask, denominator, kept, needs_mask_gradient: bool):
    """The backward of a `WeightsTransform` and the softmax before it: given dw (N, W) at the weights that read the
    values, w = r · kept (scaled) with r = p·m / (Σ p·m + ε) (or p), p = softmax(s), returns w and the gradients of the
    scores s and of the mask m (None without a mask or `needs_mask_gradient`). `kept`: as drawn, scaled (or None)."""
    renormalized = weights if mask is None else weights * mask / denominator  # r
    read = renormalized if kept is None else renormalized * kept  # w
    grad_renormalized = grad_read if kept is None else grad_read * kept  # dr
    grad_mask = None
    if mask is None:
        grad_weights = grad_renormalized
    else:  # r = a / (Σa + ε), a = p·m: da = (dr − Σ dr·r) / (Σa + ε), then dp = da·m and dm = da·p
        grad_masked = (grad_renormalized - (grad_renormalized * renormalized).sum(-1, keepdim=True)) / denominator
        grad_weights = grad_masked * mask
        grad_mask = grad_masked * weights if needs_mask_gradient else None
    grad_scores = weights * (grad_weights - (weights * grad_weights).sum(-1, keepdim=True))  # softmax backward
    return read, grad_scores, grad_mask


def _read_backward(tape, group, start, end, grad_output, query, weights, mask, denominator, kept, transform,
                   needs_mask_gradient):  # fmt: skip
    """The backward of `_read_forward` written out: adds the keys' and values' gradients into the tape's buffers and
    returns the gradients of the query (through the keys), of the scores (= of the bias) and of the mask."""
    if kept is not None:  # as `WeightsTransform.dropout_mask` drew it: 1 / (1 − p) where kept
        kept = kept.to(weights.dtype).div_(1 - transform.dropout)
    elif transform is not None and transform.seed is not None:  # drawn again from its seed
        kept = transform.dropout_mask(weights)
    keys = tape.keys[group, :, :, start:end].flatten(0, 1)
    values = tape.values[group, :, :, start:end].flatten(0, 1)
    scale = query.shape[-1] ** -0.5
    grad_read = torch.bmm(grad_output.unsqueeze(1), values.transpose(1, 2)).squeeze(1)  # dw (N, W)
    read, grad_scores, grad_mask = transform_backward(grad_read, weights, mask, denominator, kept,
                                                      needs_mask_gradient)  # fmt: skip
    grad_query = torch.bmm(grad_scores.unsqueeze(1), keys).squeeze(1) * scale
    grad_keys, grad_values = tape.gradients()
    grad_keys = grad_keys[group, :, :, start:end].flatten(0, 1)
    grad_keys.addcmul_(grad_scores.unsqueeze(-1), (query * scale).unsqueeze(1))  # += dS ⊗ q / sqrt(d)
    grad_values = grad_values[group, :, :, start:end].flatten(0, 1)
    grad_values.addcmul_(read.unsqueeze(-1), grad_output.unsqueeze(1))  # += w ⊗ dO
    return grad_query, grad_scores, grad_mask


class _TapeRead(torch.autograd.Function):
    """Attention of one step over a slice of the tape. The backward is written out (softmax attention for a single
    query, and the official layouts' `WeightsTransform`: the adaptive span's mask and renormalisation, dropout on the
    weights), reads the keys and values once, and adds their gradients into the tape's gradient buffers in place."""

    @staticmethod
    def forward(ctx, query, bias, anchor, mask, tape, group, start, end, transform):
        with torch.no_grad():
            output, weights, denominator, kept = _read_forward(tape, group, start, end, query, bias, transform)
        ctx.save_for_backward(query, weights, mask, denominator, kept)
        ctx.tape, ctx.window = tape, (group, start, end)
        ctx.transform = None if transform is None else transform._replace(mask=None)  # (the mask is saved)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, weights, mask, denominator, kept = ctx.saved_tensors
        grad_query, grad_scores, grad_mask = _read_backward(
            ctx.tape, *ctx.window, grad_output, query, weights, mask, denominator, kept, ctx.transform,
            ctx.needs_input_grad[3],
        )  # fmt: skip
        grad_bias = grad_scores if ctx.needs_input_grad[1] else None
        return grad_query, grad_bias, torch.zeros((), device=query.device), grad_mask, None, None, None, None, None


class ScoreTerms(NamedTuple):
    """What a step of the official layouts adds to its scores and does to its weights, as a function of the tensors
    that learn: `build(query, table, span_ratio, prepared)` → (bias (B·H, W), `WeightsTransform` or None, a function
    of the bias's and the mask's gradients giving those of the query, the table and the span ratios), with `table` the
    learned relative positions and `span_ratio` the adaptive span (each None when not used)."""

    build: Callable
    table: torch.Tensor | None
    span_ratio: torch.Tensor | None
    # What the step's layers share in the forward (`build`'s `prepared`); the backward builds it again.
    prepared: object = None
    # A bias (B·H, W) with the built bias's rows that see nothing (all −inf), shared by the step's layers, so that a
    # read finds those rows once per step (None: found in the built bias).
    blind_from: torch.Tensor | None = None

    def __call__(self, query: torch.Tensor):
        """(bias, transform) for `query`, with what was prepared for the step."""
        return self.build(query, self.table, self.span_ratio, self.prepared)[:2]


class _TapeTermsRead(torch.autograd.Function):
    """`_TapeRead` whose bias and mask are built by `ScoreTerms.build` from the query, the learned relative positions
    and the adaptive span, in the forward and again in the backward: a step keeps its query (and an unseeded dropout's kept
    entries) instead of window-sized scores, index and mask, so that training memory grows with tokens × hidden size.
    The built terms are differentiated by the function `build` returns."""

    @staticmethod
    def forward(ctx, query, table, span_ratio, anchor, tape, group, start, end, build, prepared):
        with torch.no_grad():
            bias, transform, _ = build(query, table, span_ratio, prepared)
            output, _, _, kept = _read_forward(tape, group, start, end, query, bias, transform)
        ctx.save_for_backward(query, table, span_ratio, kept)
        ctx.tape, ctx.window, ctx.build = tape, (group, start, end), build
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, table, span_ratio, kept = ctx.saved_tensors
        tape, (group, start, end) = ctx.tape, ctx.window
        bias, transform, gradients = ctx.build(query, table, span_ratio)
        mask = None if transform is None or transform.mask is None else transform.mask.to(query.dtype)
        keys = tape.keys[group, :, :, start:end].flatten(0, 1)
        weights = attention_weights(query, keys, bias)
        denominator = None if mask is None else renormalizer(weights * mask, transform.epsilon)
        needs_span_ratio = span_ratio is not None and ctx.needs_input_grad[2]
        grad_query, grad_scores, grad_mask = _read_backward(
            tape, group, start, end, grad_output, query, weights, mask, denominator, kept, transform,
            mask is not None and needs_span_ratio,
        )  # fmt: skip
        grad_terms, grad_table, grad_span_ratio = gradients(
            grad_scores, grad_mask, table is not None and ctx.needs_input_grad[1], needs_span_ratio
        )
        if grad_terms is not None:
            grad_query = grad_query + grad_terms
        anchor = torch.zeros((), device=query.device)
        return grad_query, grad_table, grad_span_ratio, anchor, None, None, None, None, None, None
