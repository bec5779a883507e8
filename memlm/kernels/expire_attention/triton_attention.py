"""Expire-Span attention as a FlashAttention-style Triton kernel, forward and backward (SPEC §2, §5).

Sukhbaatar et al. (2021), *Not All Memories are Created Equal: Learning to Forget by Expiring*, Sec. 4.1. The
masked, renormalised weights of Eq. 4 with the soft mask of Eq. 5::

    m_ti = clamp(1 + r_ti / R, 0, 1),  r_ti = e_i − (t − i)
    a'_ti = m_ti e^{s_ti} / Σ_j m_tj e^{s_tj} = softmax_i(s_ti + log m_ti)

are computed tile by tile with an online softmax (Dao et al., FlashAttention-2): no (T, N) tensor is ever formed.
The mask comes from the spans and positions inside the kernel, as a factor ``m`` on ``e^{s − max}`` (so no
logarithm), and a key tile that no query of the tile can see — every key in the future, too far, an empty slot,
or expired (``max_i r_ti ≤ −R`` at the tile's earliest query) — is skipped after reading only its positions and
spans. The backward recomputes the weights from the saved log-sum-exp ``L_t = log Σ_j m_tj e^{s_tj}``:

    dS_ti = m_ti e^{s_ti − L_t} (dP_ti − D_t),   dP = dO Vᵀ,   D_t = Σ dO_t · O_t
    de_i  = Σ_t dS_ti / (R m_ti) = Σ_t e^{s_ti − L_t} (dP_ti − D_t) / R   on the open ramp −R < r_ti < 0

with the span gradient summed over the heads (one span per key, shared by the heads).

Positions enter the kernel as int32 offsets from each row's first query; invalid key slots get a position later
than every query, which makes them invisible by causality alone. The readable definition is ``reference.py``;
the tests check this file against it.
"""

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
_MAX_HEAD_DIM = 128


@triton.jit
def _tile_is_visible(
    query_positions,
    query_in_range,
    key_positions,
    spans,
    max_distance,
    ramp,
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
):
    """Whether some (query, key) pair of the tile may be visible with m > 0, from per-tile bounds only.

    Conservative: False guarantees that every pair is invisible, in the same float32 arithmetic as _soft_mask."""
    first_query = tl.min(tl.where(query_in_range, query_positions, _FAR), axis=0)
    last_query = tl.max(tl.where(query_in_range, query_positions, -_FAR), axis=0)
    key_valid = key_positions < _FAR
    visible = tl.min(key_positions, axis=0) <= last_query  # some valid key is not in the future of every query
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
    ramp,
    inverse_ramp,
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
):
    """Per (query, key) pair of a tile: visible with m > 0, the soft mask m (Eq. 5), and on the open ramp."""
    distance = query_positions[:, None] - key_positions[None, :]  # t − i
    visible = distance >= 0
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


