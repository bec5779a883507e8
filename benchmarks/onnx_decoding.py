"""Decoding through ONNX Runtime next to eager and compiled PyTorch (issue 41): greedy tokens/s at batch 1 after a
prompt of 64 and of 2,048 tokens, for DeltaNet, the Feedback Transformer and a 🤗 Llama of the same size, each
exported to ONNX the same way: graphs whose memory is an explicit input and output.

- DeltaNet and the Feedback Transformer: `memlm export onnx`'s graphs (`memlm.onnx_export`: a prefill block of P
  tokens and a one-token step over a memory of fixed size), decoded by its runner (`memlm.onnx_runner`).
- 🤗 Llama: one graph over any number of tokens whose keys and values (growing with the context) are inputs and
  outputs, exported with torch's exporter as memlm's are (a `DynamicCache` filled from the inputs); the prompt is one
  call, each new token one.
- Eager and compiled PyTorch: the model's forward with its cache, one token a step, as `generate` decodes (Llama with
  a dynamic cache, and a static one when compiled); compiled = the call `generate` compiles for
  `compile_config=CompileConfig(fullgraph=True)` (`model.get_compiled_call`), the memory made ready for it first.

Each way reads the prompt once, untimed; each timed call then runs N greedy steps and carries its memory on to the
next call, so tokens/s = N / (time of a call) counts decoding alone (a prompt of 2,048 tokens takes the Feedback
Transformer seconds to read, which would swamp the steps). The context grows by N each call (warm-up included).
Every model and way is timed in turns (medians; each ratio the median of the rounds' ratios). ONNX Runtime and torch
use the same threads (`--threads`, default: one per core). The seconds each export took are printed too.

    python benchmarks/onnx_decoding.py [--json results.json]      # a few minutes on 2 quiet cores
    python benchmarks/onnx_decoding.py --quick                    # one tiny layer, the eager backend: a smoke run
    python benchmarks/onnx_decoding.py --write-docs --json benchmarks/results/onnx_decoding.json
    python benchmarks/onnx_decoding.py --report benchmarks/results/onnx_decoding.json
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy
import torch
from torch import nn

try:  # run as a script (python benchmarks/onnx_decoding.py) or imported as benchmarks.onnx_decoding
    import report
    from compiled_decoding import MEMORY_SPAN, QUICK_SIZES, SIZES, build, compile_config
except ImportError:
    from benchmarks import report
    from benchmarks.compiled_decoding import MEMORY_SPAN, QUICK_SIZES, SIZES, build, compile_config

MODELS = ("deltanet", "feedback", "llama")
NAMES = {"deltanet": "DeltaNet", "feedback": "Feedback", "llama": "🤗 Llama"}
WAYS = ("eager", "compiled", "onnx")
COLUMNS = [
    ("model", "name", "s"),
    ("prompt", "context", "d"),
    ("eager tokens/s", "eager_tokens_per_s", ".0f"),
    ("compiled tokens/s", "compiled_tokens_per_s", ".0f"),
    ("ONNX Runtime tokens/s", "onnx_tokens_per_s", ".0f"),
    ("ONNX Runtime / eager", "onnx_over_eager", ".2f"),
    ("ONNX Runtime / compiled", "onnx_over_compiled", ".2f"),
]
EXPORT_COLUMNS = [("model", "name", "s"), ("export seconds", "export_seconds", ".0f"), ("block P", "block_size", "s")]


class LlamaGraph(nn.Module):
    """A 🤗 Llama over `input_ids` (B, T) at `position_ids` (B, T) after the keys and values `past` (per layer: keys,
    values (B, H, S, d)) → the last token's logits and the keys and values after the call (S + T)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        output = self.model(input_ids, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return (
            output.logits[:, -1],
            *(tensor for layer in output.cache.layers for tensor in (layer.keys, layer.values)),
        )


