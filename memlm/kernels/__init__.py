"""Kernels behind the memlm models: one folder per operation (SPEC §5).

Each operation has a readable recurrent reference (``reference.py``) beside a fast implementation
and a single public function that dispatches between them. This module only holds what every
operation shares: choosing the backend. It imports nothing heavy, so ``import memlm`` never needs
Triton or a GPU.

The backend is picked, in order, by the ``backend=`` argument of the public function, the
environment variable ``MEMLM_KERNELS``, and the default ``"torch"``:

- ``"torch"``: the vectorised pure-PyTorch implementation (runs everywhere).
- ``"reference"``: the readable recurrent definition, for debugging and tests.
"""

import os

__all__ = ["BACKENDS", "ENVIRONMENT_VARIABLE", "resolve_backend"]

ENVIRONMENT_VARIABLE = "MEMLM_KERNELS"
BACKENDS = ("torch", "reference")
DEFAULT_BACKEND = "torch"


def resolve_backend(backend: str | None = None) -> str:
    """Return the backend to run: ``backend`` if given, else ``$MEMLM_KERNELS``, else ``"torch"``.

    Raises:
        ValueError: if the requested backend is unknown, naming where it came from (the argument or
            the environment variable), the bad value and the allowed values.
    """
    if backend is None:
        source = f"environment variable {ENVIRONMENT_VARIABLE}"
        backend = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
        if not backend:
            return DEFAULT_BACKEND
    else:
        source = "argument backend"
    allowed = ", ".join(repr(name) for name in BACKENDS)
    if backend == "triton":
        raise ValueError(
            f"{source}={backend!r}: Triton kernels are not available yet in memlm; allowed values are {allowed}."
        )
    if backend not in BACKENDS:
        raise ValueError(f"{source}={backend!r} is not a known kernel backend; allowed values are {allowed}.")
    return backend
