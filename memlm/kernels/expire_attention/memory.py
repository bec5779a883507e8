"""The memories of one Expire-Span layer: how they are kept, appended to, expired and counted (SPEC §2).

Sukhbaatar et al. (2021), *Not All Memories are Created Equal: Learning to Forget by Expiring*. Memory ``h_i`` at
position ``i`` has a span ``e_i = L σ(w·h_i + b)`` (paper Eq. 3); query ``t`` weighs it by ``m_ti = clamp(1 + (e_i −
(t − i)) / R, 0, 1)`` (Eq. 5). ``m`` only falls as ``t`` grows, so a memory with ``m = 0`` for the next query is dead
for good and may be deleted: ``m_ti = 0 ⇔ i + e_i + R ≤ t`` (:func:`expired_memories`).

:class:`ExpireSpanMemory` keeps a layer's memories in a padded layout (rows of a batch expire at different rates).
Decoding appends one memory per step, so without gradients the memories live in a preallocated buffer and appending
writes in place; dead memories are marked invalid at once (never attended again) but only compacted away when they
fill a fraction of the layout (:data:`COMPACT_FRACTION`), so the layout stays bounded without a copy at every step.
Between two checks, which come every :func:`check_interval` appended memories, the memories that die are left in
place: their mask is m = 0 (Eq. 5), so the attention gives them exactly zero weight (log 0 = −inf) and the counts
of :func:`memory_counts` skip them, just as for the memories that die inside a block of the parallel forward.
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .reference import expire_span_mask, memory_statistics, visible_keys

__all__ = [
    "COMPACT_FRACTION",
    "ExpireSpanMemory",
    "MemorySnapshot",
    "check_interval",
    "decoding_slack",
    "expired_memories",
    "next_decoding_slack",
    "memory_counts",
]

# Lazy pruning: the layout is compacted once the slots that no row needs (dead or empty) exceed this fraction of it.
COMPACT_FRACTION = 1 / 8
# A new buffer holds this fraction more slots than it needs, at least `_MINIMUM_GROWTH`: appends copy the memories
# only when it is full, which amortises to a constant per appended memory.
_GROWTH_FRACTION = 1 / 4
_MINIMUM_GROWTH = 64


def check_interval(width: int) -> int:
    """How many memories a buffer appends after a pruning check at `width` before the next check (decoding)."""
    return max(16, width // 16)


_FIELDS = ("keys", "values", "positions", "valid", "spans", "span_inputs", "hidden_states")
_SLOT_DIMENSION = {
    "keys": 2, "values": 2, "positions": 1, "valid": 1, "spans": 1, "span_inputs": 1, "hidden_states": 1,
}  # fmt: skip


class _Buffer:
    """Preallocated storage shared by the memories that are its prefixes; `used` slots are written. A memory whose
    width equals `used` may append in place; any other (an older prefix) copies, so no slot is written twice."""

    def __init__(self, tensors: dict[str, torch.Tensor], used: int, next_check: int):
        self.tensors = tensors
        self.used = used
        self.next_check = next_check  # the width at which `ExpireSpanMemory.prune` looks next
        self.capacity = tensors["positions"].shape[1]
        # Per field (contiguous, from `new_empty`): its sizes before and after the slot dimension, strides, and the
        # stride of a slot, for `slots`.
        self.layouts = {
            name: (tensor, tensor.shape[: _SLOT_DIMENSION[name]], tensor.shape[_SLOT_DIMENSION[name] + 1 :],
                   tensor.stride(), tensor.stride(_SLOT_DIMENSION[name]))
            for name, tensor in tensors.items()
        }  # fmt: skip

    def slots(self, name: str, start: int, count: int) -> torch.Tensor:
        """Field `name`'s slots start..start + count − 1, as a view: `as_strided` from the layout, which costs about
        half of a `narrow` (two views per field and layer at every decoding step)."""
        tensor, before, after, strides, slot_stride = self.layouts[name]
        return tensor.as_strided((*before, count, *after), strides, start * slot_stride)


@dataclass
class ExpireSpanMemory:
    """The memories of one layer in a padded layout: row b holds its memories in the slots where valid[b] is True."""

    keys: torch.Tensor  # (B, H, N, d), rotated by their positions
    values: torch.Tensor  # (B, H, N, d)
    positions: torch.Tensor  # (B, N) absolute position i of each memory
    valid: torch.Tensor  # (B, N) False for empty, padding or dead slots
    spans: torch.Tensor | None  # (B, N) float32 e_i (None when expiration is off)
    span_inputs: torch.Tensor | None  # (B, N, D): h_i, kept in training so spans follow the current parameters
    # (B, N, D): the layer inputs that made the memories, with `recompute_memory` (their keys, values and spans are
    # recomputed from them with the current weights at every block, as the official code trains)
    hidden_states: torch.Tensor | None = None
    buffer: _Buffer | None = dataclasses.field(default=None, repr=False, compare=False)
    # Decoding: a lower bound on min over rows and valid memories of (i + e_i) − t, t the row's next query; None
    # when unknown. While it is >= 0 no memory is on the ramp or expired (see `decoding_slack`).
    expiry_slack: float | None = dataclasses.field(default=None, repr=False, compare=False)
    # Decoding: whether every slot is valid (no padding, no memory marked dead in place), when known; kept with the
    # slack, forgotten where the validity changes in place.
    every_valid: bool | None = dataclasses.field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """What a copy or a checkpoint keeps: the memories, not the decoding buffer, slack and validity (rebuilt)."""
        return {
            name: value for name, value in vars(self).items() if name not in ("buffer", "expiry_slack", "every_valid")
        }

    @property
    def width(self) -> int:
        return self.positions.shape[1]

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in _FIELDS}

    def select(self, keep: torch.Tensor, width: int | None = None) -> "ExpireSpanMemory":
        """Compact: keep the entries where `keep` (B, N) is True, in order, padding rows to the longest (`width`, the
        most entries a row keeps, when the caller has read it already)."""
        if width is None:
            width = int(keep.sum(1).max()) if keep.numel() else 0
            if width == keep.shape[1] and bool(keep.all()):
                return self
        if keep.shape[0] == 1 and not torch.compiler.is_compiling():  # one row (a single sequence): its kept slots,
            # read by index (a third of the operations of the gathers below; compiled, no data-dependent shape)
            slots = keep.nonzero()[:, 1]

            def take(tensor, dim):
                return None if tensor is None else tensor.index_select(dim, slots)

            tensors = {name: take(tensor, _SLOT_DIMENSION[name]) for name, tensor in self.tensors().items()}
            tensors["valid"] = take(keep, 1)
            return ExpireSpanMemory(**tensors)
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]  # live entries first

        def take(tensor, dim):
            if tensor is None:
                return None
            index = order.view(*order.shape[:1], *([1] * (dim - 1)), width, *([1] * (tensor.dim() - dim - 1)))
            return tensor.gather(dim, index.expand(*tensor.shape[:dim], width, *tensor.shape[dim + 1 :]))

        tensors = {name: take(tensor, _SLOT_DIMENSION[name]) for name, tensor in self.tensors().items()}
        tensors["valid"] = take(keep, 1)
        return ExpireSpanMemory(**tensors)

    def append(self, other: "ExpireSpanMemory") -> "ExpireSpanMemory":
        """These memories followed by `other`'s. Span inputs are kept only when both sides have them. Without
        gradients (decoding), `other` is written in place into the buffer when this memory is its newest prefix.
        With gradients enabled, never in place: an attention's backward may read these memories (its keys and their
        validity, even when only its queries need gradients) after later blocks have appended and pruned."""
        if torch.compiler.is_compiling() or torch.is_grad_enabled():
            return self._joined(other)
        return self._appended_in_place(other)

    def _joined(self, other: "ExpireSpanMemory") -> "ExpireSpanMemory":
        def join(first, second, dim):
            return None if first is None or second is None else torch.cat([first, second], dim=dim)

        return ExpireSpanMemory(
            **{name: join(getattr(self, name), getattr(other, name), _SLOT_DIMENSION[name]) for name in _FIELDS}
        )

    def _appended_in_place(self, other: "ExpireSpanMemory") -> "ExpireSpanMemory":
        width, total = self.width, self.width + other.width
        buffer = self.buffer
        # The buffer takes `other` as it is when it holds exactly the fields both sides have, in other's dtypes (one
        # pass over the fields: a decoding step appends to every layer).
        reusable = buffer is not None and buffer.used == width and buffer.capacity >= total
        names = []
        for name in _FIELDS:
            theirs = getattr(other, name)
            kept = theirs is not None and getattr(self, name) is not None
            if kept:
                names.append(name)
            if reusable and (kept != (name in buffer.tensors) or kept and buffer.tensors[name].dtype != theirs.dtype):
                reusable = False
        if not reusable:
            ours, theirs = self.tensors(), other.tensors()
            capacity = total + max(int(total * _GROWTH_FRACTION), _MINIMUM_GROWTH)
            tensors = {}
            for name in names:
                dim, tensor = _SLOT_DIMENSION[name], ours[name]
                shape = (*tensor.shape[:dim], capacity, *tensor.shape[dim + 1 :])
                tensors[name] = tensor.new_empty(shape, dtype=theirs[name].dtype)
                tensors[name].narrow(dim, 0, width).copy_(tensor)
            # A grown buffer keeps its next check; a first one, for memories just pruned (a forward's, or compacted
            # by the last check), looks after the interval, as after any check (one that dies meanwhile has m = 0).
            next_check = width + check_interval(width) if buffer is None else buffer.next_check
            buffer = _Buffer(tensors, width, next_check)
        views, slots, written, count = dict.fromkeys(_FIELDS), [], [], total - width
        for name in names:
            slots.append(buffer.slots(name, width, count))
            written.append(getattr(other, name))
            views[name] = buffer.slots(name, 0, total)
        torch._foreach_copy_(slots, written)  # (one call for the fields: a decoding step appends to every layer)
        buffer.used = total
        return ExpireSpanMemory(**views, buffer=buffer)

    def slots(self, start: int, count: int) -> "ExpireSpanMemory":
        """The `count` slots from `start` on, as views, without the buffer (appending them copies them)."""
        return ExpireSpanMemory(
            **{
                name: None if tensor is None else tensor.narrow(_SLOT_DIMENSION[name], start, count)
                for name, tensor in self.tensors().items()
            }
        )

    def detached(self, keep_span_inputs: bool) -> "ExpireSpanMemory":
        """The memories as later blocks read them: without gradient to the hidden states that made them, and without
        span inputs unless kept (training, so that spans follow the current parameters)."""
        tensors = self.tensors()
        if not keep_span_inputs:
            tensors["span_inputs"] = None
        if any(tensor is not None and tensor.requires_grad for tensor in tensors.values()):  # (decoding: none does)
            tensors = {name: None if tensor is None else tensor.detach() for name, tensor in tensors.items()}
        return ExpireSpanMemory(
            **tensors, buffer=self.buffer, expiry_slack=self.expiry_slack, every_valid=self.every_valid
        )

    def map(self, function) -> "ExpireSpanMemory":
        """Apply `function` to every tensor along the batch dimension (reorder, repeat, select rows). Every new row
        is a copy of an old one, so the expiry slack stays a lower bound."""
        return ExpireSpanMemory(
            **{name: None if tensor is None else function(tensor) for name, tensor in self.tensors().items()},
            expiry_slack=self.expiry_slack,
            every_valid=self.every_valid,
        )

    def _prunes_lazily(self) -> bool:
        """Whether `prune` marks the dead in place (decoding, with a buffer this memory is the newest prefix of)."""
        buffer = self.buffer
        return (
            not torch.compiler.is_compiling()
            and not torch.is_grad_enabled()  # marking in place is for decoding; see `append`
            and buffer is not None
            and buffer.used == self.width
        )

    def checks_pruning(self) -> bool:
        """Whether `prune` looks at the memories now: always, except in decoding between two of a buffer's checks."""
        return not self._prunes_lazily() or self.width >= self.buffer.next_check

    def prune(self, dead: Callable[[], torch.Tensor] | None) -> "ExpireSpanMemory":
        """Without empty slots and without the memories `dead` returns (B, N) True for (called only when needed).

        Eager, this compacts the layout. With a buffer (decoding), only every `check_interval` appended memories:
        the dead are marked invalid in place (never attended again, as if deleted), and the layout is compacted
        once the slots no row needs exceed `COMPACT_FRACTION` of it. Its width stays below (live memories) /
        (1 − COMPACT_FRACTION) + check_interval + the block. Compiled, the dead are only masked (how many a row
        keeps is data, which torch.compile cannot trace); the caller compacts afterwards."""
        if not self.checks_pruning():
            return self
        buffer, lazy = self.buffer, self._prunes_lazily()
        keep = self.valid if dead is None else self.valid & ~dead()
        if torch.compiler.is_compiling():
            return dataclasses.replace(self, valid=keep, every_valid=None)
        if not lazy:
            return self.select(keep)
        self.valid.copy_(keep)  # the dead stay dead for every later query (m only falls as t grows)
        width = int(keep.sum(1).max()) if keep.numel() else 0
        buffer.next_check = self.width + check_interval(self.width)
        if self.width - width > self.width * COMPACT_FRACTION:
            return self.select(keep, width)  # a new memory: its slack is computed again at the next step
        self.expiry_slack = None  # recomputed at the next step: without the dead memories it may have grown
        self.every_valid = None
        return self


