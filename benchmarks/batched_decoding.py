"""Serving many rows at once: what does a decoded token cost at batch 1, 8 and 32 after 64, 1,024 and 8,192 tokens?

A fixed-size memory (DeltaNet's fast weights, the Feedback Transformer's τ memories, Expire-Span's unexpired ones)
does not grow with the context, where 🤗 Llama's keys and values do: this table shows what that is worth to someone
decoding for many users. For each batch size and context: decoded tokens/s (all rows) of the three memlm families
and 🤗 Llama (🤗 Mamba too, up to `--mamba-context`: its PyTorch prefill is a loop over the tokens), timed in turns,
and the bytes each cache holds after the prompt. All models: hidden 256, 4 layers, 4 heads, MLP 1024, byte vocabulary,
untrained weights in their default layouts, float32; greedy steps with the cache (`report.Decoding`), the prompt
read in pieces of `--prefill-chunk` tokens (untimed); each ratio to Llama is the median of the rounds' ratios
(`report.paired_speedup`).

    python benchmarks/batched_decoding.py [--json RESULTS]             # the full table: many minutes on 2 cores
    python benchmarks/batched_decoding.py --quick                      # small sizes: checks the script
    python benchmarks/batched_decoding.py --write-docs --json benchmarks/results/batched_decoding.json
    python benchmarks/batched_decoding.py --report benchmarks/results/batched_decoding.json
"""

import argparse
import statistics

import torch
from tqdm.auto import tqdm

try:  # run as a script (python benchmarks/batched_decoding.py) or imported as benchmarks.batched_decoding
    import report
except ImportError:
    from benchmarks import report

SIZES = {"vocab_size": 258, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "intermediate_size": 1024}  # fmt: skip
QUICK_SIZES = {"vocab_size": 258, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
               "intermediate_size": 64}  # fmt: skip
MODELS = ("deltanet", "expire_span", "feedback", "llama", "mamba")
NAMES = {"deltanet": "DeltaNet", "expire_span": "Expire-Span", "feedback": "Feedback", "llama": "🤗 Llama",
         "mamba": "🤗 Mamba"}  # fmt: skip


def build(name: str, sizes: dict, longest: int):
    """The model `name` at `sizes` (seed 0), eval mode; Llama's positions reach `longest` tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MambaConfig

    from memlm import DeltaNetConfig, ExpireSpanConfig, FeedbackTransformerConfig

    torch.manual_seed(0)
    if name == "mamba":  # no heads nor MLP: its mixer expands the width twice
        config = MambaConfig(vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"],
                             num_hidden_layers=sizes["num_hidden_layers"])  # fmt: skip
    elif name == "llama":
        config = LlamaConfig(**sizes, max_position_embeddings=longest)
    else:
        config = {"deltanet": DeltaNetConfig, "expire_span": ExpireSpanConfig,
                  "feedback": FeedbackTransformerConfig}[name](**sizes)  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def measure(args, sizes: dict) -> list[dict]:
    longest = max(args.contexts) + args.decode_steps * (args.repeats + 1)
    models = {name: build(name, sizes, longest) for name in args.models}
    rows = []
    for batch_size in tqdm(args.batch_sizes, desc="batch sizes", leave=False):
        for context in tqdm(args.contexts, desc="contexts", leave=False):
            decodings = {
                name: report.Decoding(
                    model,
                    context,
                    args.decode_steps,
                    batch_size,
                    prefill_chunk=None if name == "mamba" else args.prefill_chunk,
                )  # fmt: skip
                for name, model in models.items()
                if name != "mamba" or context <= args.mamba_context
            }
            cache_sizes = {name: report.cache_bytes(decoding.cache) for name, decoding in decodings.items()}
            times = report.interleaved_times(decodings, 1, args.repeats)
            row = {"batch_size": batch_size, "context": context}
            for name in decodings:
                row[f"{name}_tokens_per_s"] = batch_size * args.decode_steps / statistics.median(times[name])
                row[f"{name}_cache_megabytes"] = cache_sizes[name] / 2**20
            if "llama" in decodings:
                for name in decodings:
                    row[f"{name}_over_llama"] = report.paired_speedup(times, name, "llama")
            rows.append(row)
            del decodings
    return rows


def columns(models) -> list[tuple[str, str, str]]:
    shown = [("batch", "batch_size", "d"), ("context", "context", "d")]
    shown += [(f"{NAMES[name]} tok/s", f"{name}_tokens_per_s", ".0f") for name in models]
    shown += [(f"{NAMES[name]} / Llama", f"{name}_over_llama", ".2f") for name in models if name != "llama"]
    shown += [(f"{NAMES[name]} cache MiB", f"{name}_cache_megabytes", ".2f") for name in models]
    return shown


def docs_section(results: dict) -> str:
    """The "batched decoding" section of docs/performance/speed.md, from one full run's results."""
    settings = results["settings"]
    return "\n\n".join(
        [
            f"From `python benchmarks/batched_decoding.py` ({settings['repeats']} runs of "
            f"{settings['decode_steps']} greedy steps for every row, the models timed in turns at each batch size and "
            "context: tokens/s the median of the runs, a ratio to Llama the median of the rounds' ratios). "
            f"{report.measured_on(settings)} Hidden size {SIZES['hidden_size']}, "
            f"{SIZES['num_hidden_layers']} layers, {SIZES['num_attention_heads']} heads, MLP "
            f"{SIZES['intermediate_size']}, byte vocabulary, untrained weights in the default layouts, float32; tok/s "
            "counts the tokens of every row; cache = the bytes its tensors hold after the prompt (🤗 Mamba only up to "
            f"{settings['mamba_context']} tokens of context: its PyTorch prefill is a loop over the tokens).",
            report.markdown_table(columns(settings["models"]), results["rows"]),
            goals(results["rows"]),
        ]
    )


