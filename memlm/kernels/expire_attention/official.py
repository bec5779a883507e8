"""Expire-Span attention with the official code's options on the torch backend, differentiated by hand (SPEC §8).

The official model (facebookresearch/transformer-sequential) adds learned relative positions to the scores, hides
key t from query t and renormalises with an ε (see `reference.py`); no fused kernel of PyTorch takes these, so the
scores (B, H, T, N) are written out, in as few passes over them as the arithmetic allows. With s the scaled scores
(positions included) and m the soft mask (Eq. 5), the official weights (Eq. 4 with its ε; its softmax runs over the
keys with m > 0) are

    w_i = m_i e^{s_i} / (Σ_j m_j e^{s_j} + ε Σ_{j: m_j > 0} e^{s_j}) = w¹_i / (1 + ε Σ_j w¹_j / m_j),
    w¹ = softmax(s + log m),  log 0 = −inf (hidden keys too),

or, as the official code computes them (and a decoding step does), w_i = m_i p_i / (Σ_j m_j p_j + ε) with p the
softmax of s over the keys with m > 0. So a forward is one product q·kᵀ accumulated onto the bias log m (+ the
positions' term), one softmax and, with ε, one weighted sum. In training the forward keeps its inputs and output;
the backward computes w again and, with g_i = dO·v_i, G = Σ_j w_j g_j = dO·o (no pass over the pairs) and
u_i = w_i / m_i,

    ds_i = w_i (g_i − G) − ε G u_i,   dm_i = Σ_heads u_i (g_i − G),   dq = scale·ds·K (+ positions),
    dK = scale·dsᵀ·q,   dV = wᵀ·dO,   de_i = Σ_t dm_ti / R where 0 < m_ti < 1 (Eq. 5)

so that one (query, key) tensor per step of this chain is alive at a time, for one layer and block. With
`keep_weights` the forward keeps w too and the backward skips building it again (the caller decides when that memory
is worth it). The positions' term is built only in the key columns where some pair is 1..P apart (`_position_band`).
Tested against the reference under autograd in float64 (tests/kernels/test_expire_attention.py).
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from memlm.kernels import in_dtype, sums_are_finite

from .reference import _compute_dtype, expire_span_attention_reference, visible_keys
from .sdpa import log_clamped

__all__ = ["expire_span_attention_official", "expire_span_attention_official_decoding", "padded_position_table"]

# A decoding step adds the positions' rows to the keys (k_i + p_{t−i}: one gather, one add over the keys) while a
# row's keys hold at most this many numbers (H · N · d), and multiplies the table by the query beyond (q·[0; table; 0]ᵀ,
# gathered at each key's row). One call on a 2-core CPU, 4 heads of 64: the first took 16 % less time at 100–150 keys,
# 5 % less at 600, 6 % more at 1,100 (the limit: 512 such keys).
FOLDED_POSITIONS_LIMIT = 2**17


def expire_span_attention_official(query, key, value, spans, query_positions, key_positions, *, ramp, key_valid=None,
                                   max_distance=None, scale=None, dropout=0.0, position_scores=None,
                                   attend_to_self=True, renormalization_epsilon=0.0, relative_positions=None,
                                   keep_weights=False):  # fmt: skip
    """As `expire_span_attention_reference` (which runs attention dropout); with gradients through
    `_OfficialAttention`, which keeps the weights (B, H, T, N) for the backward with `keep_weights` (else computes
    them again there)."""
    if dropout > 0:
        options = dict(ramp=ramp, key_valid=key_valid, max_distance=max_distance, scale=scale, dropout=dropout,
                       position_scores=position_scores, attend_to_self=attend_to_self,
                       renormalization_epsilon=renormalization_epsilon, relative_positions=relative_positions)  # fmt: skip
        return expire_span_attention_reference(query, key, value, spans, query_positions, key_positions, **options)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    settings = (ramp, key_valid, max_distance, scale, attend_to_self, renormalization_epsilon)
    inputs = (query, key, value, spans, position_scores, relative_positions)
    if not torch.is_grad_enabled() or not any(x is not None and x.requires_grad for x in inputs):
        dtype = _compute_dtype(query, key, value, spans)
        cast = [None if x is None else x.to(dtype) for x in (query, key, value, position_scores, relative_positions)]
        pairs = _pair_terms(settings, query_positions, key_positions, spans, dtype, relative_positions, False)
        weights = _weights(settings, pairs, cast[0], cast[1], cast[3], _extended(cast[4]))
        return (weights @ cast[2]).to(query.dtype)
    return _OfficialAttention.apply(settings, keep_weights, query_positions, key_positions, query, key, value, spans,
                                    position_scores, relative_positions)  # fmt: skip


def padded_position_table(table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[0; table; 0] (P + 2, d) in `dtype` for `expire_span_attention_official_decoding`: row d holds p_d for the
    distances d = 1..P, and a zero row stands for the token itself (d = 0) and for every key farther than P, so that a
    key's positions term is row min(t − i, P + 1). The layers share the table: a decoding step pads it once."""
    zero = table.new_zeros(1, table.shape[1], dtype=dtype)
    return torch.cat([zero, in_dtype(table, dtype), zero])


