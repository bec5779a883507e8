"""Check Triton kernels for real GPUs on a machine without one: record what a call launches, compile it, read it.

Triton compiles ahead of time for any NVIDIA target on a CPU-only machine. This module finds what a call of memlm's
kernels (or of any Triton code) launches and compiles exactly those launches for sm_80 and sm_90:

1. :func:`record_launches` runs a call inside Triton's interpreter (``TRITON_INTERPRET=1`` set before the kernels
   were imported) with CPU tensors that report ``cuda`` as their device, so that the dispatching code picks the
   tiles and launch options it would pick on a GPU — on the ``target`` GPU, whose compute capability
   ``torch.cuda.get_device_capability`` answers inside the block. Every launch is recorded (with its target): the kernel, its arguments (tensor
   dtypes and 16-byte alignment, integer values, compile-time constants), grid, ``num_warps`` and ``num_stages``.
   Autotuned kernels record every configuration (the GPU may pick any of them), or only the first.
   With ``count=True`` the interpreter also counts, per launch, the global-memory bytes that the loads, stores and
   atomics touch (unmasked elements only) and the FLOPs of ``tl.dot`` (2·M·N·K per product, on the full tiles),
   per line of the kernel's body, classified as the interpreter sees them: tensor cores for bf16 / fp16 / fp8
   operands or a TF32 input precision, CUDA cores for exact fp32 (``input_precision="ieee"``) and fp64.
2. :func:`compile_launches` compiles the distinct launches in subprocesses without the interpreter, through the
   same specialisation as ``JITFunction.run`` (integers equal to 1 and 16-divisibility of integers and pointers),
   and returns per target: shared memory, registers, spilled bytes (ptxas ``-v``), whether the PTX holds
   tensor-core instructions (``mma`` / ``wgmma``), and per kernel line how many of its dots the compiler put on
   tensor cores (TTGIR: ``warp_group_dot`` or an MMA layout) — :meth:`CompiledLaunch.split_flops` uses that to
   classify the counted FLOPs, since a kernel may take another path in the interpreter than on the GPU.

Example (a developer checking the delta rule for an A100 and an H100, from the repository's root)::

    TRITON_INTERPRET=1 python -c "
    import torch
    from memlm.kernels.delta_rule import delta_rule
    from devtools.gpu_compile import compile_launches, record_launches, on_gpu
    for target in ('sm_80', 'sm_90'):
        with record_launches(target=target) as recorder:
            q, k, v = (on_gpu(torch.randn(2, 4, 128, 64, dtype=torch.bfloat16)) for _ in range(3))
            delta_rule(q, k, v, backend='triton')
        for result in compile_launches(recorder.launches):
            print(result)
    "

Nothing here imports Triton at ``import memlm``; Triton is imported when these functions run.
"""

import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

__all__ = [
    "SHARED_MEMORY_LIMITS",
    "TARGETS",
    "CompiledLaunch",
    "Launch",
    "Recorder",
    "backward",
    "compile_launches",
    "on_gpu",
    "record_launches",
]

# Compute capability of each target, and the most shared memory one block may opt in to (CUDA C Programming
# Guide, "Technical Specifications per Compute Capability": 163 KB on 8.0, 227 KB on 9.0).
TARGETS = {"sm_80": 80, "sm_90": 90}
SHARED_MEMORY_LIMITS = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}


@dataclasses.dataclass
class Launch:
    """One kernel launch: the kernel (``module`` and ``name``), its arguments in a JSON-friendly form, and what the
    interpreter counted when ``count=True`` (bytes and FLOPs of the whole launch, all programs of the grid)."""

    module: str
    name: str
    arguments: list
    keywords: dict
    grid: list
    phase: str = ""
    # The GPU target the launch was chosen for (what get_device_capability answered); "" for any target.
    target: str = ""
    bytes_read: int = 0
    bytes_written: int = 0
    tensor_core_flops: int = 0
    cuda_core_flops: int = 0
    # Dot FLOPs by the line of the kernel's body they come from (directly or through helper functions), keyed by
    # the line's source text (line numbers shift while a file is edited).
    dot_flops_by_line: dict = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        """Identifies what gets compiled: the kernel and its specialisation, not the grid or the counts."""
        return json.dumps([self.module, self.name, self.arguments, self.keywords, self.target], sort_keys=True)

    @property
    def constants(self) -> dict:
        """The keyword arguments (compile-time constants and launch options), as readable text values."""
        return {name: _describe(value) for name, value in self.keywords.items()}


