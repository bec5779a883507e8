"""How fast is the chunkwise delta rule on this machine, next to the recurrent reference and causal attention?

Prints two side-by-side tables, all measured in this one process:

1. training step (forward + backward) of the chunkwise delta rule (``memlm.kernels.delta_rule``, backend
   ``"torch"``), the recurrent reference (backend ``"reference"``; only up to ``--reference-max-length``
   tokens because it runs a Python loop per token), and causal ``scaled_dot_product_attention`` on the same
   (B, H, T, D), with the ratios reference / chunk and chunk / SDPA;
2. forward time per token of the chunkwise op (no autograd) at a short and a long context, with their ratio;
3. decode time per generated token of a small ``DeltaNetForCausalLM`` (paper preset, hidden 256, 4 layers, 4 heads)
   after a prefill of 1K, 8K and 32K tokens, with the ratio to 1K: the fast-weight memory has a fixed size, so a
   decoding step should cost the same at any context length;
4. the same DeltaNet next to a 🤗 ``LlamaForCausalLM`` (SDPA attention) and a 🤗 ``MambaForCausalLM`` (its PyTorch
   path) of about the same number of parameters (printed; within 5 %): training tokens/s (forward + backward of the
   language-model loss, the same number of tokens per step at T = 2K and 8K) and decode tokens/s (batch 1, greedy
   steps through the model's forward with its cache, the same path for all three) after 2K and 16K tokens of
   context, with the ratios DeltaNet/Llama and DeltaNet/Mamba (memlm issue 15 asks for training ≥ 1× Llama at 2K
   and ≥ 2× at 8K; decode ≥ 1× Llama at 2K, ≥ 3× at 16K, and ≥ 1× Mamba). The three models are timed in turns,
   one run of each per round, so that other jobs on the machine weigh on all of them alike.

Without mamba-ssm, 🤗 Mamba's PyTorch path scans the sequence one token at a time in Python: training it takes
minutes per step, so its training is timed only with ``--mamba-training``, and its prefill (which is not timed) is
capped at ``--mamba-prefill`` tokens. Its decoding step reads only a fixed-size state, so its cost does not depend on
how many tokens built that state.

Whatever a ratio compares is timed in turns, one run of each per round (the reference at most 3 rounds), with
``time.perf_counter`` and PyTorch's default number of threads: times are medians of ``--repeats`` rounds after
``--warmup`` runs, ratios the median of the rounds' ratios (``report.paired_speedup``). Absolute numbers depend on
the machine; the ratios are the point.

    python benchmarks/delta_rule.py [--json results.json]     # a few minutes on 2 quiet cores
    python benchmarks/delta_rule.py --quick                   # short sizes: a smoke run
    python benchmarks/delta_rule.py --tables models           # only the model-level table
    python benchmarks/delta_rule.py --write-docs --json benchmarks/results/delta_rule.json   # what the docs quote
    python benchmarks/delta_rule.py --report benchmarks/results/delta_rule.json  # rewrite the docs from a saved run

``--write-docs`` (after a full run) and ``--report RESULTS_JSON`` rewrite the DeltaNet section of
docs/performance/speed.md from the results (see ``report.py``).
"""

import argparse
import statistics

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from memlm.kernels.delta_rule import delta_rule

try:  # run as a script (python benchmarks/delta_rule.py) or imported as benchmarks.delta_rule
    import report
except ImportError:
    from benchmarks import report

TRAINING_LENGTHS = (512, 2048, 8192)
FORWARD_LENGTHS = (2048, 32768)
DECODE_CONTEXTS = (1024, 8192, 32768)
MODEL_TRAINING_LENGTHS = (2048, 8192)
MODEL_DECODE_CONTEXTS = (2048, 16384)
# --quick: the same tables at short sizes.
QUICK_SIZES = {
    "training_lengths": (256, 1024),
    "forward_lengths": (512, 2048),
    "decode_contexts": (128, 1024),
    "model_training_lengths": (256, 1024),
    "model_decode_contexts": (128, 1024),
}
VOCAB_SIZE = 258  # bytes and two special tokens, as memlm's byte-level runs use


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


def delta_rule_training_step(backend: str, length: int, args):
    """One forward + backward of ``delta_rule`` with the given backend."""
    query, key, value, beta = make_inputs(args.batch_size, args.num_heads, length, args.head_dim, requires_grad=True)
    grad_output = torch.randn_like(value)

    def step():
        output, _ = delta_rule(query, key, value, beta, chunk_size=args.chunk_size, backend=backend)
        output.backward(grad_output)

    return step


