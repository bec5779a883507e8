"""DeltaNet's DPFP feature map and its key/query normalisation as one operation with a hand-written backward.

Schlag et al. (2021), Eq. 37 (deterministic parameter-free projection) and Sec. 4.2 (normalisation)::

    r = [relu(x), relu(−x)] ∈ R^{2d}
    φ(x) = concat_{j=1..ν} r ⊙ roll(r, j) ∈ R^{2dν}        (roll(r, j)_i = r_{i−j}, indices mod 2d)
    sum:  φ ← φ / max(Σ_i φ_i, ε)          l2:  φ ← φ / sqrt(Σ_i φ_i² + ε)

Written with separate PyTorch ops (as :func:`dpfp_reference` does), autograd keeps r, its rolled copies, the products
and the normaliser, and runs about a dozen element-wise passes backward. Here the forward writes each product
straight into the output (no rolled copy, no concatenation) and the backward differentiates the whole map in closed
form from r and the output:

    sum:  ∂L/∂p = (g − (g·φ)) / s     (s = Σ_i p_i, and ∂L/∂p = g / ε where s was clamped)
    l2:   ∂L/∂p = n (g − φ (g·φ))     (n = (Σ_i p_i² + ε)^(−1/2))
    ∂L/∂r_i = Σ_j (∂L/∂p_j)_i r_{i−j} + (∂L/∂p_j)_{i+j} r_{i+j}
    ∂L/∂x = ∂L/∂r_{:d} · [x > 0] − ∂L/∂r_{d:} · [x < 0]

Half-precision inputs are computed in float32 and the result cast back (one rounding instead of one per op).
"""

import torch
import torch.nn.functional as F

from memlm.kernels import in_dtype

__all__ = ["NORMALIZATIONS", "dpfp", "dpfp_reference"]

NORMALIZATIONS = ("none", "sum", "l2")
# Inputs without gradients up to this many numbers (a decoding step's queries and keys up to batch 64 with 8 heads of
# width 128) run in the fewest ops; larger ones write in place and spare the memory.
FEW_NUMBERS = 1 << 16


def dpfp_reference(hidden_states: torch.Tensor, nu: int, normalization: str, eps: float) -> torch.Tensor:
    """The readable definition (Eq. 37, then the normalisation), one PyTorch op per step; the tests check
    :func:`dpfp` against it."""
    rectified = torch.cat([F.relu(hidden_states), F.relu(-hidden_states)], dim=-1)
    features = torch.cat([rectified * rectified.roll(shifts=j, dims=-1) for j in range(1, nu + 1)], dim=-1)
    if normalization == "sum":
        return features / features.sum(-1, keepdim=True).clamp_min(eps)
    if normalization == "l2":
        wide = features.to(_compute_dtype(features))  # float32, or float64 for float64 inputs
        return (wide * torch.rsqrt(wide.pow(2).sum(-1, keepdim=True) + eps)).to(features.dtype)
    return features


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def _rolled_products(rectified: torch.Tensor, nu: int) -> torch.Tensor:
    """(..., 2d) → (..., ν, 2d): product j-1 is r ⊙ roll(r, j), written slice by slice (no rolled copy)."""
    width = rectified.shape[-1]
    products = rectified.new_empty(*rectified.shape[:-1], nu, width)
    for shift in range(1, nu + 1):
        product = products[..., shift - 1, :]
        torch.mul(rectified[..., shift:], rectified[..., : width - shift], out=product[..., shift:])
        torch.mul(rectified[..., :shift], rectified[..., width - shift :], out=product[..., :shift])
    return products


def _few_features(hidden_states: torch.Tensor, nu: int, normalization: str, eps: float) -> torch.Tensor:
    """The forward without gradients for a few vectors (a decoding step): the same numbers as `_features` in the
    fewest ops (each costs a few µs on a CPU, more than its arithmetic here), where `_features` spares the memory."""
    inputs = in_dtype(hidden_states, _compute_dtype(hidden_states))
    rectified = F.relu(torch.cat([inputs, inputs.neg()], dim=-1))
    if nu == 1:
        features = rectified * rectified.roll(1, dims=-1)
    else:
        features = torch.cat([rectified * rectified.roll(shift, dims=-1) for shift in range(1, nu + 1)], dim=-1)
    if normalization == "sum":
        features.div_(features.sum(-1, keepdim=True).clamp_min_(eps))
    elif normalization == "l2":
        features.mul_(features.pow(2).sum(-1, keepdim=True).add_(eps).rsqrt_())
    return in_dtype(features, hidden_states.dtype)


def _features(hidden_states: torch.Tensor, nu: int, normalization: str, eps: float):
    """The forward: r, the normalised features (in float32 or wider) and the normaliser (None without one)."""
    dtype = _compute_dtype(hidden_states)
    inputs = hidden_states.to(dtype)
    dim = inputs.shape[-1]
    rectified = inputs.new_empty(*inputs.shape[:-1], 2 * dim)
    torch.clamp_min(inputs, 0, out=rectified[..., :dim])
    torch.sub(rectified[..., :dim], inputs, out=rectified[..., dim:])  # relu(−x) = relu(x) − x
    features = _rolled_products(rectified, nu).view(*inputs.shape[:-1], 2 * dim * nu)
    normaliser = None
    if normalization == "sum":
        normaliser = features.sum(-1, keepdim=True)
        features.div_(normaliser.clamp_min(eps))
    elif normalization == "l2":
        normaliser = torch.rsqrt(features.pow(2).sum(-1, keepdim=True).add_(eps))
        features.mul_(normaliser)
    return rectified, features, normaliser