def export_llama(model, path: Path, threads: int | None):
    """`LlamaGraph` exported with the token and past lengths free; returns an ONNX Runtime generate function."""
    import onnxruntime

    from memlm.onnx_export import quiet_exporter

    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    past = [torch.zeros(1, config.num_key_value_heads, 3, head_dim) for _ in range(2 * config.num_hidden_layers)]
    tokens, past_length = torch.export.Dim("tokens", min=1, max=8192), torch.export.Dim("past", min=1, max=8192)
    names = [f"past.{index}" for index in range(len(past))]
    with torch.no_grad(), quiet_exporter():
        program = torch.onnx.export(
            LlamaGraph(model),
            (torch.zeros(1, 2, dtype=torch.long), torch.tensor([[3, 4]]), *past),
            input_names=["input_ids", "position_ids", *names],
            output_names=["logits", *(f"present.{index}" for index in range(len(past)))],
            dynamic_shapes=({1: tokens}, {1: tokens}, tuple({2: past_length} for _ in past)),
            dynamo=True,
        )
    program.save(str(path))
    options = onnxruntime.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    empty = {name: numpy.zeros((1, config.num_key_value_heads, 0, head_dim), numpy.float32) for name in names}

    def decoder(prompt: numpy.ndarray, steps: int):
        feeds = {"input_ids": prompt, "position_ids": numpy.arange(prompt.shape[1])[None], **empty}

        def run(new_tokens: int):
            nonlocal feeds
            for _ in range(new_tokens):
                logits, *present = session.run(None, feeds)
                token = logits.argmax(-1)[:, None]
                position = feeds["position_ids"][:, -1:] + 1
                feeds = {"input_ids": token, "position_ids": position, **dict(zip(names, present))}

        run(1)  # the prompt (and its first token)
        return lambda: run(steps)

    return decoder


def onnx_decoder(model, family: str, folder: Path, quick: bool, threads: int | None):
    """Export `model` into `folder`; returns (decoder(prompt, steps) through ONNX Runtime, export seconds, P): the
    decoder reads the prompt, then each call of what it returns runs `steps` greedy steps, carrying the memory on."""
    from memlm.onnx_export import export_onnx
    from memlm.onnx_runner import OnnxLanguageModel

    started = time.perf_counter()
    if family == "llama":
        folder.mkdir(parents=True)
        decoder = export_llama(model, folder / "llama.onnx", threads)
        return decoder, time.perf_counter() - started, None
    manifest = export_onnx(model, folder, block_size=4 if quick else None)
    runner = OnnxLanguageModel(folder, threads)

    def decoder(prompt: numpy.ndarray, steps: int):
        logits, memory = runner.forward(prompt)
        token = logits.argmax(-1)[:, None]

        def run():
            nonlocal logits, memory, token
            for _ in range(steps):
                logits, memory = runner.forward(token, memory)
                token = logits.argmax(-1)[:, None]

        return run

    return decoder, time.perf_counter() - started, manifest["block_size"]


def torch_decoder(model, family: str, prompt: torch.Tensor, config, steps: int, capacity: int):
    """After reading `prompt` (eagerly, untimed), a function running `steps` greedy steps through the model's forward
    with its cache, carrying it on; compiled with `config` (None: eager) as `generate` compiles the decoding step.
    `capacity`: the tokens a Llama's static cache holds (prompt and every step)."""
    from transformers import DynamicCache, StaticCache

    from memlm.compat import cache_keyword, output_cache

    keyword = cache_keyword(model)
    if family == "llama":
        cache = DynamicCache(config=model.config) if config is None else StaticCache(model.config, capacity)
    else:
        cache = model.cache_class(model.config)
        if config is not None:
            cache.prepare_compiled_decoding()
    forward = model if config is None else model.get_compiled_call(config)
    position = prompt.shape[1]
    with torch.no_grad():
        output = model(prompt, use_cache=True, logits_to_keep=1, **{keyword: cache})
    cache, token = output_cache(output), output.logits[:, -1:].argmax(-1)

    def run():
        nonlocal cache, token, position
        with torch.no_grad():
            for _ in range(steps):
                where = {"position_ids": torch.tensor([[position]])} if family == "llama" else {}
                output = forward(token, use_cache=True, logits_to_keep=1, **where, **{keyword: cache})
                cache, token = output_cache(output), output.logits[:, -1:].argmax(-1)
                position += 1

    return run


