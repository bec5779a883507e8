"""Chunkwise-parallel delta rule and sum rule in plain PyTorch (SPEC §1), with a hand-written backward.

The sequence is cut into ``N`` chunks of ``C`` tokens. Inside a chunk with entering state ``S₀`` and
rows ``K, Q, V, β`` (SPEC §1, the WY form of the delta rule)::

    A = I + strictly_lower(diag(β) K Kᵀ);   W = A⁻¹ diag(β) K;   U = A⁻¹ diag(β) V
    O = Q S₀ + causal(Q Kᵀ) (U − W S₀)            causal keeps j ≤ i
    S_C = S₀ + Kᵀ (U − W S₀)

Everything that does not depend on ``S₀`` (``A⁻¹``, ``P = causal(Q Kᵀ)``) is computed for all chunks at once; only
the ``N``-step state recurrence runs as a Python loop, three small products per chunk, since U − W S₀ =
A⁻¹ (diag(β) V − diag(β) K S₀)::

    V'_n = A_n⁻¹ (diag(β) V_n − diag(β) K_n S_n)          S_{n+1} = S_n + K_nᵀ V'_n
    (then, for all chunks: O_n = Q_n S_n + P_n V'_n)

This form builds neither the ``d_k × d_k`` transition ``I − Kᵀ W`` nor ``W`` itself: per chunk the loop costs
``2·C·d_k·d_v + C²·d_v`` multiply-adds, against ``C²·(d_k + d_v)`` to build ``[W | U]`` for all chunks plus
``2·C·d_k·d_v`` in the loop, fewer at every ``d_k > 0`` (DPFP doubles ``d_k`` to ``2C``).

The backward (hand-written, :class:`DeltaRuleChunkFunction`) runs the state-gradient recurrence in reverse from the
``N`` chunk-entry states and new values ``V'`` saved by the forward (never one state per token, never autograd
through the loop)::

    dV'_n = P_nᵀ dO_n + K_n dS_{n+1}     dY_n = A_n⁻ᵀ dV'_n     dS_n = Q_nᵀ dO_n + dS_{n+1} − (diag(β) K_n)ᵀ dY_n

then differentiates the chunk-local quantities in closed form, batched over all chunks. Measured on CPU (B=2, H=4,
D=64), a hand-written backward is about 2x faster than recomputing the chunk-local part under autograd and calling
``torch.autograd.grad`` on it.

Without autograd (inference, prefill) the sequence is processed in segments of whole chunks with the
state carried between them, which bounds the temporaries and keeps the time per token flat in T.

The readable definition is ``reference.py``; the tests check this file against it.
"""

import torch
import torch.nn.functional as F

from memlm.kernels import in_dtype

__all__ = ["delta_rule_chunk", "delta_rule_step", "sum_rule_chunk", "sum_rule_step"]


# Without autograd, sequences are processed in segments of about this many elements of B·H·T·(d_k + d_v):
# 1024 tokens for B=2, H=4, d_k=d_v=64.
_SEGMENT_ELEMENTS = 1 << 20


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """Internal math and state run in float32, or in float64 when any input is float64."""
    for tensor in tensors:  # a loop, not any(…): decoding calls this at every layer and step
        if tensor is not None and tensor.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _initial_state(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
) -> torch.Tensor:
    """The state entering the sequence as ``(B·H, d_k, d_v)`` in the compute dtype (zeros if ``None``)."""
    batch_size, num_heads, _, key_dim = key.shape
    dtype = _compute_dtype(query, key, value, beta, initial_state)
    if initial_state is None:
        return torch.zeros(batch_size * num_heads, key_dim, value.shape[-1], dtype=dtype, device=key.device)
    return initial_state.to(dtype).reshape(batch_size * num_heads, key_dim, value.shape[-1])


