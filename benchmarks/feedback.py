"""How fast is the Feedback Transformer next to a same-size 🤗 Llama (SDPA attention) on this machine?

Prints one side-by-side table, all measured in this one process:

- training throughput: tokens/s of forward + backward + optimizer-free step on a batch of B=32 sequences of T=256
  tokens (the Feedback Transformer runs its step loop over the 256 positions, Llama runs in parallel);
- decoding throughput: tokens/s of greedy steps (batch 1) after a prefill of 512 and of 2048 tokens;
- cache bytes per token: the Feedback cache holds one key/value set for all layers (shared projections), Llama's
  one per layer.

Both models: hidden 256, 4 layers, 4 heads, gated MLP of width 768, byte vocabulary; the Feedback memory span
τ = 2048 so both see the whole context. The models take turns run by run, so that a machine busy with something else
slows them alike: times are medians of `--repeats` rounds after a warm-up, ratios the median of the rounds' ratios.
`--compile-step` adds a column for the Feedback Transformer with `compile_step=True` (its step body through
`torch.compile`; warm-up compiles).

    python benchmarks/feedback.py [--compile-step] [--json results.json]
    python benchmarks/feedback.py --write-docs --json benchmarks/results/feedback.json   # what the docs quote
    python benchmarks/feedback.py --report benchmarks/results/feedback.json   # rewrite the docs from a saved run

``--write-docs`` (after a run) and ``--report RESULTS_JSON`` rewrite the Feedback Transformer section of
docs/performance/speed.md from the results (see ``report.py``).
"""

import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memlm import FeedbackTransformerConfig, FeedbackTransformerForCausalLM

try:  # run as a script (python benchmarks/feedback.py) or imported as benchmarks.feedback
    import report
except ImportError:
    from benchmarks import report

SIZES = {"vocab_size": 258, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 4}  # fmt: skip
DECODE_CONTEXTS = (512, 2048)


def build_models(compile_step: bool = False):
    torch.manual_seed(0)
    feedback = FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**SIZES, memory_span=2048))
    llama = LlamaForCausalLM(LlamaConfig(**SIZES, max_position_embeddings=4096, attn_implementation="sdpa"))
    models = {"feedback": feedback, "llama": llama}
    if compile_step:  # the same weights, its step compiled
        models["feedback_compiled"] = FeedbackTransformerForCausalLM(
            FeedbackTransformerConfig(**SIZES, memory_span=2048, compile_step=True)
        )
        models["feedback_compiled"].load_state_dict(feedback.state_dict())
    return models


def training_step(model, batch_size: int, length: int):
    model.train()
    tokens = torch.randint(0, 258, (batch_size, length), generator=torch.Generator().manual_seed(0))

    def step():
        model.zero_grad(set_to_none=True)
        model(tokens, labels=tokens).loss.backward()

    return step


# Issue 22's goals: Feedback / Llama training tokens/s, and decoding tokens/s after 2048 tokens.
GOALS = {"train_tokens_per_s": ("training", 0.5), "decode_2048_tokens_per_s": ("decoding at 2K", 2.0)}
ROWS = [
    ("train_tokens_per_s", "training tokens/s (B={batch_size}, T={length})"),
    *((f"decode_{context}_tokens_per_s", f"decode tokens/s at {context}") for context in DECODE_CONTEXTS),
    ("cache_bytes_per_token", "cache bytes/token"),
]


def table_rows(results: dict) -> list[dict]:
    """One row per measurement: each model's figure and the Feedback models' ratios to Llama (for times, the median
    of the rounds' ratios the run kept; for the cache, the ratio of the figures)."""
    settings, llama = results["settings"], results["results"]["llama"]
    rows = []
    for key, header in ROWS:
        row = {"what": header.format(**settings)}
        for name, figures in results["results"].items():
            row[name] = figures[key]
            if name != "llama":
                timed = key != "cache_bytes_per_token"
                row[f"{name}_over_llama"] = figures["over_llama"][key] if timed else figures[key] / llama[key]
        rows.append(row)
    return rows


