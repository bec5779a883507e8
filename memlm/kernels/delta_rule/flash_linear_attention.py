"""The delta rule on flash-linear-attention's kernels (the ``"fla"`` backend): memlm's call mapped onto FLA's.

Imported only when that backend runs (it imports ``fla``, which ``import memlm`` never does). The call is mapped onto
FLA's convention (layout, β, scaling, float32 states, packed sequences) by `fla_convention.fla_call`, shared with a
swapped-in Hub kernel (`hub_function.py`).

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

from .fla_convention import fla_call

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
    decodes = _decodes(key, cu_seqlens)
    (query, key, value, beta), arguments = fla_call(query, key, value, beta, initial_state, output_final_state,
                                                    cu_seqlens, cu_seqlens_cpu)  # fmt: skip
    if decodes:
        output, final_state = fused_recurrent_delta_rule(query, key, value, beta, **arguments)
    else:
        chunk_size = chunk_size if chunk_size in CHUNK_SIZES else DEFAULT_CHUNK_SIZE
        output, final_state = chunk_delta_rule(query, key, value, beta, chunk_size=chunk_size, **arguments)
    return output.transpose(1, 2), final_state
