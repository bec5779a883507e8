"""Does compiling the decoding step pay on this machine, and what does the first compile cost?

`generate(..., compile_config=CompileConfig(...))` compiles the decoding step of the models whose memory keeps its
size: DeltaNet (fast weights of fixed size) and the Feedback Transformer (a ring of τ slots). Printed, all measured
in this one run:

- decoding: greedy tokens/s at batch 1 after a prompt, eager and compiled, for DeltaNet, the Feedback Transformer
  and a 🤗 Llama of the same size with a static cache (`cache_implementation="static"`, what 🤗 compiles); the three
  models and both ways take turns, run by run, and compiled / eager is printed, the median of the rounds' ratios;
- first compile: the seconds the first compiled call costs beyond a warm one, from an empty inductor cache in a
  fresh interpreter, for each family: of the decoding step `generate` compiles, and of the whole forward as
  `torch.compile(model)` compiles it for a prompt then one decoding step (the only way to compile memlm's models
  before `generate` could; Expire-Span, whose memory changes size, compiles only this way).

Sizes: hidden 256, 4 layers, 4 heads, gated MLP of width 768, byte vocabulary; τ = 256 for the Feedback
Transformer, spans up to 256 for Expire-Span. Decoding tokens/s count the steps after the first token
(`report.generation_step_seconds`), so the prompt's (eager) forward is left out.

    python benchmarks/compiled_decoding.py [--json results.json]     # about 5 minutes on 2 quiet cores
    python benchmarks/compiled_decoding.py --quick                   # tiny sizes, Dynamo only: a smoke run
    python benchmarks/compiled_decoding.py --write-docs --json benchmarks/results/compiled_decoding.json
    python benchmarks/compiled_decoding.py --report benchmarks/results/compiled_decoding.json

``--quick`` compiles with the "eager" backend (Dynamo captures the graphs, nothing is generated), in this process:
its times say nothing about inductor. ``--write-docs`` (after a full run) and ``--report RESULTS_JSON`` rewrite the
compiled decoding section of docs/performance/speed.md from the results (see ``report.py``).
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from tqdm.auto import tqdm

from memlm.compat import cache_keyword, output_cache

try:  # run as a script (python benchmarks/compiled_decoding.py) or imported as benchmarks.compiled_decoding
    import report
except ImportError:
    from benchmarks import report

SIZES = {"vocab_size": 258, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 4}  # fmt: skip
QUICK_SIZES = {"vocab_size": 258, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 2}  # fmt: skip
MEMORY_SPAN = 256
DECODING_MODELS = ("deltanet", "feedback", "llama")
FAMILIES = ("deltanet", "expire_span", "feedback", "llama")
NAMES = {
    "deltanet": "DeltaNet",
    "expire_span": "Expire-Span",
    "feedback": "Feedback",
    "llama": "🤗 Llama (static cache)",
}


def build(family: str, sizes: dict):
    """A model of `family` in eval mode (seed 0), with the memory span of this page."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from memlm import (
        DeltaNetConfig,
        DeltaNetForCausalLM,
        ExpireSpanConfig,
        ExpireSpanForCausalLM,
        FeedbackTransformerConfig,
        FeedbackTransformerForCausalLM,
    )

    torch.manual_seed(0)
    span = min(MEMORY_SPAN, 4 * sizes["hidden_size"])
    if family == "deltanet":
        model = DeltaNetForCausalLM(DeltaNetConfig(**sizes))
    elif family == "feedback":
        model = FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**sizes, memory_span=span))
    elif family == "expire_span":
        model = ExpireSpanForCausalLM(ExpireSpanConfig(**sizes, max_span=span, ramp=span // 8, block_size=span // 4))
    else:
        # No end-of-text token, as memlm's configs here: `generate` runs the same processors for every model.
        model = LlamaForCausalLM(LlamaConfig(**sizes, max_position_embeddings=4096, attn_implementation="sdpa",
                                             bos_token_id=None, eos_token_id=None))  # fmt: skip
    return model.eval()


def compile_config(backend: str):
    from transformers import CompileConfig

    # mode None: "reduce-overhead" (🤗's default) is CUDA graphs, which a CPU does without.
    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True  # 🤗 compiles on GPUs only, unless told
    return config


def generate_options(family: str, prompt: torch.Tensor, config, steps: int) -> dict:
    """`generate`'s arguments for decoding compiled with `config` (None: eager). Llama takes a static cache as long as
    the longest call needs, the same at every call (a new size would recompile)."""
    static = {"cache_implementation": "static", "max_cache_len": prompt.shape[1] + steps} if family == "llama" else {}
    return {**static, **({} if config is None else {"compile_config": config})}


def generator(model, family: str, prompt: torch.Tensor, config, steps: int):
    """A function generating `new_tokens` tokens greedily after `prompt`, compiled with `config` (None: eager)."""
    options = generate_options(family, prompt, config, steps)

    def generate(new_tokens: int):
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              **options)  # fmt: skip

    return generate


def measure_decoding(args, sizes: dict) -> list[dict]:
    """Eager and compiled greedy decoding of each model, timed in turns (`report.generation_step_seconds`: the steps
    after the first new token): tokens/s, the median of the runs, and compiled / eager, the median of the rounds'
    ratios (`report.paired_speedup`: a round's eager and compiled runs are seconds apart)."""
    prompt = torch.randint(0, sizes["vocab_size"], (1, args.context), generator=torch.Generator().manual_seed(0))
    config = compile_config(args.backend)
    functions = {}
    for family in DECODING_MODELS:
        model = build(family, sizes)
        for way, way_config in (("eager", None), ("compiled", config)):
            options = generate_options(family, prompt, way_config, args.decode_steps)
            functions[family, way] = functools.partial(
                report.generation_step_seconds, model, prompt, args.decode_steps, **options
            )
    times = report.interleaved_times(functions, 1, args.repeats, timed_inside=True)  # (the warm-up compiles)
    rows = []
    for family in DECODING_MODELS:
        row = {"model": family}
        for way in ("eager", "compiled"):
            row[f"{way}_tokens_per_s"] = 1 / statistics.median(times[family, way])
        row["compiled_over_eager"] = report.paired_speedup(times, (family, "compiled"), (family, "eager"))
        rows.append(row)
    return rows


def first_compile_seconds(kind: str, family: str, sizes: dict, backend: str, context: int) -> float | None:
    """Seconds the first compiled call of `family` costs beyond the second: "step", `generate` compiling the decoding
    step (None where it does not compile it: Expire-Span); "forward", `torch.compile(model)` run on a prompt and then
    one decoding step."""
    model = build(family, sizes)
    prompt = torch.randint(0, sizes["vocab_size"], (1, context), generator=torch.Generator().manual_seed(0))
    if kind == "step":
        if family == "expire_span":
            return None
        generate = generator(model, family, prompt, compile_config(backend), 2)
        run = lambda: generate(2)  # noqa: E731  (the prompt runs eagerly, one step compiled)
    else:
        compiled = torch.compile(model, backend=backend)

        def run():
            with torch.no_grad():
                output = compiled(prompt, use_cache=True)
                compiled(prompt[:, -1:], use_cache=True, **{cache_keyword(model): output_cache(output)})

    torch._dynamo.reset()
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    start = time.perf_counter()
    run()
    return first - (time.perf_counter() - start)


def measure_first_compiles(args, sizes: dict) -> list[dict]:
    """Each first compile from an empty inductor cache, in a fresh interpreter (in this process with --quick)."""
    rows = []
    for family in tqdm(FAMILIES, desc="first compiles", leave=False):
        row = {"family": family}
        for kind in ("step", "forward"):
            values = {"kind": kind, "family": family, "sizes": sizes, "backend": args.backend,
                      "context": args.compile_context}  # fmt: skip
            row[f"{kind}_seconds"] = first_compile_seconds(**values) if args.quick else run_isolated(values)
        step, forward = row["step_seconds"], row["forward_seconds"]
        row["forward_over_step"] = None if step is None else forward / step
        rows.append(row)
    return rows


def run_isolated(values: dict) -> float | None:
    with tempfile.TemporaryDirectory() as cache:
        environment = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)  # nothing compiled before
        command = [sys.executable, __file__, "--measure", json.dumps(values)]
        finished = subprocess.run(command, capture_output=True, text=True, env=environment, check=True)
    return json.loads(finished.stdout.strip().splitlines()[-1])


