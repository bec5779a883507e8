"""Readable definition of Expire-Span attention (SPEC §2).

Sukhbaatar et al. (2021), *Not All Memories are Created Equal: Learning to Forget by Expiring*, Sec. 4.1.
Memory ``i`` (a key at absolute position ``i``) carries a learned span ``e_i``; seen from a query at position
``t`` its remaining life is ``r_ti = e_i − (t − i)`` and its soft mask (Eq. 5, ramp ``R``) is::

    m_ti = clamp(1 + r_ti / R, 0, 1)

The attention weights of the visible keys are masked and renormalised (Eq. 4)::

    a_ti  = softmax_i(s_ti),  s_ti = scale · q_t·k_i
    a'_ti = m_ti a_ti / Σ_j m_tj a_tj,   o_t = Σ_i a'_ti v_i

Every faster path in ``memlm.kernels.expire_attention`` is tested against :func:`expire_span_attention_reference`.
:func:`expire_span_mask` and :func:`visible_keys` are the one place the mask and the visibility rule are written;
the fast path and the model's bookkeeping (span loss, memory counts) use them too.

Shapes: query ``(B, H, T, d)``, key ``(B, H, N, d)``, value ``(B, H, N, d_v)``, spans ``(B, N)``, query_positions
``(B, T)``, key_positions ``(B, N)``, key_valid ``(B, N)``. Inputs are not validated here; use
``memlm.kernels.expire_attention.expire_span_attention``.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["expire_span_attention_reference", "expire_span_mask", "visible_keys"]


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when any input is float64."""
    if any(tensor is not None and tensor.dtype == torch.float64 for tensor in tensors):
        return torch.float64
    return torch.float32


def expire_span_mask(
    spans: torch.Tensor | None,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    ramp: float,
) -> torch.Tensor:
    """The soft mask ``m_ti = clamp(1 + (e_i − (t − i)) / R, 0, 1)`` of paper Eq. 5, ``(B, T, N)``.

    Computed in float32 (float64 for float64 spans) whatever the spans' dtype, so that long spans keep their
    resolution. ``spans=None`` means no key ever expires (m = 1). Visibility (causality, padding, a maximum
    distance) is not applied here; see :func:`visible_keys`.

    The gradient with respect to the spans is ``1/R`` strictly inside the ramp (0 < m < 1) and 0 elsewhere,
    including at m = 0 and m = 1: only memories on the ramp learn (paper, Fig. 2 and the text after Eq. 5).
    """
    batch_size, length = query_positions.shape
    dtype = torch.float64 if spans is not None and spans.dtype == torch.float64 else torch.float32
    if spans is None:
        return torch.ones(batch_size, length, key_positions.shape[1], dtype=dtype, device=key_positions.device)
    distance = (query_positions[:, :, None] - key_positions[:, None, :]).to(dtype)  # t − i
    remaining = spans.to(dtype)[:, None, :] - distance  # r_ti = e_i − (t − i)
    ramp_position = 1 + remaining / ramp
    on_ramp = (ramp_position > 0) & (ramp_position < 1)
    # Eq. 5; the clamped ends are constants, so the gradient lives on the open ramp only.
    return torch.where(on_ramp, ramp_position, ramp_position.detach().clamp(0, 1))


def visible_keys(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    max_distance: float | None = None,
    attend_to_self: bool = True,
) -> torch.Tensor:
    """Which keys each query may see, ``(B, T, N)`` bool: ``i ≤ t`` (``i < t`` without ``attend_to_self``), the key
    slot is valid, and ``t − i ≤ max_distance`` when given. Causality is by position, so memories and the current
    block may be concatenated in any order."""
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # t − i
    visible = distance >= (0 if attend_to_self else 1)
    if key_valid is not None:
        visible = visible & key_valid[:, None, :]
    if max_distance is not None:
        visible = visible & (distance <= max_distance)
    return visible