@dataclasses.dataclass
class CompiledLaunch:
    """A launch compiled for one target. ``error`` holds the compiler's message if it failed (the rest is then 0)."""

    launch: Launch
    target: str
    shared_memory: int = 0
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    tensor_core_instructions: bool = False
    # Per line of the kernel's body (its source text): [dots on tensor cores, all dots] in the compiled kernel's TTGIR.
    dots_by_line: dict = dataclasses.field(default_factory=dict)
    error: str = ""

    def split_flops(self) -> tuple[int, int]:
        """The launch's counted dot FLOPs as (on tensor cores, on CUDA cores), each kernel line's FLOPs classified by
        the dots the compiler made of that line; lines the compiled kernel has no dot for keep the interpreter's
        classification (which can differ: a kernel may take another path in the interpreter)."""
        launch = self.launch
        tensor_core = cuda_core = 0
        for line, flops in launch.dot_flops_by_line.items():
            on_tensor_cores, total = self.dots_by_line.get(line, (0, 0))
            if total:
                share = flops * on_tensor_cores // total
                tensor_core, cuda_core = tensor_core + share, cuda_core + flops - share
        unmatched = sum(flops for line, flops in launch.dot_flops_by_line.items() if not self.dots_by_line.get(line))
        counted = launch.tensor_core_flops + launch.cuda_core_flops
        if unmatched and counted:
            tensor_core += unmatched * launch.tensor_core_flops // counted
            cuda_core += unmatched - unmatched * launch.tensor_core_flops // counted
        return tensor_core, cuda_core

    @property
    def problems(self) -> list[str]:
        """What makes this launch unfit for its target: a compile error, shared memory over the limit, spills."""
        if self.error:
            return [f"does not compile: {self.error.strip().splitlines()[-1] if self.error.strip() else 'error'}"]
        found = []
        limit = SHARED_MEMORY_LIMITS[self.target]
        if self.shared_memory > limit:
            found.append(f"needs {self.shared_memory} bytes of shared memory, over the {limit} of {self.target}")
        if self.spill_stores or self.spill_loads:
            found.append(f"spills registers ({self.spill_stores} bytes stored, {self.spill_loads} bytes loaded)")
        return found

    def __str__(self) -> str:
        name = f"{self.launch.name} on {self.target} {self.launch.constants}"
        if self.error:
            return f"{name}: {'; '.join(self.problems)}"
        return (
            f"{name}: shared memory {self.shared_memory} B, {self.registers} registers, spills "
            f"{self.spill_stores}/{self.spill_loads} B, tensor cores {'yes' if self.tensor_core_instructions else 'no'}"
        )


# --- Recording -------------------------------------------------------------------------------------------------


class _OnGpu(torch.Tensor):
    """A CPU tensor that reports ``cuda:0`` as its device, so that code choosing GPU tiles by device takes that path."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):
        return True


def on_gpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (on CPU) seen as a CUDA tensor by the dispatching code; use inside :func:`record_launches`."""
    if isinstance(tensor, _OnGpu) or not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return tensor
    return tensor.as_subclass(_OnGpu)


def _cpu_device(device):
    if device is None or isinstance(device, int):
        return torch.device("cpu") if isinstance(device, int) else device
    device = torch.device(device)
    return torch.device("cpu") if device.type == "cuda" else device


def _on_gpu_everywhere(value):
    if isinstance(value, torch.Tensor):
        return on_gpu(value)
    if isinstance(value, (tuple, list)) and any(isinstance(item, torch.Tensor) for item in value):
        return type(value)(_on_gpu_everywhere(item) for item in value)
    return value


