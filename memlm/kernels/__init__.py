"""Kernels behind the memlm models: one folder per operation (SPEC §5).

Each operation has a readable recurrent reference (``reference.py``) beside a PyTorch implementation and Triton
kernels (``triton_*.py``), and a single public function that dispatches between them. This module only holds what
every operation shares: choosing the backend. It imports nothing heavy: ``import memlm`` never needs Triton,
flash-linear-attention or a GPU, and the Triton and FLA modules are imported only when their backend runs.

The backend is picked, in order, by the ``backend=`` argument of the public function, the environment variable
``MEMLM_KERNELS``, and otherwise by the tensors: for CUDA tensors ``"fla"`` when flash-linear-attention ≥ 0.6 is
installed, else ``"triton"`` when Triton is installed; ``"torch"`` for everything else.

- ``"torch"``: the vectorised pure-PyTorch implementation (runs everywhere).
- ``"triton"``: memlm's Triton kernels, on CUDA tensors (on CPU tensors only inside Triton's interpreter,
  ``TRITON_INTERPRET=1``, which is how the tests run them without a GPU). Cases a kernel does not cover (e.g.
  float64, attention dropout) run the PyTorch implementation.
- ``"fla"``: the delta rule runs flash-linear-attention's kernels (``chunk_delta_rule`` to train and prefill in
  float16/bfloat16, ``fused_recurrent_delta_rule`` to decode one token); everything FLA does not cover runs as with
  ``"triton"``: the sum rule, Expire-Span attention, float32 prefill and training, key widths above 256, and float64
  (PyTorch). Install it with ``pip install memlm[fla]``.
- ``"reference"``: the readable recurrent definition, for debugging and tests.

:func:`describe_backend` says in one line which implementation an operation will run on a device and dtype.
"""

import contextlib
import contextvars
import functools
import importlib.metadata
import importlib.util
import math
import os

import torch

__all__ = [
    "BACKENDS",
    "ENVIRONMENT_VARIABLE",
    "FLA_MINIMUM_VERSION",
    "OPERATIONS",
    "check_triton_device",
    "checked_at_every_call",
    "checking_every_call",
    "collecting_unchecked_sums",
    "describe_backend",
    "flash_linear_attention_available",
    "flash_linear_attention_version",
    "in_dtype",
    "is_finite_now",
    "mark_static",
    "plain_weights",
    "resolve_backend",
    "triton_available",
]

ENVIRONMENT_VARIABLE = "MEMLM_KERNELS"
BACKENDS = ("torch", "triton", "reference", "fla")
# The public operations of memlm.kernels, and the ones flash-linear-attention implements.
OPERATIONS = ("delta_rule", "sum_rule", "expire_span_attention", "feedback")
FLA_OPERATIONS = ("delta_rule",)
FLA_MINIMUM_VERSION = (0, 6)
FLA_INSTALL_HINT = "pip install 'memlm[fla]'"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def flash_linear_attention_version() -> str | None:
    """The installed version of flash-linear-attention's kernels, or ``None`` if the ``fla`` package is not there.

    Read from the package metadata, without importing ``fla`` (which is slow and registers FLA's models with 🤗
    Auto classes). In 0.6 the kernels (``fla.ops``) ship in the ``fla-core`` distribution, which
    ``flash-linear-attention`` pins to its own version; without ``fla-core`` the version of
    ``flash-linear-attention`` is read.
    """
    if importlib.util.find_spec("fla") is None:
        return None
    for distribution in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"0.6.0"`` → ``(0, 6, 0)``."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return ()


def flash_linear_attention_available() -> bool:
    """Whether flash-linear-attention ≥ 0.6 (the version whose conventions ``"fla"`` maps) and Triton are
    installed."""
    version = flash_linear_attention_version()
    return version is not None and _release(version) >= FLA_MINIMUM_VERSION and triton_available()


def resolve_backend(backend: str | None = None, device=None, operation: str | None = None) -> str:
    """Return the backend to run: ``backend`` if given, else ``$MEMLM_KERNELS``, else, when ``device`` is a CUDA
    device, ``"fla"`` if flash-linear-attention ≥ 0.6 is installed or ``"triton"`` if Triton is, else ``"torch"``.

    ``"fla"`` is returned only for the operations flash-linear-attention implements (``operation="delta_rule"``);
    for any other operation (or ``operation=None``) it resolves to ``"triton"``, the kernels that run in its place.

    Raises:
        ValueError: if the requested backend is unknown, naming where it came from (the argument or the
            environment variable), the bad value and the allowed values; if ``"triton"`` is requested and the
            ``triton`` package is not installed; or if ``"fla"`` is requested and flash-linear-attention ≥ 0.6 is not
            installed.
    """
    if backend is None:
        source = f"environment variable {ENVIRONMENT_VARIABLE}"
        backend = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
        if not backend:
            cuda = device is not None and getattr(device, "type", str(device).split(":")[0]) == "cuda"
            if not cuda:
                return "torch"
            if flash_linear_attention_available():
                return "fla" if operation in FLA_OPERATIONS else "triton"
            return "triton" if triton_available() else "torch"
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
    if backend == "fla":
        if not flash_linear_attention_available():
            version = flash_linear_attention_version()
            if version is None:
                found = "which is not installed"
            elif _release(version) < FLA_MINIMUM_VERSION:
                found = f"found version {version}"
            else:
                found = "which needs the triton package, not installed"
            raise ValueError(
                f"{source}='fla' needs flash-linear-attention >= 0.6, {found} ({FLA_INSTALL_HINT}); "
                f"allowed values are {allowed}."
            )
        return "fla" if operation in FLA_OPERATIONS else "triton"
    return backend