@dataclass
class MemorySnapshot:
    """A layer's memories as they stood before a block, to come back to (a cache rolling back speculative tokens) after
    later blocks changed the buffer they share in place: appends write past the snapshot's width, which it does not
    see, but lazy pruning marks memories dead in its slots, so the validity is copied, with the buffer's counters."""

    memory: ExpireSpanMemory | None
    valid: torch.Tensor | None = None
    used: int | None = None
    next_check: int | None = None
    expiry_slack: float | None = None
    every_valid: bool | None = None

    @classmethod
    def of(cls, memory: ExpireSpanMemory | None) -> "MemorySnapshot":
        if memory is None:
            return cls(None)
        buffer = memory.buffer
        return cls(memory, memory.valid.clone(), buffer and buffer.used, buffer and buffer.next_check,
                   memory.expiry_slack, memory.every_valid)  # fmt: skip

    def restore(self) -> ExpireSpanMemory | None:
        """The memory as it was: its validity written back (in place: the buffer's later views are dropped) and the
        buffer's counters, so that the next append writes where the snapshot ends."""
        memory = self.memory
        if memory is None:
            return None
        memory.valid.copy_(self.valid)
        if memory.buffer is not None:
            memory.buffer.used, memory.buffer.next_check = self.used, self.next_check
        memory.expiry_slack, memory.every_valid = self.expiry_slack, self.every_valid
        return memory


