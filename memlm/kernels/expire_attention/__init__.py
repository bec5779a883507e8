"""Expire-Span attention (SPEC §2): softmax attention over memories that expire after a learned span.

Sukhbaatar et al. (2021), *Not All Memories are Created Equal: Learning to Forget by Expiring*, Sec. 4.1.
Key ``i`` at absolute position ``i`` has a span ``e_i``; a query at position ``t`` weighs it by the soft mask
``m_ti = clamp(1 + (e_i − (t − i)) / R, 0, 1)`` (Eq. 5) and renormalises its attention (Eq. 4).

:func:`expire_span_attention` validates its inputs and dispatches on the backend (see
:func:`memlm.kernels.resolve_backend`): ``"torch"`` runs ``scaled_dot_product_attention`` with the bias
``log m`` (``sdpa.py``), ``"triton"`` a FlashAttention-style kernel that computes the mask inside and skips expired
tiles (``triton_attention.py``), ``"reference"`` the explicit softmax-mask-renormalise of ``reference.py``. The
official code's options (learned relative positions, no attention to self, the renormalisation ε) run inside the
Triton kernel too; on the ``torch`` backend ``official.py``: the scores written out, differentiated by hand.
:func:`expire_span_mask` is the mask itself, for the model's span loss and memory bookkeeping. A decoding step's
one query per row takes fewer passes (``one_query.py``: :func:`expire_span_attention_decoding`,
:func:`expire_span_attention_official_decoding`, and their parts, which a step runs for all its layers at once).
"""

import math
from numbers import Real

import torch

from memlm.kernels import check_triton_device, resolve_backend, sums_are_finite

from .official import expire_span_attention_official
from .one_query import expire_span_attention_decoding, expire_span_attention_official_decoding, padded_position_table
from .reference import (
    expire_span_attention_reference,
    expire_span_mask,
    memory_statistics,
    relative_position_scores,
    visible_keys,
)
from .sdpa import expire_span_attention_sdpa

__all__ = [
    "expire_span_attention",
    "expire_span_attention_decoding",
    "expire_span_attention_official_decoding",
    "expire_span_attention_reference",
    "expire_span_attention_sdpa",
    "expire_span_mask",
    "memory_statistics",
    "padded_position_table",
    "relative_position_scores",
    "visible_keys",
]


def _shape(tensor) -> str:
    return str(tuple(tensor.shape)) if isinstance(tensor, torch.Tensor) else type(tensor).__name__


def _is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_positions(name: str, positions, expected: tuple[int, int], meaning: str) -> None:
    if not isinstance(positions, torch.Tensor) or positions.shape != expected:
        raise ValueError(f"{name} must be a tensor of shape {meaning} = {expected}, got {_shape(positions)}.")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer absolute positions, got dtype {positions.dtype}.")


def _check_official_options(query, key, position_scores, attend_to_self, renormalization_epsilon,
                            relative_positions) -> None:  # fmt: skip
    expected = (*query.shape[:3], key.shape[2])
    if relative_positions is not None:
        if (
            not isinstance(relative_positions, torch.Tensor)
            or relative_positions.dim() != 2
            or relative_positions.shape[1] != query.shape[-1]
        ):
            raise ValueError(
                f"relative_positions must be None or a tensor of shape (positions, width) with the query's width "
                f"{query.shape[-1]}, got {_shape(relative_positions)}."
            )
        if not relative_positions.is_floating_point():
            raise ValueError(
                f"relative_positions must be a floating-point tensor, got dtype {relative_positions.dtype}."
            )
    if position_scores is not None:
        if not isinstance(position_scores, torch.Tensor) or tuple(position_scores.shape) != expected:
            raise ValueError(
                f"position_scores must be None or a tensor of shape (batch, heads, tokens, keys) = {expected}, got "
                f"{_shape(position_scores)}."
            )
        if not position_scores.is_floating_point():
            raise ValueError(f"position_scores must be a floating-point tensor, got dtype {position_scores.dtype}.")
    if not isinstance(attend_to_self, bool):
        raise ValueError(f"attend_to_self must be True or False, got {attend_to_self!r}.")
    if not _is_number(renormalization_epsilon) or not 0 <= renormalization_epsilon < math.inf:
        raise ValueError(f"renormalization_epsilon must be a finite number >= 0, got {renormalization_epsilon!r}.")