def goals(rows: list[dict]) -> str:
    """Issue 40's goals for DeltaNet, judged from the rows: at least Llama's speed in every cell, and at least ten
    times it at the largest batch after the longest context."""
    lowest = min(rows, key=lambda row: row["deltanet_over_llama"])
    largest = max(rows, key=lambda row: (row["batch_size"], row["context"]))
    every = lowest["deltanet_over_llama"] >= 1
    far = largest["deltanet_over_llama"] >= 10
    return (
        f"DeltaNet over Llama: at least 1× in every cell — {'met' if every else 'missed'} (lowest "
        f"{report.against(lowest['deltanet_over_llama'], 1)}× at batch {lowest['batch_size']} after "
        f"{lowest['context']} tokens); at least 10× at batch {largest['batch_size']} after {largest['context']} tokens "
        f"— {'met' if far else 'missed'} ({report.against(largest['deltanet_over_llama'], 10)}×)."
    )


SECTION = report.Section(
    "batched_decoding",
    "python benchmarks/batched_decoding.py --report benchmarks/results/batched_decoding.json",
    docs_section,
)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = report.arguments(__doc__, repeats=3, section=SECTION)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 1024, 8192], help="tokens before decoding")
    parser.add_argument("--decode-steps", type=int, default=16, help="greedy steps per timed run")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="prompt tokens per prefill call")
    parser.add_argument("--mamba-context", type=int, default=1024, help="the longest context 🤗 Mamba is timed at")
    quick = {"batch_sizes": [1, 3], "contexts": [8, 40], "decode_steps": 2, "repeats": 1, "prefill_chunk": 16,
             "mamba_context": 8}  # fmt: skip
    positive = ("decode_steps", "repeats", "prefill_chunk", "mamba_context")
    args = report.parse(parser, argv, quick, positive=positive)
    if any(value < 1 for value in args.batch_sizes + args.contexts):
        parser.error(f"--batch-sizes and --contexts must be positive, got {args.batch_sizes} and {args.contexts}")
    args.models = [name for name in MODELS if name in args.models]
    return args


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    saved = report.saved_run(args, SECTION)
    if saved is not None:
        return saved
    results = {"settings": report.own_settings(args) | report.start(args)}
    results["rows"] = measure(args, QUICK_SIZES if args.quick else SIZES)
    report.print_table("Batched greedy decoding", columns(args.models), results["rows"])
    return report.finish(results, args, SECTION)


if __name__ == "__main__":
    main()