# The devices whose tensors the operations check at every call (issue 33): a CPU read-back costs no device read. On
# other devices (a GPU, whose queue a read-back at every layer would stall) the models collect the sums the calls
# would have checked and read them back once per forward, running it again with every call checked when one is not
# finite (`memlm.modeling.memory.keeps_non_finite_in_place`). Tests empty this set to run that path on CPU tensors.
DEVICES_CHECKED_AT_EVERY_CALL = {"cpu"}
_EVERY_CALL = contextvars.ContextVar("memlm_non_finite_checked_at_every_call", default=False)
_COLLECTED_SUMS = contextvars.ContextVar("memlm_non_finite_collected_sums", default=None)


@contextlib.contextmanager
def checking_every_call():
    """Within it, the operations check their outputs (`sums_are_finite`) on every device, not only CPU tensors: what
    a model's forward runs in after the sums collected on a GPU (`collecting_unchecked_sums`) were not all finite."""
    token = _EVERY_CALL.set(True)
    try:
        yield
    finally:
        _EVERY_CALL.reset(token)


@contextlib.contextmanager
def collecting_unchecked_sums():
    """Within it, the calls that do not check their tensors (`checked_at_every_call` is False for their device) append
    the float32 sums they would have checked to the list it yields, on the device, without reading them back: the
    caller reads them all at once."""
    sums = []
    token = _COLLECTED_SUMS.set(sums)
    try:
        yield sums
    finally:
        _COLLECTED_SUMS.reset(token)


def in_dtype(tensor, dtype):
    """`tensor` in `dtype`, without a call when it already is: `Tensor.to` costs a dispatch even then, and a decoding
    step, bound by its number of calls on a CPU, converts at every layer."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def mark_static(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Mark `tensor` as one that keeps its address from one compiled call to the next (CUDA graphs read it there,
    without a copy), as 🤗's static caches do; not while tracing, where torch does not allow it."""
    if tensor is not None and not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
    return tensor


def plain_tensor(weight) -> bool:
    """Whether `weight` is an ordinary tensor: not a quantized tensor subclass (torchao swaps an `nn.Linear`'s weight
    for one that implements only the module's own product) nor a packed or sharded one."""
    return type(weight) in (torch.nn.Parameter, torch.Tensor) and type(weight.data) is torch.Tensor


def plain_weights(*modules) -> bool:
    """Whether every module's weight is an ordinary tensor (`plain_tensor`). A fast path that reads weights itself
    (stacking them, passing them to a compiled function) needs this; otherwise it calls the modules."""
    return all(plain_tensor(getattr(module, "weight", None)) for module in modules)


def checked_at_every_call(device) -> bool:
    """Whether the operations check their outputs for tensors on `device` at every call (`sums_are_finite`)."""
    return _EVERY_CALL.get() or device.type in DEVICES_CHECKED_AT_EVERY_CALL


def sums_are_finite(*tensors) -> bool:
    """Whether each of `tensors` sums to a finite number (so holds no NaN or inf): the check the operations run
    before keeping a non-finite input in place (issue 33). The sums are taken in float32 (a float16 sum of finite
    values could overflow) and read back, so only where that is cheap (`checked_at_every_call`: CPU tensors, or
    everywhere inside `checking_every_call`); elsewhere it answers True without looking, after handing the sums to
    `collecting_unchecked_sums` when one collects them. Under torch.compile it answers True."""
    import torch

    if torch.compiler.is_compiling():
        return True
    if len(tensors) == 1 and tensors[0].is_cpu and "cpu" in DEVICES_CHECKED_AT_EVERY_CALL:  # (a decoding step's
        # check, at every layer: half the time of the general case below)
        return is_finite_now(tensors[0])
    if not all(checked_at_every_call(tensor.device) for tensor in tensors):
        collected = _COLLECTED_SUMS.get()
        if collected is not None:
            collected.extend(tensor.detach().sum(dtype=torch.float32) for tensor in tensors)
        return True
    sums = [tensor.detach().sum(dtype=torch.float32) for tensor in tensors]
    # .numpy() reads the CPU copy without a dispatched `.item()` (tests count those as device reads); math.isfinite
    # reads it without more torch calls (a decoding step checks at every layer).
    return all(math.isfinite(total.cpu().numpy()) for total in sums)