class _AsIfOnGpu(torch.overrides.TorchFunctionMode):
    """Allocations asked on ``cuda`` are made on CPU, and every tensor result reports ``cuda``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return on_gpu(args[0])
        if name == "to":
            args = tuple(
                _cpu_device(item) if isinstance(item, (torch.device, int)) and not isinstance(item, bool) else item
                for item in args
            )
            args = tuple(
                _cpu_device(item) if isinstance(item, str) and item.startswith("cuda") else item for item in args
            )
        return _on_gpu_everywhere(func(*args, **kwargs))


def backward(output: torch.Tensor, gradient: torch.Tensor | None = None) -> None:
    """``output.backward(gradient)`` inside :func:`record_launches` (plain ``.backward()`` would run the backward
    outside the recording mode, on the real device type)."""
    gradient = torch.ones_like(output) if gradient is None else gradient
    torch.autograd.graph._engine_run_backward(
        (output,), (gradient,), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def _encode(value):
    """A kernel argument in JSON form: tensors by dtype and 16-byte alignment, Triton dtypes and functions by name."""
    import triton
    import triton.language as tl

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, tl.constexpr):
        return _encode(value.value)
    if isinstance(value, tl.dtype):
        return {"triton_dtype": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return {"tuple": [_encode(item) for item in value]}
    if isinstance(value, (triton.runtime.JITFunction, triton.runtime.interpreter.InterpretedFunction)):
        return {"function": f"{value.fn.__module__}:{value.fn.__qualname__}"}  # a kernel passed to a kernel
    raise ValueError(f"cannot record a kernel argument of type {type(value).__name__}: {value!r}")


def _describe(value) -> str:
    if isinstance(value, dict):
        if "tensor" in value:
            return f"tensor {value['tensor']}"
        if "triton_dtype" in value:
            return value["triton_dtype"]
        if "function" in value:
            return value["function"].rsplit(":", 1)[-1]
        if "tuple" in value:
            return "(" + ", ".join(_describe(item) for item in value["tuple"]) + ")"
    return repr(value)


def _grid(grid, arguments: dict) -> list[int]:
    try:
        grid = grid(arguments) if callable(grid) else grid
        return [int(size) for size in grid]
    except Exception:  # a grid that needs more than the arguments: not needed to compile
        return []


class Recorder:
    """The launches seen inside :func:`record_launches`; set ``phase`` to label the launches that follow."""

    def __init__(self):
        self.launches: list[Launch] = []
        self.phase = ""
        self._current: Launch | None = None
        self._code = ("", "")
        self._sources = {}
        self._source = ([], 0)
        self._record_only = False

    def distinct(self) -> list[Launch]:
        """The launches that compile differently (the first launch of each specialisation)."""
        seen = {}
        for launch in self.launches:
            seen.setdefault(launch.key, launch)
        return list(seen.values())


def _element_bytes(handle) -> int:
    element = handle.dtype.element_ty if handle.dtype.is_ptr() else handle.dtype
    return max(1, element.primitive_bitwidth // 8)


def _dot_on_tensor_cores(a, b, input_precision) -> bool:
    from triton._C.libtriton import ir

    for operand in (a, b):
        dtype = operand.dtype.scalar if hasattr(operand.dtype, "scalar") else operand.dtype
        if dtype.primitive_bitwidth in (8, 16) and dtype.is_floating():
            return True
        if dtype.primitive_bitwidth == 64:
            return False
    return input_precision != ir.INPUT_PRECISION.IEEE


def _line_text(source: tuple[list[str], int], line: int) -> str:
    """The stripped text of line ``line`` of a file, given the source lines of a function and its first line."""
    lines, first = source
    return lines[line - first].strip() if 0 <= line - first < len(lines) else f"line {line}"


def _kernel_line(code) -> int:
    """The line of the running kernel's body (code object ``code``) that the current call comes from."""
    frame = sys._getframe(2)
    line = 0
    while frame is not None:
        if frame.f_code.co_name == code[1] and frame.f_code.co_filename == code[0]:
            line = frame.f_lineno
        frame = frame.f_back
    return line


