"""Kernels behind the memlm models: one folder per operation (SPEC §5).

Each operation has a readable recurrent reference (``reference.py``) beside a PyTorch implementation and Triton
kernels (``triton_*.py``), and a single public function that dispatches between them. This module only holds what
every operation shares: choosing the backend. It imports nothing heavy: ``import memlm`` never needs Triton or a GPU,
and the Triton modules are imported only when their backend runs.

The backend is picked, in order, by the ``backend=`` argument of the public function, the environment variable
``MEMLM_KERNELS``, and otherwise by the tensors: ``"triton"`` for CUDA tensors when Triton is installed,
``"torch"`` for everything else.

- ``"torch"``: the vectorised pure-PyTorch implementation (runs everywhere).
- ``"triton"``: the Triton kernels, on CUDA tensors (on CPU tensors only inside Triton's interpreter,
  ``TRITON_INTERPRET=1``, which is how the tests run them without a GPU). Cases a kernel does not cover (e.g.
  float64, attention dropout) run the PyTorch implementation.
- ``"reference"``: the readable recurrent definition, for debugging and tests.
"""

import importlib.util
import os

__all__ = ["BACKENDS", "ENVIRONMENT_VARIABLE", "check_triton_device", "resolve_backend", "triton_available"]

ENVIRONMENT_VARIABLE = "MEMLM_KERNELS"
BACKENDS = ("torch", "triton", "reference")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str | None = None, device=None) -> str:
    """Return the backend to run: ``backend`` if given, else ``$MEMLM_KERNELS``, else ``"triton"`` when ``device``
    is a CUDA device and Triton is installed, else ``"torch"``.

    Raises:
        ValueError: if the requested backend is unknown, naming where it came from (the argument or the
            environment variable), the bad value and the allowed values; or if ``"triton"`` is requested and the
            ``triton`` package is not installed.
    """
    if backend is None:
        source = f"environment variable {ENVIRONMENT_VARIABLE}"
        backend = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
        if not backend:
            cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
            return "triton" if cuda and triton_available() else "torch"
    else:
        source = "argument backend"
    allowed = ", ".join(repr(name) for name in BACKENDS)
    if backend not in BACKENDS:
        raise ValueError(f"{source}={backend!r} is not a known kernel backend; allowed values are {allowed}.")
    if backend == "triton" and not triton_available():
        raise ValueError(
            f"{source}={backend!r} needs the triton package, which is not installed (pip install triton, on Linux); "
            f"allowed values are {allowed}."
        )
    return backend


def check_triton_device(device) -> None:
    """Raise ``ValueError`` unless Triton kernels can run on ``device``: CUDA, or any device inside Triton's
    interpreter."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"The 'triton' kernel backend runs on CUDA tensors (or, for testing, on CPU inside Triton's interpreter "
            f"with TRITON_INTERPRET=1 set before memlm's kernels are imported); got tensors on {device}. Use "
            f"MEMLM_KERNELS=torch on this device."
        )
