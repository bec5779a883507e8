"""Expire-Span attention as a FlashAttention-style Triton kernel, forward and backward (SPEC §2, §5).

Sukhbaatar et al. (2021), *Not All Memories are Created Equal: Learning to Forget by Expiring*, Sec. 4.1. The
masked, renormalised weights of Eq. 4 with the soft mask of Eq. 5::

    m_ti = clamp(1 + r_ti / R, 0, 1),  r_ti = e_i − (t − i)
    a'_ti = m_ti e^{s_ti} / Σ_j m_tj e^{s_tj} = softmax_i(s_ti + log m_ti)

are computed tile by tile with an online softmax (Dao et al., FlashAttention-2): no (T, N) tensor is ever formed.
The mask comes from the spans and positions inside the kernel, as a factor ``m`` on ``e^{s − max}`` (so no
logarithm). A key tile that no query of the tile can see — every key in the future, too far, an empty slot, or
expired (``max_i r_ti ≤ −R`` at the tile's earliest query) — is invisible; a first pass over the positions and
spans alone finds the first and the last visible tile, and the main loop runs over exactly that range with
unconditional loads, which the compiler can pipeline (invisible tiles inside the range are masked pair by pair).
The backward recomputes the weights from the saved log-sum-exp ``L_t = log Σ_j m_tj e^{s_tj}``:

    dS_ti = m_ti e^{s_ti − L_t} (dP_ti − D_t),   dP = dO Vᵀ,   D_t = Σ dO_t · O_t
    de_i  = Σ_t dS_ti / (R m_ti) = Σ_t e^{s_ti − L_t} (dP_ti − D_t) / R   on the open ramp −R < r_ti < 0

with the span gradient summed over the heads (one span per key, shared by the heads).

The official code's options (SPEC §8) run in the same kernels. Its learned relative positions add q_t · p_{t−i} to
the scores: q·P (B·H, T, P) is one product before the kernels (made again in the backward, not kept) and each
pair loads its term from it (or from given per-pair scores); the term's gradient is dS, added atomically by the
query kernel (two keys at one position share an entry), and dq += dS_P·P, dP = dS_Pᵀ·q follow as products.
Without attention to the token itself a query sees t − i ≥ 1. The renormalisation ε, a'_ti = m_ti a_ti / (Σ_j m_tj
a_tj + ε) with the softmax over the keys with m > 0, is o_t = Σ_i m_ti e^{s_ti} v_i / (Σ_j m_tj e^{s_tj} + ε Σ_j
e^{s_tj}): the forward keeps the second sum too, L_t is the log of that denominator, and dS_ti gains −ε e^{s_ti − L_t}
D_t (the span gradient is unchanged).

Positions enter the kernel as int32 offsets from each row's first query; invalid key slots get a position later
than every query, which makes them invisible by causality alone. Addresses are int64 wherever a token index
meets a stride (tokens · heads · width passes 2^31 at a million tokens), and the grid is one axis of tiles ×
(batch × heads), so any batch × heads launches. Dots take bfloat16 / float16 operands on tensor cores with float32
accumulation; float32 inputs use exact (IEEE) dots unless PyTorch's float32 matmuls may use TF32
(``torch.set_float32_matmul_precision("high")``). Tiles are chosen per kernel, dtype and head width (see
_GPU_CONFIGS). The readable definition is ``reference.py``; the tests check this file against it.
"""

import functools
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:  # pragma: no cover - depends on the platform
    raise ImportError(
        "The Triton Expire-Span attention kernel needs Triton: pip install triton (Linux), or use the torch backend."
    ) from error

__all__ = ["expire_span_attention_triton"]

# Positions are stored as int32 offsets from each row's first query, clipped to ±_POSITION_LIMIT; invalid and
# padding key slots get _FAR, later than any query. Distances t − i then stay within ±2^30.
_POSITION_LIMIT = 2**29
_FAR = tl.constexpr(2**30)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Wider heads run the torch backend (the dispatcher in __init__.py sends them there): tiles are chosen and checked
# for every dtype and both targets only up to 128.
_MAX_HEAD_DIM = 128


@triton.jit
def _tile_is_visible(
    query_positions,
    query_in_range,
    key_positions,
    spans,
    max_distance,
    min_distance,
    ramp,
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
):
    """Whether some (query, key) pair of the tile may be visible with m > 0, from per-tile bounds only.

    Conservative: False guarantees that every pair is invisible, in the same float32 arithmetic as _soft_mask."""
    first_query = tl.min(tl.where(query_in_range, query_positions, _FAR), axis=0)
    last_query = tl.max(tl.where(query_in_range, query_positions, -_FAR), axis=0)
    key_valid = key_positions < _FAR
    # Some valid key is not in the future of every query (t − i ≥ 1 without attention to the token itself).
    visible = tl.min(key_positions, axis=0) + min_distance <= last_query
    if HAS_MAX_DISTANCE:
        latest_key = tl.max(tl.where(key_valid, key_positions, -_FAR), axis=0)
        visible = visible & (first_query - latest_key <= max_distance)
    if HAS_SPANS:
        # r_ti = e_i − (t − i) decreases with t, so the tile's earliest query sees the longest remaining lives.
        remaining = spans - (first_query - key_positions).to(tl.float32)
        visible = visible & (tl.max(tl.where(key_valid, remaining, -float("inf")), axis=0) > -ramp)
    return visible


@triton.jit
def _soft_mask(
    query_positions,
    key_positions,
    spans,
    max_distance,
    min_distance,
    ramp,
    inverse_ramp,
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
):
    """Per (query, key) pair of a tile: visible with m > 0, the soft mask m (Eq. 5), and on the open ramp."""
    distance = query_positions[:, None] - key_positions[None, :]  # t − i
    visible = distance >= min_distance
    if HAS_MAX_DISTANCE:
        visible = visible & (distance <= max_distance)
    mask = tl.full(distance.shape, 1.0, tl.float32)
    on_ramp = distance < -_FAR  # all False
    if HAS_SPANS:
        remaining = spans[None, :] - distance.to(tl.float32)  # r_ti
        # m > 0 ⇔ r > −R, as in the reference; (r + R) / R is then > 0 in float32 too (Sterbenz), never 0.
        visible = visible & (remaining > -ramp)
        mask = tl.minimum((remaining + ramp) * inverse_ramp, 1.0)
        on_ramp = visible & (remaining < 0)
    return visible, mask, on_ramp