@contextlib.contextmanager
def _counting(recorder: Recorder):
    """Count bytes of unmasked loaded / stored elements and dot FLOPs into the launch that is running."""
    import numpy
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    originals = {
        name: getattr(builder, name)
        for name in (
            "create_masked_load",
            "create_masked_store",
            "create_dot",
            "create_atomic_rmw",
            "create_atomic_cas",
        )
    }

    def masked_load(pointers, mask, *args, **kwargs):
        if recorder._current is not None:
            recorder._current.bytes_read += int(numpy.count_nonzero(mask.data)) * _element_bytes(pointers)
        return originals["create_masked_load"](pointers, mask, *args, **kwargs)

    def masked_store(pointers, value, mask, *args, **kwargs):
        if recorder._current is not None:
            recorder._current.bytes_written += int(numpy.count_nonzero(mask.data)) * _element_bytes(pointers)
        return originals["create_masked_store"](pointers, value, mask, *args, **kwargs)

    def atomic_rmw(operation, pointers, value, mask, *args, **kwargs):
        if recorder._current is not None:
            moved = int(numpy.count_nonzero(mask.data)) * _element_bytes(pointers)
            recorder._current.bytes_read += moved
            recorder._current.bytes_written += moved
        return originals["create_atomic_rmw"](operation, pointers, value, mask, *args, **kwargs)

    def atomic_cas(pointers, *args, **kwargs):
        if recorder._current is not None:
            moved = int(numpy.size(pointers.data)) * _element_bytes(pointers)
            recorder._current.bytes_read += moved
            recorder._current.bytes_written += moved
        return originals["create_atomic_cas"](pointers, *args, **kwargs)

    def dot(a, b, d, input_precision, *args, **kwargs):
        launch = recorder._current
        if launch is not None:
            *batch, rows, inner = a.data.shape
            flops = 2 * rows * b.data.shape[-1] * inner * int(numpy.prod(batch, dtype=numpy.int64))
            if _dot_on_tensor_cores(a, b, input_precision):
                launch.tensor_core_flops += flops
            else:
                launch.cuda_core_flops += flops
            line = _line_text(recorder._source, _kernel_line(recorder._code))
            launch.dot_flops_by_line[line] = launch.dot_flops_by_line.get(line, 0) + flops
        return originals["create_dot"](a, b, d, input_precision, *args, **kwargs)

    replacements = {
        "create_masked_load": masked_load,
        "create_masked_store": masked_store,
        "create_dot": dot,
        "create_atomic_rmw": atomic_rmw,
        "create_atomic_cas": atomic_cas,
    }
    for name, replacement in replacements.items():
        setattr(builder, name, replacement)
    try:
        yield
    finally:
        for name in replacements:
            delattr(builder, name)  # the class's methods show through again


def _loop_range(*bounds):
    """``range`` whose values are Triton scalars, as loop variables are in compiled kernels (the interpreter gives
    Python ints, on which kernels written for the compiler fail, e.g. ``index.to(tl.int64)``)."""
    import operator

    import numpy
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    for value in range(*(operator.index(bound) for bound in bounds)):
        yield tl.tensor(TensorHandle(numpy.array([value], dtype=numpy.int32), tl.int32), tl.int32)