def attention_training_step(length: int, args):
    """One forward + backward of causal ``scaled_dot_product_attention`` on the same shapes."""
    query, key, value, _ = make_inputs(args.batch_size, args.num_heads, length, args.head_dim, requires_grad=True)
    grad_output = torch.randn_like(value)

    def step():
        F.scaled_dot_product_attention(query, key, value, is_causal=True).backward(grad_output)

    return step


def delta_rule_forward(length: int, args):
    """One forward of the chunkwise ``delta_rule`` without autograd."""
    query, key, value, beta = make_inputs(args.batch_size, args.num_heads, length, args.head_dim, requires_grad=False)

    def step():
        with torch.no_grad():
            delta_rule(query, key, value, beta, chunk_size=args.chunk_size, backend="torch")

    return step


def training_table(args) -> list[dict]:
    """Per T: the chunkwise op and causal SDPA timed in turns, and where T allows, the recurrent reference and the
    chunkwise op in turns again (the reference runs a Python loop per token: at most 3 rounds). Times are medians;
    ratios are medians of the rounds' ratios (`report.paired_speedup`)."""
    rows = []
    for length in tqdm(args.training_lengths, desc="forward + backward", leave=False):
        chunk = delta_rule_training_step("torch", length, args)
        times = report.interleaved_times(
            {"chunk": chunk, "sdpa": attention_training_step(length, args)}, args.warmup, args.repeats
        )
        row = {
            "tokens": length,
            "chunk_ms": statistics.median(times["chunk"]) * 1e3,
            "reference_ms": None,
            "sdpa_ms": statistics.median(times["sdpa"]) * 1e3,
            "reference_over_chunk": None,
            "chunk_over_sdpa": report.paired_speedup(times, "sdpa", "chunk"),
        }
        if length <= args.reference_max_length:
            reference = delta_rule_training_step("reference", length, args)
            times = report.interleaved_times({"chunk": chunk, "reference": reference}, 1, min(args.repeats, 3))
            row["reference_ms"] = statistics.median(times["reference"]) * 1e3
            row["reference_over_chunk"] = report.paired_speedup(times, "chunk", "reference")
        rows.append(row)
    return rows


def forward_table(args) -> list[dict]:
    """Microseconds per token (of B·H·T) of the chunkwise forward at each T, the lengths timed in turns; the ratio to
    the shortest is the median of the rounds' ratios."""
    unit = {length: args.batch_size * args.num_heads * length for length in args.forward_lengths}
    forwards = {length: delta_rule_forward(length, args) for length in args.forward_lengths}
    times = report.interleaved_times(forwards, args.warmup, args.repeats)
    shortest = args.forward_lengths[0]
    return [
        {
            "tokens": length,
            "us_per_token": statistics.median(times[length]) / unit[length] * 1e6,
            # per token: (t_T / n_T) / (t_shortest / n_shortest)
            "over_shortest": report.paired_speedup(times, shortest, length) * unit[shortest] / unit[length],
        }
        for length in forwards
    ]


def deltanet_model():
    """The DeltaNet of the decode and model tables: paper preset, hidden 256, 4 layers, 4 heads."""
    from memlm import DeltaNetConfig, DeltaNetForCausalLM

    torch.manual_seed(0)
    config = DeltaNetConfig.from_preset(
        "paper", vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=4, num_attention_heads=4
    )
    return DeltaNetForCausalLM(config)


