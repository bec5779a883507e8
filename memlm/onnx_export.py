"""Export DeltaNet and the Feedback Transformer to ONNX, for ONNX Runtime (`memlm export onnx MODEL_DIR OUT_DIR`).

A memory model decodes with a memory that each call reads and returns, so the export is two graphs over an explicit
memory, every tensor of it an input (`past.NAME`) and an output (`present.NAME`) of fixed shape:

- `prefill.onnx`: a block of P tokens (`input_ids` (B, P)) and the memory → the last token's logits (B, V) and the
  memory after the block. A prompt runs as whole blocks, then one token at a time.
- `step.onnx`: one token (B, 1) and the memory → its logits and the next memory.

Both start from `initial_memory.npz`, the memory before any token (`allocated_memory`: DeltaNet's zero fast weights;
the Feedback Transformer's ring of τ slots, empty or holding the official zero initial memory). `memlm_onnx.json`
describes the memory and the block size, `run_onnx.py` (this package's `onnx_runner`) decodes with ONNX Runtime and
NumPy alone (and 🤗 tokenizers for text), and the tokenizer's files are copied beside them.

Why fixed blocks and not one graph for any prompt length: the chunkwise delta rule and the Feedback Transformer's
recurrence (sequential in t, paper Eq. 1) loop over the chunks and steps of a sequence in Python, which an exported
graph unrolls for one length. A prompt thus runs as the calls `generate` would make over the same blocks: equal logits
for every layout whose memory does not depend on how a sequence is cut into calls (all but DeltaNet's
`position_encoding="sinusoidal"`, whose positions count within each call as the official code's segments do).

Expire-Span is refused: its memory keeps the tokens whose span has not expired, a number that depends on the data,
so no graph of fixed shapes holds it (SPEC §2).

The command and its tests: docs/guides/onnx.md, tests/clients/test_onnx.py.
"""

import contextlib
import json
import logging
import shutil
import time
import warnings
from pathlib import Path

import numpy
import torch
from torch import nn

from memlm.checkpoint_files import checkpoint_folder, load_model

EXTRA_HINT = 'pip install "memlm[onnx]"'
# The tokenizer's files a runner reads (the first that exists; `tokenizer.json` is what 🤗 tokenizers load).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
MANIFEST = "memlm_onnx.json"
# torch 2.11's exporter (constraints/oldest.txt) wrote DeltaNet's step graph without its fast-weights output.
MINIMUM_TORCH = (2, 13)
FORMAT_VERSION = 1


