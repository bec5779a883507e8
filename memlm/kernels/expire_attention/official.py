"""Expire-Span attention with the official code's options on the torch backend, differentiated by hand (SPEC §8).

The official model (facebookresearch/transformer-sequential) adds learned relative positions to the scores, hides
key t from query t and renormalises with an ε (see `reference.py`); no fused kernel of PyTorch takes these, so the
scores (B, H, T, N) are written out, in as few passes over them as the arithmetic allows. With s the scaled scores
(positions included) and m the soft mask (Eq. 5), the official weights (Eq. 4 with its ε; its softmax runs over the
keys with m > 0) are

    w_i = m_i e^{s_i} / (Σ_j m_j e^{s_j} + ε Σ_{j: m_j > 0} e^{s_j}) = w¹_i / (1 + ε Σ_j w¹_j / m_j),
    w¹ = softmax(s + log m),  log 0 = −inf (hidden keys too),

or, as the official code computes them, w_i = m_i p_i / (Σ_j m_j p_j + ε) with p the softmax of s over the keys with
m > 0 (a decoding step's one query takes a third form, one fused call: `one_query.py`). So a forward is one product
q·kᵀ accumulated onto the bias log m (+ the positions' term), one softmax and, with ε, one weighted sum. In training the forward keeps its inputs and
output; the backward computes w again and, with g_i = dO·v_i, G = Σ_j w_j g_j = dO·o (no pass over the pairs) and
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

from .reference import _compute_dtype, expire_span_attention_reference, visible_keys
from .sdpa import log_clamped

__all__ = ["expire_span_attention_official"]


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