def columns(compiled: bool) -> list[tuple[str, str, str]]:
    shown = [("", "what", "s"), ("Feedback", "feedback", ".1f"), ("Llama (sdpa)", "llama", ".1f"),
             ("Feedback / Llama", "feedback_over_llama", ".2f")]  # fmt: skip
    if compiled:
        shown += [("compile_step", "feedback_compiled", ".1f"), ("compiled / Llama", "feedback_compiled_over_llama",
                                                                  ".2f")]  # fmt: skip
    return shown


def docs_section(results: dict) -> str:
    """The Feedback Transformer section of docs/performance/speed.md, from one run's results."""
    settings = results["settings"]
    compiled = "feedback_compiled" in results["results"]
    parts = [
        f"From `python benchmarks/feedback.py{' --compile-step' if compiled else ''}`: hidden 256, 4 layers, 4 heads, "
        f"MLP 768, τ = 2048; training = forward + backward on B = {settings['batch_size']} sequences of "
        f"T = {settings['length']}; decoding = {settings['decode_steps']} greedy steps at batch 1 after a prefill; "
        f"the models in turns, medians of {settings['repeats']} rounds, each ratio the median of the rounds' ratios. "
        f"{report.measured_on(settings)}",
        report.markdown_table(columns(compiled), table_rows(results)),
    ]
    goals = []
    for key, (what, goal) in GOALS.items():
        ratio = results["results"]["feedback"]["over_llama"][key]
        goals.append(f"{what} {report.judged(ratio, goal)}")
    parts.append("Feedback over Llama: " + "; ".join(goals) + ".")
    return "\n\n".join(parts)


SECTION = report.Section("feedback", "python benchmarks/feedback.py --report benchmarks/results/feedback.json",
                         docs_section)  # fmt: skip


def main(argv=None):
    parser = report.arguments(__doc__, repeats=7, section=SECTION)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--compile-step", action="store_true", help="add the Feedback model with compile_step=True")
    args = report.parse(parser, argv, {"batch_size": 2, "length": 16, "decode_steps": 4, "repeats": 1})
    saved = report.saved_run(args, SECTION)
    if saved is not None:
        return saved
    machine = report.start(args)
    models = build_models(args.compile_step)
    results = {name: {} for name in models}

    def record(key: str, times: dict, tokens: int) -> None:
        """Each model's tokens/s under `key` (the median round), and its paired ratio to Llama's."""
        for name in models:
            results[name][key] = tokens / statistics.median(times[name])
            if name != "llama":
                results[name].setdefault("over_llama", {})[key] = report.paired_speedup(times, name, "llama")

    times = report.interleaved_times(
        {name: training_step(model, args.batch_size, args.length) for name, model in models.items()}, 1, args.repeats
    )
    record("train_tokens_per_s", times, args.batch_size * args.length)
    for context in DECODE_CONTEXTS:
        decodings = {name: report.Decoding(model, context, args.decode_steps) for name, model in models.items()}
        record(
            f"decode_{context}_tokens_per_s", report.interleaved_times(decodings, 1, args.repeats), args.decode_steps
        )
        if context == DECODE_CONTEXTS[-1]:
            for name, decoding in decodings.items():
                # The Feedback ring holds τ slots; Llama holds every token seen: per token of context.
                seen = decoding.cache.get_seq_length()
                slots = models[name].config.memory_span if name.startswith("feedback") else seen
                results[name]["cache_bytes_per_token"] = report.cache_bytes(decoding.cache) / slots
    saved = {"settings": report.own_settings(args) | machine, "results": results}
    report.print_table("The Feedback Transformer next to 🤗 Llama", columns(args.compile_step), table_rows(saved))
    return report.finish(saved, args, SECTION)


if __name__ == "__main__":
    main()