# The scores' position terms q_t · p (SPEC §8), a float32 input of the kernels: none, one per (query, key) pair
# (B·H, T, N), or the learned relative positions scored per query and distance (B·H, T, P), column d − 1 for
# 1 ≤ d = t − i ≤ P.
_NO_POSITIONS = tl.constexpr(0)
_PAIR_POSITIONS = tl.constexpr(1)
_RELATIVE_POSITIONS = tl.constexpr(2)


@triton.jit
def _position_offsets(query_tokens, query_in_range, keys, query_positions, key_positions, visible, num_positions,
                      POSITIONS: tl.constexpr):  # fmt: skip
    """Where the position term of each visible pair of a tile is, in one (batch, head)'s rows of `num_positions`
    columns, and which pairs have one (never a query past the last: a tile's tail rows may look visible)."""
    has_term = visible & query_in_range[:, None]
    if POSITIONS == _RELATIVE_POSITIONS:
        distance = query_positions[:, None] - key_positions[None, :]  # t − i
        has_term = has_term & (distance >= 1) & (distance <= num_positions)
        column = tl.where(has_term, distance - 1, 0)
    else:
        column = tl.where(has_term, keys[None, :], 0)
    return query_tokens[:, None] * num_positions + column, has_term


@triton.jit
def _visible_key_tiles(
    KeyPositions,
    Spans,
    query_positions,
    query_in_range,
    num_keys,
    max_distance,
    min_distance,
    ramp,
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The key tiles [first, end) some query of this query tile may see: from the first to the last tile that
    _tile_is_visible keeps, found from the keys' positions and spans alone (first = end when there is none)."""
    num_tiles = tl.cdiv(num_keys, BLOCK_N)
    first = num_tiles
    end = num_tiles * 0
    for tile in range(0, num_tiles):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_in_range = keys < num_keys
        key_positions = tl.load(KeyPositions + keys, mask=key_in_range, other=_FAR)
        spans = tl.zeros([BLOCK_N], tl.float32)
        if HAS_SPANS:
            spans = tl.load(Spans + keys, mask=key_in_range, other=0.0)
        visible = _tile_is_visible(
            query_positions,
            query_in_range,
            key_positions,
            spans,
            max_distance,
            min_distance,
            ramp,
            HAS_SPANS,
            HAS_MAX_DISTANCE,
        )
        first = tl.where(visible, tl.minimum(first, tile), first)
        end = tl.where(visible, tile + 1, end)
    return first, end


@triton.jit
def _visible_query_tiles(
    QueryPositions,
    key_positions,
    spans,
    num_queries,
    max_distance,
    min_distance,
    ramp,
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The query tiles [first, end) of which some query may see a key of this key tile (first = end: none)."""
    num_tiles = tl.cdiv(num_queries, BLOCK_M)
    first = num_tiles
    end = num_tiles * 0
    for tile in range(0, num_tiles):
        queries = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        query_in_range = queries < num_queries
        query_positions = tl.load(QueryPositions + queries, mask=query_in_range, other=0)
        visible = _tile_is_visible(
            query_positions,
            query_in_range,
            key_positions,
            spans,
            max_distance,
            min_distance,
            ramp,
            HAS_SPANS,
            HAS_MAX_DISTANCE,
        )
        first = tl.where(visible, tl.minimum(first, tile), first)
        end = tl.where(visible, tile + 1, end)
    return first, end


@triton.jit
def _program_tile(num_items, BLOCK: tl.constexpr):
    """(tile, batch × head) of this program: the grid is one axis of tiles × (batch × head), heads outermost."""
    num_tiles = tl.cdiv(num_items, BLOCK)
    program = tl.program_id(0)
    return program % num_tiles, program // num_tiles


@triton.jit
def _forward_kernel(
    Query,
    Key,
    Value,
    Spans,
    QueryPositions,
    KeyPositions,
    Positions,
    Output,
    LogSumExp,
    query_stride_batch,
    query_stride_head,
    query_stride_token,
    query_stride_dim,
    key_stride_batch,
    key_stride_head,
    key_stride_token,
    key_stride_dim,
    value_stride_batch,
    value_stride_head,
    value_stride_token,
    value_stride_dim,
    output_stride_batch,
    output_stride_head,
    output_stride_token,
    output_stride_dim,
    num_heads,
    num_queries,
    num_keys,
    key_dim,
    value_dim,
    scale,
    ramp,
    inverse_ramp,
    max_distance,
    min_distance,
    epsilon,
    num_positions,
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
    HAS_EPSILON: tl.constexpr,
    POSITIONS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One tile of BLOCK_M queries of one (batch, head) against its visible key tiles, with an online softmax."""
    tile, batch_head = _program_tile(num_queries, BLOCK_M)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    queries = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    query_in_range = queries < num_queries
    # Token × stride products are int64: (tokens · heads · width) passes 2^31 at a million tokens.
    query_tokens = queries.to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    key_dim_offsets = dims.to(tl.int64) * key_stride_dim
    value_dim_offsets = value_dims.to(tl.int64) * value_stride_dim

    query = tl.load(
        Query
        + batch * query_stride_batch
        + head * query_stride_head
        + query_tokens[:, None] * query_stride_token
        + dims.to(tl.int64)[None, :] * query_stride_dim,
        mask=query_in_range[:, None] & (dims[None, :] < key_dim),
        other=0.0,
    )
    query_positions = tl.load(QueryPositions + batch * num_queries + queries, mask=query_in_range, other=0)
    KeyPositions += batch * num_keys
    if HAS_SPANS:
        Spans += batch * num_keys
    if POSITIONS != _NO_POSITIONS:
        Positions += batch_head.to(tl.int64) * num_queries * num_positions
    Key += batch * key_stride_batch + head * key_stride_head
    Value += batch * value_stride_batch + head * value_stride_head
    first, end = _visible_key_tiles(
        KeyPositions,
        Spans,
        query_positions,
        query_in_range,
        num_keys,
        max_distance,
        min_distance,
        ramp,
        HAS_SPANS,
        HAS_MAX_DISTANCE,
        BLOCK_N,
    )

    row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)  # max of the visible scores seen so far
    row_sum = tl.zeros([BLOCK_M], tl.float32)  # Σ_j m_tj e^{s_tj − row_max}
    row_total = tl.zeros([BLOCK_M], tl.float32)  # Σ_j e^{s_tj − row_max}, for the official ε
    accumulator = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for key_start in range(first * BLOCK_N, end * BLOCK_N, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_in_range = keys < num_keys
        key_tokens = keys.to(tl.int64)
        key_positions = tl.load(KeyPositions + keys, mask=key_in_range, other=_FAR)
        spans = tl.zeros([BLOCK_N], tl.float32)
        if HAS_SPANS:
            spans = tl.load(Spans + keys, mask=key_in_range, other=0.0)
        key = tl.load(
            Key + key_tokens[:, None] * key_stride_token + key_dim_offsets[None, :],
            mask=key_in_range[:, None] & (dims[None, :] < key_dim),
            other=0.0,
        )
        value = tl.load(
            Value + key_tokens[:, None] * value_stride_token + value_dim_offsets[None, :],
            mask=key_in_range[:, None] & (value_dims[None, :] < value_dim),
            other=0.0,
        )
        visible, mask, _ = _soft_mask(
            query_positions,
            key_positions,
            spans,
            max_distance,
            min_distance,
            ramp,
            inverse_ramp,
            HAS_SPANS,
            HAS_MAX_DISTANCE,
        )
        scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale
        if POSITIONS != _NO_POSITIONS:  # + q_t · p_{t−i} (SPEC §8)
            offsets, has_term = _position_offsets(
                query_tokens, query_in_range, keys, query_positions, key_positions, visible, num_positions, POSITIONS
            )
            # Scaled before the sum: a tile added to a dot's result becomes its accumulator, for which the
            # compiler keeps far more registers (hundreds of bytes of spills in the backward).
            scores += tl.load(Positions + offsets, mask=has_term, other=0.0) * scale
        scores = tl.where(visible, scores, -float("inf"))  # s_ti
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # a row that has seen no key yet stays at 0
        unmasked = tl.exp(scores - shift[:, None])
        weights = unmasked * mask  # m_ti e^{s_ti − max}, Eq. 4
        rescale = tl.exp(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(weights, axis=1)
        if HAS_EPSILON:
            row_total = row_total * rescale + tl.sum(unmasked, axis=1)
        accumulator = accumulator * rescale[:, None] + tl.dot(
            weights.to(value.dtype), value, input_precision=DOT_PRECISION
        )
        row_max = new_max

    # The official ε: Σ m a + ε = (Σ m e^s + ε Σ e^s) / Σ e^s, the softmax over the keys with m > 0.
    if HAS_EPSILON:
        row_sum += epsilon * row_total
    # A query that sees no key with m > 0 outputs zeros, and L = +inf gives it zero weights in the backward.
    has_key = row_sum > 0
    row_sum = tl.where(has_key, row_sum, 1.0)
    output = accumulator / row_sum[:, None]
    log_sum_exp = tl.where(has_key, row_max + tl.log(row_sum), float("inf"))
    tl.store(
        Output
        + batch * output_stride_batch
        + head * output_stride_head
        + query_tokens[:, None] * output_stride_token
        + value_dims.to(tl.int64)[None, :] * output_stride_dim,
        output.to(Output.dtype.element_ty),
        mask=query_in_range[:, None] & (value_dims[None, :] < value_dim),
    )
    tl.store(LogSumExp + batch_head.to(tl.int64) * num_queries + queries, log_sum_exp, mask=query_in_range)


@triton.jit
def _backward_key_kernel(
    Query,
    Key,
    Value,
    Spans,
    QueryPositions,
    KeyPositions,
    Positions,
    GradOutput,
    LogSumExp,
    Delta,
    GradKey,
    GradValue,
    GradSpans,
    query_stride_batch,
    query_stride_head,
    query_stride_token,
    query_stride_dim,
    key_stride_batch,
    key_stride_head,
    key_stride_token,
    key_stride_dim,
    value_stride_batch,
    value_stride_head,
    value_stride_token,
    value_stride_dim,
    grad_output_stride_batch,
    grad_output_stride_head,
    grad_output_stride_token,
    grad_output_stride_dim,
    num_heads,
    num_queries,
    num_keys,
    key_dim,
    value_dim,
    scale,
    ramp,
    inverse_ramp,
    max_distance,
    min_distance,
    epsilon,
    num_positions,
    HAS_SPANS: tl.constexpr,
    SPANS_NEED_GRAD: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
    HAS_EPSILON: tl.constexpr,
    POSITIONS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Gradients of one tile of BLOCK_N keys of one (batch, head): key, value, and the span per head."""
    tile, batch_head = _program_tile(num_keys, BLOCK_N)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    key_in_range = keys < num_keys
    key_tokens = keys.to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    query_dim_offsets = dims.to(tl.int64) * query_stride_dim
    grad_output_dim_offsets = value_dims.to(tl.int64) * grad_output_stride_dim
    key_mask = key_in_range[:, None] & (dims[None, :] < key_dim)
    value_mask = key_in_range[:, None] & (value_dims[None, :] < value_dim)

    key = tl.load(
        Key
        + batch * key_stride_batch
        + head * key_stride_head
        + key_tokens[:, None] * key_stride_token
        + dims.to(tl.int64)[None, :] * key_stride_dim,
        mask=key_mask,
        other=0.0,
    )
    value = tl.load(
        Value
        + batch * value_stride_batch
        + head * value_stride_head
        + key_tokens[:, None] * value_stride_token
        + value_dims.to(tl.int64)[None, :] * value_stride_dim,
        mask=value_mask,
        other=0.0,
    )
    key_positions = tl.load(KeyPositions + batch * num_keys + keys, mask=key_in_range, other=_FAR)
    spans = tl.zeros([BLOCK_N], tl.float32)
    if HAS_SPANS:
        spans = tl.load(Spans + batch * num_keys + keys, mask=key_in_range, other=0.0)
    QueryPositions += batch * num_queries
    Query += batch * query_stride_batch + head * query_stride_head
    GradOutput += batch * grad_output_stride_batch + head * grad_output_stride_head
    LogSumExp += batch_head.to(tl.int64) * num_queries
    Delta += batch_head.to(tl.int64) * num_queries
    if POSITIONS != _NO_POSITIONS:
        Positions += batch_head.to(tl.int64) * num_queries * num_positions
    first, end = _visible_query_tiles(
        QueryPositions,
        key_positions,
        spans,
        num_queries,
        max_distance,
        min_distance,
        ramp,
        HAS_SPANS,
        HAS_MAX_DISTANCE,
        BLOCK_M,
    )

    grad_key = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_value = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    grad_spans = tl.zeros([BLOCK_N], tl.float32)
    for query_start in range(first * BLOCK_M, end * BLOCK_M, BLOCK_M):
        queries = query_start + tl.arange(0, BLOCK_M)
        query_in_range = queries < num_queries
        query_tokens = queries.to(tl.int64)
        query_positions = tl.load(QueryPositions + queries, mask=query_in_range, other=0)
        query = tl.load(
            Query + query_tokens[:, None] * query_stride_token + query_dim_offsets[None, :],
            mask=query_in_range[:, None] & (dims[None, :] < key_dim),
            other=0.0,
        )
        grad_output = tl.load(
            GradOutput + query_tokens[:, None] * grad_output_stride_token + grad_output_dim_offsets[None, :],
            mask=query_in_range[:, None] & (value_dims[None, :] < value_dim),
            other=0.0,
        )
        log_sum_exp = tl.load(LogSumExp + queries, mask=query_in_range, other=float("inf"))
        delta = tl.load(Delta + queries, mask=query_in_range, other=0.0)
        visible, mask, on_ramp = _soft_mask(
            query_positions,
            key_positions,
            spans,
            max_distance,
            min_distance,
            ramp,
            inverse_ramp,
            HAS_SPANS,
            HAS_MAX_DISTANCE,
        )
        scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale
        if POSITIONS != _NO_POSITIONS:
            offsets, has_term = _position_offsets(
                query_tokens, query_in_range, keys, query_positions, key_positions, visible, num_positions, POSITIONS
            )
            # Scaled before the sum: a tile added to a dot's result becomes its accumulator, for which the
            # compiler keeps far more registers (hundreds of bytes of spills in the backward).
            scores += tl.load(Positions + offsets, mask=has_term, other=0.0) * scale
        # a'_ti / m_ti = e^{s_ti − L_t}, bounded by 1 / m_ti; 0 for an invisible pair or a query with no key.
        unmasked = tl.exp(tl.where(visible, scores, -float("inf")) - log_sum_exp[:, None])
        weights = unmasked * mask  # a'_ti
        grad_value += tl.dot(tl.trans(weights.to(grad_output.dtype)), grad_output, input_precision=DOT_PRECISION)
        grad_weights = tl.dot(grad_output, tl.trans(value), input_precision=DOT_PRECISION)  # dP
        grad_unmasked = unmasked * (grad_weights - delta[:, None])  # dS / m
        grad_scores = grad_unmasked * mask  # dS, the gradient of s + log m
        if HAS_EPSILON:  # the ε term of the official normaliser (see the module docstring)
            grad_scores -= epsilon * unmasked * delta[:, None]
        grad_key += tl.dot(tl.trans(grad_scores.to(query.dtype)), query, input_precision=DOT_PRECISION)
        if SPANS_NEED_GRAD:
            # ∂ log m / ∂e = 1 / (R m) on the open ramp (Eq. 5), 0 elsewhere.
            grad_spans += tl.sum(tl.where(on_ramp, grad_unmasked, 0.0), axis=0)

    # Gradients are stored contiguously in (batch, head, key, width) / (batch, head, key).
    tl.store(
        GradKey + (batch_head.to(tl.int64) * num_keys + key_tokens[:, None]) * key_dim + dims[None, :],
        (grad_key * scale).to(GradKey.dtype.element_ty),
        mask=key_mask,
    )
    tl.store(
        GradValue + (batch_head.to(tl.int64) * num_keys + key_tokens[:, None]) * value_dim + value_dims[None, :],
        grad_value.to(GradValue.dtype.element_ty),
        mask=value_mask,
    )
    if SPANS_NEED_GRAD:
        tl.store(GradSpans + batch_head.to(tl.int64) * num_keys + keys, grad_spans * inverse_ramp, mask=key_in_range)


@triton.jit
def _backward_query_kernel(
    Query,
    Key,
    Value,
    Spans,
    QueryPositions,
    KeyPositions,
    Positions,
    GradOutput,
    LogSumExp,
    Delta,
    GradQuery,
    GradPositions,
    query_stride_batch,
    query_stride_head,
    query_stride_token,
    query_stride_dim,
    key_stride_batch,
    key_stride_head,
    key_stride_token,
    key_stride_dim,
    value_stride_batch,
    value_stride_head,
    value_stride_token,
    value_stride_dim,
    grad_output_stride_batch,
    grad_output_stride_head,
    grad_output_stride_token,
    grad_output_stride_dim,
    num_heads,
    num_queries,
    num_keys,
    key_dim,
    value_dim,
    scale,
    ramp,
    inverse_ramp,
    max_distance,
    min_distance,
    epsilon,
    num_positions,
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
    HAS_EPSILON: tl.constexpr,
    POSITIONS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Gradient of one tile of BLOCK_M queries of one (batch, head), looping over its visible key tiles."""
    tile, batch_head = _program_tile(num_queries, BLOCK_M)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    queries = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    query_in_range = queries < num_queries
    query_tokens = queries.to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    key_dim_offsets = dims.to(tl.int64) * key_stride_dim
    value_dim_offsets = value_dims.to(tl.int64) * value_stride_dim
    query_mask = query_in_range[:, None] & (dims[None, :] < key_dim)

    query = tl.load(
        Query
        + batch * query_stride_batch
        + head * query_stride_head
        + query_tokens[:, None] * query_stride_token
        + dims.to(tl.int64)[None, :] * query_stride_dim,
        mask=query_mask,
        other=0.0,
    )
    grad_output = tl.load(
        GradOutput
        + batch * grad_output_stride_batch
        + head * grad_output_stride_head
        + query_tokens[:, None] * grad_output_stride_token
        + value_dims.to(tl.int64)[None, :] * grad_output_stride_dim,
        mask=query_in_range[:, None] & (value_dims[None, :] < value_dim),
        other=0.0,
    )
    query_positions = tl.load(QueryPositions + batch * num_queries + queries, mask=query_in_range, other=0)
    log_sum_exp = tl.load(
        LogSumExp + batch_head.to(tl.int64) * num_queries + queries, mask=query_in_range, other=float("inf")
    )
    delta = tl.load(Delta + batch_head.to(tl.int64) * num_queries + queries, mask=query_in_range, other=0.0)
    KeyPositions += batch * num_keys
    if HAS_SPANS:
        Spans += batch * num_keys
    if POSITIONS != _NO_POSITIONS:
        Positions += batch_head.to(tl.int64) * num_queries * num_positions
        GradPositions += batch_head.to(tl.int64) * num_queries * num_positions
    Key += batch * key_stride_batch + head * key_stride_head
    Value += batch * value_stride_batch + head * value_stride_head
    first, end = _visible_key_tiles(
        KeyPositions,
        Spans,
        query_positions,
        query_in_range,
        num_keys,
        max_distance,
        min_distance,
        ramp,
        HAS_SPANS,
        HAS_MAX_DISTANCE,
        BLOCK_N,
    )

    grad_query = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for key_start in range(first * BLOCK_N, end * BLOCK_N, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_in_range = keys < num_keys
        key_tokens = keys.to(tl.int64)
        key_positions = tl.load(KeyPositions + keys, mask=key_in_range, other=_FAR)
        spans = tl.zeros([BLOCK_N], tl.float32)
        if HAS_SPANS:
            spans = tl.load(Spans + keys, mask=key_in_range, other=0.0)
        key = tl.load(
            Key + key_tokens[:, None] * key_stride_token + key_dim_offsets[None, :],
            mask=key_in_range[:, None] & (dims[None, :] < key_dim),
            other=0.0,
        )
        value = tl.load(
            Value + key_tokens[:, None] * value_stride_token + value_dim_offsets[None, :],
            mask=key_in_range[:, None] & (value_dims[None, :] < value_dim),
            other=0.0,
        )
        visible, mask, _ = _soft_mask(
            query_positions,
            key_positions,
            spans,
            max_distance,
            min_distance,
            ramp,
            inverse_ramp,
            HAS_SPANS,
            HAS_MAX_DISTANCE,
        )
        scores = tl.dot(query, tl.trans(key), input_precision=DOT_PRECISION) * scale
        if POSITIONS != _NO_POSITIONS:
            offsets, has_term = _position_offsets(
                query_tokens, query_in_range, keys, query_positions, key_positions, visible, num_positions, POSITIONS
            )
            # Scaled before the sum: a tile added to a dot's result becomes its accumulator, for which the
            # compiler keeps far more registers (hundreds of bytes of spills in the backward).
            scores += tl.load(Positions + offsets, mask=has_term, other=0.0) * scale
        unmasked = tl.exp(tl.where(visible, scores, -float("inf")) - log_sum_exp[:, None])
        grad_weights = tl.dot(grad_output, tl.trans(value), input_precision=DOT_PRECISION)
        grad_scores = unmasked * mask * (grad_weights - delta[:, None])
        if HAS_EPSILON:
            grad_scores -= epsilon * unmasked * delta[:, None]
        grad_query += tl.dot(grad_scores.to(key.dtype), key, input_precision=DOT_PRECISION)
        if POSITIONS != _NO_POSITIONS:  # atomic: two keys at one position share a relative position's entry
            tl.atomic_add(GradPositions + offsets, grad_scores * scale, mask=has_term)

    tl.store(
        GradQuery + (batch_head.to(tl.int64) * num_queries + query_tokens[:, None]) * key_dim + dims[None, :],
        (grad_query * scale).to(GradQuery.dtype.element_ty),
        mask=query_mask,
    )


# Launch configurations (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) of each kernel on a GPU, by the
# dots' operands — "16-bit" (bfloat16 / float16 on tensor cores), "tf32" (float32 on tensor cores) or "ieee"
# (exact float32 on CUDA cores) — and the padded head width (≤ 64 or 128). The first entry is the default; with
# several, the autotuner times them once per (widths, dtypes) on the GPU. Every entry was compiled for sm_80 and
# sm_90 at widths 16 to 128, with and without sizes divisible by 16, and checked with ptxas -v: no register
# spills, at most 89 KB of shared memory on sm_80 (so the 99 KB of sm_86 / sm_89 fit too) and 129 KB on sm_90.
# Timed only as whole kernels so far (docs/performance/speed.md, "On a GPU"), not config by config. IEEE float32
# dots take num_stages=1: pipelined, their operands go to local memory (kilobytes of spills in ptxas), and CUDA-core
# dots gain little from overlapped loads.
_GPU_CONFIGS = {
    ("forward", "16-bit", 64): [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    ("forward", "16-bit", 128): [(64, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3)],
    ("key", "16-bit", 64): [(32, 32, 4, 3)],
    ("key", "16-bit", 128): [(32, 64, 8, 3), (32, 64, 8, 2)],
    ("query", "16-bit", 64): [(64, 32, 4, 3), (128, 32, 8, 2)],
    ("query", "16-bit", 128): [(64, 32, 8, 3), (64, 64, 8, 2)],
    ("forward", "tf32", 64): [(32, 32, 4, 2), (64, 32, 4, 2)],
    ("forward", "tf32", 128): [(32, 32, 4, 2), (16, 32, 4, 2)],
    ("key", "tf32", 64): [(16, 32, 4, 2)],
    ("key", "tf32", 128): [(16, 32, 8, 2), (16, 32, 4, 2)],
    ("query", "tf32", 64): [(32, 32, 4, 2), (32, 16, 4, 2)],
    ("query", "tf32", 128): [(32, 16, 4, 2)],
    ("forward", "ieee", 64): [(32, 32, 4, 1)],
    ("forward", "ieee", 128): [(32, 32, 8, 1)],
    ("key", "ieee", 64): [(16, 32, 4, 1)],
    ("key", "ieee", 128): [(16, 32, 8, 1)],
    ("query", "ieee", 64): [(16, 16, 4, 1)],
    ("query", "ieee", 128): [(32, 16, 8, 1)],
}
# Extra candidates for sm_90 only (they spill or exceed the budget on sm_80).
_SM90_CONFIGS = {
    ("forward", "16-bit", 128): [(128, 64, 8, 3)],
    ("key", "16-bit", 64): [(32, 64, 8, 3)],
    ("query", "16-bit", 64): [(64, 64, 4, 3)],
}
# With a position term (the official code's learned relative positions, SPEC §8) each pair's term is loaded too;
# where that spills with the configurations above, these replace them (compiled and checked as above).
_POSITIONS_GPU_CONFIGS = {
    ("forward", "16-bit", 64): [(128, 32, 8, 3), (64, 32, 4, 3)],
    ("forward", "16-bit", 128): [(128, 32, 8, 3), (64, 32, 8, 3)],
    ("key", "16-bit", 128): [(16, 64, 8, 3), (16, 64, 8, 2), (16, 32, 8, 3)],
    ("query", "16-bit", 64): [(64, 32, 8, 3), (128, 32, 8, 2), (32, 32, 4, 3)],
    ("query", "16-bit", 128): [(64, 32, 8, 3), (32, 32, 4, 3)],
    ("key", "tf32", 128): [(16, 32, 8, 2)],
    ("forward", "ieee", 128): [(16, 32, 8, 1)],
    ("key", "ieee", 128): [(16, 32, 4, 1)],
}
# Under Triton's interpreter (CPU tests): tiles of 16, so that small test shapes cross tiles and have tails.
_INTERPRETER_TILES = {"BLOCK_M": 16, "BLOCK_N": 16}
# CUDA allows 2^31 − 1 blocks on a grid's first axis (65 535 on the others); the grid is that one axis.
_MAX_PROGRAMS = 2**31 - 1


def _head_blocks(key_dim: int, value_dim: int) -> dict:
    return {
        "BLOCK_D": max(16, triton.next_power_of_2(key_dim)),
        "BLOCK_DV": max(16, triton.next_power_of_2(value_dim)),
    }


def _launch_configs(dtype: torch.dtype, key_dim: int, value_dim: int, capability: int | None = None,
                    positions: bool = False) -> dict:  # fmt: skip
    """The GPU launch configurations of the forward, key-gradient and query-gradient kernels, default first.

    ``capability`` is the device's compute capability as 10 · major + minor (80, 90, ...); None (no device: ahead
    of time) gives the candidates that fit every target. ``positions``: the kernels load a position term."""
    blocks = _head_blocks(key_dim, value_dim)
    precision = _dot_precision(dtype)
    operands = "16-bit" if dtype != torch.float32 else precision
    width = 64 if max(blocks.values()) <= 64 else 128
    configs = {}
    for kernel in ("forward", "key", "query"):
        shapes = list(_GPU_CONFIGS[(kernel, operands, width)])
        if positions:
            shapes = list(_POSITIONS_GPU_CONFIGS.get((kernel, operands, width), shapes))
        elif capability == 90:
            shapes += _SM90_CONFIGS.get((kernel, operands, width), [])
        configs[kernel] = [
            {"BLOCK_M": rows, "BLOCK_N": columns, "num_warps": warps, "num_stages": stages, **blocks}
            for rows, columns, warps, stages in shapes
        ]
    return configs


def _dot_precision(dtype: torch.dtype) -> str:
    """IEEE float32 dots unless PyTorch's float32 matmuls may use TF32 (``torch.set_float32_matmul_precision``),
    so that float32 attention is as exact as the torch backend's; 16-bit operands always use tensor cores."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _grid(num_tiles: int, batch_heads: int) -> tuple[int]:
    """One grid axis of ``num_tiles × batch_heads`` programs (see _program_tile), for any batch × heads."""
    programs = num_tiles * batch_heads
    if programs > _MAX_PROGRAMS:
        raise ValueError(
            f"the Triton Expire-Span kernel would launch {num_tiles} tiles × {batch_heads} (batch × heads) = "
            f"{programs} programs, above the {_MAX_PROGRAMS} CUDA allows; split the batch."
        )
    return (programs,)


def _is_interpreted() -> bool:
    return not isinstance(_forward_kernel, triton.runtime.jit.JITFunction)


def _untimed(kernel_call, quantiles):
    """The autotuner's timer in Triton's interpreter: nothing runs, every configuration ties, the first is kept."""
    return [0.0 for _ in quantiles]


def _zero_position_gradients(arguments: dict, reset_only: bool = False) -> None:
    """The autotuner's hook before each timed run of the query kernel, and once after the timing: the kernel adds
    into GradPositions (atomics), so each run, and the chosen configuration's, must start from zeros."""
    if arguments.get("GradPositions") is not None:
        arguments["GradPositions"].zero_()


@functools.cache
def _autotuned(name: str, configs: tuple, interpreted: bool) -> triton.runtime.Autotuner:
    kernel = {"forward": _forward_kernel, "key": _backward_key_kernel, "query": _backward_query_kernel}[name]
    candidates = [
        triton.Config({"BLOCK_M": rows, "BLOCK_N": columns}, num_warps=warps, num_stages=stages)
        for rows, columns, warps, stages in configs
    ]
    # Timing runs each candidate several times on the real arguments: the forward and key kernels only store their
    # outputs, the query kernel's position gradients are zeroed before each run (_zero_position_gradients).
    hook = _zero_position_gradients if name == "query" else None
    return triton.autotune(
        candidates, key=["key_dim", "value_dim"], pre_hook=hook, do_bench=_untimed if interpreted else None
    )(kernel)


def _launch(name: str, kernel, arguments: tuple, options: dict, num_items: int, batch_heads: int, device) -> None:
    """Launch one kernel over ``num_items`` queries (forward, query) or keys (key) of every (batch, head).

    CPU tensors (Triton's interpreter): tiles of 16. CUDA tensors: the configurations of _launch_configs for the
    device's capability, through the autotuner when there are several — in the interpreter (e.g. recording the
    launches, see devtools.gpu_compile) nothing is timed and the first runs; compiled without a driver
    (ahead of time), the first runs directly."""
    block = "BLOCK_N" if name == "key" else "BLOCK_M"
    dtype = arguments[0].dtype
    key_dim, value_dim = arguments[0].shape[3], arguments[2].shape[3]
    options = {**options, **_head_blocks(key_dim, value_dim), "DOT_PRECISION": _dot_precision(dtype)}
    if device.type != "cuda":
        grid = _grid(triton.cdiv(num_items, _INTERPRETER_TILES[block]), batch_heads)
        kernel[grid](*arguments, **options, **_INTERPRETER_TILES)
        return
    capability = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        capability = 10 * major + minor
    configs = _launch_configs(dtype, key_dim, value_dim, capability, options["POSITIONS"] != 0)[name]
    interpreted = _is_interpreted()
    if len(configs) > 1 and (capability is not None or interpreted):
        shapes = tuple((c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]) for c in configs)
        _autotuned(name, shapes, interpreted)[lambda meta: _grid(triton.cdiv(num_items, meta[block]), batch_heads)](
            *arguments, **options
        )
        return
    config = configs[0]  # holds BLOCK_D and BLOCK_DV too
    kernel[_grid(triton.cdiv(num_items, config[block]), batch_heads)](*arguments, **{**options, **config})


def _strides(tensor: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(tensor.stride())


def _kernel_positions(query_positions, key_positions, key_valid):
    """int32 positions relative to each row's first query, clipped to ±_POSITION_LIMIT; invalid keys at _FAR."""
    if query_positions.shape[1] > 0:
        origin = query_positions.amin(dim=1, keepdim=True)
    else:
        origin = torch.zeros_like(query_positions[:, :1])
    queries = (query_positions - origin).clamp(-_POSITION_LIMIT, _POSITION_LIMIT).to(torch.int32)
    keys = (key_positions - origin).clamp(-_POSITION_LIMIT, _POSITION_LIMIT).to(torch.int32)
    if key_valid is not None:
        keys = keys.masked_fill(~key_valid, _FAR.value)
    return queries.contiguous(), keys.contiguous()


def _options(ramp, max_distance, scale, has_spans, attend_to_self=True, epsilon=0.0, positions=0,
             num_positions=0) -> dict:  # fmt: skip
    """The scalar arguments and switches shared by the three kernels."""
    # Distances between kernel positions are integers within ±2^30: t − i ≤ D ⇔ t − i ≤ ⌊D⌋, and a limit of
    # 2^30 or more never excludes a key.
    has_max_distance = max_distance is not None and max_distance < 2**30
    return {
        "scale": float(scale),
        "ramp": float(ramp),
        "inverse_ramp": 1.0 / float(ramp),
        "max_distance": int(math.floor(max_distance)) if has_max_distance else 0,
        "min_distance": 0 if attend_to_self else 1,
        "epsilon": float(epsilon),
        "num_positions": int(num_positions),
        "HAS_SPANS": has_spans,
        "HAS_MAX_DISTANCE": has_max_distance,
        "HAS_EPSILON": epsilon > 0,
        "POSITIONS": positions,
    }


def _position_terms(query, table, position_scores) -> tuple[torch.Tensor | None, int]:
    """The kernels' position input, float32 (B·H, T, W) contiguous, and its layout: the learned relative positions
    scored per query and distance, q_t · p_d (W = P), or the given per-pair scores (W = N)."""
    if table is not None:
        return (query.float() @ table.float().mT).contiguous(), _RELATIVE_POSITIONS.value
    if position_scores is not None:
        return position_scores.float().contiguous(), _PAIR_POSITIONS.value
    return None, _NO_POSITIONS.value


class _ExpireSpanAttention(torch.autograd.Function):
    """Forward and FlashAttention-2 style backward of the Triton kernels; the span gradient is summed over heads.
    The relative positions' scores q·p (B, H, T, P) are made again in the backward rather than kept."""

    @staticmethod
    def forward(ctx, query, key, value, spans, query_positions, key_positions, ramp, max_distance, scale,
                attend_to_self, epsilon, position_scores, table):  # fmt: skip
        batch_size, num_heads, num_queries, key_dim = query.shape
        num_keys, value_dim = key.shape[2], value.shape[3]
        spans_float = spans.detach().float().contiguous() if spans is not None else None
        with torch.no_grad():
            positions, layout = _position_terms(query, table, position_scores)
        output = torch.empty(batch_size, num_heads, num_queries, value_dim, dtype=query.dtype, device=query.device)
        log_sum_exp = torch.empty(batch_size, num_heads, num_queries, dtype=torch.float32, device=query.device)
        num_positions = 0 if positions is None else positions.shape[-1]
        options = _options(ramp, max_distance, scale, spans_float is not None, attend_to_self, epsilon, layout,
                           num_positions)  # fmt: skip
        if batch_size * num_heads * num_queries > 0:
            arguments = (query, key, value, spans_float, query_positions, key_positions, positions, output)
            arguments += (log_sum_exp, *_strides(query), *_strides(key), *_strides(value), *_strides(output))
            arguments += (num_heads, num_queries, num_keys, key_dim, value_dim)
            _launch("forward", _forward_kernel, arguments, options, num_queries, batch_size * num_heads, query.device)
        ctx.save_for_backward(query, key, value, spans_float, query_positions, key_positions, output, log_sum_exp,
                              position_scores, table)  # fmt: skip
        ctx.options = options
        ctx.spans_dtype = spans.dtype if spans is not None else None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, spans, query_positions, key_positions, output, log_sum_exp, position_scores, table = (
            ctx.saved_tensors
        )
        batch_size, num_heads, num_queries, key_dim = query.shape
        num_keys, value_dim = key.shape[2], value.shape[3]
        spans_need_grad = spans is not None and ctx.needs_input_grad[3]
        grad_output = grad_output.to(query.dtype)
        delta = (grad_output.float() * output.float()).sum(dim=-1).contiguous()  # D_t = Σ dO_t · O_t
        positions, _ = _position_terms(query, table, position_scores)
        grad_positions = None if positions is None else torch.zeros_like(positions)
        grad_query = torch.zeros_like(query, memory_format=torch.contiguous_format)
        grad_key = torch.zeros_like(key, memory_format=torch.contiguous_format)
        grad_value = torch.zeros_like(value, memory_format=torch.contiguous_format)
        grad_spans = None
        if spans_need_grad:
            grad_spans = torch.zeros(batch_size, num_heads, num_keys, dtype=torch.float32, device=query.device)
        inputs = (query, key, value, spans, query_positions, key_positions, positions, grad_output, log_sum_exp)
        inputs += (delta,)
        shared = (*_strides(query), *_strides(key), *_strides(value), *_strides(grad_output))
        shared += (num_heads, num_queries, num_keys, key_dim, value_dim)
        batch_heads = batch_size * num_heads
        if batch_heads * num_keys > 0 and num_queries > 0:
            arguments = (*inputs, grad_key, grad_value, grad_spans, *shared)
            options = {**ctx.options, "SPANS_NEED_GRAD": spans_need_grad}
            _launch("key", _backward_key_kernel, arguments, options, num_keys, batch_heads, query.device)
        if batch_heads * num_queries > 0 and num_keys > 0:
            arguments = (*inputs, grad_query, grad_positions, *shared)
            _launch("query", _backward_query_kernel, arguments, ctx.options, num_queries, batch_heads, query.device)
        if grad_spans is not None:
            grad_spans = grad_spans.sum(dim=1).to(ctx.spans_dtype)  # one span per key, shared by the heads
        grad_position_scores = grad_table = None
        if table is not None:  # s = scale · (q·k + q·p_d): dq += Σ_d ds_d p_d, dp_d = Σ ds_d q
            grad_query = (grad_query.float() + grad_positions @ table.float()).to(query.dtype)
            grad_table = (grad_positions.flatten(0, -2).mT @ query.float().flatten(0, -2)).to(table.dtype)
        elif position_scores is not None:
            grad_position_scores = grad_positions.to(position_scores.dtype)
        return (grad_query, grad_key, grad_value, grad_spans, None, None, None, None, None, None, None,
                grad_position_scores, grad_table)  # fmt: skip


def expire_span_attention_triton(
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
    """Expire-Span attention (paper Eqs. 4-5) with the Triton kernels. Inputs are otherwise not validated here.

    Same arguments and output as :func:`memlm.kernels.expire_attention.reference.expire_span_attention_reference`:
    ``(B, H, T, d_v)`` in the query's dtype, zeros for a query that sees no key. Differentiable with respect to
    query, key, value and spans, and with the official code's options (SPEC §8) the position scores or the
    table of relative positions (not both at once). float32, bfloat16 or float16 inputs (float32 accumulation; float32 dots are IEEE,
    or TF32 when ``torch.get_float32_matmul_precision()`` is not "highest"), widths up to 128; any strides. Positions
    within a row must lie within 2^29 of the row's first query.

    Raises:
        ValueError: for ``dropout > 0`` (use the torch backend), another dtype, a width above 128, or tensors on
            different devices.
    """
    if dropout > 0:
        raise ValueError(
            f"dropout={dropout!r}: the Triton Expire-Span kernel has no attention dropout; the torch backend "
            f"(backend='torch') supports dropout > 0."
        )
    if query.dtype not in _DTYPES:
        raise ValueError(
            f"query, key and value must be float32, bfloat16 or float16 for the Triton kernel, got {query.dtype}; "
            f"the torch backend supports other dtypes."
        )
    if max(query.shape[-1], value.shape[-1]) > _MAX_HEAD_DIM:
        raise ValueError(
            f"the Triton kernel supports key and value widths up to {_MAX_HEAD_DIM}, got {query.shape[-1]} and "
            f"{value.shape[-1]}; the torch backend has no such limit."
        )
    if position_scores is not None and relative_positions is not None:
        raise ValueError(
            "the Triton Expire-Span kernel takes position_scores or relative_positions, not both; add the relative "
            "positions' scores to position_scores (relative_position_scores) or use the torch backend."
        )
    others = {"key": key, "value": value, "spans": spans, "query_positions": query_positions}
    others |= {"key_positions": key_positions, "key_valid": key_valid, "position_scores": position_scores}
    others |= {"relative_positions": relative_positions}
    for name, tensor in others.items():
        if tensor is not None and tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}; put them on one device.")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    query_positions, key_positions = _kernel_positions(query_positions, key_positions, key_valid)
    return _ExpireSpanAttention.apply(
        query, key, value, spans, query_positions, key_positions, ramp, max_distance, scale, attend_to_self,
        renormalization_epsilon, position_scores, relative_positions,
    )  # fmt: skip