def decoding_slack(
    memory: "ExpireSpanMemory | None", positions: torch.Tensor, token_valid: torch.Tensor
) -> float | None:
    """For a decoding step (one query t per row, `positions` (B, 1)): a lower bound on r_ti = e_i − (t − i) over the
    rows and the valid memories, or None when unknown. When it is >= 0, every memory the query sees has m_ti = 1
    (paper Eq. 5: 1 + r/R >= 1, also after float32 rounding, which keeps the sign), so the attention is plain
    attention over the visible memories and nothing is on the ramp. Kept across steps in `memory.expiry_slack` (see
    `next_decoding_slack`); computed here (one pass and a read) when unknown and every row's token is real."""
    if memory is None:
        return math.inf
    if memory.expiry_slack is not None:
        return memory.expiry_slack
    if memory.spans is None or not bool(token_valid.all()):
        return None
    expiry = (memory.spans.double() + memory.positions).masked_fill_(~memory.valid, math.inf)  # i + e_i
    return float((expiry - positions).min()) if expiry.numel() else math.inf


def next_decoding_slack(slack: float, spans: torch.Tensor) -> float:
    """The slack for the next step, from this step's `slack` and the spans e_t (B, 1) of its memories: every row's
    next query is at most one position further, and a memory made at t has r = e_t − 1 for the query at t + 1. A
    negative slack only says that the mask is needed, and stays negative: the spans are not read then."""
    return (min(slack, float(spans.min())) if slack >= 0 else slack) - 1