@contextlib.contextmanager
def record_launches(
    all_configs: bool = True,
    count: bool = False,
    execute: bool = True,
    as_if_on_gpu: bool = True,
    target: str = "sm_90",
):
    """Record every Triton kernel launched inside the block (see the module docstring); yields a :class:`Recorder`.

    Args:
        all_configs: autotuned kernels record every configuration (True) or only the first (False); the first
            configuration is the one that runs.
        count: also count bytes and dot FLOPs per launch (slower).
        execute: run the kernels (in the interpreter). Without it the launches are only recorded, and outputs
            are left as allocated: only for code whose later launches do not depend on earlier results.
        as_if_on_gpu: tensors report ``cuda`` (see below). Turn it off for code that enters CUDA device contexts
            (e.g. flash-linear-attention's ``input_guard``); such code then takes its CPU decisions.
        target: the GPU the launches are chosen for (a key of ``TARGETS``): ``torch.cuda.get_device_capability``
            returns its compute capability inside the block, and :func:`compile_launches` compiles each launch for
            its own target only.

    With ``as_if_on_gpu``, tensors created inside the block on ``"cuda"`` (or through :func:`on_gpu`) are CPU
    tensors reporting ``cuda``; run backward passes with :func:`backward`.

    Raises:
        RuntimeError: if Triton's interpreter is off (``TRITON_INTERPRET=1`` must be set before the kernels are
            imported).
        ValueError: for an unknown target.
    """
    from triton.runtime import autotuner, interpreter

    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; allowed targets are {', '.join(map(repr, TARGETS))}.")

    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(
            "record_launches runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 before the kernels "
            "are imported (the compilation for GPU targets then runs in a subprocess without it)."
        )
    recorder = Recorder()
    original_run = interpreter.InterpretedFunction.run
    original_autotune = autotuner.Autotuner.run

    def run(self, *args, grid, warmup, **kwargs):
        function = self.fn
        bound = dict(zip(self.arg_names, args))
        launch = Launch(
            module=function.__module__,
            name=function.__qualname__,
            arguments=[_encode(value) for value in args],
            keywords={name: _encode(value) for name, value in kwargs.items() if name not in bound},
            grid=_grid(grid, {**bound, **kwargs}),
            phase=recorder.phase,
            target=target,
        )
        recorder.launches.append(launch)
        if recorder._record_only or not execute:
            return None
        recorder._current = launch
        recorder._code = (function.__code__.co_filename, function.__name__)
        if function not in recorder._sources:  # read when the interpreter reads it (its first launch)
            recorder._sources[function] = inspect.getsourcelines(function)
        recorder._source = recorder._sources[function]
        names = function.__globals__
        had_range = "range" in names
        previous_range = names.get("range")
        names["range"] = _loop_range
        try:
            return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            recorder._current = None
            if had_range:
                names["range"] = previous_range
            else:
                del names["range"]

    def autotune(self, *args, **kwargs):
        # No benchmark without a GPU: the first configuration runs; with all_configs the others are recorded too.
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        if all_configs:
            recorder._record_only = True
            try:
                for config in configs[1:]:
                    self.fn.run(*args, **kwargs, **config.all_kwargs())
            finally:
                recorder._record_only = False
        config = configs[0]
        self.best_config = config
        if config.pre_hook is not None:
            config.pre_hook({**self.nargs, **kwargs, **config.all_kwargs()})
        return self.fn.run(*args, **kwargs, **config.all_kwargs())

    interpreter.InterpretedFunction.run = run
    autotuner.Autotuner.run = autotune
    original_capability = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: divmod(TARGETS[target], 10)
    mode = _AsIfOnGpu()
    # Tensors saved for backward come back as plain tensors: make them report cuda too.
    saved = torch._C._FunctionBase.saved_tensors
    context = torch.autograd.function.BackwardCFunction
    if as_if_on_gpu:
        context.saved_tensors = property(lambda ctx: _on_gpu_everywhere(saved.__get__(ctx)))
    try:
        with contextlib.ExitStack() as stack:
            if count:
                stack.enter_context(_counting(recorder))
            if as_if_on_gpu:
                stack.enter_context(mode)
            yield recorder
    finally:
        interpreter.InterpretedFunction.run = original_run
        autotuner.Autotuner.run = original_autotune
        torch.cuda.get_device_capability = original_capability
        if as_if_on_gpu:
            del context.saved_tensors


# --- Compiling -------------------------------------------------------------------------------------------------