def comparison_models() -> dict:
    """DeltaNet, 🤗 Llama and 🤗 Mamba of about the same size. Llama: the same hidden size, layers, heads and MLP
    as DeltaNet (it lacks only DeltaNet's β projection); Mamba: hidden 256 and 8 layers (a Mamba layer holds about
    as many parameters as a DeltaNet layer's attention and MLP together: 8 of them match 4 DeltaNet layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MambaConfig, MambaForCausalLM

    deltanet = deltanet_model()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=256,
            intermediate_size=deltanet.config.intermediate_size,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=max(MODEL_DECODE_CONTEXTS) + 4096,
            tie_word_embeddings=deltanet.config.tie_word_embeddings,
            attn_implementation="sdpa",
        )
    )
    torch.manual_seed(0)
    mamba = MambaForCausalLM(
        MambaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=256,
            num_hidden_layers=8,
            tie_word_embeddings=deltanet.config.tie_word_embeddings,
        )
    )
    return {"deltanet": deltanet, "llama": llama, "mamba": mamba}


def training_step(model, length: int, args):
    """One forward + backward of the language-model loss on ``args.model_tokens // length`` rows of `length`
    tokens (gradients dropped after each step)."""
    batch_size = max(1, args.model_tokens // length)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (batch_size, length), generator=generator)

    def step():
        model.train()
        model(input_ids, labels=input_ids).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    return step


def model_table(args) -> tuple[dict, list[dict], list[dict]]:
    """Parameter counts, then training rows (per T) and decode rows (per context), with the DeltaNet ratios. The
    models are timed in turns (see `report.interleaved_times`): tokens/s from the median time, each ratio the median
    of the rounds' ratios (`report.paired_speedup`)."""
    models = comparison_models()
    parameters = {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}
    for model in models.values():
        model.eval()
    training_rows = []
    for length in tqdm(args.model_training_lengths, desc="model training", leave=False):
        timed = {name: model for name, model in models.items() if name != "mamba" or args.mamba_training}
        times = report.interleaved_times(
            {name: training_step(model, length, args) for name, model in timed.items()}, 1, args.model_repeats
        )
        batch_size = max(1, args.model_tokens // length)
        row = {"tokens": length, "batch_size": batch_size}
        for name in models:
            row[f"{name}_tokens_per_s"] = (
                batch_size * length / statistics.median(times[name]) if name in times else None
            )
        training_rows.append(ratios_to_deltanet(row, times))
    decode_rows = []
    for context in tqdm(args.model_decode_contexts, desc="model decode", leave=False):
        functions = {
            # (🤗 Mamba's PyTorch prefill is a step loop: at most --mamba-prefill tokens)
            name: report.Decoding(
                model, min(context, args.mamba_prefill) if name == "mamba" else context, args.decode_steps
            )
            for name, model in models.items()
        }
        times = report.interleaved_times(functions, 1, args.repeats)
        row = {"context": context} | {
            f"{name}_tokens_per_s": args.decode_steps / statistics.median(times[name]) for name in models
        }
        decode_rows.append(ratios_to_deltanet(row, times))
        del functions  # the caches (Llama's grows with the context)
    return parameters, training_rows, decode_rows


def ratios_to_deltanet(row: dict, times: dict) -> dict:
    """`row` with DeltaNet's tokens/s over Llama's and Mamba's (the same tokens each round: their time ratio), None
    for a model not timed."""
    for other in ("llama", "mamba"):
        ratio = report.paired_speedup(times, "deltanet", other) if other in times else None
        row[f"deltanet_over_{other}"] = ratio
    return row


def decode_table(args) -> list[dict]:
    """Milliseconds per generated token after a prefill of each context: greedy steps of one token each, the contexts
    timed in turns (one cache each), so that a machine busy with something else slows them alike; the ratio to the
    shortest context is the median of the rounds' ratios."""
    model = deltanet_model().eval()
    functions = {
        context: report.Decoding(model, context, args.decode_steps)
        for context in tqdm(args.decode_contexts, desc="decode prefill", leave=False)
    }
    times = report.interleaved_times(functions, 1, args.repeats)
    shortest = args.decode_contexts[0]
    return [
        {
            "context": context,
            "ms_per_token": statistics.median(times[context]) / args.decode_steps * 1e3,
            "over_shortest": report.paired_speedup(times, shortest, context),
        }
        for context in functions
    ]


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = report.arguments(__doc__, repeats=7, section=SECTION,
                              quick="short sequences and contexts, fewer repeats")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--reference-max-length", type=int, default=2048, help="longest T at which the slow reference is timed"
    )
    parser.add_argument("--decode-steps", type=int, default=32, help="tokens generated per decode timing")
    parser.add_argument(
        "--model-tokens", type=int, default=8192, help="tokens per training step of the model table (batch × T)"
    )
    parser.add_argument(
        "--model-repeats", type=int, default=7, help="timed training rounds per T (the models in turns)"
    )
    parser.add_argument(
        "--mamba-training", action="store_true", help="also time 🤗 Mamba's training (minutes per step on CPU)"
    )
    parser.add_argument(
        "--mamba-prefill", type=int, default=256, help="most tokens 🤗 Mamba prefills before its decode timing"
    )
    parser.add_argument(
        "--tables",
        nargs="+",
        choices=("kernel", "decode", "models"),
        default=("kernel", "decode", "models"),
        help="which tables to measure: the delta rule op (1, 2), DeltaNet's decode (3), the model comparison (4)",
    )
    args = report.parse(parser, argv)
    sizes = {
        "training_lengths": TRAINING_LENGTHS,
        "forward_lengths": FORWARD_LENGTHS,
        "decode_contexts": DECODE_CONTEXTS,
        "model_training_lengths": MODEL_TRAINING_LENGTHS,
        "model_decode_contexts": MODEL_DECODE_CONTEXTS,
    }
    if args.quick:
        sizes = QUICK_SIZES
        args.warmup, args.repeats, args.model_repeats, args.decode_steps = 1, 1, 1, 4
        args.model_tokens = min(args.model_tokens, max(sizes["model_training_lengths"]))
        args.reference_max_length = min(args.reference_max_length, max(sizes["training_lengths"]))
        args.mamba_prefill = min(args.mamba_prefill, 32)
    for name, lengths in sizes.items():
        setattr(args, name, lengths)
    return args