def _to_chunks(tensor: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, H, T, ...)`` → ``(B·H, N, C, ...)`` in ``dtype``, zero-padding T up to ``N·C``.

    Zero keys and values are exact padding for both rules: a token with k = 0 and v = 0 neither
    reads nor writes the state, and padded positions come after every real one.
    """
    batch_size, num_heads, length = tensor.shape[:3]
    padding = -length % chunk_size
    tensor = tensor.to(dtype)
    if padding:
        # F.pad pads from the last dimension backwards; pad dimension 2 (time) at its end.
        tensor = F.pad(tensor, (0, 0) * (tensor.dim() - 3) + (0, padding))
    return tensor.reshape(batch_size * num_heads, (length + padding) // chunk_size, chunk_size, *tensor.shape[3:])


def _from_chunks(tensor: torch.Tensor, batch_size: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_to_chunks`: ``(B·H, N, C, ...)`` → ``(B, H, T, ...)`` in ``dtype``."""
    tensor = tensor.reshape(batch_size, -1, tensor.shape[1] * tensor.shape[2], *tensor.shape[3:])
    return tensor[:, :, :length].to(dtype)


def unit_lower_triangular_inverse(matrix: torch.Tensor, size: int) -> torch.Tensor:
    """(I + L)⁻¹ for the strictly lower triangle L of `matrix` (…, C, C), C = `size`, by blocks: the inverses of the
    diagonal blocks of size b known, those of size 2b are [[A⁻¹, 0], [−D⁻¹ C A⁻¹, D⁻¹]] for the blocks [[A, 0], [C, D]]
    (C padded to a power of two): a triangular solve's arithmetic, in ops ONNX has (slices, products, concatenations).
    What an exported graph computes in place of `torch.linalg.solve_triangular`, which ONNX lacks; tested against it.
    The blocks are sliced at fixed offsets: reshaping the batch of chunks (a symbolic size under torch.export) into
    grids of blocks made torch.export several times slower."""
    padded = 1 << max(size - 1, 0).bit_length()  # the power of two ≥ C
    lower = torch.tril(matrix, diagonal=-1).reshape(-1, size, size)
    if padded != size:
        lower = torch.nn.functional.pad(lower, (0, padded - size, 0, padded - size))
    inverses = [torch.ones_like(lower[:, :1, :1])] * padded  # of the 1×1 diagonal blocks
    block = 1
    while block < padded:
        merged = []
        for pair in range(padded // (2 * block)):
            start = 2 * block * pair
            first, second = inverses[2 * pair], inverses[2 * pair + 1]
            below = -(second @ lower[:, start + block : start + 2 * block, start : start + block] @ first)
            top = torch.cat([first, torch.zeros_like(first)], dim=-1)
            merged.append(torch.cat([top, torch.cat([below, second], dim=-1)], dim=-2))
        inverses = merged
        block *= 2
    return inverses[0][:, :size, :size].reshape(matrix.shape)


def _delta_rule_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Chunkwise delta rule on ``(B, H, T, ·)`` inputs from the float ``state`` ``(B·H, d_k, d_v)``.

    Returns the output ``(B·H·N, C, d_v)``, the final state ``(B·H, d_k, d_v)``, and the chunk quantities
    the backward needs, all in the state's dtype.
    """
    dtype = state.dtype
    query_chunks = _to_chunks(query, chunk_size, dtype)
    key_chunks = _to_chunks(key, chunk_size, dtype)
    value_chunks = _to_chunks(value, chunk_size, dtype)
    if beta is None:
        beta_chunks = torch.ones(key_chunks.shape[:3], dtype=dtype, device=key.device)
    else:
        beta_chunks = _to_chunks(beta, chunk_size, dtype)
    heads, num_chunks, _, key_dim = key_chunks.shape
    value_dim = value_chunks.shape[-1]

    # Chunk-local quantities for all chunks at once: (B·H, N) flattened into one batch dimension.
    flat = (heads * num_chunks, chunk_size)
    query_flat = query_chunks.reshape(*flat, key_dim)
    key_flat = key_chunks.reshape(*flat, key_dim)
    key_beta = key_chunks * beta_chunks[..., None]  # diag(β) K
    value_beta = value_chunks * beta_chunks[..., None]  # diag(β) V
    # A = I + strictly_lower(diag(β) K Kᵀ). solve_triangular with unitriangular=True reads only the strictly
    # lower triangle, so the full product stands in for A; A⁻¹ serves the loop and the backward.
    gram = torch.bmm(key_beta.reshape(*flat, key_dim), key_flat.mT)
    if torch.compiler.is_exporting():  # for ONNX, which has no triangular solve (torch.onnx.export exports first)
        inverse = unit_lower_triangular_inverse(gram, chunk_size)
    else:
        identity = torch.eye(chunk_size, dtype=dtype, device=key.device).expand_as(gram)
        inverse = torch.linalg.solve_triangular(gram, identity, upper=False, unitriangular=True)
    inverse_chunks = inverse.view(heads, num_chunks, chunk_size, chunk_size)
    scores = torch.bmm(query_flat, key_flat.mT).tril_()  # P = causal(Q Kᵀ)

    # The only sequential part: V'_n = A_n⁻¹ (diag(β) V_n − diag(β) K_n S_n), S_{n+1} = S_n + K_nᵀ V'_n. Each product
    # writes a fresh tensor (an `out=` slice of a larger buffer is not contiguous, and bmm then computes into a
    # temporary and copies: about twice the time); one stack per list after the loop.
    states, new_values = [], []
    for index in range(num_chunks):
        states.append(state)
        projected = torch.baddbmm(value_beta[:, index], key_beta[:, index], state, alpha=-1)
        new_value = torch.bmm(inverse_chunks[:, index], projected)
        new_values.append(new_value)
        state = torch.baddbmm(state, key_chunks[:, index].mT, new_value)
    final_state = state
    states = torch.stack(states, dim=1).view(heads * num_chunks, key_dim, value_dim)  # S_n entering chunk n
    new_values = torch.stack(new_values, dim=1).view(*flat, value_dim)

    output = torch.bmm(query_flat, states).baddbmm_(scores, new_values)  # O_n = Q_n S_n + P_n V'_n
    saved = (query_flat, key_flat, value_chunks, beta_chunks, inverse, key_beta, scores, new_values, states)
    return output, final_state, saved


class DeltaRuleChunkFunction(torch.autograd.Function):
    """The chunkwise delta rule of SPEC §1 with a hand-written backward; see the module docstring."""

    @staticmethod
    def forward(ctx, query, key, value, beta, initial_state, chunk_size):
        batch_size, num_heads, length, key_dim = key.shape
        value_dim = value.shape[-1]
        state = _initial_state(query, key, value, beta, initial_state)
        output, final_state, saved = _delta_rule_forward(query, key, value, beta, state, chunk_size)
        ctx.save_for_backward(*saved)
        ctx.set_materialize_grads(False)  # an unused output or final state arrives as None
        ctx.input_dtypes = (query.dtype, key.dtype, value.dtype, None if beta is None else beta.dtype)
        ctx.state_dtype = None if initial_state is None else initial_state.dtype
        ctx.shape = (batch_size, num_heads, length, chunk_size)
        output = _from_chunks(
            output.view(batch_size * num_heads, -1, chunk_size, value_dim), batch_size, length, value.dtype
        )
        return output, final_state.view(batch_size, num_heads, key_dim, value_dim)

    @staticmethod
    def backward(ctx, grad_output, grad_final_state):
        # Own precision: a backward called inside autocast must not turn the float32 state math to half.
        device_type = next((grad.device.type for grad in (grad_output, grad_final_state) if grad is not None), "cpu")
        with torch.autocast(device_type, enabled=False):
            return DeltaRuleChunkFunction._backward(ctx, grad_output, grad_final_state)

    @staticmethod
    def _backward(ctx, grad_output, grad_final_state):
        query_flat, key_flat, value_chunks, beta_chunks, inverse, key_beta, scores, new_values, states = (
            ctx.saved_tensors
        )
        batch_size, num_heads, length, chunk_size = ctx.shape
        heads = batch_size * num_heads
        key_dim, value_dim = states.shape[-2:]
        num_chunks = states.shape[0] // heads
        dtype = states.dtype
        flat = (heads * num_chunks, chunk_size)

        if grad_output is None:
            grad_output_flat = states.new_zeros(*flat, value_dim)
        else:
            grad_output_flat = _to_chunks(grad_output, chunk_size, dtype).reshape(*flat, value_dim)

        # Reverse recurrence from dS_N = d(final state): dV'_n = P_nᵀ dO_n + K_n dS_{n+1}, through V' = A⁻¹ Y with
        # Y = diag(β) V − diag(β) K S: dY_n = A_n⁻ᵀ dV'_n and dS_n = Q_nᵀ dO_n + dS_{n+1} − (diag(β) K_n)ᵀ dY_n. The
        # parts without dS are batched over all chunks first.
        grad_state_from_output = torch.bmm(query_flat.mT, grad_output_flat).view(heads, num_chunks, key_dim, value_dim)
        grad_values_from_output = torch.bmm(scores.mT, grad_output_flat).view(heads, num_chunks, chunk_size, value_dim)
        key_chunks = key_flat.view(heads, num_chunks, chunk_size, key_dim)
        inverse_chunks = inverse.view(heads, num_chunks, chunk_size, chunk_size)
        if grad_final_state is None:
            grad_state = states.new_zeros(heads, key_dim, value_dim)
        else:
            grad_state = grad_final_state.to(dtype).reshape(heads, key_dim, value_dim)
        grad_next_states = [None] * num_chunks  # dS_{n+1}: gradient of the state leaving chunk n
        grad_value_beta = [None] * num_chunks  # dY_n: gradient of diag(β) V_n
        for index in reversed(range(num_chunks)):
            grad_next_states[index] = grad_state
            grad_new_value = torch.baddbmm(grad_values_from_output[:, index], key_chunks[:, index], grad_state)
            grad_projected = torch.bmm(inverse_chunks[:, index].mT, grad_new_value)
            grad_value_beta[index] = grad_projected
            grad_state = torch.baddbmm(grad_state_from_output[:, index].add_(grad_state), key_beta[:, index].mT,
                                       grad_projected, alpha=-1)  # fmt: skip
        grad_next_states = torch.stack(grad_next_states, dim=1).view(heads * num_chunks, key_dim, value_dim)
        grad_value_beta = torch.stack(grad_value_beta, dim=1).view(*flat, value_dim)

        # Chunk-local gradients, all chunks at once, in the form O = Q S + P V', S_next = S + Kᵀ V' with the
        # chunk's new values V' = A⁻¹ diag(β) (V − K S): everything below is a product of saved chunk quantities.
        grad_scores = torch.bmm(grad_output_flat, new_values.mT).tril_()  # dP = causal(dO V'ᵀ)
        grad_query = torch.bmm(grad_output_flat, states.mT).baddbmm_(grad_scores, key_flat)  # dO Sᵀ + dP K
        # dK (first part) = V' dS_nextᵀ + dPᵀ Q
        grad_key = torch.bmm(new_values, grad_next_states.mT).baddbmm_(grad_scores.mT, query_flat)

        # Through V' = A⁻¹ Y (dY above): dA = −dY V'ᵀ, of which the strictly lower part reaches diag(β) K Kᵀ; and
        # through Y = diag(β) V − diag(β) K S: d(diag(β) K) = −dY Sᵀ.
        grad_gram = torch.bmm(grad_value_beta, new_values.mT).tril_(-1).neg_()
        # gram = diag(β) K Kᵀ: d(diag(β) K) = −dY Sᵀ + dgram K, dK += dgramᵀ diag(β) K.
        grad_key_beta = torch.bmm(grad_gram, key_flat).baddbmm_(grad_value_beta, states.mT, alpha=-1)
        beta_flat = beta_chunks.reshape(*flat, 1)
        grad_key.baddbmm_(grad_gram.mul_(beta_flat).mT, key_flat)
        grad_key.addcmul_(grad_key_beta, beta_flat)

        query_dtype, key_dtype, value_dtype, beta_dtype = ctx.input_dtypes

        def unchunk(tensor, dtype):
            return _from_chunks(tensor.view(heads, num_chunks, chunk_size, -1), batch_size, length, dtype)

        grad_beta = None
        if ctx.needs_input_grad[3]:
            # dβ_t = d(β k_t)·k_t + d(β v_t)·v_t. The products go into buffers that are no longer needed
            # (fresh large allocations are slow on CPU).
            value_flat = value_chunks.reshape(*flat, value_dim)
            grad_beta = grad_key_beta.mul_(key_flat).sum(-1)
            grad_beta += torch.linalg.vecdot(grad_value_beta, value_flat)
            grad_beta = unchunk(grad_beta, beta_dtype).squeeze(-1)
        grad_initial_state = None
        if ctx.needs_input_grad[4]:
            grad_initial_state = grad_state.view(batch_size, num_heads, key_dim, value_dim).to(ctx.state_dtype)
        return (
            unchunk(grad_query, query_dtype) if ctx.needs_input_grad[0] else None,
            unchunk(grad_key, key_dtype) if ctx.needs_input_grad[1] else None,
            unchunk(grad_value_beta.mul_(beta_flat), value_dtype) if ctx.needs_input_grad[2] else None,
            grad_beta,
            grad_initial_state,
            None,
        )


def delta_rule_chunk(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise delta rule (SPEC §1). Inputs are not validated here; use ``memlm.kernels.delta_rule``.

    Shapes: query/key ``(B, H, T, d_k)``, value ``(B, H, T, d_v)``, beta ``(B, H, T)`` or ``None``
    (β = 1), initial_state ``(B, H, d_k, d_v)`` or ``None`` (zeros). Returns the output in the value's
    dtype and the final state in float32 (float64 for float64 inputs) if ``output_final_state``.
    """
    inputs = (query, key, value, beta, initial_state)
    if torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in inputs):
        output, final_state = DeltaRuleChunkFunction.apply(query, key, value, beta, initial_state, chunk_size)
        return output, (final_state if output_final_state else None)

    # Without autograd nothing has to be kept for a backward: run the sequence in segments of whole chunks,
    # carrying the state, so the temporaries stay small and the time per token does not grow with T.
    batch_size, num_heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    state = _initial_state(*inputs)
    tokens_per_segment = chunk_size * max(
        1, _SEGMENT_ELEMENTS // (batch_size * num_heads * chunk_size * (key_dim + value_dim))
    )
    if torch.compiler.is_exporting():  # one graph for every batch size: the exported block is one segment
        tokens_per_segment = max(length, 1)
    output = value.new_empty(batch_size, num_heads, length, value_dim)
    for start in range(0, length, tokens_per_segment):
        end = min(start + tokens_per_segment, length)
        segment_output, state, _ = _delta_rule_forward(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            None if beta is None else beta[:, :, start:end],
            state,
            chunk_size,
        )
        segment_output = segment_output.view(batch_size, num_heads, -1, value_dim)
        output[:, :, start:end] = segment_output[:, :, : end - start]
    final_state = state.view(batch_size, num_heads, key_dim, value_dim) if output_final_state else None
    return output, final_state


