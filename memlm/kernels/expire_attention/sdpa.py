"""Expire-Span attention through PyTorch's fused ``scaled_dot_product_attention`` (SPEC §2).

The masked, renormalised weights of paper Eq. 4 are a softmax with an additive bias::

    a'_ti = m_ti e^{s_ti} / Σ_j m_tj e^{s_tj} = softmax_i(s_ti + log m_ti),   log 0 = −inf

so the bias ``log m_ti`` (−inf where m = 0 or the key is not visible) goes to SDPA as a float ``attn_mask``.
The bias is differentiable with respect to the spans: ``∂ log m / ∂e = 1 / (R m)`` on the ramp, 0 elsewhere,
and never NaN (``log`` only sees ``m ≥ tiny``; the −inf entries come from ``torch.where``).

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

from .reference import expire_span_mask, visible_keys

__all__ = ["expire_span_attention_sdpa"]


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
    allowed = visible_keys(query_positions, key_positions, key_valid, max_distance)  # (B, T, N)
    if spans is None:
        bias = None
    else:
        mask = expire_span_mask(spans, query_positions, key_positions, ramp)  # m_ti, Eq. 5
        allowed = allowed & (mask > 0)
        tiny = torch.finfo(mask.dtype).tiny
        bias = torch.where(allowed, mask.clamp_min(tiny).log(), float("-inf"))  # log m_ti
    has_key = allowed.any(dim=-1, keepdim=True)  # (B, T, 1)
    # Open a query that sees no key to every key so the kernel stays finite; its output is zeroed below.
    if bias is None:
        attention_mask = allowed | ~has_key
    else:
        attention_mask = torch.where(has_key, bias, 0.0).to(query.dtype)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask[:, None], dropout_p=dropout, scale=scale
    )
    return output.masked_fill(~has_key[:, None], 0.0)
