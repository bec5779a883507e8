"""The step body compiled by `torch.compile` (the `compile_step` option of the Feedback Transformer's config).

A step of the recurrence runs ~40 small ops per layer on (B, D) rows: a CPU spends more time launching them than
computing. `torch.compile` (inductor) fuses the element-wise ops around each product of the step's three pure
functions (the query, the block after the attention read, the memory of Eq. 1; `modeling_feedback_transformer.py`)
into a few generated kernels. The same functions run eagerly otherwise; the tests check both against `reference.py`.
"""

import functools
import shutil

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = ["compiled", "compiler_available"]


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