def sum_rule_chunk(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise sum rule (causal linear attention), differentiated by autograd.

    Per chunk ``n``: ``O_n = Q_n S_n + causal(Q_n K_nᵀ) V_n`` with ``S_n = S₀ + Σ_{m<n} K_mᵀ V_m``, an
    exclusive cumulative sum, so there is no loop at all. Same shapes and dtypes as :func:`delta_rule_chunk`.
    """
    batch_size, num_heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    dtype = _compute_dtype(query, key, value, initial_state)
    query_chunks = _to_chunks(query, chunk_size, dtype)
    key_chunks = _to_chunks(key, chunk_size, dtype)
    value_chunks = _to_chunks(value, chunk_size, dtype)
    heads, num_chunks = key_chunks.shape[:2]

    chunk_updates = key_chunks.mT @ value_chunks  # K_nᵀ V_n, (B·H, N, d_k, d_v)
    # Exclusive cumulative sum: the state entering chunk n holds the updates of chunks 0..n-1.
    states = torch.cat([torch.zeros_like(chunk_updates[:, :1]), chunk_updates[:, :-1].cumsum(dim=1)], dim=1)
    if initial_state is not None:
        states = states + initial_state.to(dtype).reshape(heads, 1, key_dim, value_dim)
    scores = (query_chunks @ key_chunks.mT).tril()  # causal(Q Kᵀ)
    output = query_chunks @ states + scores @ value_chunks
    final_state = None
    if output_final_state:
        final_state = (states[:, -1] + chunk_updates[:, -1]).reshape(batch_size, num_heads, key_dim, value_dim)
    return _from_chunks(output, batch_size, length, value.dtype), final_state


def delta_rule_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One delta-rule step for decoding (T = 1): O(d_k·d_v), independent of the context length.

    Same arguments and returns as :func:`delta_rule_chunk` with ``T == 1``; with ``in_place`` (no autograd) the new
    state is written into ``initial_state`` when it is contiguous and in the compute dtype, and the returned final
    state is then ``initial_state`` itself (a decoding cache keeps its memory without copying it).
    """
    batch_size, num_heads, _, key_dim = key.shape
    value_dim = value.shape[-1]
    dtype = _compute_dtype(query, key, value, beta, initial_state)
    # One row per (batch, head): (B·H, 1, d), so each product is a single bmm. Decoding is bound by the number of ops
    # (a few µs each on a CPU), so none is spent on a conversion that has nothing to do.
    query_step = in_dtype(query, dtype).reshape(-1, 1, key_dim)
    key_step = in_dtype(key, dtype).reshape(-1, 1, key_dim)
    value_step = in_dtype(value, dtype).reshape(-1, 1, value_dim)
    if initial_state is None:
        state = key_step.new_zeros(batch_size * num_heads, key_dim, value_dim)
    else:
        state = in_dtype(initial_state, dtype).reshape(-1, key_dim, value_dim)  # a view when it can be updated
    delta = torch.baddbmm(value_step, key_step, state, alpha=-1)  # v − v̄ with v̄ = Sᵀ k, as a row, in one op
    if beta is not None:
        delta = delta * in_dtype(beta, dtype).reshape(-1, 1, 1)
    # S + β k (v − v̄)ᵀ: an outer product, element-wise (a matrix product with an inner size of 1 costs more).
    in_place = (
        in_place
        and initial_state is not None
        and state.data_ptr() == initial_state.data_ptr()  # a view of it, not a converted copy
        and not (torch.is_grad_enabled() and (state.requires_grad or delta.requires_grad))
    )
    if in_place:
        state.addcmul_(key_step.mT, delta)
    else:
        state = torch.addcmul(state, key_step.mT, delta)
    output = in_dtype(torch.bmm(query_step, state).view(batch_size, num_heads, 1, value_dim), value.dtype)  # (Sᵀ q)ᵀ
    if not output_final_state:
        return output, None
    return output, initial_state if in_place else state.view(batch_size, num_heads, key_dim, value_dim)


def sum_rule_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One sum-rule step for decoding (T = 1): O(d_k·d_v), independent of the context length; ``in_place`` as for
    :func:`delta_rule_step`."""
    dtype = _compute_dtype(query, key, value, initial_state)
    query_step, key_step, value_step = in_dtype(query, dtype), in_dtype(key, dtype), in_dtype(value, dtype)
    if initial_state is None:
        state = key_step.mT @ value_step  # k vᵀ
    else:
        state = in_dtype(initial_state, dtype)
        in_place = (
            in_place
            and state is initial_state
            and not (torch.is_grad_enabled() and (state.requires_grad or key_step.requires_grad
                                                  or value_step.requires_grad))
        )  # fmt: skip
        state = state.addcmul_(key_step.mT, value_step) if in_place else torch.addcmul(state, key_step.mT, value_step)
    return in_dtype(query_step @ state, value.dtype), (state if output_final_state else None)