@triton.jit
def _forward_kernel(
    Query,
    Key,
    Value,
    Spans,
    QueryPositions,
    KeyPositions,
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
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One tile of BLOCK_M queries of one (batch, head) against every key tile, with an online softmax."""
    batch_head = tl.program_id(1)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    queries = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    query_in_range = queries < num_queries
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)

    query = tl.load(
        Query
        + batch * query_stride_batch
        + head * query_stride_head
        + queries[:, None] * query_stride_token
        + dims[None, :] * query_stride_dim,
        mask=query_in_range[:, None] & (dims[None, :] < key_dim),
        other=0.0,
    )
    query_positions = tl.load(QueryPositions + batch * num_queries + queries, mask=query_in_range, other=0)
    Key += batch * key_stride_batch + head * key_stride_head
    Value += batch * value_stride_batch + head * value_stride_head

    row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)  # max of the visible scores seen so far
    row_sum = tl.zeros([BLOCK_M], tl.float32)  # Σ_j m_tj e^{s_tj − row_max}
    accumulator = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for key_start in range(0, num_keys, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_in_range = keys < num_keys
        key_positions = tl.load(KeyPositions + batch * num_keys + keys, mask=key_in_range, other=_FAR)
        spans = tl.zeros([BLOCK_N], tl.float32)
        if HAS_SPANS:
            spans = tl.load(Spans + batch * num_keys + keys, mask=key_in_range, other=0.0)
        if _tile_is_visible(
            query_positions, query_in_range, key_positions, spans, max_distance, ramp, HAS_SPANS, HAS_MAX_DISTANCE
        ):
            key = tl.load(
                Key + keys[:, None] * key_stride_token + dims[None, :] * key_stride_dim,
                mask=key_in_range[:, None] & (dims[None, :] < key_dim),
                other=0.0,
            )
            value = tl.load(
                Value + keys[:, None] * value_stride_token + value_dims[None, :] * value_stride_dim,
                mask=key_in_range[:, None] & (value_dims[None, :] < value_dim),
                other=0.0,
            )
            visible, mask, _ = _soft_mask(
                query_positions, key_positions, spans, max_distance, ramp, inverse_ramp, HAS_SPANS, HAS_MAX_DISTANCE
            )
            scores = tl.dot(query, tl.trans(key), input_precision="ieee") * scale  # s_ti
            scores = tl.where(visible, scores, -float("inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # a row that has seen no key yet stays at 0
            weights = tl.exp(scores - shift[:, None]) * mask  # m_ti e^{s_ti − max}, Eq. 4
            rescale = tl.exp(row_max - shift)
            row_sum = row_sum * rescale + tl.sum(weights, axis=1)
            accumulator = accumulator * rescale[:, None] + tl.dot(
                weights.to(value.dtype), value, input_precision="ieee"
            )
            row_max = new_max

    # A query that sees no key with m > 0 outputs zeros, and L = +inf gives it zero weights in the backward.
    has_key = row_sum > 0
    row_sum = tl.where(has_key, row_sum, 1.0)
    output = accumulator / row_sum[:, None]
    log_sum_exp = tl.where(has_key, row_max + tl.log(row_sum), float("inf"))
    tl.store(
        Output
        + batch * output_stride_batch
        + head * output_stride_head
        + queries[:, None] * output_stride_token
        + value_dims[None, :] * output_stride_dim,
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
    HAS_SPANS: tl.constexpr,
    SPANS_NEED_GRAD: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Gradients of one tile of BLOCK_N keys of one (batch, head): key, value, and the span per head."""
    batch_head = tl.program_id(1)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    key_in_range = keys < num_keys
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    key_mask = key_in_range[:, None] & (dims[None, :] < key_dim)
    value_mask = key_in_range[:, None] & (value_dims[None, :] < value_dim)

    key = tl.load(
        Key
        + batch * key_stride_batch
        + head * key_stride_head
        + keys[:, None] * key_stride_token
        + dims[None, :] * key_stride_dim,
        mask=key_mask,
        other=0.0,
    )
    value = tl.load(
        Value
        + batch * value_stride_batch
        + head * value_stride_head
        + keys[:, None] * value_stride_token
        + value_dims[None, :] * value_stride_dim,
        mask=value_mask,
        other=0.0,
    )
    key_positions = tl.load(KeyPositions + batch * num_keys + keys, mask=key_in_range, other=_FAR)
    spans = tl.zeros([BLOCK_N], tl.float32)
    if HAS_SPANS:
        spans = tl.load(Spans + batch * num_keys + keys, mask=key_in_range, other=0.0)
    Query += batch * query_stride_batch + head * query_stride_head
    GradOutput += batch * grad_output_stride_batch + head * grad_output_stride_head
    LogSumExp += batch_head.to(tl.int64) * num_queries
    Delta += batch_head.to(tl.int64) * num_queries

    grad_key = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    grad_value = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    grad_spans = tl.zeros([BLOCK_N], tl.float32)
    for query_start in range(0, num_queries, BLOCK_M):
        queries = query_start + tl.arange(0, BLOCK_M)
        query_in_range = queries < num_queries
        query_positions = tl.load(QueryPositions + batch * num_queries + queries, mask=query_in_range, other=0)
        if _tile_is_visible(
            query_positions, query_in_range, key_positions, spans, max_distance, ramp, HAS_SPANS, HAS_MAX_DISTANCE
        ):
            query = tl.load(
                Query + queries[:, None] * query_stride_token + dims[None, :] * query_stride_dim,
                mask=query_in_range[:, None] & (dims[None, :] < key_dim),
                other=0.0,
            )
            grad_output = tl.load(
                GradOutput
                + queries[:, None] * grad_output_stride_token
                + value_dims[None, :] * grad_output_stride_dim,
                mask=query_in_range[:, None] & (value_dims[None, :] < value_dim),
                other=0.0,
            )
            log_sum_exp = tl.load(LogSumExp + queries, mask=query_in_range, other=float("inf"))
            delta = tl.load(Delta + queries, mask=query_in_range, other=0.0)
            visible, mask, on_ramp = _soft_mask(
                query_positions, key_positions, spans, max_distance, ramp, inverse_ramp, HAS_SPANS, HAS_MAX_DISTANCE
            )
            scores = tl.dot(query, tl.trans(key), input_precision="ieee") * scale
            # a'_ti / m_ti = e^{s_ti − L_t}, bounded by 1 / m_ti; 0 for an invisible pair or a query with no key.
            unmasked = tl.exp(tl.where(visible, scores, -float("inf")) - log_sum_exp[:, None])
            weights = unmasked * mask  # a'_ti
            grad_value += tl.dot(tl.trans(weights.to(grad_output.dtype)), grad_output, input_precision="ieee")
            grad_weights = tl.dot(grad_output, tl.trans(value), input_precision="ieee")  # dP
            grad_unmasked = unmasked * (grad_weights - delta[:, None])  # dS / m
            grad_scores = grad_unmasked * mask  # dS, the gradient of s + log m
            grad_key += tl.dot(tl.trans(grad_scores.to(query.dtype)), query, input_precision="ieee")
            if SPANS_NEED_GRAD:
                # ∂ log m / ∂e = 1 / (R m) on the open ramp (Eq. 5), 0 elsewhere.
                grad_spans += tl.sum(tl.where(on_ramp, grad_unmasked, 0.0), axis=0)

    # Gradients are stored contiguously in (batch, head, key, width) / (batch, head, key).
    tl.store(
        GradKey + (batch_head.to(tl.int64) * num_keys + keys[:, None]) * key_dim + dims[None, :],
        (grad_key * scale).to(GradKey.dtype.element_ty),
        mask=key_mask,
    )
    tl.store(
        GradValue + (batch_head.to(tl.int64) * num_keys + keys[:, None]) * value_dim + value_dims[None, :],
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
    GradOutput,
    LogSumExp,
    Delta,
    GradQuery,
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
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Gradient of one tile of BLOCK_M queries of one (batch, head), looping over the key tiles."""
    batch_head = tl.program_id(1)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    queries = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    query_in_range = queries < num_queries
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    query_mask = query_in_range[:, None] & (dims[None, :] < key_dim)

    query = tl.load(
        Query
        + batch * query_stride_batch
        + head * query_stride_head
        + queries[:, None] * query_stride_token
        + dims[None, :] * query_stride_dim,
        mask=query_mask,
        other=0.0,
    )
    grad_output = tl.load(
        GradOutput
        + batch * grad_output_stride_batch
        + head * grad_output_stride_head
        + queries[:, None] * grad_output_stride_token
        + value_dims[None, :] * grad_output_stride_dim,
        mask=query_in_range[:, None] & (value_dims[None, :] < value_dim),
        other=0.0,
    )
    query_positions = tl.load(QueryPositions + batch * num_queries + queries, mask=query_in_range, other=0)
    log_sum_exp = tl.load(
        LogSumExp + batch_head.to(tl.int64) * num_queries + queries, mask=query_in_range, other=float("inf")
    )
    delta = tl.load(Delta + batch_head.to(tl.int64) * num_queries + queries, mask=query_in_range, other=0.0)
    Key += batch * key_stride_batch + head * key_stride_head
    Value += batch * value_stride_batch + head * value_stride_head

    grad_query = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for key_start in range(0, num_keys, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_in_range = keys < num_keys
        key_positions = tl.load(KeyPositions + batch * num_keys + keys, mask=key_in_range, other=_FAR)
        spans = tl.zeros([BLOCK_N], tl.float32)
        if HAS_SPANS:
            spans = tl.load(Spans + batch * num_keys + keys, mask=key_in_range, other=0.0)
        if _tile_is_visible(
            query_positions, query_in_range, key_positions, spans, max_distance, ramp, HAS_SPANS, HAS_MAX_DISTANCE
        ):
            key = tl.load(
                Key + keys[:, None] * key_stride_token + dims[None, :] * key_stride_dim,
                mask=key_in_range[:, None] & (dims[None, :] < key_dim),
                other=0.0,
            )
            value = tl.load(
                Value + keys[:, None] * value_stride_token + value_dims[None, :] * value_stride_dim,
                mask=key_in_range[:, None] & (value_dims[None, :] < value_dim),
                other=0.0,
            )
            visible, mask, _ = _soft_mask(
                query_positions, key_positions, spans, max_distance, ramp, inverse_ramp, HAS_SPANS, HAS_MAX_DISTANCE
            )
            scores = tl.dot(query, tl.trans(key), input_precision="ieee") * scale
            unmasked = tl.exp(tl.where(visible, scores, -float("inf")) - log_sum_exp[:, None])
            grad_weights = tl.dot(grad_output, tl.trans(value), input_precision="ieee")
            grad_scores = unmasked * mask * (grad_weights - delta[:, None])
            grad_query += tl.dot(grad_scores.to(key.dtype), key, input_precision="ieee")

    tl.store(
        GradQuery + (batch_head.to(tl.int64) * num_queries + queries[:, None]) * key_dim + dims[None, :],
        (grad_query * scale).to(GradQuery.dtype.element_ty),
        mask=query_mask,
    )


def _tiles(dtype: torch.dtype, device: torch.device, key_dim: int, value_dim: int) -> dict:
    """Tile sizes and launch options of the forward, key-gradient and query-gradient kernels.

    Small tiles in the interpreter (CPU), so that tests cross tiles. On CUDA, tiles that compile for sm_90
    without register spills (checked with ptxas, not yet timed); float32 (exact, no tensor cores) takes smaller
    ones."""
    widths = {
        "BLOCK_D": max(16, triton.next_power_of_2(key_dim)),
        "BLOCK_DV": max(16, triton.next_power_of_2(value_dim)),
    }
    if device.type != "cuda":
        small = {"BLOCK_M": 16, "BLOCK_N": 16, **widths}
        return {"forward": small, "key": small, "query": small}
    if dtype == torch.float32:
        shapes = {"forward": (32, 32, 8), "key": (16, 32, 8), "query": (32, 16, 8)}
    elif max(key_dim, value_dim) <= 64:
        shapes = {"forward": (128, 64, 8), "key": (32, 64, 8), "query": (64, 32, 4)}
    else:
        shapes = {"forward": (64, 64, 8), "key": (32, 64, 8), "query": (64, 32, 8)}
    return {
        kernel: {"BLOCK_M": rows, "BLOCK_N": columns, "num_warps": warps, "num_stages": 2, **widths}
        for kernel, (rows, columns, warps) in shapes.items()
    }


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


def _options(ramp, max_distance, scale, has_spans) -> dict:
    """The scalar arguments and switches shared by the three kernels."""
    # Distances between kernel positions are integers within ±2^30: t − i ≤ D ⇔ t − i ≤ ⌊D⌋, and a limit of
    # 2^30 or more never excludes a key.
    has_max_distance = max_distance is not None and max_distance < 2**30
    return {
        "scale": float(scale),
        "ramp": float(ramp),
        "inverse_ramp": 1.0 / float(ramp),
        "max_distance": int(math.floor(max_distance)) if has_max_distance else 0,
        "HAS_SPANS": has_spans,
        "HAS_MAX_DISTANCE": has_max_distance,
    }


class _ExpireSpanAttention(torch.autograd.Function):
    """Forward and FlashAttention-2 style backward of the Triton kernels; the span gradient is summed over heads."""

    @staticmethod
    def forward(ctx, query, key, value, spans, query_positions, key_positions, ramp, max_distance, scale):
        batch_size, num_heads, num_queries, key_dim = query.shape
        num_keys, value_dim = key.shape[2], value.shape[3]
        spans_float = spans.detach().float().contiguous() if spans is not None else None
        output = torch.empty(batch_size, num_heads, num_queries, value_dim, dtype=query.dtype, device=query.device)
        log_sum_exp = torch.empty(batch_size, num_heads, num_queries, dtype=torch.float32, device=query.device)
        options = _options(ramp, max_distance, scale, spans_float is not None)
        tiles = _tiles(query.dtype, query.device, key_dim, value_dim)["forward"]
        grid = (triton.cdiv(num_queries, tiles["BLOCK_M"]), batch_size * num_heads)
        if grid[0] * grid[1] > 0:
            _forward_kernel[grid](
                query,
                key,
                value,
                spans_float,
                query_positions,
                key_positions,
                output,
                log_sum_exp,
                *_strides(query),
                *_strides(key),
                *_strides(value),
                *_strides(output),
                num_heads,
                num_queries,
                num_keys,
                key_dim,
                value_dim,
                **options,
                **tiles,
            )
        ctx.save_for_backward(query, key, value, spans_float, query_positions, key_positions, output, log_sum_exp)
        ctx.options = options
        ctx.spans_dtype = spans.dtype if spans is not None else None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, spans, query_positions, key_positions, output, log_sum_exp = ctx.saved_tensors
        batch_size, num_heads, num_queries, key_dim = query.shape
        num_keys, value_dim = key.shape[2], value.shape[3]
        spans_need_grad = spans is not None and ctx.needs_input_grad[3]
        grad_output = grad_output.to(query.dtype)
        delta = (grad_output.float() * output.float()).sum(dim=-1).contiguous()  # D_t = Σ dO_t · O_t
        grad_query = torch.zeros_like(query, memory_format=torch.contiguous_format)
        grad_key = torch.zeros_like(key, memory_format=torch.contiguous_format)
        grad_value = torch.zeros_like(value, memory_format=torch.contiguous_format)
        grad_spans = None
        if spans_need_grad:
            grad_spans = torch.zeros(batch_size, num_heads, num_keys, dtype=torch.float32, device=query.device)
        tiles = _tiles(query.dtype, query.device, key_dim, value_dim)
        shared = (
            *_strides(query),
            *_strides(key),
            *_strides(value),
            *_strides(grad_output),
            num_heads,
            num_queries,
            num_keys,
            key_dim,
            value_dim,
        )
        key_grid = (triton.cdiv(num_keys, tiles["key"]["BLOCK_N"]), batch_size * num_heads)
        if key_grid[0] * key_grid[1] > 0 and num_queries > 0:
            _backward_key_kernel[key_grid](
                query,
                key,
                value,
                spans,
                query_positions,
                key_positions,
                grad_output,
                log_sum_exp,
                delta,
                grad_key,
                grad_value,
                grad_spans,
                *shared,
                **ctx.options,
                SPANS_NEED_GRAD=spans_need_grad,
                **tiles["key"],
            )
        query_grid = (triton.cdiv(num_queries, tiles["query"]["BLOCK_M"]), batch_size * num_heads)
        if query_grid[0] * query_grid[1] > 0 and num_keys > 0:
            _backward_query_kernel[query_grid](
                query,
                key,
                value,
                spans,
                query_positions,
                key_positions,
                grad_output,
                log_sum_exp,
                delta,
                grad_query,
                *shared,
                **ctx.options,
                **tiles["query"],
            )
        if grad_spans is not None:
            grad_spans = grad_spans.sum(dim=1).to(ctx.spans_dtype)  # one span per key, shared by the heads
        return grad_query, grad_key, grad_value, grad_spans, None, None, None, None, None


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
) -> torch.Tensor:
    """Expire-Span attention (paper Eqs. 4-5) with the Triton kernels. Inputs are otherwise not validated here.

    Same arguments and output as :func:`memlm.kernels.expire_attention.reference.expire_span_attention_reference`:
    ``(B, H, T, d_v)`` in the query's dtype, zeros for a query that sees no key. Differentiable with respect to
    query, key, value and spans. float32, bfloat16 or float16 inputs (float32 accumulation), widths up to 128;
    any strides. Positions within a row must lie within 2^29 of the row's first query.

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
    others = {"key": key, "value": value, "spans": spans, "query_positions": query_positions}
    others |= {"key_positions": key_positions, "key_valid": key_valid}
    for name, tensor in others.items():
        if tensor is not None and tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}; put them on one device.")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    query_positions, key_positions = _kernel_positions(query_positions, key_positions, key_valid)
    return _ExpireSpanAttention.apply(
        query, key, value, spans, query_positions, key_positions, ramp, max_distance, scale
    )