def expire_span_attention_official_decoding(query, key, value, spans, distance, key_valid, ramp: float, table=None,
                                            attend_to_self=True, renormalization_epsilon=0.0, padded_table=None):  # fmt: skip
    """A decoding step's attention with the official options, without gradients: one query t per row, after every key
    (``distance`` t − i >= 0, (B, N)), the token's own key the only one at distance 0, no distance limit; `key_valid`
    None when every key is valid; `table` the learned relative positions (P, d) or None, `padded_table` the table as
    `padded_position_table` pads it (padded here when not given, or not in the compute dtype).
    `expire_span_attention_official`'s weights (see the module docstring) for that query in fewer passes: no (T, N)
    pair terms, no band search, no 1/m (with ε, m weighs the softmax after). Returns the output and the soft mask m
    (B, N) it attended with (Eq. 5; 0 at a hidden key: invalid, or the token's own without `attend_to_self`), for the
    caller to count the reads; None when the output is not finite (a hidden key's NaN reaches it, or no key is
    visible): the caller then takes `expire_span_attention`."""
    dtype, output_dtype = _compute_dtype(query, key, value, spans), query.dtype
    query, key, value = (in_dtype(tensor, dtype) for tensor in (query, key, value))
    batch_size, num_heads, _, head_dim = query.shape
    scale = head_dim**-0.5
    ramp_position = (in_dtype(spans, dtype) - distance).div_(ramp).add_(1)  # 1 + (e_i − (t − i)) / R
    mask = (ramp_position if key_valid is None else torch.where(key_valid, ramp_position, 0)).clamp_(0, 1)  # Eq. 5
    if not attend_to_self:
        mask.masked_fill_(distance == 0, 0)  # the token's own key, hidden
    # With ε the softmax runs over the visible keys (bias 0, −inf where m = 0: log ⌈m⌉) and m weighs it after, as the
    # official code computes it; without ε, log m in the bias gives the weights at once.
    epsilon = renormalization_epsilon
    bias = (mask.ceil() if epsilon > 0 else mask).log()[:, None, None]  # (B, 1, 1, N), log 0 = −inf
    shape = (batch_size, num_heads, 1, key.shape[2])
    scores = None
    if table is not None:  # q_t · p_{t−i} for t − i in 1..P, 0 for the token itself and farther
        if padded_table is None or padded_table.dtype != dtype:
            padded_table = padded_position_table(table, dtype)
        rows = padded_table.shape[0]
        if key[0].numel() <= FOLDED_POSITIONS_LIMIT:  # few keys: q·(k_i + p_{t−i}), in the scores' one product
            key = key + F.embedding(distance.clamp(max=rows - 1), padded_table)[:, None]
        else:  # q·[0; table; 0]ᵀ gathered at each key's row
            if distance.device.type == "cpu" and distance.numel():  # where reading a number costs no wait: the rows
                rows = min(rows, int(distance.max()) + 1)  # up to the farthest key's (not all P + 2)
            row = distance.clamp(max=rows - 1)[:, None, None].expand(shape)
            scores = torch.add(bias, (query @ padded_table[:rows].mT).gather(-1, row), alpha=scale)
    query, key = query.flatten(0, 1), key.flatten(0, 1).mT
    if scores is None:  # the bias broadcast over the heads as the product's first term
        scores = torch.baddbmm(bias.expand(shape).reshape(-1, 1, shape[-1]), query, key, alpha=scale)
    else:
        scores = scores.view(-1, 1, shape[-1]).baddbmm_(query, key, alpha=scale)
    weights = torch.ops.aten._softmax.out(scores, -1, False, out=scores).view(shape)
    if epsilon > 0:  # w = m·p / (Σ_j m_j p_j + ε), p the softmax over the visible keys (see the module docstring)
        weights = weights.mul_(mask[:, None, None])
        output = (weights @ value).div_(weights.sum(-1, keepdim=True).add_(epsilon))
    else:  # w = softmax(s + log m)
        output = weights @ value
    return (in_dtype(output, output_dtype), mask) if sums_are_finite(output) else None


class _PositionBand(NamedTuple):
    """The key columns [start, stop) that hold every pair at a distance 1..P from its query, and the row of
    [table; 0] each of their pairs reads, (B, 1, T, stop − start): the positions' term is 0 outside them."""

    start: int
    stop: int
    row: torch.Tensor