DECODING_COLUMNS = [
    ("", "name", "s"),
    ("eager tok/s", "eager_tokens_per_s", ".1f"),
    ("compiled tok/s", "compiled_tokens_per_s", ".1f"),
    ("compiled / eager", "compiled_over_eager", ".2f"),
]
COMPILE_COLUMNS = [
    ("", "name", "s"),
    ("first compile s, generate's decoding step", "step_seconds", ".1f"),
    ("first compile s, torch.compile(model): prompt + one step", "forward_seconds", ".1f"),
    ("whole forward / step", "forward_over_step", ".1f"),
]


def _named(rows: list[dict], key: str) -> list[dict]:
    return [{**row, "name": NAMES[row[key]]} for row in rows]


def docs_section(results: dict) -> str:
    """The compiled decoding section of docs/performance/speed.md, from one full run's results."""
    settings = results["settings"]
    return "\n\n".join(
        [
            f"From `python benchmarks/compiled_decoding.py` (the models and both ways timed in turns, "
            f"{settings['repeats']} rounds: tokens/s the median of the runs, compiled / eager the median of the "
            "rounds' ratios, each round's eager and compiled runs seconds apart; torch.compile backend "
            f"{settings['backend']!r}). {report.measured_on(settings)} "
            f"Hidden size {SIZES['hidden_size']}, {SIZES['num_hidden_layers']} layers, "
            f"{SIZES['num_attention_heads']} heads, byte vocabulary, τ = {MEMORY_SPAN}; greedy decoding at batch 1 "
            f"after a prompt of {settings['context']} tokens, tokens/s of the {settings['decode_steps'] - 1} steps "
            "after the first token. Compiled = `generate(..., compile_config=CompileConfig(fullgraph=True))` "
            '(Llama with `cache_implementation="static"`).',
            report.markdown_table(DECODING_COLUMNS, _named(results["decoding"], "model")),
            "The first compile, from an empty inductor cache (later processes load the compiled code from the cache: "
            "`TORCHINDUCTOR_CACHE_DIR`): of the decoding step `generate` compiles, and of the whole forward as "
            f"`torch.compile(model)` compiles it for a prompt of {settings['compile_context']} tokens then one step. "
            "Expire-Span's memory changes size as memories expire, so `generate` decodes it eagerly.",
            report.markdown_table(COMPILE_COLUMNS, _named(results["first_compile"], "family")),
        ]
    )


