"""The step body compiled by `torch.compile` (the `compile_step` option of the Feedback Transformer's config).

A step of the recurrence runs ~40 small ops per layer on (B, D) rows: a CPU spends more time launching them than
computing. `torch.compile` (inductor) fuses the element-wise ops around each product of the step's three pure
functions below (the query, the block after the attention read, the memory of Eq. 1) into a few generated kernels.
The same functions run eagerly otherwise; the tests check both against `reference.py`. They take the weights as
arguments: one compiled function serves every layer.
"""

import functools
import shutil

import torch
import torch.nn.functional as F
from transformers.utils import logging

from ..rotary import rotate

logger = logging.get_logger(__name__)

__all__ = ["ACTIVATIONS", "compiled", "compiler_available", "step_block", "step_memory", "step_query"]


def _gelu_tanh(states: torch.Tensor) -> torch.Tensor:
    return F.gelu(states, approximate="tanh")  # 🤗's "gelu_new"


# The config's `hidden_act` as plain functions, for the compiled step (one function object for every layer).
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "gelu_new": _gelu_tanh}


def _rms_norm(states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.RMSNorm.forward` as a function of its weight."""
    dtype = torch.promote_types(states.dtype, torch.float32)
    return F.rms_norm(states.to(dtype), weight.shape, weight.to(dtype), eps).to(states.dtype)


def step_query(hidden_states, norm_weight, eps: float, query_weight, cos, signed_sin, head_dim: int):
    """A layer's query of the memory, q = rotate(W_q · norm(x)): (B, D) → (B·H, d). The step body of
    `compile_step` (compiled) and the eager step compute the same numbers."""
    query = F.linear(_rms_norm(hidden_states, norm_weight, eps), query_weight)
    query = query.view(query.shape[0], -1, head_dim)
    if cos is not None:
        query = rotate(query, cos, signed_sin)
    return query.reshape(-1, head_dim)


def step_block(hidden_states, context, output_weight, norm_weight, eps: float, gate_weight, up_weight, down_weight,
               activation):  # fmt: skip
    """The rest of a layer once the memory is read: residual = x + W_o · context; x' = residual + MLP(norm(residual)).
    `up_weight` None: `gate_weight` holds [W_gate; W_up] stacked (one product). Returns residual, gate, up and x'."""
    residual = hidden_states + F.linear(context, output_weight)
    normed = _rms_norm(residual, norm_weight, eps)
    if up_weight is None:
        gate, up = F.linear(normed, gate_weight).chunk(2, dim=-1)
    else:
        gate, up = F.linear(normed, gate_weight), F.linear(normed, up_weight)
    return residual, gate, up, residual + F.linear(activation(gate) * up, down_weight)


def step_memory(states: list, layer_weights, norm_weight, eps: float, projections, cos, signed_sin, head_dim: int):
    """Paper Eq. 1, m_t = norm(Σ_l softmax(w)_l · x_t^l), and its keys and values (G, B, H, d), rotated; `projections`
    holds a (W_k, W_v) pair per key/value set. Returns the stack of the states, the mix, m_t, keys and values."""
    wide = torch.promote_types(layer_weights.dtype, torch.float32)
    weights = torch.softmax(layer_weights.to(wide), dim=0).to(states[0].dtype)
    stack = torch.stack(states)
    mixture = torch.einsum("l,lbd->bd", weights, stack)
    memory = _rms_norm(mixture, norm_weight, eps)
    batch_size = memory.shape[0]
    keys = torch.stack([F.linear(memory, key) for key, _ in projections]).view(len(projections), batch_size, -1,
                                                                                 head_dim)  # fmt: skip
    values = torch.stack([F.linear(memory, value) for _, value in projections]).view_as(keys)
    if cos is not None:
        keys = rotate(keys, cos, signed_sin)
    return stack, mixture, memory, keys, values


@functools.cache
def compiler_available(device_type: str) -> bool:
    """Whether inductor can generate code for `device_type`: a C++ compiler for the CPU, Triton for GPUs."""
    if device_type == "cpu":
        return any(shutil.which(name) for name in ("g++", "c++", "clang++"))
    if device_type in ("cuda", "xpu"):
        from torch.utils._triton import has_triton

        return has_triton()
    return False


@functools.cache
def compiled(function):
    """`function` compiled once per process (shapes become dynamic after the first new shape)."""
    return torch.compile(function, dynamic=None)


@functools.cache
def warn_no_compiler(device_type: str):
    logger.warning(
        f"compile_step=True but torch.compile has no compiler for {device_type} here (a C++ compiler for the CPU, "
        "Triton for GPUs): the Feedback Transformer's step runs eagerly."
    )