class _PairTerms(NamedTuple):
    """What the heads share per (query, key) pair, (B, 1, T, N) each: the bias log m (−inf where the key is hidden
    or m = 0), 1/m where the bias is finite (0 elsewhere; None when neither ε
    nor a span gradient needs it), whether 0 < m < 1 (for the span gradient, else None), the columns the positions'
    term reaches (None without a table, or when no pair is near enough), and which queries see a key at all
    ((B, 1, T, 1), None when all do). A forward that keeps the weights keeps these too, without the bias."""

    bias: torch.Tensor | None
    inverse: torch.Tensor | None
    on_ramp: torch.Tensor | None
    band: _PositionBand | None
    sees: torch.Tensor | None


_BAND_QUERIES = 16  # from this many queries on, the positions' term is built in its band of key columns only


def _position_band(query_positions, key_positions, count) -> _PositionBand | None:
    """The `_PositionBand` of a table of `count` positions: a key i of row b is in it when some query t of the row has
    1 ≤ t − i ≤ count, i.e. max t − i ≥ 1 and min t − i ≤ count (keys sorted by position make it the last ~T + P
    columns, whatever the window). A few queries (decoding) take every column: the search would cost more than it
    saves."""
    start, stop = 0, key_positions.shape[1]
    if query_positions.shape[1] >= _BAND_QUERIES:
        first = query_positions.amin(1, keepdim=True)
        last = query_positions.amax(1, keepdim=True)
        near = ((last - key_positions >= 1) & (first - key_positions <= count)).any(0).nonzero().flatten()
        if near.numel() == 0:
            return None
        start, stop = near[0].item(), near[-1].item() + 1
    row = (query_positions[:, None, :, None] - key_positions[:, None, None, start:stop]).sub_(1)  # d − 1
    return _PositionBand(start, stop, row.masked_fill_((row < 0) | (row >= count), count))  # row P scores 0


def _pair_terms(settings, query_positions, key_positions, spans, dtype, table, span_gradient) -> _PairTerms:
    ramp, key_valid, max_distance, _, attend_to_self, epsilon = settings
    visible = visible_keys(query_positions, key_positions, key_valid, max_distance, attend_to_self)[:, None]
    inverse = on_ramp = None
    if spans is None:
        bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, -math.inf)
        if epsilon > 0:
            inverse = visible.to(dtype)
    else:
        # m = clamp(1 + (e_i − (t − i)) / R, 0, 1) (Eq. 5), positions taken from each row's first query so that the
        # float terms stay small.
        origin = query_positions.amin(dim=1, keepdim=True)
        key_term = (spans.detach().to(dtype) + (key_positions - origin)).div_(ramp).add_(1)
        query_term = (query_positions - origin).to(dtype).div_(ramp)
        mask = (key_term[:, None, None, :] - query_term[:, None, :, None]).clamp_(0, 1)  # (B, 1, T, N)
        if span_gradient:
            on_ramp = (mask > 0) & (mask < 1)
        visible = visible & (mask > 0)  # a key with m = 0 has weight 0, and the official softmax leaves it out
        if epsilon > 0 or span_gradient:
            inverse = torch.where(visible, mask.reciprocal(), 0.0)
        bias = log_clamped(mask, ~visible)
    sees = visible.any(-1, keepdim=True)
    if bool(sees.all()):
        sees = None
    else:  # a row of −inf would make the softmax NaN: score it 0 and zero its weights afterwards
        bias = torch.where(sees, bias, 0.0)
    band = None if table is None else _position_band(query_positions, key_positions, table.shape[0])
    return _PairTerms(bias, inverse, on_ramp, band, sees)


def _extended(table):
    """[table; 0]: (P + 1, d), the last row read by the pairs at distances outside 1..P."""
    return None if table is None else torch.cat([table, table.new_zeros(1, table.shape[1])])


def _weights(settings, pairs: _PairTerms, query, key, position_scores, table) -> torch.Tensor:
    """The official weights w (B, H, T, N) (see the module docstring)."""
    scale, epsilon = settings[3], settings[5]
    batch_size, num_heads, length, _ = query.shape
    shape = (batch_size, num_heads, length, key.shape[2])
    if position_scores is not None:
        scores = torch.add(pairs.bias, position_scores, alpha=scale)
    else:
        scores = pairs.bias.expand(shape).contiguous()
    band = pairs.band
    if band is not None:  # the positions' term q_t · p_{t−i}, gathered from q·[table; 0]ᵀ, in the columns it reaches
        terms = (query @ table.mT).gather(-1, band.row.expand(*shape[:3], band.stop - band.start))
        scores[..., band.start : band.stop].add_(terms, alpha=scale)
    scores = scores.view(-1, length, shape[-1]).baddbmm_(query.flatten(0, 1), key.flatten(0, 1).mT, alpha=scale)
    weights = torch.ops.aten._softmax.out(scores, -1, False, out=scores).view(shape)  # w¹ = softmax(s + log m)
    if epsilon > 0:
        weights /= torch.linalg.vecdot(weights, pairs.inverse).unsqueeze(-1).mul_(epsilon).add_(1)
    if pairs.sees is not None:
        weights.mul_(pairs.sees)
    return weights