def _check_inputs(
    query, key, value, spans, query_positions, key_positions, ramp, key_valid, max_distance, scale, dropout
) -> None:
    """Raise ``ValueError`` naming the offending argument, its value or shape, and what is expected."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-dimensional tensor (batch, heads, tokens, width), got {_shape(tensor)}."
            )
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}.")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype} and {value.dtype}.")
    batch_size, num_heads, length, key_dim = query.shape
    num_keys = key.shape[2]
    if key.shape[:2] != (batch_size, num_heads) or key.shape[3] != key_dim:
        raise ValueError(
            f"key must have shape (batch, heads, keys, width) with the query's batch, heads and width, got query "
            f"{_shape(query)} and key {_shape(key)}."
        )
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"value must share (batch, heads, keys) with key, got value {_shape(value)} and key {_shape(key)}."
        )
    if spans is not None:
        if not isinstance(spans, torch.Tensor) or spans.shape != (batch_size, num_keys):
            raise ValueError(
                f"spans must be None or a tensor of shape (batch, keys) = {(batch_size, num_keys)}, got {_shape(spans)}."
            )
        if not spans.is_floating_point():
            raise ValueError(f"spans must be a floating-point tensor (spans in tokens), got dtype {spans.dtype}.")
    _check_positions("query_positions", query_positions, (batch_size, length), "(batch, tokens)")
    _check_positions("key_positions", key_positions, (batch_size, num_keys), "(batch, keys)")
    if key_valid is not None:
        if not isinstance(key_valid, torch.Tensor) or key_valid.shape != (batch_size, num_keys):
            raise ValueError(
                f"key_valid must be None or a tensor of shape (batch, keys) = {(batch_size, num_keys)}, "
                f"got {_shape(key_valid)}."
            )
        if key_valid.dtype != torch.bool:
            raise ValueError(
                f"key_valid must be a bool tensor (False marks an empty slot), got dtype {key_valid.dtype}."
            )
    if not _is_number(ramp) or not math.isfinite(ramp) or ramp <= 0:
        raise ValueError(f"ramp must be a positive finite number (the ramp length R in tokens), got {ramp!r}.")
    if max_distance is not None and (not _is_number(max_distance) or not max_distance >= 0):
        raise ValueError(f"max_distance must be None or a number >= 0 (in tokens), got {max_distance!r}.")
    if scale is not None and (not _is_number(scale) or not math.isfinite(scale)):
        raise ValueError(f"scale must be None (width ** -0.5) or a finite number, got {scale!r}.")
    if not _is_number(dropout) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}.")


def expire_span_attention(
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
    backend: str | None = None,
    position_scores: torch.Tensor | None = None,
    attend_to_self: bool = True,
    renormalization_epsilon: float = 0.0,
    relative_positions: torch.Tensor | None = None,
    keep_weights: bool = False,
) -> torch.Tensor:
    """Attention over keys that expire after their learned spans (paper Eqs. 4-5, SPEC §2).

    Key ``i`` is visible to query ``t`` when ``key_positions ≤ query_positions`` (causal by absolute position, so
    memories and the current block may be concatenated in any order), ``key_valid`` is True, and ``t − i ≤
    max_distance``. A visible key is weighed by ``m_ti = clamp(1 + (e_i − (t − i)) / R, 0, 1)`` and the weights
    are renormalised; a query that sees no key with m > 0 outputs zeros.

    Args:
        query: ``(B, H, T, d)``.
        key: ``(B, H, N, d)``.
        value: ``(B, H, N, d_v)``; same dtype as query and key.
        spans: the span ``e_i`` of each key in tokens, ``(B, N)`` float, differentiable; ``None``: never expires.
        query_positions: absolute position ``t`` of each query, ``(B, T)`` integer.
        key_positions: absolute position ``i`` of each key, ``(B, N)`` integer.
        ramp: the ramp length ``R > 0`` of the soft mask (Eq. 5).
        key_valid: ``(B, N)`` bool; False marks a padding or deleted slot, never visible. ``None``: all valid.
        max_distance: keys with ``t − i > max_distance`` are not visible (fixed-span attention, random memory
            shortening); ``None``: no limit.
        scale: score scale; ``None`` means ``d ** -0.5``.
        dropout: dropout probability on the attention weights (applied only when > 0; the caller passes 0 in eval).
        backend: ``"torch"``, ``"triton"`` or ``"reference"``; ``None`` reads ``$MEMLM_KERNELS``, else picks
            ``"triton"`` for CUDA tensors (when installed) and ``"torch"`` otherwise. The Triton kernel does not
            cover attention dropout, float64 or head widths above 128: those run the torch implementation.
        position_scores: ``(B, H, T, N)`` added to ``q·k`` before the scale (the official learned relative
            positions, ``q_t · p_{t−i}``), or ``None``.
        attend_to_self: False hides key ``t`` from query ``t`` (the official causal mask).
        renormalization_epsilon: ``ε >= 0``; ``ε > 0`` renormalises as the official code, ``m a / (Σ m a + ε)``
            with the softmax over the keys with ``m > 0``.
        relative_positions: ``(P, d)``, the learned relative positions ``p_1 … p_P``: adds ``q_t · p_{t−i}`` for
            ``1 ≤ t − i ≤ P`` as ``position_scores`` would, without a ``(B, H, T, N)`` input. These official options
            run in the Triton kernel (``position_scores`` or ``relative_positions``, not both); on the other
            backends ``official.py``: the scores written out in few passes, and with gradients (no dropout) a
            forward that keeps only its inputs and output and a backward written out (one block's weights alive at a
            time).
        keep_weights: with gradients through the official options on the torch backend, keep the ``(B, H, T, N)``
            weights for the backward instead of computing them again there: faster, for that much more memory.

    Returns:
        ``(B, H, T, d_v)`` in the query's dtype. On CPU tensors a non-finite key, value or span at position i leaves
        the outputs of the queries that do not see it as they are without it, and those that see it get NaN.

    Example:
        >>> import torch
        >>> from memlm.kernels.expire_attention import expire_span_attention
        >>> query, key, value = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> spans = torch.tensor([[0.0, 9.0, 9.0, 9.0, 9.0, 9.0]])  # the memory at position 0 lives 0 tokens
        >>> at, positions = torch.tensor([[5]]), torch.arange(6)[None]
        >>> output = expire_span_attention(query, key, value, spans, at, positions, ramp=1.0)
        >>> without_it = expire_span_attention(query, key[:, :, 1:], value[:, :, 1:], spans[:, 1:], at,
        ...                                    positions[:, 1:], ramp=1.0)
        >>> torch.allclose(output, without_it)  # 5 tokens later, past its ramp of 1: it is gone
        True
    """
    _check_inputs(
        query, key, value, spans, query_positions, key_positions, ramp, key_valid, max_distance, scale, dropout
    )
    _check_official_options(query, key, position_scores, attend_to_self, renormalization_epsilon, relative_positions)
    if not isinstance(keep_weights, bool):
        raise ValueError(f"keep_weights must be True or False, got {keep_weights!r}.")
    options = dict(
        ramp=ramp, key_valid=key_valid, max_distance=max_distance, scale=scale, dropout=dropout, backend=backend,
        position_scores=position_scores, attend_to_self=attend_to_self,
        renormalization_epsilon=renormalization_epsilon, relative_positions=relative_positions,
        keep_weights=keep_weights,
    )  # fmt: skip
    output = _expire_span_attention(query, key, value, spans, query_positions, key_positions, **options)
    # The spans too: a NaN span can hide its key instead of spreading.
    if sums_are_finite(output, *([] if spans is None else [spans])):
        return output
    return _causal_despite_non_finite(output, query, key, value, spans, query_positions, key_positions, options)


def _causal_despite_non_finite(output, query, key, value, spans, query_positions, key_positions, options):
    """Keep a non-finite key, value or span where it is: the products of an attention kernel multiply the weights
    of every key with every value, and a masked key's weight 0 times its NaN value is NaN, which would reach queries
    that cannot see that key. The attention runs again with those keys' inputs zeroed (what cannot see them does not
    depend on them), and the outputs of the queries that see one of them are NaN. Checked as the delta rule's (see
    `memlm.kernels.delta_rule._causal_despite_non_finite`): CPU tensors at every call, others once per model forward."""
    bad = ~(torch.isfinite(key).all(-1) & torch.isfinite(value).all(-1))  # (B, H, N)
    if spans is not None:
        bad |= ~torch.isfinite(spans)[:, None]
    if options["relative_positions"] is not None:  # as scores, to find the pairs a non-finite p_d reaches
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
        scores = relative_position_scores(options["relative_positions"], query, distance)
        if options["position_scores"] is not None:
            scores = scores + options["position_scores"]
        options = {**options, "position_scores": scores, "relative_positions": None}
    position_scores = options["position_scores"]
    bad_pairs = None if position_scores is None else ~torch.isfinite(position_scores)  # (B, H, T, N)
    if not bool(bad.any()) and (bad_pairs is None or not bool(bad_pairs.any())):
        return output  # non-finite queries only stay in their own rows; or an overflow: nothing to keep in place
    zero = torch.zeros((), dtype=key.dtype, device=key.device)
    key, value = (torch.where(bad[..., None], zero, tensor) for tensor in (key, value))
    if spans is not None:
        spans = torch.where(bad.any(1), torch.zeros((), dtype=spans.dtype, device=spans.device), spans)
    pairs = bad[:, :, None, :].expand(*query.shape[:3], key.shape[2])
    if bad_pairs is not None:
        options = {
            **options,
            "position_scores": torch.where(bad_pairs, zero.to(position_scores.dtype), position_scores),
        }
        pairs = pairs | bad_pairs
    output = _expire_span_attention(query, key, value, spans, query_positions, key_positions, **options)
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # (B, 1, T, N)
    visible = distance >= (0 if options["attend_to_self"] else 1)
    if options["key_valid"] is not None:
        visible = visible & options["key_valid"][:, None, None, :]
    if options["max_distance"] is not None:
        visible = visible & (distance <= options["max_distance"])
    seen = (pairs & visible).any(-1)  # (B, H, T): queries that see a non-finite key
    return torch.where(seen[..., None], torch.full((), float("nan"), dtype=output.dtype), output)


def _expire_span_attention(
    query, key, value, spans, query_positions, key_positions, *, ramp, key_valid, max_distance, scale, dropout,
    backend, position_scores, attend_to_self, renormalization_epsilon, relative_positions, keep_weights=False,
):  # fmt: skip
    options = dict(ramp=ramp, key_valid=key_valid, max_distance=max_distance, scale=scale, dropout=dropout)
    official = dict(
        position_scores=position_scores, attend_to_self=attend_to_self,
        renormalization_epsilon=renormalization_epsilon, relative_positions=relative_positions,
    )  # fmt: skip
    is_official = (
        position_scores is not None or relative_positions is not None or not attend_to_self
        or renormalization_epsilon > 0
    )  # fmt: skip
    backend = resolve_backend(backend, query.device)
    if key.shape[2] == 0:  # no key at all: every query sees none, zeros (the reference's few ops)
        backend = "reference"
    supported = (
        query.dtype in (torch.float32, torch.float16, torch.bfloat16) and max(query.shape[-1], value.shape[-1]) <= 128
    )
    if backend == "triton" and dropout == 0 and supported and (position_scores is None or relative_positions is None):
        check_triton_device(query.device)
        from .triton_attention import expire_span_attention_triton

        return expire_span_attention_triton(
            query, key, value, spans, query_positions, key_positions, **options, **official
        )
    if backend == "reference":
        return expire_span_attention_reference(
            query, key, value, spans, query_positions, key_positions, **options, **official
        )
    if is_official:
        return expire_span_attention_official(
            query, key, value, spans, query_positions, key_positions, **options, **official, keep_weights=keep_weights
        )
    return expire_span_attention_sdpa(query, key, value, spans, query_positions, key_positions, **options)
