"""memlm's delta-rule call in flash-linear-attention's convention, for both places that hand it to FLA's kernels: the
``"fla"`` backend (`flash_linear_attention.py`, the installed package) and a swapped-in Hub kernel
(`hub_function.py`). It imports nothing of FLA.

- layout: memlm's query, key and value are ``(B, H, T, d)``, FLA's ``(B, T, H, d)`` (transposed views here; FLA makes
  them contiguous); β is ``(B, H, T)`` or ``None`` (β = 1) in memlm, ``(B, T, H)`` and required by FLA;
- queries: memlm's callers scale and normalise queries and keys before the call, so FLA gets ``scale=1`` (its default
  is d_k^-1/2) and ``use_qk_l2norm_in_kernel=False``;
- states: memlm keeps them in float32;
- packed sequences: ``cu_seqlens`` offsets as int64, with a host copy (``cu_seqlens_cpu``) that spares FLA a device
  sync.
"""

import torch

__all__ = ["fla_call"]


def fla_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: list[int] | None = None,
) -> tuple[tuple[torch.Tensor, ...], dict]:
    """(query, key, value, β) in FLA's layout, and the keyword arguments its delta-rule kernels take."""
    batch_size, num_heads, length, _ = key.shape
    query, key, value = (tensor.transpose(1, 2) for tensor in (query, key, value))  # (B, T, H, d)
    beta = key.new_ones(batch_size, length, num_heads) if beta is None else beta.transpose(1, 2)
    arguments = {
        "scale": 1.0,
        "initial_state": None if initial_state is None else initial_state.float(),
        "output_final_state": output_final_state,
        "use_qk_l2norm_in_kernel": False,
    }
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int64)
        host = cu_seqlens.cpu() if cu_seqlens_cpu is None else torch.tensor(cu_seqlens_cpu, dtype=torch.int64)
        arguments.update(cu_seqlens=cu_seqlens, cu_seqlens_cpu=host)
    return (query, key, value, beta), arguments