class _OfficialAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, settings, keep_weights, query_positions, key_positions, query, key, value, spans,
                position_scores, table):  # fmt: skip
        dtype = _compute_dtype(query, key, value, spans)
        # With the weights kept, so are the pair terms their backward reads (1/m, the ramp, the positions' band).
        span_gradient = keep_weights and spans is not None and spans.requires_grad
        with torch.no_grad():
            cast = [None if x is None else x.to(dtype) for x in (query, key, value, position_scores, table)]
            pairs = _pair_terms(settings, query_positions, key_positions, spans, dtype, table, span_gradient)
            weights = _weights(settings, pairs, cast[0], cast[1], cast[3], _extended(cast[4]))
            output = weights @ cast[2]
        ctx.settings, ctx.dtype = (*settings[:1], None, *settings[2:]), dtype  # the validity is saved, checked
        ctx.pairs = pairs._replace(bias=None, sees=None) if keep_weights else None
        ctx.save_for_backward(query_positions, key_positions, settings[1], query, key, value, spans, position_scores,
                              table, output, weights if keep_weights else None)  # fmt: skip
        return output.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        query_positions, key_positions, key_valid, query, key, value, spans, position_scores, table, output, kept = (
            ctx.saved_tensors
        )
        settings, dtype = (*ctx.settings[:1], key_valid, *ctx.settings[2:]), ctx.dtype
        ramp, scale, epsilon = settings[0], settings[3], settings[5]
        span_gradient = spans is not None and ctx.needs_input_grad[7]
        q, k, v, scores_in, table_in = (
            None if x is None else x.detach().to(dtype) for x in (query, key, value, position_scores, table)
        )
        extended = _extended(table_in)
        if kept is None:
            pairs = _pair_terms(settings, query_positions, key_positions, spans, dtype, table, span_gradient)
            weights = _weights(settings, pairs, q, k, scores_in, extended)
        else:
            pairs, weights = ctx.pairs, kept
        grad_output = grad_output.to(dtype)
        grad_value = weights.mT @ grad_output
        total = torch.linalg.vecdot(grad_output, output).unsqueeze(-1)  # G = Σ_j w_j g_j = dO·o
        grad_scores = (grad_output @ v.mT).sub_(total)  # g − G
        if epsilon > 0:  # − ε G / m
            grad_scores.addcmul_(pairs.inverse, total, value=-epsilon)
        grad_scores.mul_(weights)  # ds = w (g − G) − ε G u
        grad_spans = None
        if span_gradient:  # dm = Σ_heads u (g − G) = (Σ_heads ds + ε Σ_heads G w) / m; Eq. 5: ∂m/∂e = 1/R on the ramp
            by_pair = grad_scores.sum(1, keepdim=True)
            if epsilon > 0:
                weighted = weights[:, :1] * total[:, :1]  # Σ_heads G w, head by head: no (B, H, T, N) product
                for head in range(1, weights.shape[1]):
                    weighted.addcmul_(weights[:, head : head + 1], total[:, head : head + 1])
                by_pair.addcmul_(weighted, pairs.inverse, value=epsilon)
            grad_mask = by_pair.mul_(pairs.inverse).masked_fill_(~pairs.on_ramp, 0.0)
            grad_spans = (grad_mask.sum((1, 2)) / ramp).to(spans.dtype)
        del weights
        grad_query = (grad_scores @ k).mul_(scale)  # d(q·k + position terms) = scale · ds
        grad_key = (grad_scores.mT @ q).mul_(scale)
        grad_table = None
        if pairs.band is not None:  # the positions' term, from the columns it reaches
            band = pairs.band
            grad_band = grad_scores[..., band.start : band.stop]
            by_distance = grad_scores.new_zeros(*grad_scores.shape[:-1], extended.shape[0])
            by_distance.scatter_add_(-1, band.row.expand(grad_band.shape), grad_band)
            by_distance = by_distance[..., :-1].mul_(scale)
            grad_query += by_distance @ table_in
            grad_table = (by_distance.flatten(0, -2).mT @ q.flatten(0, -2)).to(table.dtype)
        elif table is not None:
            grad_table = torch.zeros_like(table)
        grad_position_scores = None
        if position_scores is not None:
            grad_position_scores = (grad_scores * scale).to(position_scores.dtype)
        return (None, None, None, None, grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
                grad_spans, grad_position_scores, grad_table)  # fmt: skip