def compile_launches(
    launches: list[Launch], targets=("sm_80", "sm_90"), jobs: int | None = None, timeout: float = 1800
) -> list[CompiledLaunch]:
    """Compile every distinct launch for every target, in ``jobs`` subprocesses without Triton's interpreter. A
    launch recorded for one target (``Launch.target``) compiles for that target only, if it is in ``targets``.

    Compiled kernels land in Triton's cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), so a second
    check of unchanged kernels is fast. Returns one :class:`CompiledLaunch` per (distinct launch, target), in order.

    Raises:
        ValueError: for an unknown target, naming the allowed ones.
        RuntimeError: if a compile subprocess dies (not for a kernel that fails to compile: that is reported in
            the result's ``error``).
    """
    for target in targets:
        if target not in TARGETS:
            raise ValueError(f"unknown target {target!r}; allowed targets are {', '.join(map(repr, TARGETS))}.")
    distinct = list({launch.key: launch for launch in launches}.values())
    work = [
        (index, target) for index, launch in enumerate(distinct) for target in targets if launch.target in ("", target)
    ]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    processes = []
    with tempfile.TemporaryDirectory() as folder:
        for job in range(jobs):
            share = work[job::jobs]
            request = [{"launch": dataclasses.asdict(distinct[index]), "target": target} for index, target in share]
            path = os.path.join(folder, f"request{job}.json")
            with open(path, "w") as file:
                json.dump(request, file)
            command = [sys.executable, "-c", _WORKER, path, str(Path(__file__).resolve().parents[1])]
            processes.append(
                (
                    share,
                    subprocess.Popen(
                        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                    ),
                )
            )
        results = {}
        for share, process in processes:
            stdout, stderr = process.communicate(timeout=timeout)
            if process.returncode != 0:
                raise RuntimeError(
                    f"the compile subprocess failed (exit code {process.returncode}):\n{stderr[-4000:]}"
                )
            for (index, target), answer in zip(share, json.loads(stdout.strip().splitlines()[-1])):
                results[index, target] = CompiledLaunch(launch=distinct[index], target=target, **answer)
    return [results[item] for item in work]


# The compile subprocess: memlm's package __init__ (🤗 Transformers and the models) is not needed to compile
# kernels, so the worker imports memlm.kernels without it; devtools/ is found from the folder that holds it.
_WORKER = """
import importlib.util, sys, types
sys.path.insert(0, sys.argv[2])
if "memlm" not in sys.modules:
    package = types.ModuleType("memlm")
    package.__path__ = list(importlib.util.find_spec("memlm").submodule_search_locations)
    sys.modules["memlm"] = package
from devtools.gpu_compile import _main
_main(sys.argv[1])
"""


def _decode(value):
    import triton.language as tl

    if isinstance(value, dict):
        if "tensor" in value:
            dtype = getattr(torch, value["tensor"])
            storage = torch.empty(64, dtype=dtype)
            return storage if value["aligned"] else storage[1:]
        if "triton_dtype" in value:
            return tl.dtype(value["triton_dtype"])
        if "function" in value:
            module, name = value["function"].split(":")
            return _find_attribute(importlib.import_module(module), name)
        if "tuple" in value:
            return tuple(_decode(item) for item in value["tuple"])
    return value


def _find_attribute(module, qualified_name: str):
    value = module
    for part in qualified_name.split("."):
        value = getattr(value, part)
    return value


def _jit_function(module: str, name: str):
    """The ``JITFunction`` behind a kernel object (unwrapping autotuners and heuristics)."""
    import triton

    kernel = _find_attribute(importlib.import_module(module), name)
    while not isinstance(kernel, triton.runtime.JITFunction):
        if not hasattr(kernel, "fn"):
            raise ValueError(f"{module}.{name} is not a Triton kernel (got {type(kernel).__name__}).")
        kernel = kernel.fn
    return kernel


