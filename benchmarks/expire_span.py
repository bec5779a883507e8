"""Does expiring memories pay off? Expire-Span against the same model with expiration off (a fixed span of L).

Prints two side-by-side tables, measured on this machine in one run:

1. Training step (forward + backward of one segment of `--segment` tokens, blocks of `--block-size`, carrying the
   memory of earlier segments as in truncated-BPTT training) at maximum span L ∈ {4096, 16384}: time and peak memory
   of an Expire-Span model whose spans are L/8 against the same model with `expire_memories=False`, which keeps every
   memory for the full L (Transformer-XL style). Before measuring, enough segments are run to fill the memory to its
   steady state. Every measurement runs in its own subprocess: times with the default allocator; peak memory in a
   separate run where large buffers are returned to the system when freed (MALLOC_MMAP_THRESHOLD_), so that the
   resident set size tracks live tensors: peak = the rise of VmHWM (reset through /proc/self/clear_refs) during a
   step over the resident size before it.
2. Generation: decode time per token and the number of cache entries per layer after a prefill of 1K, 8K and 32K
   tokens, for the same two models at L = 16384, measured in one process with their repeats interleaved.

Model: hidden 128, 2 layers, 4 heads, ramp R = 128, byte vocabulary. Times are medians of `--repeats` steps.

    python benchmarks/expire_span.py [--json results.json] [--tables generation] [--contexts 1024 ...]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

MAX_SPANS = (4096, 16384)
DECODE_CONTEXTS = (1024, 8192, 32768)
DECODE_MAX_SPAN = 16384


def build_model(max_span: int, expire: bool, block_size: int):
    from memlm import ExpireSpanConfig, ExpireSpanForCausalLM

    torch.manual_seed(0)
    config = ExpireSpanConfig(
        vocab_size=258, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        max_span=max_span, ramp=128, block_size=block_size, expire_memories=expire, initial_span_fraction=1 / 8,
        span_loss_coefficient=1e-6,
    )  # fmt: skip
    # Freshly initialised spans are exactly initial_span_fraction · L = L/8 for every memory.
    return ExpireSpanForCausalLM(config)


def _resident_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def training_measurement(max_span: int, expire: bool, args) -> dict:
    """Runs in a subprocess: steady-state training step time, or (with --memory) peak memory rise."""
    model = build_model(max_span, expire, args.block_size).train()
    generator = torch.Generator().manual_seed(0)
    cache = None
    warmup_segments = max_span // args.segment + 2
    for _ in range(warmup_segments):  # fill the memory to its steady state (no backward needed)
        tokens = torch.randint(0, 258, (1, args.segment), generator=generator)
        cache = model(tokens, cache=cache, use_cache=True).cache
    entries = cache.memory_entries()
    timings = []
    rise = 0
    for _ in range(2 if args.memory else args.repeats):
        tokens = torch.randint(0, 258, (1, args.segment), generator=generator)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset the peak resident set size (VmHWM)
        before = _resident_kib("VmRSS")
        start = time.perf_counter()
        output = model(tokens, labels=tokens, cache=cache, use_cache=True)
        output.loss.backward()
        timings.append(time.perf_counter() - start)
        rise = max(rise, _resident_kib("VmHWM") - before)
        cache = output.cache
        model.zero_grad(set_to_none=True)
        del output
    if args.memory:
        return {"peak_rise_mib": rise / 1024, "memory_entries": max(entries)}
    return {"step_seconds": statistics.median(timings), "memory_entries": max(entries)}


def decode_measurement(args) -> dict[str, list[dict]]:
    """Both models in one process, their timing repeats interleaved, so that a busy machine slows both alike."""
    models = {name: build_model(DECODE_MAX_SPAN, expire, args.block_size).eval()
              for name, expire in (("expire_span", True), ("fixed", False))}  # fmt: skip
    rows = {name: [] for name in models}
    with torch.no_grad():
        for context in args.contexts:
            prompt = torch.randint(0, 258, (1, context), generator=torch.Generator().manual_seed(1))
            caches, tokens, timings = {}, {}, {name: [] for name in models}
            for name, model in models.items():
                caches[name] = model(prompt, use_cache=True, logits_to_keep=1).cache
                tokens[name] = prompt[:, -1:]
            for _ in range(args.repeats):
                for name, model in models.items():
                    token, cache = tokens[name], caches[name]
                    start = time.perf_counter()
                    for _ in range(args.decode_steps):
                        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    timings[name].append((time.perf_counter() - start) / args.decode_steps)
                    tokens[name] = token
            for name in models:
                rows[name].append({"context": context, "ms_per_token": statistics.median(timings[name]) * 1e3,
                                   "memory_entries": max(caches[name].memory_entries())})  # fmt: skip
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


def print_table(title: str, header: list[str], rows: list[list[str]]):
    print(f"\n{title}")
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    for line in [header, *rows]:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segment", type=int, default=2048, help="tokens per training segment")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--tables",
        nargs="+",
        choices=["training", "generation"],
        default=["training", "generation"],
        help="which tables to measure (generation alone takes a few minutes)",
    )
    parser.add_argument(
        "--contexts",
        nargs="+",
        type=int,
        default=list(DECODE_CONTEXTS),
        help="prefill lengths of the generation table",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 keeps a busy machine's other jobs from stalling a step",
    )
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.measure is not None:
        request = json.loads(args.measure)
        if request["kind"] == "training":
            result = training_measurement(request["max_span"], request["expire"], args)
        else:
            result = decode_measurement(args)
        print(json.dumps(result))
        return result

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    results = {"training": [], "decode": {}}
    try:
        return run_tables(args, results)
    finally:
        if args.json:
            with open(args.json, "w") as file:
                json.dump(results, file, indent=2)


def run_tables(args, results: dict) -> dict:
    rows = []
    for max_span in MAX_SPANS if "training" in args.tables else ():
        fixed = run_isolated("training", args, max_span=max_span, expire=False)
        fixed |= run_isolated("training", args, memory=True, max_span=max_span, expire=False)
        expiring = run_isolated("training", args, max_span=max_span, expire=True)
        expiring |= run_isolated("training", args, memory=True, max_span=max_span, expire=True)
        results["training"].append({"max_span": max_span, "fixed": fixed, "expire_span": expiring})
        rows.append([
            str(max_span), str(expiring["memory_entries"]), str(fixed["memory_entries"]),
            f"{expiring['step_seconds']:.2f}", f"{fixed['step_seconds']:.2f}",
            f"{fixed['step_seconds'] / expiring['step_seconds']:.2f}",
            f"{expiring['peak_rise_mib']:.0f}", f"{fixed['peak_rise_mib']:.0f}",
            f"{fixed['peak_rise_mib'] / max(expiring['peak_rise_mib'], 1e-9):.2f}",
        ])  # fmt: skip
    if "training" in args.tables:
        print_table(
            f"Training step, segment {args.segment} tokens in blocks of {args.block_size}, steady-state memory "
            "(Expire-Span spans = L/8 vs fixed span L)",
            ["L", "memories (expire)", "memories (fixed)", "expire s", "fixed s", "speed-up", "expire MiB",
             "fixed MiB", "memory ratio"],
            rows,
        )  # fmt: skip
    if "generation" not in args.tables:
        return results
    results["decode"] = run_isolated("decode", args)
    expiring, fixed = results["decode"]["expire_span"], results["decode"]["fixed"]
    print_table(
        f"Decoding after a prefill, L = {DECODE_MAX_SPAN}, batch 1 (cache entries = widest layer)",
        ["context", "expire ms/token", "fixed ms/token", "expire entries", "fixed entries"],
        [[str(e["context"]), f"{e['ms_per_token']:.2f}", f"{f['ms_per_token']:.2f}", str(e["memory_entries"]),
          str(f["memory_entries"])] for e, f in zip(expiring, fixed)],
    )  # fmt: skip
    return results


if __name__ == "__main__":
    main()
