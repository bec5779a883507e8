"""The delta rule on flash-linear-attention's kernels (the ``"fla"`` backend): memlm's call mapped onto FLA's.

Imported only when that backend runs (it imports ``fla``, which ``import memlm`` never does). The two conventions:

- layout: memlm's query, key and value are ``(B, H, T, d)``, FLA's ``(B, T, H, d)`` (FLA removed ``head_first``);
  β is ``(B, H, T)`` or ``None`` (β = 1) in memlm, ``(B, T, H)`` and required by FLA's ``chunk_delta_rule``;
- queries: memlm's callers scale and normalise them (and the keys) before the call, so FLA gets ``scale=1`` (its
  default is d_k^-1/2) and ``use_qk_l2norm_in_kernel=False``;
- states: ``(N, H, d_k, d_v)`` in both; memlm keeps them in float32, and FLA returns float32 final states;
- packed sequences: ``cu_seqlens`` offsets with batch size 1 in both (FLA wants int64, and a CPU copy spares it
  a device sync).

Both compute, per head and token (Schlag et al. 2021, Eqs. 20-25): ``v̄ = Sᵀk``, ``S ← S + β k (v − v̄)ᵀ``,
``o = Sᵀq`` (FLA's ``naive.py`` writes the same recurrence). Gradients flow to every tensor input, the initial state
included.

What FLA covers: ``fused_recurrent_delta_rule`` for one token (decoding) in float16, bfloat16 or float32, and
``chunk_delta_rule`` for longer or packed inputs in float16 or bfloat16 (it refuses float32) with key widths up to
256. :func:`fla_covers` says whether an input is covered; :func:`memlm.kernels.delta_rule.delta_rule` runs memlm's
Triton kernels for the rest.
"""

import torch

try:
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
except ImportError as error:
    raise ImportError(
        "The 'fla' kernel backend of memlm needs flash-linear-attention >= 0.6: pip install 'memlm[fla]', or choose "
        "the 'triton' or 'torch' backend."
    ) from error

__all__ = ["CHUNK_DTYPES", "CHUNK_SIZES", "MAX_CHUNK_KEY_DIM", "delta_rule_fla", "fla_covers"]

CHUNK_DTYPES = (torch.float16, torch.bfloat16)  # chunk_delta_rule asserts its inputs are not float32
RECURRENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_CHUNK_KEY_DIM = 256  # chunk_delta_rule's state kernels hold at most four 64-wide key blocks
CHUNK_SIZES = (16, 32, 64)  # the chunk sizes chunk_delta_rule accepts
DEFAULT_CHUNK_SIZE = 64


def _decodes(key: torch.Tensor, cu_seqlens: torch.Tensor | None) -> bool:
    return key.shape[2] == 1 and cu_seqlens is None


def fla_covers(query, key, value, cu_seqlens=None) -> bool:
    """Whether FLA's kernels take these inputs: one dtype for query, key and value, and for a single token any of
    float16, bfloat16 and float32 (``fused_recurrent_delta_rule``), else float16 or bfloat16 with a key width of at
    most 256 (``chunk_delta_rule``)."""
    if not query.dtype == key.dtype == value.dtype:
        return False
    if _decodes(key, cu_seqlens):
        return key.dtype in RECURRENT_DTYPES
    return key.dtype in CHUNK_DTYPES and key.shape[-1] <= MAX_CHUNK_KEY_DIM


def delta_rule_fla(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule on FLA's kernels, with memlm's arguments and results (see :func:`delta_rule`).

    Inputs must be covered (:func:`fla_covers`) and validated by :func:`delta_rule`. One token without
    ``cu_seqlens`` runs ``fused_recurrent_delta_rule``; anything else ``chunk_delta_rule``, in chunks of
    ``chunk_size`` tokens when that is 16, 32 or 64 (the sizes FLA accepts), else of 64 (the result is the same).

    Returns:
        The output ``(B, H, T, d_v)`` in the value's dtype (a transposed view of FLA's ``(B, T, H, d_v)``), and the
        final state ``(B, H, d_k, d_v)`` (``(N, H, d_k, d_v)`` with ``cu_seqlens``) in float32 if
        ``output_final_state``, else ``None``.
    """
    batch_size, num_heads, length, _ = key.shape
    decodes = _decodes(key, cu_seqlens)
    # (B, H, T, d) → (B, T, H, d): views; FLA makes them contiguous (its input_guard) before its kernels run.
    query, key, value = (tensor.transpose(1, 2) for tensor in (query, key, value))
    if beta is None:
        beta = key.new_ones(batch_size, length, num_heads)
    else:
        beta = beta.transpose(1, 2)
    if initial_state is not None:
        initial_state = initial_state.float()  # memlm's states are float32, whatever the inputs
    arguments = {
        "scale": 1.0,  # memlm's callers scale the queries themselves
        "initial_state": initial_state,
        "output_final_state": output_final_state,
        "use_qk_l2norm_in_kernel": False,  # ...and normalise queries and keys themselves
    }
    if decodes:
        output, final_state = fused_recurrent_delta_rule(query, key, value, beta, **arguments)
    else:
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(torch.int64)
            host = cu_seqlens.cpu() if cu_seqlens_cpu is None else torch.tensor(cu_seqlens_cpu, dtype=torch.int64)
            arguments.update(cu_seqlens=cu_seqlens, cu_seqlens_cpu=host)
        chunk_size = chunk_size if chunk_size in CHUNK_SIZES else DEFAULT_CHUNK_SIZE
        output, final_state = chunk_delta_rule(query, key, value, beta, chunk_size=chunk_size, **arguments)
    return output.transpose(1, 2), final_state
