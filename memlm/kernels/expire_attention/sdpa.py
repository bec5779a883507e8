"""Expire-Span attention through PyTorch's fused ``scaled_dot_product_attention`` (SPEC §2).

The masked, renormalised weights of paper Eq. 4 are a softmax with an additive bias::

    a'_ti = m_ti e^{s_ti} / Σ_j m_tj e^{s_tj} = softmax_i(s_ti + log m_ti),   log 0 = −inf

so the bias ``log m_ti`` (−inf where m = 0 or the key is not visible) goes to SDPA as a float ``attn_mask``.
The bias is differentiable with respect to the spans: ``∂ log m / ∂e = 1 / (R m)`` on the ramp, 0 elsewhere,
and never NaN (``_LogRamp`` writes that gradient itself). It is built in few passes over the (query, key) pairs,
which dominate the cost of this path on CPU.

SDPA and a mask that requires grad, measured on CPU with torch 2.13: the CPU flash kernel refuses such a mask
(and a value width different from the key width), and SDPA's dispatcher then runs its math backend, whose
gradients for query, key, value and the mask agree with an explicit matmul/softmax to float32 rounding. No
fallback of our own is needed. Without grad (inference) the flash kernel is used.

A query that sees no key is given a row of zeros in the bias and its output is zeroed afterwards: some
fused kernels return NaN for fully masked rows (pytorch/pytorch#110213), this never does, and its gradients
are zero.

The readable definition is ``reference.py``; the tests check this file against it.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .reference import visible_keys

__all__ = ["expire_span_attention_sdpa"]


def log_clamped(ramp_position: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """log(clamp(x, 0, 1)) in a new tensor, −inf at x <= 0 and where `hidden` (a bool mask that covers x <= 0 too,
    when given). The logarithm of 0 takes a slow path in PyTorch's CPU kernels (about ten times the time of any other
    value, measured with torch 2.13), and most pairs of an expiring memory have m = 0: the logarithm is taken of x
    clamped to the smallest normal number, and the −inf written after."""
    tiny = torch.finfo(ramp_position.dtype).tiny
    hidden = ramp_position <= 0 if hidden is None else hidden
    return ramp_position.clamp(tiny, 1).log_().masked_fill_(hidden, float("-inf"))


class _LogRamp(torch.autograd.Function):
    """log(clamp(x, 0, 1)) with the gradient 1/x strictly inside (0, 1) and 0 elsewhere (never NaN at x <= 0).

    One fused step instead of clamp → where → log: the bias is built over all (query, key) pairs, so every pass
    over that tensor counts."""

    @staticmethod
    def forward(ctx, ramp_position):
        ctx.save_for_backward(ramp_position)
        return log_clamped(ramp_position)

    @staticmethod
    def backward(ctx, grad_output):
        (ramp_position,) = ctx.saved_tensors
        inside = (ramp_position > 0) & (ramp_position < 1)
        return torch.where(inside, grad_output / ramp_position, 0.0)


def expire_span_bias(spans, query_positions, key_positions, ramp, key_valid=None, max_distance=None):
    """The additive bias log m_ti (−inf where m = 0 or the key is not visible), float32, (B, T, N).

    1 + (e_i − (t − i)) / R is formed as c_i − t/R with c_i = 1 + (e_i + i)/R: one pass over the (T, N) pairs.
    Positions are taken relative to each row's first query so the float32 terms stay small."""
    dtype = torch.float64 if spans is not None and spans.dtype == torch.float64 else torch.float32
    visible = visible_keys(query_positions, key_positions, key_valid, max_distance)
    if spans is None:
        return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    single_query = query_positions.shape[1] == 1  # decoding: the origin is the query, t/R = 0
    origin = query_positions if single_query else query_positions.amin(dim=1, keepdim=True)
    key_term = (spans.to(dtype) + (key_positions - origin)).div_(ramp).add_(1)  # c_i = 1 + (e_i + i) / R
    if single_query:
        ramp_position = key_term[:, None, :]  # 1 + (e_i − (t − i)) / R
    else:
        query_term = (query_positions - origin).to(dtype) / ramp  # t / R
        ramp_position = key_term[:, None, :] - query_term[:, :, None]  # 1 + (e_i − (t − i)) / R
    if torch.is_grad_enabled() and spans.requires_grad:
        log_mask = _LogRamp.apply(ramp_position)  # log m_ti, Eq. 5
        return log_mask.masked_fill(~visible, float("-inf"))
    return log_clamped(ramp_position, ~visible | (ramp_position <= 0))