def measure(args, sizes: dict, work: Path) -> tuple[list[dict], list[dict]]:
    config = compile_config(args.backend)
    functions, exports = {}, []
    for family in MODELS:
        model = build(family, sizes)
        decoder, seconds, block_size = onnx_decoder(model, family, work / family, args.quick, args.threads)
        exports.append({"model": family, "export_seconds": seconds, "block_size": str(block_size or "any")})
        print(f"exported {family} in {seconds:.0f} s", flush=True)
        for context in args.contexts:
            prompt = torch.randint(0, sizes["vocab_size"], (1, context), generator=torch.Generator().manual_seed(0))
            capacity = context + args.decode_steps * (args.repeats + 2)
            for way, options in (("eager", None), ("compiled", config)):
                functions[(family, context, way)] = torch_decoder(
                    model, family, prompt, options, args.decode_steps, capacity
                )
            functions[(family, context, "onnx")] = decoder(prompt.numpy(), args.decode_steps)
    times = report.interleaved_times(functions, 1, args.repeats)  # (the warm-up compiles)
    rows = []
    for family in MODELS:
        for context in args.contexts:
            row = {"model": family, "context": context}
            for way in WAYS:
                row[f"{way}_tokens_per_s"] = args.decode_steps / statistics.median(times[family, context, way])
            for way in ("eager", "compiled"):
                row[f"onnx_over_{way}"] = report.paired_speedup(
                    times, (family, context, "onnx"), (family, context, way)
                )
            rows.append(row)
    return rows, exports


def _named(rows: list[dict]) -> list[dict]:
    return [{**row, "name": NAMES[row["model"]]} for row in rows]


def docs_section(results: dict) -> str:
    """The ONNX Runtime section of docs/performance/speed.md, from one full run's results."""
    settings = results["settings"]
    return "\n\n".join(
        [
            f"From `python benchmarks/onnx_decoding.py` ({settings['repeats']} runs, the models and the three ways "
            "timed in turns: tokens/s the median of the runs, a ratio the median of the rounds' ratios; "
            f"torch.compile backend {settings['backend']!r}). "
            f"{report.measured_on(settings)} Hidden size {SIZES['hidden_size']}, {SIZES['num_hidden_layers']} layers, "
            f"{SIZES['num_attention_heads']} heads, byte vocabulary, τ = {MEMORY_SPAN}; greedy decoding at batch 1 "
            f"after the prompt (read untimed), tokens/s of calls of {settings['decode_steps']} steps, each carrying "
            "the memory on. ONNX Runtime runs the "
            "graphs of `memlm export onnx` (🤗 Llama: one graph over its growing keys and values, exported the same "
            "way); compiled = the decoding step `generate` compiles for `CompileConfig(fullgraph=True)` "
            "(`model.get_compiled_call`; Llama over a static cache).",
            report.markdown_table(COLUMNS, _named(results["decoding"])),
            "The exports' seconds (torch.export, the ONNX translation and its optimiser; P: the prefill block):",
            report.markdown_table(EXPORT_COLUMNS, _named(results["exports"])),
        ]
    )


SECTION = report.Section(
    "onnx_decoding", "python benchmarks/onnx_decoding.py --report benchmarks/results/onnx_decoding.json", docs_section
)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = report.arguments(__doc__, repeats=5, section=SECTION,
                              quick="one tiny layer, the eager backend, one repeat: a run that checks the script")  # fmt: skip
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 2048], help="prompts before the decoding")
    parser.add_argument("--decode-steps", type=int, default=64, help="new tokens per timed generate call")
    parser.add_argument("--backend", default="inductor", help="the torch.compile backend")
    quick = {"contexts": [8, 32], "decode_steps": 8, "repeats": 1, "backend": "eager"}
    return report.parse(parser, argv, quick)


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    saved = report.saved_run(args, SECTION)
    if saved is not None:
        return saved
    import memlm  # noqa: F401  (registers memlm's classes)

    # --quick: one layer (the exports' tracing and optimiser grow with the graph; the smoke run only checks the script)
    sizes = {**QUICK_SIZES, "num_hidden_layers": 1} if args.quick else SIZES
    settings = {key: getattr(args, key) for key in ("contexts", "decode_steps", "repeats", "backend")}
    results = {"settings": {**settings, "quick": args.quick, **report.start(args)}}
    with tempfile.TemporaryDirectory() as work:
        results["decoding"], results["exports"] = measure(args, sizes, Path(work))
    report.print_table("Greedy decoding: eager, compiled, ONNX Runtime", COLUMNS, _named(results["decoding"]))
    report.print_table("Exports", EXPORT_COLUMNS, _named(results["exports"]))
    return report.finish(results, args, SECTION)


if __name__ == "__main__":
    main()