def require_onnx():
    """torch's exporter needs `onnx` and `onnxscript`; refuse in one line naming the extra when they are missing."""
    missing = []
    for name in ("onnx", "onnxscript"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ValueError(f"Exporting to ONNX needs {' and '.join(missing)}, not installed: {EXTRA_HINT}.")
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < MINIMUM_TORCH:
        raise ValueError(
            f"Exporting to ONNX needs torch {'.'.join(map(str, MINIMUM_TORCH))} or newer (tested: 2.13, 2.15); "
            f"torch {torch.__version__}'s exporter leaves a memory output out of the graphs."
        )


def default_block_size(config) -> int:
    """P: DeltaNet's chunk size (the chunkwise form's unit); the Feedback Transformer's steps are unrolled in the
    graph one by one, so fewer of them (16) keep the export short."""
    if config.model_type == "memlm_deltanet":
        return config.chunk_size
    return 16


def memory_tensors(cache) -> dict[str, torch.Tensor]:
    """The memory's tensors by name: `layers.I.NAME` for each layer's state (and its token count), `next_positions`
    where the cache counts positions per row."""
    tensors = {}
    for index, layer in enumerate(cache.layers):
        for name in layer.tensor_names:
            tensor = getattr(layer, name)
            if tensor is not None:
                tensors[f"layers.{index}.{name}"] = tensor
        tensors[f"layers.{index}.token_count"] = layer.token_count
    if cache.next_positions is not None:
        tensors["next_positions"] = cache.next_positions
    return tensors


class MemoryGraph(nn.Module):
    """`model` over a block of tokens with its memory as explicit tensors: forward(input_ids, *memory) → (the last
    token's logits, *the memory after the block), the memory in the order of `memory_tensors(template)`. The flags a
    cache keeps beside its tensors (the Feedback ring's layout, the weights its keys and values were made with) are
    taken from `template`, the model's `allocated_memory`."""

    def __init__(self, model, template):
        super().__init__()
        self.model = model
        self.names = list(memory_tensors(template))
        self.cache_class = type(template)
        self.layer_flags = [
            {flag: getattr(layer, flag) for flag in ("ring", "full_ring") if hasattr(layer, flag)}
            for layer in template.layers
        ]
        self.weights_version = template.weights_version

    def forward(self, input_ids: torch.Tensor, *memory: torch.Tensor):
        cache = self.cache_class(self.model.config)
        cache.weights_version = self.weights_version
        for layer, flags in zip(cache.layers, self.layer_flags):
            for flag, value in flags.items():
                setattr(layer, flag, value)
        for name, tensor in zip(self.names, memory):
            tensor = tensor.clone()  # the model writes its memory in place: the graph's inputs stay as given
            if name == "next_positions":
                cache.next_positions = tensor
            else:
                _, index, field = name.split(".")
                setattr(cache.layers[int(index)], field, tensor)
        output = self.model(input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return (output.logits[:, -1], *memory_tensors(output.cache).values())


def check_exportable(config: dict):
    """Refuse in words what cannot be exported; `config` as config.json holds it."""
    family = config.get("model_type")
    if family == "memlm_expire_span":
        raise ValueError(
            "Expire-Span cannot be exported to ONNX: its memory holds the tokens whose span has not expired, a number "
            "that depends on the data, while an ONNX graph's memory inputs have fixed shapes. DeltaNet and the "
            "Feedback Transformer export (their memories have fixed sizes)."
        )
    if family not in ("memlm_deltanet", "memlm_feedback_transformer"):
        raise ValueError(f"memlm exports DeltaNet and Feedback Transformer models to ONNX, not {family!r}.")
    if config.get("adaptive_softmax_cutoffs"):
        raise ValueError(
            "This DeltaNet's output is an adaptive softmax (adaptive_softmax_cutoffs), which the export does not "
            "write: run it with PyTorch."
        )


@contextlib.contextmanager
def quiet_exporter():
    """The exporter's notes that are no problem of the user's, silenced while it runs: torch.onnx's "torchvision is
    not installed" per vision operator, onnx_ir's default type for empty attribute lists, and Python warnings."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnx_ir", "onnxscript")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export_graph(graph: MemoryGraph, input_ids: torch.Tensor, memory: list, path: Path, dynamic_batch: bool):
    """torch.onnx.export (torch.export, then ONNX) of `graph` at the inputs given, written to `path`."""
    names = graph.names
    batch = torch.export.Dim("batch", min=1, max=4096) if dynamic_batch else None
    dynamic_shapes = None
    if batch is not None:
        # (forward's `*memory` is one argument to torch.export: a tuple of specifications)
        dynamic_shapes = ({0: batch}, tuple({0: batch} if tensor.dim() else {} for tensor in memory))
    with quiet_exporter():
        program = torch.onnx.export(
            graph,
            (input_ids, *memory),
            input_names=["input_ids", *(f"past.{name}" for name in names)],
            output_names=["logits", *(f"present.{name}" for name in names)],
            dynamic_shapes=dynamic_shapes,
            dynamo=True,
            verbose=False,
        )
    program.save(str(path))


@contextlib.contextmanager
def chunks_of_at_most(config, length: int):
    """DeltaNet's chunks no longer than a block of `length` tokens while it is exported: a block shorter than a chunk
    would be padded to the chunk's size, whose inverse (`unit_lower_triangular_inverse`) makes the graph larger and
    its export longer for nothing (the same function: only the order of the sums changes)."""
    chunk_size = getattr(config, "chunk_size", None)
    if chunk_size is not None and length < chunk_size:
        config.chunk_size = length
    try:
        yield
    finally:
        if chunk_size is not None:
            config.chunk_size = chunk_size


def export_onnx(model_dir, output_dir, block_size: int | None = None, dynamic_batch: bool = True) -> dict:
    """Write the ONNX export of the model saved in `model_dir` into `output_dir` (see the module docstring); returns
    the manifest written beside the graphs."""
    require_onnx()
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2):
        raise ValueError(
            f"block_size must be an integer of at least 2 (one token is the step graph), got {block_size!r}."
        )
    output = Path(output_dir)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"{str(output_dir)!r} exists and is not an empty folder; choose a new folder.")
    if isinstance(model_dir, nn.Module):
        check_exportable(model_dir.config.to_dict())
        model = model_dir
    else:
        check_exportable(checkpoint_folder(str(model_dir))[1])  # (before reading the weights)
        model = load_model(str(model_dir))
    model = model.float()  # ONNX Runtime's CPU kernels: float32
    model = model.eval()
    config = model.config
    block_size = default_block_size(config) if block_size is None else block_size
    started = time.perf_counter()
    template = model.allocated_memory(batch_size=2 if dynamic_batch else 1)
    graph = MemoryGraph(model, template)
    memory = [tensor.clone() for tensor in memory_tensors(template).values()]
    batch_size = memory[0].shape[0]
    output.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for file, length in (("step.onnx", 1), ("prefill.onnx", block_size)):
            input_ids = torch.zeros(batch_size, length, dtype=torch.long)
            with chunks_of_at_most(config, length):
                export_graph(graph, input_ids, memory, output / file, dynamic_batch)
    initial = {name: tensor[:1].numpy() if tensor.dim() else tensor.numpy() for name, tensor in memory_tensors(
        model.allocated_memory(batch_size=1)).items()}  # fmt: skip
    numpy.savez(output / "initial_memory.npz", **initial)
    manifest = {
        "format_version": FORMAT_VERSION,
        "model_type": config.model_type,
        "block_size": block_size,
        "vocab_size": config.vocab_size,
        "dynamic_batch": dynamic_batch,
        # Tensors with a batch axis (0) are repeated per row; a token count is one number for all rows.
        "memory": {
            name: {"shape": list(array.shape), "dtype": str(array.dtype), "batch_axis": 0 if array.ndim else None}
            for name, array in initial.items()
        },  # fmt: skip
        "eos_token_id": getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        "export_seconds": round(time.perf_counter() - started, 1),
    }
    (output / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.copyfile(Path(__file__).with_name("onnx_runner.py"), output / "run_onnx.py")
    if not isinstance(model_dir, nn.Module):
        for name in TOKENIZER_FILES:
            if (Path(model_dir) / name).is_file():
                shutil.copyfile(Path(model_dir) / name, output / name)
    return manifest