_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def _ptxas_report(log: str, ptx: str, capability: int) -> tuple[int, int, int]:
    """Registers, spill stores and spill loads from ptxas ``-v``: the log of the compilation when it ran, else
    (a kernel from Triton's cache) a fresh run of the ptxas Triton uses for ``capability``."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    if not _REGISTERS.search(log):
        with tempfile.TemporaryDirectory() as folder:
            source = os.path.join(folder, "kernel.ptx")
            with open(source, "w") as file:
                file.write(ptx)
            command = [get_ptxas(capability).path, "-v", "--regAllocOptLevel=2"]
            command += [f"--gpu-name={sm_arch_from_capability(capability)}", source]
            finished = subprocess.run(
                [*command, "-o", os.path.join(folder, "kernel.cubin")], capture_output=True, text=True, check=True
            )
        log = finished.stdout + finished.stderr
    registers = max((int(found) for found in _REGISTERS.findall(log)), default=0)
    spills = _SPILLS.findall(log)
    return registers, sum(int(stores) for stores, _ in spills), sum(int(loads) for _, loads in spills)


_LOCATION = re.compile(r"^(#loc\d*) = loc\((.*)\)$", re.MULTILINE)
_DOT = re.compile(r"= (tt\.dot|ttng\.warp_group_dot|ttng\.tc_gen5_mma)\b(.*) loc\((#loc\d*)\)$", re.MULTILINE)


def _dots_by_line(ttgir: str, filename: str, source: tuple[list[str], int]) -> dict:
    """Per line of the kernel's body that a dot comes from (the outermost call site, so a dot inside a helper counts
    at the line of the kernel that calls it; keyed by the line's text in ``source``, the kernel's source lines as
    compiled and its first line number): [dots on tensor cores, all dots]. A ``tt.dot`` left with a blocked
    (not MMA) result layout runs on CUDA cores; ``warp_group_dot`` (wgmma), ``tc_gen5_mma`` and MMA layouts on
    tensor cores."""
    locations = dict(_LOCATION.findall(ttgir))
    # Triton's cache keys a kernel by its source and first line, not its file's path: a kernel compiled from another
    # checkout of the same file comes back with that checkout's path, so only the file's name is compared.
    own_file = re.compile(r'^"(?:[^"]*/)?' + re.escape(os.path.basename(filename)) + r'":(\d+):')

    def outer_line(name, depth=0):
        text = locations.get(name, "")
        if depth > 50 or not text:
            return 0
        if text.startswith("callsite("):
            return outer_line(text.rsplit(" at ", 1)[1].rstrip(")"), depth + 1)
        found = own_file.match(text)
        if found:
            return int(found.group(1))
        inner = re.search(r"#loc\d*", text)
        return outer_line(inner.group(0), depth + 1) if inner else 0

    dots = {}
    for operation, rest, location in _DOT.findall(ttgir):
        on_tensor_cores = operation != "tt.dot" or "#mma" in rest.rsplit("->", 1)[-1]
        counts = dots.setdefault(_line_text(source, outer_line(location)), [0, 0])
        counts[0] += int(on_tensor_cores)
        counts[1] += 1
    return dots


def _compile_one(launch: dict, target: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    capability = TARGETS[target]
    gpu = GPUTarget("cuda", capability, 32)
    log = io.StringIO()
    try:
        function = _jit_function(launch["module"], launch["name"])
        backend = make_backend(gpu)
        binder = create_function_from_signature(function.signature, function.params, backend)
        keywords = {name: _decode(value) for name, value in launch["keywords"].items()}
        keywords.setdefault("debug", False)
        bound, specialisation, options = binder(*[_decode(value) for value in launch["arguments"]], **keywords)
        options, signature, constants, attributes = function._pack_args(
            backend, keywords, bound, specialisation, options
        )
        triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas -v when it runs it: keep that
        with contextlib.redirect_stdout(log):
            source = ASTSource(function, signature, constants, attributes)
            kernel = triton.compile(source, target=gpu, options=options.__dict__)
        ptx = kernel.asm["ptx"]
        registers, spill_stores, spill_loads = _ptxas_report(log.getvalue(), ptx, capability)
    except Exception as error:  # the message is the result: the check reports it per kernel
        return {"error": f"{type(error).__name__}: {error}"[-4000:]}
    return {
        "shared_memory": int(kernel.metadata.shared),
        "registers": registers,
        "spill_stores": spill_stores,
        "spill_loads": spill_loads,
        "tensor_core_instructions": bool(re.search(r"^\s*(wgmma|mma)\.", ptx, flags=re.MULTILINE)),
        "dots_by_line": _dots_by_line(
            kernel.asm["ttgir"], function.fn.__code__.co_filename, (function.raw_src, function.starting_line_number)
        ),
    }


def _main(path: str) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compiling for GPU targets needs a process without TRITON_INTERPRET=1.")
    with open(path) as file:
        request = json.load(file)
    answers = [_compile_one(item["launch"], item["target"]) for item in request]
    sys.stdout.write(json.dumps(answers) + "\n")


if __name__ == "__main__":
    _main(sys.argv[1])