SECTION = report.Section(
    "compiled_decoding",
    "python benchmarks/compiled_decoding.py --report benchmarks/results/compiled_decoding.json",
    docs_section,
)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = report.arguments(__doc__, repeats=5, section=SECTION,
                              quick="tiny sizes, the eager backend, one repeat: a run that checks the script")  # fmt: skip
    parser.add_argument("--context", type=int, default=64, help="prompt before the timed decoding")
    parser.add_argument("--decode-steps", type=int, default=64, help="new tokens per timed generate call")
    parser.add_argument("--compile-context", type=int, default=16, help="prompt of the whole-forward compile")
    parser.add_argument("--backend", default="inductor", help="the torch.compile backend")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # one first compile, in a child process
    quick = {"context": 8, "decode_steps": 12, "compile_context": 4, "repeats": 1, "backend": "eager"}
    return report.parse(parser, argv, quick)


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    if args.measure:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        print(json.dumps(first_compile_seconds(**json.loads(args.measure))))
        return {}
    saved = report.saved_run(args, SECTION)
    if saved is not None:
        return saved
    import memlm  # noqa: F401  (registers memlm's classes)

    sizes = QUICK_SIZES if args.quick else SIZES
    settings = {
        key: getattr(args, key) for key in ("context", "decode_steps", "compile_context", "repeats", "backend")
    }
    results = {"settings": {**settings, "quick": args.quick, **report.start(args)}}
    results["first_compile"] = measure_first_compiles(args, sizes)
    results["decoding"] = measure_decoding(args, sizes)
    report.print_table("Greedy decoding, eager and compiled", DECODING_COLUMNS, _named(results["decoding"], "model"))
    report.print_table("First compile (seconds)", COMPILE_COLUMNS, _named(results["first_compile"], "family"))
    return report.finish(results, args, SECTION)


if __name__ == "__main__":
    main()