def print_model_tables(parameters: dict, training_rows: list[dict], decode_rows: list[dict], args) -> None:
    counts = ", ".join(f"{name} {count / 1e6:.3f}M" for name, count in parameters.items())
    spread = max(parameters.values()) / min(parameters.values()) - 1
    print(f"\nModels (parameters within {spread:.1%}): {counts}")
    ratios = [("DeltaNet/Llama", "deltanet_over_llama", ".2f"), ("DeltaNet/Mamba", "deltanet_over_mamba", ".2f")]
    mamba_note = "" if args.mamba_training else "; Mamba's PyTorch training not timed (--mamba-training)"
    report.print_table(
        f"Training tokens/s (forward + backward of the LM loss, {args.model_tokens} tokens per step{mamba_note})",
        [
            ("T", "tokens", "d"),
            ("batch", "batch_size", "d"),
            ("DeltaNet", "deltanet_tokens_per_s", ".0f"),
            ("Llama", "llama_tokens_per_s", ".0f"),
            ("Mamba", "mamba_tokens_per_s", ".0f"),
            *ratios,
        ],
        training_rows,
    )
    report.print_table(
        f"Decode tokens/s, batch 1, greedy steps with the cache (Mamba prefills at most {args.mamba_prefill} tokens)",
        [
            ("context", "context", "d"),
            ("DeltaNet", "deltanet_tokens_per_s", ".1f"),
            ("Llama", "llama_tokens_per_s", ".1f"),
            ("Mamba", "mamba_tokens_per_s", ".1f"),
            *ratios,
        ],
        decode_rows,
    )


# Issue 22's goals for the model table: DeltaNet / Llama training tokens/s at T = 2K and 8K.
TRAINING_GOALS = {2048: 1.25, 8192: 2.5}


