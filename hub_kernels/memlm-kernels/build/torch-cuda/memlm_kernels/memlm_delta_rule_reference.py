"""Readable recurrent definition of the delta rule and the sum rule (SPEC §1).

One plain loop over time per rule, exactly as written in Schlag, Irie & Schmidhuber (2021),
*Linear Transformers Are Secretly Fast Weight Programmers*: the sum rule of Eqs. 17-19 and the
delta rule of Sec. 4.2, Eqs. 20-25. Every faster path in ``memlm.kernels.delta_rule`` is tested
against these functions.

The paper writes the fast weight as ``W ∈ R^{d_v×d_k}`` and reads it with ``W k``; here, as in
SPEC §1, the memory is ``S = Wᵀ ∈ R^{d_k×d_v}`` and is read with ``Sᵀ k``.

Shapes: query/key ``(B, H, T, d_k)``, value ``(B, H, T, d_v)``, beta ``(B, H, T)``, state
``(B, H, d_k, d_v)``. The state is kept in float32 (float64 when an input is float64); the output
has the value's dtype.
"""

import torch

__all__ = ["delta_rule_reference", "sum_rule_reference"]


def _state_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when any input is float64."""
    if any(tensor is not None and tensor.dtype == torch.float64 for tensor in tensors):
        return torch.float64
    return torch.float32


def delta_rule_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule, one token at a time. ``beta=None`` means β = 1.

    Returns the output ``(B, H, T, d_v)`` in the value's dtype and, if ``output_final_state``, the
    final state ``(B, H, d_k, d_v)`` (else ``None``).
    """
    batch_size, num_heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    dtype = _state_dtype(query, key, value, beta, initial_state)
    output_dtype = value.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if beta is None:
        beta = torch.ones(batch_size, num_heads, length, dtype=dtype, device=key.device)
    beta = beta.to(dtype)
    if initial_state is None:
        state = torch.zeros(batch_size, num_heads, key_dim, value_dim, dtype=dtype, device=key.device)
    else:
        state = initial_state.to(dtype)

    outputs = []
    for t in range(length):
        k_t, v_t, q_t = key[:, :, t], value[:, :, t], query[:, :, t]
        # v̄_t = S_{t-1}ᵀ k_t: the value k_t currently retrieves (Eq. 20).
        retrieved = torch.einsum("bhkv,bhk->bhv", state, k_t)
        # S_t = S_{t-1} + β_t k_t (v_t − v̄_t)ᵀ (Eq. 24).
        state = state + beta[:, :, t, None, None] * k_t[..., :, None] * (v_t - retrieved)[..., None, :]
        # o_t = S_tᵀ q_t (Eq. 25).
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q_t))
    output = torch.stack(outputs, dim=2) if outputs else value.new_zeros(batch_size, num_heads, 0, value_dim)
    return output.to(output_dtype), (state if output_final_state else None)


def sum_rule_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum rule (un-normalised linear attention), one token at a time.

    Returns the output ``(B, H, T, d_v)`` in the value's dtype and, if ``output_final_state``, the
    final state ``(B, H, d_k, d_v)`` (else ``None``).
    """
    batch_size, num_heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    dtype = _state_dtype(query, key, value, initial_state)
    output_dtype = value.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if initial_state is None:
        state = torch.zeros(batch_size, num_heads, key_dim, value_dim, dtype=dtype, device=key.device)
    else:
        state = initial_state.to(dtype)

    outputs = []
    for t in range(length):
        # S_t = S_{t-1} + k_t v_tᵀ (Eq. 17).
        state = state + key[:, :, t, :, None] * value[:, :, t, None, :]
        # o_t = S_tᵀ q_t (Eq. 19, without the attention normaliser).
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, query[:, :, t]))
    output = torch.stack(outputs, dim=2) if outputs else value.new_zeros(batch_size, num_heads, 0, value_dim)
    return output.to(output_dtype), (state if output_final_state else None)
