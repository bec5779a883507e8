"""Expire-Span attention with the official code's options on the torch backend, differentiated by hand (SPEC §8).

The official model (facebookresearch/transformer-sequential) adds learned relative positions to the scores, hides
key t from query t and renormalises with an ε (see `reference.py`); no fused kernel of PyTorch takes these, so the
scores (B, H, T, N) are written out as the reference writes them. In training, the forward keeps only its inputs and
the backward computes the weights again once and differentiates them by hand (paper Eq. 4 with the official ε):

    a = softmax(s) over the visible keys,  w = m·a / (Σ m·a + ε),  o = w·V
    dw = dO·Vᵀ,  g = (dw − Σ dw·w) / (Σ m·a + ε),  da = g·m,  dm = Σ_heads g·a
    ds = a·(da − Σ a·da),  dq = scale·ds·K (+ the positions' term),  dK = scale·dsᵀ·q,  dV = wᵀ·dO
    de_i = Σ_t dm_ti / R where 0 < m_ti < 1 (Eq. 5)

so that one (query, key) tensor per step of this chain is alive at a time, for one layer and block. Tested against
the reference under autograd in float64 (tests/kernels/test_expire_attention.py).
"""

import torch

from .reference import (
    _compute_dtype,
    expire_span_attention_reference,
    expire_span_mask,
    relative_position_index,
    relative_position_scores,
    relative_position_scores_backward,
    visible_keys,
)

__all__ = ["expire_span_attention_official"]


def expire_span_attention_official(query, key, value, spans, query_positions, key_positions, *, ramp, key_valid=None,
                                   max_distance=None, scale=None, dropout=0.0, position_scores=None,
                                   attend_to_self=True, renormalization_epsilon=0.0,
                                   relative_positions=None):  # fmt: skip
    """As `expire_span_attention_reference`; with gradients (and no dropout) through `_OfficialAttention`."""
    options = dict(ramp=ramp, key_valid=key_valid, max_distance=max_distance, scale=scale, dropout=dropout,
                   position_scores=position_scores, attend_to_self=attend_to_self,
                   renormalization_epsilon=renormalization_epsilon, relative_positions=relative_positions)  # fmt: skip
    inputs = (query, key, value, spans, position_scores, relative_positions)
    if dropout > 0 or not torch.is_grad_enabled() or not any(x is not None and x.requires_grad for x in inputs):
        return expire_span_attention_reference(query, key, value, spans, query_positions, key_positions, **options)
    settings = (ramp, key_valid, max_distance, scale, attend_to_self, renormalization_epsilon)
    return _OfficialAttention.apply(settings, query_positions, key_positions, query, key, value, spans,
                                    position_scores, relative_positions)  # fmt: skip


def _weights(settings, query_positions, key_positions, query, key, spans, position_scores, table):
    """The weights w (B, H, T, N), the softmax a, the mask m (B, T, N), the denominator and what the backward needs
    of the positions, as the reference computes them."""
    ramp, key_valid, max_distance, scale, attend_to_self, epsilon = settings
    visible = visible_keys(query_positions, key_positions, key_valid, max_distance, attend_to_self)
    mask = expire_span_mask(None if spans is None else spans.detach(), query_positions, key_positions, ramp)
    mask = mask.to(query.dtype)
    if epsilon > 0:
        visible = visible & (mask > 0)  # the official softmax leaves out the keys with m = 0
    scores = query @ key.mT
    relative = None
    if table is not None:
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # (B, 1, T, N)
        relative = relative_position_index(distance, table.shape[0])
        scores = scores + relative_position_scores(table, query, relative)
    if position_scores is not None:
        scores = scores + position_scores.to(query.dtype)
    scores = scores.mul_(scale).masked_fill_(~visible[:, None], float("-inf"))
    sees = visible.any(-1, keepdim=True)[:, None]  # (B, 1, T, 1): a query that sees no key scores 0, weighs 0
    attention = torch.where(sees, scores, 0.0).softmax(dim=-1).mul_(visible[:, None])  # a
    weights = attention * mask[:, None]  # m·a
    normaliser = weights.sum(dim=-1, keepdim=True)
    denominator = normaliser + epsilon if epsilon > 0 else torch.where(normaliser > 0, normaliser, 1.0)
    return weights.div_(denominator), attention, mask, denominator, relative


class _OfficialAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, settings, query_positions, key_positions, query, key, value, spans, position_scores, table):
        dtype = _compute_dtype(query, key, value, spans)
        scale = query.shape[-1] ** -0.5 if settings[3] is None else settings[3]
        settings = (*settings[:3], scale, *settings[4:])
        with torch.no_grad():
            cast = [None if x is None else x.to(dtype) for x in (query, key, value, position_scores, table)]
            weights = _weights(settings, query_positions, key_positions, cast[0], cast[1], spans, cast[3],
                               cast[4])[0]  # fmt: skip
            output = (weights @ cast[2]).to(query.dtype)
        ctx.settings, ctx.dtype = settings, dtype
        ctx.save_for_backward(query_positions, key_positions, query, key, value, spans, position_scores, table)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query_positions, key_positions, query, key, value, spans, position_scores, table = ctx.saved_tensors
        settings, dtype = ctx.settings, ctx.dtype
        ramp, scale = settings[0], settings[3]
        inputs = [None if x is None else x.detach().to(dtype) for x in (query, key, value, position_scores, table)]
        q, k, v, scores_in, table_in = inputs
        weights, attention, mask, denominator, relative = _weights(
            settings, query_positions, key_positions, q, k, spans, scores_in, table_in
        )
        grad_output = grad_output.to(dtype)
        grad_value = weights.mT @ grad_output
        grad_weights = grad_output @ v.mT  # dw
        grad_masked = (grad_weights - (grad_weights * weights).sum(-1, keepdim=True)).div_(denominator)  # g
        del weights, grad_weights
        grad_attention = grad_masked * mask[:, None]  # da = g·m
        grad_mask = (grad_masked * attention).sum(1) if spans is not None and ctx.needs_input_grad[6] else None
        del grad_masked
        grad_scores = attention * (grad_attention - (attention * grad_attention).sum(-1, keepdim=True))  # ds
        del attention, grad_attention
        grad_scores.mul_(scale)  # d(q·k + position terms)
        grad_query = grad_scores @ k
        grad_key = grad_scores.mT @ q
        grad_table = None
        if table is not None:
            grad_positions, grad_table = relative_position_scores_backward(table_in, q, relative, grad_scores)
            grad_query, grad_table = grad_query + grad_positions, grad_table.to(table.dtype)
        grad_spans = None
        if grad_mask is not None:  # Eq. 5: ∂m/∂e = 1/R strictly inside the ramp
            on_ramp = (mask > 0) & (mask < 1)
            grad_spans = (torch.where(on_ramp, grad_mask, 0.0).sum(1) / ramp).to(spans.dtype)
        grad_position_scores = None if position_scores is None else grad_scores.to(position_scores.dtype)
        return (None, None, None, grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
                grad_spans, grad_position_scores, grad_table)  # fmt: skip