def docs_section(results: dict) -> str:
    """The DeltaNet section of docs/performance/speed.md, from one full run's results."""
    missing = {"training", "forward", "decode", "models"} - set(results)
    if missing:
        raise SystemExit(f"the docs quote a full run of every table; this one lacks {sorted(missing)}")
    settings = results["settings"]
    shape = f"B={settings['batch_size']}, H={settings['num_heads']}, D={settings['head_dim']}, chunk {settings['chunk_size']}"
    parts = [
        f"From `python benchmarks/delta_rule.py` (what each ratio compares timed in turns: medians of "
        f"{settings['repeats']} rounds, the models' training {settings['model_repeats']}; each ratio the median of "
        f"the rounds' ratios). {report.measured_on(settings)}",
        f"Forward + backward of the delta rule, {shape} (the recurrent reference is timed up to "
        f"T={settings['reference_max_length']}):",
        report.markdown_table(
            [
                ("T", "tokens", "d"),
                ("chunkwise ms", "chunk_ms", ".1f"),
                ("reference ms", "reference_ms", ".1f"),
                ("causal SDPA ms", "sdpa_ms", ".1f"),
                ("reference / chunkwise", "reference_over_chunk", ".1f"),
                ("chunkwise / SDPA", "chunk_over_sdpa", ".2f"),
            ],
            results["training"],
        ),  # fmt: skip
    ]
    forward, decode = results["forward"], results["decode"]
    parts.append(
        "Forward time per token of the chunkwise op (no autograd): "
        + ", ".join(f"{row['us_per_token']:.2f} µs at T={row['tokens']}" for row in forward)
        + f" (ratio {forward[-1]['over_shortest']:.2f}). Decode time per token of a `DeltaNetForCausalLM` (paper "
        "preset, hidden 256, 4 layers, 4 heads, batch 1; the contexts timed in turns): "
        + ", ".join(f"{row['ms_per_token']:.2f} ms after {row['context']} tokens" for row in decode)
        + f" (ratio {decode[-1]['over_shortest']:.2f}): the memory has a fixed size, so a step does the same work at "
        "any context length."
    )
    models = results["models"]
    counts = " / ".join(f"{count / 1e6:.3f}M" for count in models["parameters"].values())
    parts.append(
        "The whole model next to 🤗 Llama (SDPA, same hidden size, layers, heads and MLP) and 🤗 Mamba (its PyTorch "
        f"path: no `mamba-ssm` on CPU; hidden 256, 8 layers), {counts} parameters; training = forward + backward of "
        f"the LM loss on {settings['model_tokens']:,} tokens per step; decoding = greedy steps at batch 1 with the "
        f"cache (Mamba's state has a fixed size, so its prefill is capped at {settings['mamba_prefill']} tokens"
        + ("" if settings["mamba_training"] else "; its training, minutes per step on CPU, is not timed")
        + "):"
    )
    rows = [
        {"what": f"training tokens/s, T = {row['tokens']} (batch {row['batch_size']})", **row}
        for row in models["training"]
    ] + [{"what": f"decode tokens/s after {row['context'] // 1024}K", **row} for row in models["decode"]]
    parts.append(
        report.markdown_table(
            [("", "what", "s"), ("DeltaNet", "deltanet_tokens_per_s", ".1f"), ("Llama", "llama_tokens_per_s", ".1f"),
             ("Mamba", "mamba_tokens_per_s", ".1f"), ("DeltaNet / Llama", "deltanet_over_llama", ".2f"),
             ("DeltaNet / Mamba", "deltanet_over_mamba", ".2f")],
            rows,
        )
    )  # fmt: skip
    goals = []
    for row in models["training"]:
        goal = TRAINING_GOALS.get(row["tokens"])
        if goal is not None:
            goals.append(report.judged(row["deltanet_over_llama"], goal, f" at T = {row['tokens']}"))
    if goals:
        parts.append("Training, DeltaNet over Llama: " + "; ".join(goals) + ".")
    return "\n\n".join(parts)


SECTION = report.Section(
    "delta_rule", "python benchmarks/delta_rule.py --report benchmarks/results/delta_rule.json", docs_section
)


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    saved = report.saved_run(args, SECTION)
    if saved is not None:
        return saved
    machine = report.start(args)
    shape = f"B={args.batch_size}, H={args.num_heads}, D={args.head_dim}, chunk={args.chunk_size}"
    settings = {
        key: list(value) if isinstance(value, tuple) else value for key, value in report.own_settings(args).items()
    }
    results = {"settings": settings | machine}
    if "kernel" in args.tables:
        results["training"] = training_table(args)
        report.print_table(
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
        report.print_table(
            f"Chunkwise forward without autograd, {shape}: time per token (of B·H·T)",
            [
                ("T", "tokens", "d"),
                ("us/token", "us_per_token", ".3f"),
                (f"ratio to T={args.forward_lengths[0]}", "over_shortest", ".2f"),
            ],
            results["forward"],
        )
    if "decode" in args.tables:
        results["decode"] = decode_table(args)
        report.print_table(
            "Decode time per token, DeltaNetForCausalLM (paper preset, hidden 256, 4 layers, 4 heads), batch 1",
            [
                ("context", "context", "d"),
                ("ms/token", "ms_per_token", ".2f"),
                (f"ratio to {args.decode_contexts[0]}", "over_shortest", ".2f"),
            ],
            results["decode"],
        )
    if "models" in args.tables:
        parameters, training_rows, decode_rows = model_table(args)
        results["models"] = {"parameters": parameters, "training": training_rows, "decode": decode_rows}
        print_model_tables(parameters, training_rows, decode_rows, args)
    return report.finish(results, args, SECTION)


if __name__ == "__main__":
    main()
