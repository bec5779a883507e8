"""The delta rule as 🤗's `chunk_gated_delta_rule` kernel function, which `kernels.kernelize` can swap for a Hub kernel.

🤗 Transformers gives Qwen3-Next's gated delta rule the kernel-function name ``chunk_gated_delta_rule`` and maps it,
for ``use_kernels=True`` on CUDA, to flash-linear-attention's kernel repository (5.24: ``kernels-community/fla``,
version 2). The gated delta rule (Yang et al. 2025) is ``S_t = exp(g_t) S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ``
(FLA's ``(d_k, d_v)`` layout: ``S_t = exp(g_t) S_{t−1} + β_t k_t (v_t − exp(g_t) S_{t−1}ᵀ k_t)ᵀ``); with the gate
``g = 0`` it is DeltaNet's delta rule (Schlag et al. 2021, Eqs. 20-25), ``o_t = S_tᵀ q_t``.

DeltaNet's attention layer carries :data:`chunk_gated_delta_rule` (``use_kernelized_func``), so a kernel mapping
that names ``chunk_gated_delta_rule`` — 🤗's default mapping, or one of your own — makes ``kernels.kernelize`` swap
in that kernel, and :func:`memlm.kernels.delta_rule.delta_rule` then runs it first for what it covers (float16 or
bfloat16, key widths up to 256, more than one token or packed sequences): a Hub kernel, then the installed FLA
package, then memlm's own kernels, as Qwen3-Next orders them. Without the ``kernels`` package the decorator does
nothing and nothing is swapped.

Calls pass everything after ``beta`` by keyword (the signature a Hub layer must match fixes only the number and kind
of its arguments, not their names), and ``scale=1.0``: memlm's callers scale and normalise queries and keys
themselves. Whether a Hub repository's layer passes ``scale`` on to FLA is not verified here (no network); the tests
use a local repository whose layer does.
"""

import torch

from memlm.kernels.hub import running_kernel, use_kernel_forward_from_hub

from .fla_convention import fla_call

HUB_FUNCTION_NAME = "chunk_gated_delta_rule"
COVERED_DTYPES = (torch.float16, torch.bfloat16)  # FLA's chunk kernels refuse float32
MAX_KEY_DIM = 256  # FLA's state kernels hold at most four 64-wide key blocks


@use_kernel_forward_from_hub(HUB_FUNCTION_NAME)
def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What runs until a kernel is swapped in: memlm's delta rule in 🤗's convention for this function (Qwen3-Next's
    signature): query and key ``(B, T, H, d_k)``, value ``(B, T, H, d_v)``, the log-gate ``g`` and ``beta``
    ``(B, T, H)``, states ``(B, H, d_k, d_v)``; ``scale`` (keyword, default ``d_k^-1/2``) multiplies the queries and
    ``cu_seqlens`` packs sequences. memlm's rule has no gate: ``g`` must be zero."""
    if torch.count_nonzero(g).item():
        raise ValueError(
            "memlm's chunk_gated_delta_rule computes the ungated delta rule: g must be 0 everywhere (got a nonzero "
            "gate); kernelize a gated kernel (e.g. flash-linear-attention's) for a gated rule."
        )
    from memlm.kernels.delta_rule import delta_rule

    if use_qk_l2norm_in_kernel:
        query, key = (torch.nn.functional.normalize(tensor, dim=-1) for tensor in (query, key))
    scale = kwargs.get("scale")
    query = query * (query.shape[-1] ** -0.5 if scale is None else scale)
    output, state = delta_rule(
        *(tensor.transpose(1, 2) for tensor in (query, key, value, beta)), initial_state=initial_state,
        output_final_state=output_final_state, chunk_size=chunk_size, cu_seqlens=kwargs.get("cu_seqlens"),
    )  # fmt: skip
    return output.transpose(1, 2), state


def swapped_kernel(module: torch.nn.Module):
    """The `chunk_gated_delta_rule` kernel `kernels.kernelize` swapped into `module` (a layer carrying its own copy
    through `memlm.kernels.hub.use_kernelized_func`), or `None` while it runs memlm's own function, and under
    `torch.compile`."""
    if torch.compiler.is_compiling():  # a graph captured by torch.compile runs memlm's own kernels
        return None
    function = module.__dict__.get("_kernel_funcs", {}).get(HUB_FUNCTION_NAME)
    if function is None or running_kernel(function) is None:
        return None
    return function


def hub_covers(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens=None) -> bool:
    """Whether FLA's chunk kernel takes these inputs: one dtype, float16 or bfloat16, key widths up to 256, and more
    than one token or packed sequences (one token decodes with memlm's or FLA's recurrent step instead)."""
    return (
        query.dtype == key.dtype == value.dtype
        and key.dtype in COVERED_DTYPES
        and key.shape[-1] <= MAX_KEY_DIM
        and (key.shape[2] > 1 or cu_seqlens is not None)
    )


def delta_rule_hub(
    kernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    beta: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """memlm's delta-rule call ((B, H, T, d) tensors, β or None) on a swapped-in `chunk_gated_delta_rule` kernel,
    with g = 0 (no decay) and scale 1. Returns the output (B, H, T, d_v) and the final state (float32) or None."""
    (query, key, value, beta), arguments = fla_call(query, key, value, beta, initial_state, output_final_state,
                                                    cu_seqlens, cu_seqlens_cpu)  # fmt: skip
    batch_size, length, num_heads = beta.shape
    # g = 0: no decay, the gated rule is DeltaNet's.
    gate = torch.zeros(batch_size, length, num_heads, dtype=torch.float32, device=key.device)
    output, final_state = kernel(query, key, value, g=gate, beta=beta, **arguments)
    if output_final_state and final_state is not None:
        final_state = final_state.float()
    return output.transpose(1, 2), (final_state if output_final_state else None)