def expire_span_attention_sdpa(
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
    """Expire-Span attention (paper Eqs. 4-5) as SDPA with the bias ``log m``. Inputs are not validated here.

    Same arguments and output as :func:`memlm.kernels.expire_attention.reference.expire_span_attention_reference`:
    ``(B, H, T, d_v)`` in the query's dtype, zeros for a query that sees no key.
    """
    arguments = (query, key, value, spans, query_positions, key_positions, ramp, key_valid, max_distance, scale)
    if spans is not None and spans.requires_grad and torch.is_grad_enabled():
        # A bias that requires grad sends SDPA to its math backend, which keeps the (B, H, T, N) weights for the
        # backward. Instead: a forward without grad (the fused kernel), and the weights recomputed in the backward,
        # so one layer's weights are alive at a time, not all of them.
        if dropout == 0:
            return _RecomputedAttention.apply(*arguments)
        return checkpoint(_attention, *arguments, dropout, use_reentrant=False)  # same dropout mask when replayed
    return _attention(*arguments, dropout)


class _RecomputedAttention(torch.autograd.Function):
    """Expire-Span attention whose forward keeps only its inputs; the backward recomputes the weights."""

    @staticmethod
    def forward(ctx, query, key, value, spans, query_positions, key_positions, ramp, key_valid, max_distance, scale):
        with torch.no_grad():
            output = _attention(
                query, key, value, spans, query_positions, key_positions, ramp, key_valid, max_distance, scale, 0.0
            )
        ctx.save_for_backward(query, key, value, spans, query_positions, key_positions, key_valid)
        ctx.options = (ramp, max_distance, scale)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, spans, query_positions, key_positions, key_valid = ctx.saved_tensors
        ramp, max_distance, scale = ctx.options
        with torch.enable_grad():
            inputs = [
                tensor.detach().requires_grad_(needed)
                for tensor, needed in zip((query, key, value, spans), ctx.needs_input_grad[:4])
            ]
            output = _attention(*inputs, query_positions, key_positions, ramp, key_valid, max_distance, scale, 0.0)
            wanted = [tensor for tensor in inputs if tensor.requires_grad]
            computed = iter(torch.autograd.grad(output, wanted, grad_output))
        gradients = [next(computed) if tensor.requires_grad else None for tensor in inputs]
        return (*gradients, None, None, None, None, None, None)


def _attention(
    query, key, value, spans, query_positions, key_positions, ramp, key_valid, max_distance, scale, dropout
):
    bias = expire_span_bias(spans, query_positions, key_positions, ramp, key_valid, max_distance)
    has_key = bias.amax(dim=-1, keepdim=True) > float("-inf")  # (B, T, 1)
    # Under torch.compile the zeroing path always runs (same output, no data-dependent branch).
    everyone_sees_a_key = not torch.compiler.is_compiling() and bool(has_key.all())
    if not everyone_sees_a_key:
        # Open a query that sees no key to every key so the kernel stays finite; its output is zeroed below.
        bias = torch.where(has_key, bias, 0.0)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=bias.to(query.dtype)[:, None], dropout_p=dropout, scale=scale
    )
    return output if everyone_sees_a_key else output.masked_fill(~has_key[:, None], 0.0)
