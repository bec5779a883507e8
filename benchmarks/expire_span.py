"""Does expiring memories pay off? Expire-Span against the same model with expiration off (a fixed span of L).

Prints two side-by-side tables, measured on this machine in one run:

1. Training step (forward + backward of one segment of `--segment` tokens, blocks of `--block-size`, carrying the
   memory of earlier segments as in truncated-BPTT training) at maximum span L ∈ {4096, 16384} (`--max-spans`): time
   and peak memory of an Expire-Span model whose spans are L/8 against the same model with `expire_memories=False`,
   which keeps every memory for the full L (Transformer-XL style). Before measuring, enough segments are run to fill
   the memory to its steady state. Times: the two models in one subprocess with the default allocator, their steps in
   turns (speed-up: the median of the rounds' ratios); peak memory: each model in a subprocess of its own where large
   buffers are returned to the system when freed (MALLOC_MMAP_THRESHOLD_), so that the resident set size tracks live
   tensors: peak = the rise of VmHWM (reset through /proc/self/clear_refs) during a step over the resident size
   before it.
2. Generation: decode time per token and the number of cache entries per layer after a prefill of 1K, 8K and 32K
   tokens (`--contexts`), for the same two models at L = 16384, measured in one process with their repeats
   interleaved.

Model: hidden 128, 2 layers, 4 heads, ramp R = 128, byte vocabulary. Times are medians of `--repeats` rounds, speed-ups
the median of the rounds' ratios.

    python benchmarks/expire_span.py [--json results.json] [--tables generation] [--contexts 1024 ...]
    python benchmarks/expire_span.py --write-docs --json benchmarks/results/expire_span.json   # what the docs quote
    python benchmarks/expire_span.py --report benchmarks/results/expire_span.json   # rewrite the docs from a saved run

``--write-docs`` (after a run of both tables) and ``--report RESULTS_JSON`` rewrite the Expire-Span section of
docs/performance/speed.md from the results (see ``report.py``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

try:  # run as a script (python benchmarks/expire_span.py) or imported as benchmarks.expire_span
    import report
except ImportError:
    from benchmarks import report

# The model at every span: spans start at initial_span_fraction · L (L/8) for every memory.
SIZES = {"vocab_size": 258, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
         "num_attention_heads": 4, "ramp": 128, "initial_span_fraction": 1 / 8}  # fmt: skip
MAX_SPANS = (4096, 16384)
DECODE_CONTEXTS = (1024, 8192, 32768)
DECODE_MAX_SPAN = 16384


def build_model(max_span: int, expire: bool, block_size: int):
    from memlm import ExpireSpanConfig, ExpireSpanForCausalLM

    torch.manual_seed(0)
    config = ExpireSpanConfig(**SIZES, max_span=max_span, block_size=block_size, expire_memories=expire,
                              span_loss_coefficient=1e-6)  # fmt: skip
    return ExpireSpanForCausalLM(config)


def _resident_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class TrainingSteps:
    """A model's training steps over random segments, the memory of earlier segments carried; built with enough
    segments run (no backward) to fill the memory to its steady state."""

    def __init__(self, max_span: int, expire: bool, args):
        self.model = build_model(max_span, expire, args.block_size).train()
        self.generator = torch.Generator().manual_seed(0)
        self.segment, self.cache = args.segment, None
        for _ in range(max_span // args.segment + 2):
            self.cache = self.model(self.segments(), cache=self.cache, use_cache=True).cache
        self.memory_entries = max(self.cache.memory_entries())

    def segments(self) -> torch.Tensor:
        return torch.randint(0, 258, (1, self.segment), generator=self.generator)

    def __call__(self) -> None:
        tokens = self.segments()
        output = self.model(tokens, labels=tokens, cache=self.cache, use_cache=True)
        output.loss.backward()
        self.cache = output.cache
        self.model.zero_grad(set_to_none=True)


def training_times(max_span: int, args) -> dict:
    """Runs in a subprocess: both models' steady-state training steps in turns; each one's median step and memory
    entries, and the speed-up (fixed / Expire-Span, the median of the rounds' ratios)."""
    steps = {name: TrainingSteps(max_span, expire, args) for name, expire in (("fixed", False), ("expire_span", True))}
    times = report.interleaved_times(steps, 1, args.repeats)
    result = {
        name: {"step_seconds": statistics.median(times[name]), "memory_entries": step.memory_entries}
        for name, step in steps.items()
    }
    return result | {"speed_up": report.paired_speedup(times, "expire_span", "fixed")}


def training_memory(max_span: int, expire: bool, args) -> dict:
    """Runs in a subprocess (with --memory): the peak rise of the resident set size over two steady-state steps."""
    step = TrainingSteps(max_span, expire, args)
    rise = 0
    for _ in range(2):
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset the peak resident set size (VmHWM)
        before = _resident_kib("VmRSS")
        step()
        rise = max(rise, _resident_kib("VmHWM") - before)
    return {"peak_rise_mib": rise / 1024, "memory_entries": step.memory_entries}


def decode_measurement(args) -> dict:
    """Both models in one process, their timing repeats interleaved, so that a busy machine slows both alike; per
    context, each one's rows and the speed-up (fixed / Expire-Span, the median of the rounds' ratios)."""
    models = {name: build_model(DECODE_MAX_SPAN, expire, args.block_size).eval()
              for name, expire in (("expire_span", True), ("fixed", False))}  # fmt: skip
    rows = {name: [] for name in models} | {"speed_up": []}
    with torch.no_grad():
        for context in args.contexts:
            decodings = {name: report.Decoding(model, context, args.decode_steps) for name, model in models.items()}
            times = report.interleaved_times(decodings, 0, args.repeats)
            for name, decoding in decodings.items():
                rows[name].append({"context": context,
                                   "ms_per_token": statistics.median(times[name]) / args.decode_steps * 1e3,
                                   "memory_entries": max(decoding.cache.memory_entries())})  # fmt: skip
            rows["speed_up"].append(report.paired_speedup(times, "expire_span", "fixed"))
    return rows


def run_isolated(kind: str, args, memory: bool = False, **values) -> dict | list:
    """Run one measurement in a fresh interpreter and return its JSON result."""
    command = [sys.executable, __file__, "--measure", json.dumps({"kind": kind, **values})]
    command += ["--segment", str(args.segment), "--block-size", str(args.block_size), "--repeats", str(args.repeats),
                "--decode-steps", str(args.decode_steps), "--contexts", *map(str, args.contexts)]  # fmt: skip
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    environment = dict(os.environ)
    if memory:
        # Large buffers are mmap-ed and returned to the system when freed, so the resident size tracks live tensors.
        command.append("--memory")
        environment.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    result = subprocess.run(command, capture_output=True, text=True, env=environment, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


# The two tables' (header, row key, format) columns, printed and in the docs; ratios are fixed / Expire-Span.
TRAINING_COLUMNS = [
    ("L", "max_span", "d"),
    ("memories (Expire-Span)", "expire_span_memories", "d"),
    ("memories (fixed)", "fixed_memories", "d"),
    ("Expire-Span s/step", "expire_span_seconds", ".2f"),
    ("fixed s/step", "fixed_seconds", ".2f"),
    ("speed-up", "speed_up", ".2f"),
    ("Expire-Span peak MiB", "expire_span_mib", ".0f"),
    ("fixed peak MiB", "fixed_mib", ".0f"),
    ("memory ratio", "memory_ratio", ".2f"),
]
DECODE_COLUMNS = [
    ("context", "context", "d"),
    ("Expire-Span ms/token", "expire_span_ms", ".2f"),
    ("fixed ms/token", "fixed_ms", ".2f"),
    ("speed-up", "speed_up", ".2f"),
    ("Expire-Span cache entries", "expire_span_entries", "d"),
    ("fixed cache entries", "fixed_entries", "d"),
]


def training_rows(results: dict) -> list[dict]:
    """One row per maximum span L: both models' figures and their ratios."""
    rows = []
    for measured in results["training"]:
        expiring, fixed = measured["expire_span"], measured["fixed"]
        rows.append({
            "max_span": measured["max_span"],
            "expire_span_memories": expiring["memory_entries"], "fixed_memories": fixed["memory_entries"],
            "expire_span_seconds": expiring["step_seconds"], "fixed_seconds": fixed["step_seconds"],
            "speed_up": measured["speed_up"],
            "expire_span_mib": expiring["peak_rise_mib"], "fixed_mib": fixed["peak_rise_mib"],
            "memory_ratio": fixed["peak_rise_mib"] / expiring["peak_rise_mib"] if expiring["peak_rise_mib"] else None,
        })  # fmt: skip
    return rows


def decode_rows(results: dict) -> list[dict]:
    """One row per context: both models' decode time per token and cache entries, and the speed-up."""
    decode = results["decode"]
    return [
        {"context": expiring["context"], "expire_span_ms": expiring["ms_per_token"], "fixed_ms": fixed["ms_per_token"],
         "speed_up": speed_up,
         "expire_span_entries": expiring["memory_entries"], "fixed_entries": fixed["memory_entries"]}
        for expiring, fixed, speed_up in zip(decode["expire_span"], decode["fixed"], decode["speed_up"])
    ]  # fmt: skip


def run_command(settings: dict) -> str:
    """The command line of a run: the script and the options whose values differ from their defaults."""
    parser = argument_parser()
    words = ["python benchmarks/expire_span.py"]
    for name in ("segment", "block_size", "repeats", "decode_steps", "max_spans", "contexts"):
        value = settings[name]
        if value != parser.get_default(name):
            words += [f"--{name.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    if settings["requested_threads"] is not None:
        words += ["--threads", str(settings["requested_threads"])]
    return " ".join(words)


def docs_section(results: dict) -> str:
    """The Expire-Span section of docs/performance/speed.md, from one run's results (both tables)."""
    settings = results["settings"]
    missing = {"training", "generation"} - set(settings["tables"])
    if missing:
        raise SystemExit(f"the docs quote both tables; this run lacks {sorted(missing)}")
    model = (
        f"hidden {SIZES['hidden_size']}, {SIZES['num_hidden_layers']} layers, {SIZES['num_attention_heads']} heads, "
        f"MLP {SIZES['intermediate_size']}, R = {SIZES['ramp']}, spans at L/{round(1 / SIZES['initial_span_fraction'])}"
    )
    return "\n\n".join([
        "Expire-Span against the same model with expiration off (a fixed span of L, Transformer-XL style), from "
        f"`{run_command(settings)}`: {model} (the initial span fraction); a training step is forward + backward of "
        f"a {settings['segment']}-token segment in blocks of {settings['block_size']} with the memory of earlier "
        "segments carried at its steady state (memories: the entries of the widest layer there); the two models' "
        f"steps in turns in one process, times the medians of {settings['repeats']} rounds, speed-ups the median of "
        "the rounds' ratios; peak memory is the rise of the resident set size during a step, with large buffers "
        "returned to the system when freed so that it tracks live tensors (each model in a process of its own, see "
        f"the script's docstring). {report.measured_on(settings)}",
        report.markdown_table(TRAINING_COLUMNS, training_rows(results)),
        f"Decoding after a prefill (L = {settings['decode_max_span']}, batch 1; times are medians of "
        f"{settings['repeats']} runs of {settings['decode_steps']} greedy steps, the two models in turns in one "
        "process, speed-ups the median of the rounds' ratios; cache entries of the widest layer, after the timed "
        "steps; decoding appends into a preallocated buffer and compacts expired memories lazily, so the count "
        "includes expired slots not yet compacted):",
        report.markdown_table(DECODE_COLUMNS, decode_rows(results)),
    ])  # fmt: skip


SECTION = report.Section(
    "expire_span", "python benchmarks/expire_span.py --report benchmarks/results/expire_span.json", docs_section
)


def argument_parser() -> argparse.ArgumentParser:
    parser = report.arguments(__doc__, repeats=5, section=SECTION)
    parser.add_argument("--segment", type=int, default=2048, help="tokens per training segment")
    parser.add_argument("--block-size", type=int, default=512, help="tokens per block of a segment")
    parser.add_argument("--decode-steps", type=int, default=32, help="greedy steps per timed decoding run")
    parser.add_argument("--tables", nargs="+", choices=["training", "generation"], default=["training", "generation"],
                        help="which tables to measure (both take a few minutes)")  # fmt: skip
    parser.add_argument("--max-spans", nargs="+", type=int, default=list(MAX_SPANS),
                        help="maximum spans L of the training table")  # fmt: skip
    parser.add_argument("--contexts", nargs="+", type=int, default=list(DECODE_CONTEXTS),
                        help="prefill lengths of the generation table")  # fmt: skip
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    parser = argument_parser()
    args = report.parse(parser, argv, {"segment": 256, "block_size": 64, "repeats": 1, "decode_steps": 4,
                                       "max_spans": [256], "contexts": [64]})  # fmt: skip
    saved = report.saved_run(args, SECTION)
    if saved is not None:
        return saved
    if args.write_docs and len(args.tables) < 2:
        parser.error("--write-docs needs both tables (the docs quote both)")
    if args.measure is not None:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        request = json.loads(args.measure)
        if request["kind"] == "training" and args.memory:
            result = training_memory(request["max_span"], request["expire"], args)
        elif request["kind"] == "training":
            result = training_times(request["max_span"], args)
        else:
            result = decode_measurement(args)
        print(json.dumps(result))
        return result

    machine = report.start(args)
    settings = {key: value for key, value in report.own_settings(args).items() if key not in ("measure", "memory")}
    # `threads` is the number torch used (report.machine()); `--threads` is kept apart, for the command line.
    settings |= {"requested_threads": settings.pop("threads"), "decode_max_span": DECODE_MAX_SPAN}
    results = {"settings": settings | machine, "training": [], "decode": {}}
    try:
        run_tables(args, results)
    except BaseException:
        report.finish(results, args)  # what was measured is kept even when a later measurement fails
        raise
    return report.finish(results, args, SECTION)


def run_tables(args, results: dict) -> None:
    if "training" in args.tables:
        for max_span in args.max_spans:
            measured = {"max_span": max_span} | run_isolated("training", args, max_span=max_span)
            for name, expire in (("fixed", False), ("expire_span", True)):
                peak = run_isolated("training", args, memory=True, max_span=max_span, expire=expire)
                measured[name]["peak_rise_mib"] = peak["peak_rise_mib"]
            results["training"].append(measured)
        report.print_table(
            f"Training step, segment {args.segment} tokens in blocks of {args.block_size}, steady-state memory "
            "(Expire-Span spans = L/8 vs fixed span L)",
            TRAINING_COLUMNS,
            training_rows(results),
        )
    if "generation" in args.tables:
        results["decode"] = run_isolated("decode", args)
        report.print_table(
            f"Decoding after a prefill, L = {DECODE_MAX_SPAN}, batch 1 (cache entries = widest layer)",
            DECODE_COLUMNS,
            decode_rows(results),
        )


if __name__ == "__main__":
    main()
