"""Fused recurrent delta rule and sum rule in Triton (SPEC §1, §5): the decoding step, and a recurrent forward.

Per head, with the memory ``S ∈ R^{d_k×d_v}`` and for each token t in order:

- delta rule: ``v̄_t = Sᵀ k_t``, ``S ← S + β_t k_t (v_t − v̄_t)ᵀ``, ``o_t = Sᵀ q_t``;
- sum rule: ``S ← S + k_t v_tᵀ``, ``o_t = Sᵀ q_t``.

One kernel launch per call. Each program owns one (batch, head) and one block of value columns: the
columns of ``S`` are independent of each other (``v̄``, the update and ``o`` all act column by column), so
a program reads its ``d_k × BLOCK_V`` tile of the state once, keeps it in registers over all the tokens,
and writes it once. Keys wider than ``MAX_REGISTER_KEY_DIM`` keep the state in the final-state tensor instead
and stream it in slices of rows for every token, so every key width runs. For T = 1 this is the decoding step;
for T > 1 it is a fused recurrent forward, for inference only (no autograd: training uses the chunkwise kernel).
Per-token pointers advance by one stride per token (64-bit), so long prefills cannot overflow an address.

Same arguments, shapes and dtypes as ``delta_rule_step`` / ``sum_rule_step`` of ``chunk.py``: query/key
``(B, H, T, d_k)``, value ``(B, H, T, d_v)``, beta ``(B, H, T)`` or ``None`` (β = 1), state ``(B, H, d_k, d_v)``
or ``None`` (zeros). The math runs in float32 (float64 for float64 inputs); the output has the value's
dtype and the final state the compute dtype. Inputs may be strided (e.g. a transposed ``(B, T, H, d)``).
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(
        "memlm's Triton kernels need the triton package: pip install triton (Linux), or use the "
        "'torch' kernel backend."
    ) from error

import torch

from .memlm_delta_rule_chunk import _compute_dtype

__all__ = ["delta_rule_step_triton", "sum_rule_step_triton"]

# Up to this key width a program holds its whole column block of the state, d_k rows, in registers; wider keys keep
# the state in the output state tensor (global memory) and stream it BLOCK_K rows at a time for every token.
MAX_REGISTER_KEY_DIM = 1024
# Elements of the state tile one program holds (d_k rows × BLOCK_V columns), and its narrowest width.
_TILE_ELEMENTS = 4096
_MIN_BLOCK_V = 8
# Rows of the state per slice when the state stays in global memory.
_WIDE_BLOCK_K = 128


@triton.jit
def _fused_recurrent_kernel(
    query_ptr,
    key_ptr,
    value_ptr,
    beta_ptr,
    initial_state_ptr,
    output_ptr,
    final_state_ptr,
    query_strides_b,
    query_strides_h,
    query_strides_t,
    query_strides_k,
    key_strides_b,
    key_strides_h,
    key_strides_t,
    key_strides_k,
    value_strides_b,
    value_strides_h,
    value_strides_t,
    value_strides_v,
    beta_strides_b,
    beta_strides_h,
    beta_strides_t,
    initial_state_strides_b,
    initial_state_strides_h,
    initial_state_strides_k,
    initial_state_strides_v,
    output_strides_b,
    output_strides_h,
    output_strides_t,
    output_strides_v,
    final_state_strides_b,
    final_state_strides_h,
    final_state_strides_k,
    final_state_strides_v,
    num_heads,
    length,
    key_dim,
    value_dim,
    DELTA_RULE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    STATE_IN_REGISTERS: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Program (batch·head, value block). Offsets are 64-bit: the per-token pointers advance by one stride per
    # token instead of multiplying the token index by the stride, so long prefills cannot overflow.
    batch_head = tl.program_id(0).to(tl.int64)
    batch = batch_head // num_heads
    head = batch_head % num_heads
    columns = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    column_mask = columns < value_dim

    initial_state_head = initial_state_ptr + batch * initial_state_strides_b + head * initial_state_strides_h
    final_state_head = final_state_ptr + batch * final_state_strides_b + head * final_state_strides_h
    query_token = query_ptr + batch * query_strides_b + head * query_strides_h
    key_token = key_ptr + batch * key_strides_b + head * key_strides_h
    value_row = value_ptr + batch * value_strides_b + head * value_strides_h + columns * value_strides_v
    output_row = output_ptr + batch * output_strides_b + head * output_strides_h + columns * output_strides_v
    beta_token = beta_ptr + batch * beta_strides_b + head * beta_strides_h

    if STATE_IN_REGISTERS:
        rows = tl.arange(0, BLOCK_K)
        row_mask = rows < key_dim
        tile_mask = row_mask[:, None] & column_mask[None, :]
        # The state tile S[:, columns], read once. Padded rows and columns load as zero and stay zero: their
        # keys and values are masked to zero, so they neither write nor are read.
        if HAS_INITIAL_STATE:
            initial_state_tile = (
                initial_state_head
                + rows[:, None] * initial_state_strides_k
                + columns[None, :] * initial_state_strides_v
            )
            state = tl.load(initial_state_tile, mask=tile_mask, other=0.0).to(COMPUTE_DTYPE)
        else:
            state = tl.zeros([BLOCK_K, BLOCK_V], dtype=COMPUTE_DTYPE)
        for _ in range(length):
            key = tl.load(key_token + rows * key_strides_k, mask=row_mask, other=0.0).to(COMPUTE_DTYPE)
            value = tl.load(value_row, mask=column_mask, other=0.0).to(COMPUTE_DTYPE)
            query = tl.load(query_token + rows * query_strides_k, mask=row_mask, other=0.0).to(COMPUTE_DTYPE)
            if DELTA_RULE:
                # v̄_t = Sᵀ k_t: what k_t currently retrieves, column by column.
                retrieved = tl.sum(state * key[:, None], axis=0)
                update = value - retrieved
                if HAS_BETA:
                    update = update * tl.load(beta_token).to(COMPUTE_DTYPE)
                # S ← S + β_t k_t (v_t − v̄_t)ᵀ
                state += key[:, None] * update[None, :]
            else:
                # S ← S + k_t v_tᵀ
                state += key[:, None] * value[None, :]
            # o_t = Sᵀ q_t with the updated state.
            output = tl.sum(state * query[:, None], axis=0)
            tl.store(output_row, output.to(output_ptr.dtype.element_ty), mask=column_mask)
            query_token += query_strides_t
            key_token += key_strides_t
            value_row += value_strides_t
            output_row += output_strides_t
            beta_token += beta_strides_t
        # The new state, written once.
        if STORE_FINAL_STATE:
            final_state_tile = (
                final_state_head + rows[:, None] * final_state_strides_k + columns[None, :] * final_state_strides_v
            )
            tl.store(final_state_tile, state.to(final_state_ptr.dtype.element_ty), mask=tile_mask)
    else:
        # The state lives in the final state tensor (always given here), BLOCK_K rows at a time.
        for row_start in range(0, key_dim, BLOCK_K):
            rows = row_start + tl.arange(0, BLOCK_K)
            tile_mask = (rows < key_dim)[:, None] & column_mask[None, :]
            if HAS_INITIAL_STATE:
                initial_state_tile = (
                    initial_state_head
                    + rows[:, None] * initial_state_strides_k
                    + columns[None, :] * initial_state_strides_v
                )
                tile = tl.load(initial_state_tile, mask=tile_mask, other=0.0).to(COMPUTE_DTYPE)
            else:
                tile = tl.zeros([BLOCK_K, BLOCK_V], dtype=COMPUTE_DTYPE)
            final_state_tile = (
                final_state_head + rows[:, None] * final_state_strides_k + columns[None, :] * final_state_strides_v
            )
            tl.store(final_state_tile, tile.to(final_state_ptr.dtype.element_ty), mask=tile_mask)
        tl.debug_barrier()  # the tiles are read back by other threads of the program
        for _ in range(length):
            value = tl.load(value_row, mask=column_mask, other=0.0).to(COMPUTE_DTYPE)
            update = value
            if DELTA_RULE:
                # v̄_t = Sᵀ k_t, summed over slices of rows.
                retrieved = tl.zeros([BLOCK_V], dtype=COMPUTE_DTYPE)
                for row_start in range(0, key_dim, BLOCK_K):
                    rows = row_start + tl.arange(0, BLOCK_K)
                    row_mask = rows < key_dim
                    tile_mask = row_mask[:, None] & column_mask[None, :]
                    final_state_tile = (
                        final_state_head
                        + rows[:, None] * final_state_strides_k
                        + columns[None, :] * final_state_strides_v
                    )
                    state = tl.load(final_state_tile, mask=tile_mask, other=0.0).to(COMPUTE_DTYPE)
                    key = tl.load(key_token + rows * key_strides_k, mask=row_mask, other=0.0).to(COMPUTE_DTYPE)
                    retrieved += tl.sum(state * key[:, None], axis=0)
                update = value - retrieved
                if HAS_BETA:
                    update = update * tl.load(beta_token).to(COMPUTE_DTYPE)
            # S ← S + k_t uᵀ (u = β_t (v_t − v̄_t) or v_t) and o_t = Sᵀ q_t, slice by slice.
            output = tl.zeros([BLOCK_V], dtype=COMPUTE_DTYPE)
            for row_start in range(0, key_dim, BLOCK_K):
                rows = row_start + tl.arange(0, BLOCK_K)
                row_mask = rows < key_dim
                tile_mask = row_mask[:, None] & column_mask[None, :]
                final_state_tile = (
                    final_state_head + rows[:, None] * final_state_strides_k + columns[None, :] * final_state_strides_v
                )
                state = tl.load(final_state_tile, mask=tile_mask, other=0.0).to(COMPUTE_DTYPE)
                key = tl.load(key_token + rows * key_strides_k, mask=row_mask, other=0.0).to(COMPUTE_DTYPE)
                query = tl.load(query_token + rows * query_strides_k, mask=row_mask, other=0.0).to(COMPUTE_DTYPE)
                state += key[:, None] * update[None, :]
                output += tl.sum(state * query[:, None], axis=0)
                tl.store(final_state_tile, state.to(final_state_ptr.dtype.element_ty), mask=tile_mask)
            tl.store(output_row, output.to(output_ptr.dtype.element_ty), mask=column_mask)
            query_token += query_strides_t
            key_token += key_strides_t
            value_row += value_strides_t
            output_row += output_strides_t
            beta_token += beta_strides_t
            tl.debug_barrier()


def _check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    in_place: bool,
) -> None:
    """Raise before launching if the kernel would read out of bounds, or if autograd is expected."""
    tensors = {"query": query, "key": key, "value": value, "beta": beta, "initial_state": initial_state}
    if torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors.values()):
        raise RuntimeError(
            "the fused recurrent Triton delta/sum rule is for inference and has no backward; an input requires "
            "grad. Use the chunkwise kernel (memlm.kernels.delta_rule.delta_rule / sum_rule) for training, or "
            "run under torch.no_grad()."
        )
    if key.dim() != 4 or query.shape != key.shape:
        raise ValueError(
            f"query and key must both have shape (batch, heads, tokens, key width), got query "
            f"{tuple(query.shape)} and key {tuple(key.shape)}."
        )
    batch_size, num_heads, length, key_dim = key.shape
    if value.dim() != 4 or value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"value must have shape {(batch_size, num_heads, length)} + (value width,), got {tuple(value.shape)}."
        )
    if beta is not None and beta.shape != (batch_size, num_heads, length):
        raise ValueError(f"beta must have shape {(batch_size, num_heads, length)}, got {tuple(beta.shape)}.")
    expected_state = (batch_size, num_heads, key_dim, value.shape[-1])
    if initial_state is not None and initial_state.shape != expected_state:
        raise ValueError(f"initial_state must have shape {expected_state}, got {tuple(initial_state.shape)}.")
    devices = {tensor.device for tensor in tensors.values() if tensor is not None}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(device) for device in devices)}.")
    if not key.is_cuda and isinstance(_fused_recurrent_kernel, triton.runtime.JITFunction):
        raise RuntimeError(
            f"the Triton kernel needs CUDA tensors, got {key.device}; to run it on CPU, set TRITON_INTERPRET=1 "
            "before memlm's Triton kernels are first imported."
        )
    if in_place:
        if initial_state is None:
            raise ValueError("in_place=True updates initial_state, which must then be given.")
        compute_dtype = _compute_dtype(query, key, value, beta, initial_state)
        if initial_state.dtype != compute_dtype or not initial_state.is_contiguous():
            raise ValueError(
                f"in_place=True needs a contiguous initial_state of dtype {compute_dtype}, got "
                f"{initial_state.dtype} (contiguous: {initial_state.is_contiguous()})."
            )


def _fused_recurrent(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    in_place: bool,
    delta_rule: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the kernel for either rule; see :func:`delta_rule_step_triton`."""
    _check_inputs(query, key, value, beta, initial_state, in_place)
    batch_size, num_heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    compute_dtype = _compute_dtype(query, key, value, beta, initial_state)
    output = torch.empty(batch_size, num_heads, length, value_dim, dtype=value.dtype, device=value.device)
    key_width = triton.next_power_of_2(max(key_dim, 1))
    state_in_registers = key_width <= MAX_REGISTER_KEY_DIM
    # A state too wide for registers is kept in the final state tensor during the call, asked for or not.
    store_final_state = output_final_state or in_place or not state_in_registers
    if in_place:
        final_state = initial_state
    elif store_final_state:
        final_state = torch.empty(batch_size, num_heads, key_dim, value_dim, dtype=compute_dtype, device=key.device)
    else:
        final_state = None
    if batch_size * num_heads == 0 or value_dim == 0:  # nothing to compute: every tensor is empty
        return output, (final_state if output_final_state else None)

    # A d_k × BLOCK_V tile of about _TILE_ELEMENTS elements per program: narrower column blocks for wider keys.
    block_k = key_width if state_in_registers else _WIDE_BLOCK_K
    block_v = min(triton.next_power_of_2(value_dim), max(_MIN_BLOCK_V, _TILE_ELEMENTS // block_k))
    grid = (batch_size * num_heads, triton.cdiv(value_dim, block_v))
    # Unused pointers get a real tensor and zero strides; their constexpr flag keeps the kernel from reading them.
    beta_strides = beta.stride() if beta is not None else (0, 0, 0)
    initial_state_strides = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    final_state_strides = final_state.stride() if final_state is not None else (0, 0, 0, 0)
    _fused_recurrent_kernel[grid](
        query,
        key,
        value,
        beta if beta is not None else key,
        initial_state if initial_state is not None else key,
        output,
        final_state if final_state is not None else output,
        *query.stride(),
        *key.stride(),
        *value.stride(),
        *beta_strides,
        *initial_state_strides,
        *output.stride(),
        *final_state_strides,
        num_heads,
        length,
        key_dim,
        value_dim,
        DELTA_RULE=delta_rule,
        HAS_BETA=beta is not None,
        HAS_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=store_final_state,
        STATE_IN_REGISTERS=state_in_registers,
        COMPUTE_DTYPE=tl.float64 if compute_dtype == torch.float64 else tl.float32,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        num_warps=8 if block_k * block_v > _TILE_ELEMENTS else 4,
    )
    return output, (final_state if output_final_state else None)


def delta_rule_step_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule over T ≥ 1 tokens in one fused kernel (T = 1: the decoding step). Inference only.

    Args:
        query, key: ``(B, H, T, d_k)``, any d_k (above ``MAX_REGISTER_KEY_DIM`` the state stays in memory).
        value: ``(B, H, T, d_v)``.
        beta: ``(B, H, T)``; ``None`` means β = 1.
        initial_state: ``(B, H, d_k, d_v)``; ``None`` means zeros. Left unchanged unless ``in_place``.
        output_final_state: also return the state after the last token.
        in_place: write the new state into ``initial_state`` (contiguous, in the compute dtype) instead of a
            new tensor; with ``output_final_state`` the returned state is ``initial_state`` itself.

    Returns:
        The output ``(B, H, T, d_v)`` in the value's dtype, and the final state in float32 (float64 for
        float64 inputs) if ``output_final_state``, else ``None``.

    Raises:
        RuntimeError: if grad mode is on and an input requires grad (use the chunkwise kernel to train), or
            the tensors are on CPU without the Triton interpreter.
        ValueError: on shapes that do not fit together, mixed devices,
            or ``in_place`` without a suitable ``initial_state``.
    """
    return _fused_recurrent(
        query, key, value, beta, initial_state, output_final_state, in_place=in_place, delta_rule=True
    )


def sum_rule_step_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum rule over T ≥ 1 tokens in one fused kernel (T = 1: the decoding step). Inference only.

    Same arguments, returns and errors as :func:`delta_rule_step_triton`, without ``beta``.
    """
    return _fused_recurrent(
        query, key, value, None, initial_state, output_final_state, in_place=in_place, delta_rule=False
    )
