"""How fast is the chunkwise delta rule on this machine, next to the recurrent reference and causal attention?

Prints two side-by-side tables, all measured in this one process:

1. training step (forward + backward) of the chunkwise delta rule (``memlm.kernels.delta_rule``, backend
   ``"torch"``), the recurrent reference (backend ``"reference"``; only up to ``--reference-max-length``
   tokens because it runs a Python loop per token), and causal ``scaled_dot_product_attention`` on the same
   (B, H, T, D), with the ratios reference / chunk and chunk / SDPA;
2. forward time per token of the chunkwise op (no autograd) at a short and a long context, with their ratio;
3. decode time per generated token of a small ``DeltaNetForCausalLM`` (paper preset, hidden 256, 4 layers, 4 heads)
   after a prefill of 1K, 8K and 32K tokens, with the ratio to 1K: the fast-weight memory has a fixed size, so a
   decoding step should cost the same at any context length.

Times are medians of ``--repeats`` runs after ``--warmup`` runs, with ``time.perf_counter`` and PyTorch's
default number of threads. Absolute numbers depend on the machine; the ratios are the point.

    python benchmarks/delta_rule.py [--json results.json]
"""

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from memlm.kernels.delta_rule import delta_rule

TRAINING_LENGTHS = (512, 2048, 8192)
FORWARD_LENGTHS = (2048, 32768)
DECODE_CONTEXTS = (1024, 8192, 32768)


def median_time(function, warmup: int, repeats: int) -> float:
    """Median wall-clock seconds of ``function()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_inputs(batch_size: int, num_heads: int, length: int, head_dim: int, requires_grad: bool, seed: int = 0):
    """Query, key, value (B, H, T, D) and beta (B, H, T) as a DeltaNet layer produces them: L2-normalised
    queries and keys (queries also scaled by D^-1/2), β in (0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, num_heads, length, head_dim)
    query = F.normalize(torch.randn(shape, generator=generator), dim=-1) * head_dim**-0.5
    key = F.normalize(torch.randn(shape, generator=generator), dim=-1)
    value = torch.randn(shape, generator=generator)
    beta = torch.rand(shape[:3], generator=generator)
    return [tensor.requires_grad_(requires_grad) for tensor in (query, key, value, beta)]


def delta_rule_training_time(backend: str, length: int, args) -> float:
    """Seconds for one forward + backward of ``delta_rule`` with the given backend."""
    query, key, value, beta = make_inputs(args.batch_size, args.num_heads, length, args.head_dim, requires_grad=True)
    grad_output = torch.randn_like(value)

    def step():
        output, _ = delta_rule(query, key, value, beta, chunk_size=args.chunk_size, backend=backend)
        output.backward(grad_output)

    slow = backend == "reference"
    return median_time(step, warmup=1 if slow else args.warmup, repeats=min(args.repeats, 3) if slow else args.repeats)