def memory_statistics(
    spans: torch.Tensor | None,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    first_query: torch.Tensor,
    last_query: torch.Tensor,
    ramp: float,
    max_distance: float | None = None,
    attend_to_self: bool = True,
    distance_sums: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Per key, how many queries read it (m > 0 and visible) and how many see it on the ramp (0 < m < 1), for
    queries at every integer position of [first_query, last_query] (per row, (B,)); (B, N) float each. With
    `distance_sums`, also Σ (t − i) over the queries that see the key on the ramp (the official span loss).

    Counting instead of building the (T, N) mask: with integer positions, key i is visible to t in
    [max(first, i), min(last, i + ⌊D⌋)], has m > 0 for t < i + e_i + R and is on the ramp for t > i + e_i (Eq. 5).
    An empty range (first > last) counts nothing. The counts carry no gradient; multiply them by the spans."""
    first = first_query[:, None]
    last = last_query[:, None]
    if max_distance is not None:
        last = torch.minimum(last, key_positions + int(math.floor(max_distance)))
    start = torch.maximum(first, key_positions if attend_to_self else key_positions + 1)
    if spans is None:
        read = (last - start).add_(1).clamp_min_(0)
        zeros = torch.zeros_like(key_positions, dtype=torch.float32)
        return (torch.where(key_valid, read, 0).float(), zeros) + ((zeros,) if distance_sums else ())
    with torch.no_grad():
        # In float64, exact for integer positions and float32 spans; the (integer) query ranges as float64 too.
        expiry = spans.detach().double() + key_positions  # i + e_i
        last = torch.minimum(last, (expiry + ramp).ceil_().sub_(1))  # m > 0 ⇔ t < i + e_i + R
        read = (last - start).add_(1).clamp_min_(0)
        ramp_start = torch.maximum(start, expiry.floor_().add_(1))  # 0 < m < 1 ⇔ i + e_i < t < i + e_i + R
        on_ramp = (last - ramp_start).add_(1).clamp_min_(0)
        counts = (torch.where(key_valid, read, 0).float(), torch.where(key_valid, on_ramp, 0).float())
        if not distance_sums:
            return counts
        # Σ_{t=a}^{b} (t − i) = n · ((a + b) / 2 − i) over the n = b − a + 1 queries on the ramp.
        distances = on_ramp * ((ramp_start + last) / 2 - key_positions)
        return counts + (torch.where(key_valid, distances, 0).to(spans.dtype),)


class RelativeIndex(NamedTuple):
    """Which learned relative position each score reads: `index` d − 1 clamped to the table, `inside` whether
    1 ≤ d ≤ P (integer and bool tensors of the distances' shape). Made once for the queries that score the same keys
    (a Feedback step's layers) by `relative_position_index`."""

    index: torch.Tensor
    inside: torch.Tensor


def relative_position_index(distance: torch.Tensor, num_positions: int) -> RelativeIndex:
    """The `RelativeIndex` of integer distances d = t − i for a table of `num_positions` rows."""
    return RelativeIndex((distance - 1).clamp(0, num_positions - 1), (distance >= 1) & (distance <= num_positions))


# Up to this many query rows (a decoding step's heads at batch 1), `_position_products(..., by_row=True)` multiplies
# them one by one on a CPU (more rows are cheaper as one product, whose thread-pool wake-up they share).
_FEW_ROWS = 4


def _position_products(query: torch.Tensor, table: torch.Tensor, by_row: bool = False) -> torch.Tensor:
    """query (..., d) · table (P, d)ᵀ → (..., P). With `by_row`, a few query rows on a CPU as one matrix-vector product
    each: MKL runs a product of two or more rows on its thread pool, and waking its threads costs more than such a
    product (two pool regions a layer and step in the Feedback Transformer's official decoding with the adaptive span,
    which writes its position scores out, against none). Not the default: a row's bits would then depend on how many
    rows are multiplied together."""
    rows = query.numel() // query.shape[-1]
    if by_row and query.device.type == "cpu" and 0 < rows <= _FEW_ROWS and not torch.compiler.is_compiling():
        products = [torch.mv(table, row) for row in query.reshape(rows, query.shape[-1]).unbind()]
        return torch.stack(products).view(*query.shape[:-1], table.shape[0])
    return query @ table.mT


def relative_position_scores(table: torch.Tensor, query: torch.Tensor, distance, by_row: bool = False) -> torch.Tensor:
    """The official code's learned relative positions (`key_pe`; Sukhbaatar et al., 2019, Sec. 3) scored:
    table (P, d) with row d − 1 holding p_d, query (..., d) and, per query, the distances d = t − i of the keys it
    scores (..., W), integer (or their `RelativeIndex`), their leading dimensions broadcast to the query's → q · p_d,
    (..., W); 0 outside 1..P. The Feedback Transformer keeps its table as a bare parameter
    (`model.relative_positions`, the key its checkpoints hold), Expire-Span in
    `memlm.modeling.layers.LearnedRelativePositions`. `by_row`: see `_position_products`."""
    if not isinstance(distance, RelativeIndex):
        distance = relative_position_index(distance, table.shape[0])
    by_distance = _position_products(query, table.to(query.dtype), by_row)  # (..., P): q · p_d for d = 1..P
    index = distance.index.expand(*by_distance.shape[:-1], distance.index.shape[-1])
    return torch.where(distance.inside, by_distance.gather(-1, index), 0.0)


def relative_position_scores_backward(table: torch.Tensor, query: torch.Tensor, distance, grad_scores: torch.Tensor,
                                      needs_table: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The gradients of `relative_position_scores` for the query and the table (None without `needs_table`), given
    the scores' gradient (..., W): each score's gradient lands on its distance's row, dq = Σ_d g_d p_d and
    dp_d = Σ g_d q (0 outside 1..P)."""
    if not isinstance(distance, RelativeIndex):
        distance = relative_position_index(distance, table.shape[0])
    by_distance = grad_scores.new_zeros(*grad_scores.shape[:-1], table.shape[0])
    index = distance.index.expand(*grad_scores.shape[:-1], distance.index.shape[-1])
    by_distance.scatter_add_(-1, index, torch.where(distance.inside, grad_scores, 0.0))
    grad_query = by_distance @ table.to(by_distance.dtype)
    grad_table = None
    if needs_table:
        grad_table = (by_distance.flatten(0, -2).mT @ query.to(by_distance.dtype).flatten(0, -2)).to(table.dtype)
    return grad_query, grad_table


def expire_span_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: torch.Tensor | None,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    ramp: float,
    key_valid: torch.Tensor | None = None,
    max_distance: float | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    position_scores: torch.Tensor | None = None,
    attend_to_self: bool = True,
    renormalization_epsilon: float = 0.0,
    relative_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expire-Span attention written out as paper Eq. 4: softmax, multiply by the soft mask, renormalise.

    A query that sees no key, or only keys with m = 0, outputs zeros (with zero gradients). Returns
    ``(B, H, T, d_v)`` in the query's dtype; the math runs in float32 (float64 for float64 inputs).

    The official code's variant (facebookresearch/transformer-sequential): ``position_scores`` (B, H, T, N) are added
    to q·k before the scale, ``attend_to_self=False`` hides key t from query t, and ``renormalization_epsilon`` ε > 0
    gives a'_ti = m_ti a_ti / (Σ_j m_tj a_tj + ε) with the softmax over the keys with m > 0. `relative_positions`
    (P, d), the table p_1..p_P, adds q_t · p_{t−i} as `position_scores` would (`relative_position_scores`).
    """
    dtype = _compute_dtype(query, key, value, spans)
    output_dtype = query.dtype
    if scale is None:
        scale = query.shape[-1] ** -0.5
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)

    visible = visible_keys(query_positions, key_positions, key_valid, max_distance, attend_to_self)[:, None]
    mask = expire_span_mask(spans, query_positions, key_positions, ramp).to(dtype)[:, None]  # m_ti, Eq. 5
    if renormalization_epsilon > 0:
        visible = visible & (mask > 0)  # the official softmax leaves out the keys with m = 0 (score −inf)

    scores = query @ key.mT
    if relative_positions is not None:
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # (B, 1, T, N)
        scores = scores + relative_position_scores(relative_positions, query, distance)
    if position_scores is not None:
        scores = scores + position_scores.to(dtype)  # q_t · k_i + q_t · p_{t−i}
    scores = scale * scores  # s_ti
    scores = scores.masked_fill(~visible, float("-inf"))
    # A query that sees no key would give a row of -inf (NaN softmax): score it 0 instead; its weights are
    # zeroed below by the visibility.
    scores = torch.where(visible.any(-1, keepdim=True), scores, 0.0)
    attention = scores.softmax(dim=-1) * visible  # a_ti over the visible keys

    weights = mask * attention  # m_ti a_ti
    normaliser = weights.sum(dim=-1, keepdim=True)  # Σ_j m_tj a_tj
    if renormalization_epsilon > 0:
        weights = weights / (normaliser + renormalization_epsilon)  # the official a'_ti
    else:
        weights = weights / torch.where(normaliser > 0, normaliser, 1.0)  # a'_ti, Eq. 4
    if dropout > 0:
        weights = F.dropout(weights, p=dropout)
    output = weights @ value  # o_t = Σ_i a'_ti v_i, Eq. 4
    return output.to(output_dtype)