def is_finite_now(tensor) -> bool:
    """Whether `tensor` sums to a finite number, read back now on every device (one read-back: a GPU's queue waits for
    it), where `sums_are_finite` looks only where a read-back is free. For a check a step cannot do without: an
    Expire-Span decoding step's single look at its output (`ExpireSpanModel.step`)."""
    import torch

    total = (tensor.detach() if tensor.requires_grad else tensor).sum(dtype=torch.float32)
    # .numpy() reads a CPU sum without a dispatched `.item()` (tests count those as device reads).
    return math.isfinite((total if total.is_cpu else total.cpu()).numpy())


def check_triton_device(device, backend: str = "triton") -> None:
    """Raise ``ValueError`` unless Triton kernels (memlm's, or flash-linear-attention's for ``backend="fla"``) can
    run on ``device``: CUDA, or any device inside Triton's interpreter."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"The {backend!r} kernel backend runs on CUDA tensors (or, for testing, on CPU inside Triton's interpreter "
            f"with TRITON_INTERPRET=1 set before the kernels are imported); got tensors on {device}. Use "
            f"MEMLM_KERNELS=torch on this device."
        )


def describe_backend(operation: str, device="cpu", dtype=None, backend: str | None = None) -> str:
    """Say in one line which implementation ``operation`` runs for tensors on ``device`` of ``dtype``.

    Args:
        operation: ``"delta_rule"``, ``"sum_rule"``, ``"expire_span_attention"`` or ``"feedback"``.
        device: a ``torch.device`` or its name (``"cuda"``, ``"cpu"``).
        dtype: the inputs' dtype, a ``torch.dtype`` or its name (``"bfloat16"``, as a config's ``dtype`` may
            hold it); ``None`` means float32.
        backend: as the operation's ``backend=`` argument; ``None`` reads ``$MEMLM_KERNELS``, else the default.

    Returns:
        ``"<backend>: <what runs>"``, e.g. ``"fla: flash-linear-attention 0.6.0 chunk_delta_rule to train and
        prefill, fused_recurrent_delta_rule to decode"``.

    Raises:
        ValueError: for an unknown operation or dtype name, or as :func:`resolve_backend` for the backend.

    Example:
        >>> from memlm.kernels import describe_backend
        >>> describe_backend("delta_rule", "cpu", backend="torch")
        "torch: memlm's PyTorch chunkwise implementation (a one-token step to decode)"
        >>> describe_backend("delta_rule", "cpu", backend="reference")
        "reference: memlm's readable reference implementation"
    """
    import torch

    if operation not in OPERATIONS:
        allowed = ", ".join(repr(name) for name in OPERATIONS)
        raise ValueError(f"operation={operation!r} is not a memlm kernel operation; allowed values are {allowed}.")
    device = torch.device(device)
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise ValueError(f"dtype={dtype!r} is not a torch dtype; e.g. 'float32', 'bfloat16', 'float16'.")
        dtype = getattr(torch, name)
    dtype = torch.float32 if dtype is None else dtype
    resolved = resolve_backend(backend, device, operation)
    fla_chosen = operation not in FLA_OPERATIONS and resolve_backend(backend, device, "delta_rule") == "fla"
    if resolved == "reference":
        return "reference: memlm's readable reference implementation"
    if operation == "feedback":  # one implementation beside the reference, whatever the backend
        text = (
            f"{resolved}: memlm's PyTorch step loop (a ring of τ slots to decode; a tape and a hand-written backward "
            f"to train)"
        )
        return text + ("" if resolved == "torch" else " (no Triton kernel for this operation)")
    if resolved == "torch" or (dtype == torch.float64 and operation != "sum_rule"):
        prefix = resolved if resolved == "torch" else f"{resolved} (float64 runs PyTorch)"
        if operation == "expire_span_attention":
            return f"{prefix}: scaled_dot_product_attention with the expire-span mask as a differentiable bias"
        return f"{prefix}: memlm's PyTorch chunkwise implementation (a one-token step to decode)"
    if operation == "expire_span_attention":
        text = (
            "triton: memlm's Triton attention kernel (attention dropout and head widths above 128 run "
            "scaled_dot_product_attention)"
        )
    elif operation == "sum_rule":
        text = "triton: memlm's Triton fused recurrent step to decode, PyTorch chunkwise to train and prefill"
    elif resolved == "triton":
        text = "triton: memlm's Triton chunkwise kernel to train and prefill, its fused recurrent step to decode"
    else:
        fla = f"flash-linear-attention {flash_linear_attention_version()}"
        if dtype in (torch.float16, torch.bfloat16):
            return (
                f"fla: {fla} chunk_delta_rule to train and prefill, fused_recurrent_delta_rule to decode (key widths "
                f"above 256 run memlm's Triton kernels)"
            )
        return (
            f"fla: {fla} fused_recurrent_delta_rule to decode; memlm's Triton chunkwise kernel to train and prefill "
            f"in {str(dtype).removeprefix('torch.')} (FLA's chunk_delta_rule takes float16 and bfloat16 only)"
        )
    return text + (" (flash-linear-attention has no kernel for this operation)" if fla_chosen else "")