def attention_training_time(length: int, args) -> float:
    """Seconds for one forward + backward of causal ``scaled_dot_product_attention`` on the same shapes."""
    query, key, value, _ = make_inputs(args.batch_size, args.num_heads, length, args.head_dim, requires_grad=True)
    grad_output = torch.randn_like(value)

    def step():
        F.scaled_dot_product_attention(query, key, value, is_causal=True).backward(grad_output)

    return median_time(step, warmup=max(1, args.warmup // 2), repeats=max(3, args.repeats // 2))


def delta_rule_forward_time_per_token(length: int, args) -> float:
    """Seconds per token (of B·H·T) for one forward of the chunkwise ``delta_rule`` without autograd."""
    query, key, value, beta = make_inputs(args.batch_size, args.num_heads, length, args.head_dim, requires_grad=False)

    def step():
        with torch.no_grad():
            delta_rule(query, key, value, beta, chunk_size=args.chunk_size, backend="torch")

    return median_time(step, warmup=args.warmup, repeats=args.repeats) / (args.batch_size * args.num_heads * length)


def training_table(args) -> list[dict]:
    rows = []
    for length in tqdm(TRAINING_LENGTHS, desc="forward + backward", leave=False):
        chunk = delta_rule_training_time("torch", length, args)
        reference = (
            delta_rule_training_time("reference", length, args) if length <= args.reference_max_length else None
        )
        attention = attention_training_time(length, args)
        rows.append(
            {
                "tokens": length,
                "chunk_ms": chunk * 1e3,
                "reference_ms": None if reference is None else reference * 1e3,
                "sdpa_ms": attention * 1e3,
                "reference_over_chunk": None if reference is None else reference / chunk,
                "chunk_over_sdpa": chunk / attention,
            }
        )
    return rows


def forward_table(args) -> list[dict]:
    rows = [
        {"tokens": length, "us_per_token": delta_rule_forward_time_per_token(length, args) * 1e6}
        for length in tqdm(FORWARD_LENGTHS, desc="forward", leave=False)
    ]
    for row in rows:
        row["over_shortest"] = row["us_per_token"] / rows[0]["us_per_token"]
    return rows


def decode_time_per_token(model, context: int, args) -> float:
    """Seconds per generated token: greedy steps of one token each, after a prefill of `context` tokens."""
    with torch.no_grad():
        prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
        cache = model(prompt, use_cache=True, logits_to_keep=1).past_key_values
        token = prompt[:, -1:]

        def step():
            nonlocal token
            for _ in range(args.decode_steps):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

        return median_time(step, warmup=1, repeats=args.repeats) / args.decode_steps


def decode_table(args) -> list[dict]:
    from memlm import DeltaNetConfig, DeltaNetForCausalLM

    torch.manual_seed(0)
    config = DeltaNetConfig.from_preset(
        "paper", vocab_size=258, hidden_size=256, num_hidden_layers=4, num_attention_heads=4
    )
    model = DeltaNetForCausalLM(config).eval()
    rows = [
        {"context": context, "ms_per_token": decode_time_per_token(model, context, args) * 1e3}
        for context in tqdm(DECODE_CONTEXTS, desc="decode", leave=False)
    ]
    for row in rows:
        row["over_shortest"] = row["ms_per_token"] / rows[0]["ms_per_token"]
    return rows


def format_cell(value, pattern: str) -> str:
    return "—" if value is None else format(value, pattern)


def print_table(title: str, columns: list[tuple[str, str, str]], rows: list[dict]) -> None:
    """Print ``rows`` under ``title``; ``columns`` are (header, row key, format) triples."""
    cells = [[format_cell(row[key], pattern) for _, key, pattern in columns] for row in rows]
    widths = [max(len(header), *(len(line[i]) for line in cells)) for i, (header, _, _) in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(header.rjust(width) for (header, _, _), width in zip(columns, widths)))
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--reference-max-length", type=int, default=2048, help="longest T at which the slow reference is timed"
    )
    parser.add_argument("--decode-steps", type=int, default=32, help="tokens generated per decode timing")
    parser.add_argument("--json", type=str, default=None, help="also write the results to this JSON file")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    shape = f"B={args.batch_size}, H={args.num_heads}, D={args.head_dim}, chunk={args.chunk_size}"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    results = {
        "settings": vars(args) | {"torch": torch.__version__, "threads": torch.get_num_threads()},
        "training": training_table(args),
    }
    print_table(
        f"Forward + backward, {shape} (reference timed up to T={args.reference_max_length} only)",
        [
            ("T", "tokens", "d"),
            ("chunk ms", "chunk_ms", ".1f"),
            ("reference ms", "reference_ms", ".1f"),
            ("SDPA causal ms", "sdpa_ms", ".1f"),
            ("reference/chunk", "reference_over_chunk", ".1f"),
            ("chunk/SDPA", "chunk_over_sdpa", ".2f"),
        ],
        results["training"],
    )
    results["forward"] = forward_table(args)
    print_table(
        f"Chunkwise forward without autograd, {shape}: time per token (of B·H·T)",
        [
            ("T", "tokens", "d"),
            ("us/token", "us_per_token", ".3f"),
            (f"ratio to T={FORWARD_LENGTHS[0]}", "over_shortest", ".2f"),
        ],
        results["forward"],
    )
    results["decode"] = decode_table(args)
    print_table(
        "Decode time per token, DeltaNetForCausalLM (paper preset, hidden 256, 4 layers, 4 heads), batch 1",
        [
            ("context", "context", "d"),
            ("ms/token", "ms_per_token", ".2f"),
            (f"ratio to {DECODE_CONTEXTS[0]}", "over_shortest", ".2f"),
        ],
        results["decode"],
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)
    return results


if __name__ == "__main__":
    main()