def expired_memories(
    positions: torch.Tensor, spans: torch.Tensor | None, first_positions: torch.Tensor, ramp: float, max_span: float
) -> torch.Tensor:
    """(B, N) True for the memories no query from `first_positions` (B,) on can read: m_ti = 0 ⇔ e_i − (t − i) ≤ −R
    ⇔ i + e_i + R ≤ t (paper Eq. 5), and m only falls as t grows. Without spans (fixed span), those farther than
    `max_span` from the first query. A row whose first position is -1 (no real query) expires nothing."""
    if spans is None:
        return first_positions[:, None] - positions > max_span
    return positions + spans + ramp <= first_positions[:, None]


def memory_counts(
    spans, positions, token_valid, memory, ramp, max_distance, counted_positions=False, attend_to_self=True,
    distance_sums=False,
):  # fmt: skip
    """Per memory (B, N): how many of the block's queries read it (m > 0, the memory size of paper Eq. 6) and how
    many see it on the ramp (0 < m < 1), where the span loss lives (paper Eq. 7 and "Loss Computation"); with
    `distance_sums`, also Σ (t − i) over those on-ramp queries (the official loss sums e_i − (t − i)).

    When the valid queries of each row hold consecutive positions (always when `counted_positions`: counted from the
    padding mask; else checked, which torch.compile cannot trace), the counts come from their first and last position
    without building the (T, N) mask; other position_ids fall back to the mask. One query per row with spans may come
    with `token_valid` None: every row's query is real (a decoding step)."""
    nearest = 0 if attend_to_self else 1
    if positions.shape[1] == 1 and spans is not None:
        # One query t per row (decoding), Eq. 5 with r_ti = e_i − (t − i): read ⇔ visible and r > −R; on the ramp
        # ⇔ also r < 0. In float64, exact for integer positions and float32 spans.
        distance = positions - memory.positions  # t − i
        remaining = spans.detach().double() - distance
        read = (remaining > -ramp) & memory.valid
        if not (counted_positions and nearest == 0):  # counted positions: every memory precedes its query (i ≤ t)
            read = read & (distance >= nearest)
        if token_valid is not None:
            read = read & token_valid
        if max_distance is not None:
            read = read & (distance <= max_distance)
        on_ramp = read & (remaining < 0)
        counts = (read.float(), on_ramp.float())
        return counts + ((torch.where(on_ramp, distance, 0).to(spans.dtype),) if distance_sums else ())
    statistics = {"attend_to_self": attend_to_self, "distance_sums": distance_sums}
    if positions.shape[1] == 1:  # one query per row: its position is the range
        query = positions[:, 0]
        first, last = query.masked_fill(~token_valid[:, 0], 0), query.masked_fill(~token_valid[:, 0], -1)
        return memory_statistics(spans, memory.positions, memory.valid, first, last, ramp, max_distance, **statistics)
    valid_positions = positions.masked_fill(~token_valid, torch.iinfo(torch.long).max)
    first = valid_positions.amin(1)
    last = positions.masked_fill(~token_valid, torch.iinfo(torch.long).min).amax(1)
    count = token_valid.sum(1)
    if counted_positions or bool(torch.where(count > 0, last - first + 1 == count, True).all()):
        first = torch.where(count > 0, first, 0)
        last = torch.where(count > 0, last, -1)
        return memory_statistics(spans, memory.positions, memory.valid, first, last, ramp, max_distance, **statistics)
    visible = visible_keys(positions, memory.positions, memory.valid, max_distance, attend_to_self)
    visible = visible & token_valid[:, :, None]
    if spans is None:
        zeros = torch.zeros_like(memory.positions, dtype=torch.float32)
        return (visible.sum(1).float(), zeros) + ((zeros,) if distance_sums else ())
    with torch.no_grad():
        mask = expire_span_mask(spans.detach(), positions, memory.positions, ramp)
    on_ramp = visible & (mask > 0) & (mask < 1)
    counts = ((visible & (mask > 0)).sum(1).float(), on_ramp.sum(1).float())
    if not distance_sums:
        return counts
    distance = positions[:, :, None] - memory.positions[:, None, :]  # t − i
    return counts + (torch.where(on_ramp, distance, 0).sum(1).to(spans.dtype),)