class DPFPFunction(torch.autograd.Function):
    """φ(x) with its normalisation; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden_states, nu, normalization, eps):
        rectified, features, normaliser = _features(hidden_states, nu, normalization, eps)
        ctx.save_for_backward(rectified, features, normaliser)
        ctx.nu, ctx.normalization, ctx.eps, ctx.input_dtype = nu, normalization, eps, hidden_states.dtype
        return features.to(hidden_states.dtype)

    @staticmethod
    def backward(ctx, grad_features):
        rectified, features, normaliser = ctx.saved_tensors
        nu, normalization, eps = ctx.nu, ctx.normalization, ctx.eps
        grad = grad_features.to(features.dtype)
        if normalization != "none":
            dot = torch.linalg.vecdot(grad, features)[..., None]
            if normalization == "sum":
                dot.masked_fill_(normaliser <= eps, 0)  # a clamped denominator is the constant ε
                inverse = normaliser.clamp_min(eps).reciprocal_()
                grad = torch.addcmul(-(dot * inverse), grad, inverse)  # (g − g·φ) / s
            else:
                grad = torch.addcmul(grad, features, dot, value=-1).mul_(normaliser)  # n (g − φ (g·φ))
        width = rectified.shape[-1]
        dim = width // 2
        grad = grad.view(*rectified.shape[:-1], nu, width)
        grad_rectified = torch.empty_like(rectified)
        for shift in range(1, nu + 1):
            grad_product = grad[..., shift - 1, :]
            # p_i = r_i r_{i−j}: to r_i goes g_i r_{i−j}, to r_{i−j} goes g_i r_i (indices mod 2d).
            head, tail = grad_rectified[..., shift:], grad_rectified[..., :shift]
            if shift == 1:
                torch.mul(grad_product[..., shift:], rectified[..., : width - shift], out=head)
                torch.mul(grad_product[..., :shift], rectified[..., width - shift :], out=tail)
            else:
                head.addcmul_(grad_product[..., shift:], rectified[..., : width - shift])
                tail.addcmul_(grad_product[..., :shift], rectified[..., width - shift :])
            grad_rectified[..., : width - shift].addcmul_(grad_product[..., shift:], rectified[..., shift:])
            grad_rectified[..., width - shift :].addcmul_(grad_product[..., :shift], rectified[..., :shift])
        # r_{:d} = relu(x) and r_{d:} = relu(−x): relu's backward (one fused op each) keeps the gradient where the
        # rectified value is positive, i.e. x > 0 for r_{:d} and x < 0 for r_{d:}.
        positive = torch.ops.aten.threshold_backward(grad_rectified[..., :dim], rectified[..., :dim], 0)
        negative = torch.ops.aten.threshold_backward(grad_rectified[..., dim:], rectified[..., dim:], 0)
        grad_inputs = positive.sub_(negative)
        return grad_inputs.to(ctx.input_dtype), None, None, None


def dpfp(hidden_states: torch.Tensor, nu: int = 1, normalization: str = "none", eps: float = 1e-6) -> torch.Tensor:
    """DPFP features of ``hidden_states`` (..., d) → (..., 2dν), normalised by their sum, their L2 norm or not at all
    (``normalization`` one of ``"none"``, ``"sum"``, ``"l2"``), with a hand-written backward.

    Example:
        >>> import torch
        >>> from memlm.kernels.delta_rule.feature_map import dpfp, dpfp_reference
        >>> x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
        >>> torch.allclose(dpfp(x, 2, "sum"), dpfp_reference(x, 2, "sum", 1e-6))
        True
        >>> torch.autograd.gradcheck(lambda x: dpfp(x, 2, "l2"), (x,))
        True
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} is not one of {NORMALIZATIONS}")
    if not 1 <= nu < 2 * hidden_states.shape[-1]:
        raise ValueError(f"nu={nu} must be between 1 and 2·d − 1 = {2 * hidden_states.shape[-1] - 1}")
    if torch.compiler.is_compiling():
        # torch.compile fuses the reference's ops into a few loops (and cannot trace the writes into slices `out=`);
        # in float32 or wider, as `_features` computes.
        wide = hidden_states.to(_compute_dtype(hidden_states))
        return dpfp_reference(wide, nu, normalization, eps).to(hidden_states.dtype)
    if not (torch.is_grad_enabled() and hidden_states.requires_grad):  # nothing to save (decoding, prefill)
        if hidden_states.numel() <= FEW_NUMBERS:
            return _few_features(hidden_states, nu, normalization, eps)
        return _features(hidden_states, nu, normalization, eps)[1].to(hidden_states.dtype)
    return DPFPFunction.apply(hidden_states, nu, normalization, eps)
