"""What do the papers' official layouts cost next to memlm's default layout of the same model?

For each model family, two models of about the same number of parameters, timed in turns in this one process:
memlm's default layout (pre-norm RMSNorm blocks, gated MLP) and the layout of the paper's official code as memlm's
converter builds it (post-norm LayerNorm blocks, plain biased ReLU MLP of 1.5× the width, so that the MLPs hold the
same parameters; the official model's other options). Printed: training tokens/s (forward + backward of the LM loss)
and decode tokens/s (batch 1, greedy steps with the cache after a prompt), with official / default (the median of the
rounds' ratios, `report.paired_speedup`), and the peak memory of one training step (in a fresh process of its own:
what the step adds to the built model's resident memory at its highest, read from Linux's /proc; "—" elsewhere).

A second table puts every layout next to a 🤗 Llama of the same size through `generate()` (greedy, batch 1, byte
vocabulary) after prompts of 64 to 1,024 tokens: tokens/s of the steps after the first new token, timed inside
`generate` (`report.generation_step_seconds`), with each model's ratio to Llama and a line judging issue 40's first
goal (DeltaNet and Expire-Span at least at Llama's speed from 64 tokens up, the Feedback Transformer from 512 up).

    python benchmarks/paper_layouts.py [--json results.json]     # about 7 minutes on 2 quiet cores
    python benchmarks/paper_layouts.py --quick                   # short sizes: a smoke run
    python benchmarks/paper_layouts.py --write-docs --json benchmarks/results/paper_layouts.json
    python benchmarks/paper_layouts.py --report benchmarks/results/paper_layouts.json

``--write-docs`` (after a full run) and ``--report RESULTS_JSON`` rewrite the "papers' layouts" section of
docs/performance/speed.md from the results (see ``report.py``).
"""

import argparse
import functools
import json
import statistics
import subprocess
import sys

import torch
from tqdm.auto import tqdm

try:  # run as a script (python benchmarks/paper_layouts.py) or imported as benchmarks.paper_layouts
    import report
except ImportError:
    from benchmarks import report

VOCAB_SIZE = 4096
SIZES = {"vocab_size": VOCAB_SIZE, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}
# --quick (a smoke run, which the tests take): smaller models, spans and windows.
QUICK_SIZES = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def model_sizes(quick: bool, vocab_size: int | None) -> dict:
    sizes = QUICK_SIZES if quick else SIZES
    return sizes if vocab_size is None else {**sizes, "vocab_size": vocab_size}


def deltanet_configs(quick: bool = False, vocab_size: int | None = None) -> tuple:
    """memlm's DeltaNet (`paper` preset: DPFP-free ELU+1 here too, so only the block differs) and the official
    lmtool-fwp model (attn_type 24 with its normaliser, Transformer-XL's block, sinusoidal positions); the
    vocabulary of the sizes, or `vocab_size` tokens (so for the other families)."""
    from memlm import DeltaNetConfig
    from memlm.configuration.configuration_deltanet import LMTOOL_FWP_LAYOUT

    sizes = model_sizes(quick, vocab_size)
    default = DeltaNetConfig.from_preset("paper", feature_map="elu+1", **sizes)
    official = DeltaNetConfig(
        **{
            **LMTOOL_FWP_LAYOUT,
            **sizes,
            "feature_map": "elu+1",
            "query_key_normalization": "sum",
            "embedding_scale": sizes["hidden_size"] ** 0.5,
            "intermediate_size": default.intermediate_size * 3 // 2,
            "tie_word_embeddings": default.tie_word_embeddings,  # the official model ties them: here as the default
        }
    )
    return default, official


EXPIRE_SPAN_SIZES = {"max_span": 1024, "ramp": 32, "block_size": 256}
QUICK_EXPIRE_SPAN_SIZES = {"max_span": 64, "ramp": 8, "block_size": 32}


def expire_span_configs(quick: bool = False, vocab_size: int | None = None) -> tuple:
    """memlm's Expire-Span and the official transformer-sequential model (enwik8_small's post-norm layout: learned
    relative positions, no attention to self, zero initial memories, memories recomputed from hidden states every
    block, the remaining-span loss), spans up to 1024 tokens, blocks of 256."""
    from memlm import ExpireSpanConfig

    sizes, spans = model_sizes(quick, vocab_size), QUICK_EXPIRE_SPAN_SIZES if quick else EXPIRE_SPAN_SIZES
    default = ExpireSpanConfig(**sizes, **spans)
    official = ExpireSpanConfig(
        **sizes,
        **spans,
        norm_type="layernorm",
        norm_position="post",
        final_norm=False,
        mlp_type="plain",
        mlp_bias=True,
        hidden_act="relu",
        lm_head_bias=True,
        intermediate_size=default.intermediate_size * 3 // 2,
        position_encoding="learned_relative",
        attend_to_self=False,
        initial_memory="zeros",
        span_loss_form="remaining_span",
        renormalization_epsilon=1e-8,
        recompute_memory=True,
    )
    return default, official


def feedback_configs(quick: bool = False, vocab_size: int | None = None) -> tuple:
    """memlm's Feedback Transformer and the official transformer-sequential model (algorithmic_3var's pre-norm
    layout: learned relative positions, zero initial memories carried as hidden states whose keys and values are
    recomputed every forward, each layer's own key/value projections and norm), a window of 256 steps."""
    from memlm import FeedbackTransformerConfig

    sizes, span = model_sizes(quick, vocab_size), 32 if quick else 256
    default = FeedbackTransformerConfig(**sizes, memory_span=span)
    official = FeedbackTransformerConfig(
        **sizes,
        memory_span=span,
        norm_type="layernorm",
        norm_position="pre",
        final_norm=True,
        mlp_type="plain",
        mlp_bias=True,
        hidden_act="relu",
        lm_head_bias=True,
        # Each layer's own key and value projections (2·d² parameters) taken from the plain MLP's width (2·d per unit).
        intermediate_size=default.intermediate_size * 3 // 2 - sizes["hidden_size"],
        share_key_value=False,
        position_encoding="learned_relative",
        initial_memory="zeros",
        memory_normalization="layer",
        memory_carry="hidden_states",
        carry_first_layer_norm=True,
        attention_dropout_position="weights",
    )
    return default, official


# Each family, and the sizes it is timed at where they differ from the command line's (the Feedback Transformer runs
# one step at a time: shorter sequences).
FAMILIES = {
    "DeltaNet (lmtool-fwp)": (deltanet_configs, {}),
    "Expire-Span (transformer-sequential)": (expire_span_configs, {}),
    "Feedback (transformer-sequential)": (feedback_configs, {"length": 512, "batch_size": 2, "context": 512}),
}


def training_step(model, length: int, batch_size: int):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (batch_size, length), generator=generator)

    def step():
        model.train()
        model(input_ids, labels=input_ids).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    return step


# Run by `training_peak_megabytes` in a process of its own: build the model from the config (JSON on stdin), note
# the resident memory, take one training step, print the high-water mark's growth in MiB (Linux: /proc/self/status).
PEAK_SCRIPT = """
import json, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import memlm

def resident(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024

options = json.loads(sys.stdin.read())
config = AutoConfig.for_model(**options.pop("config"))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config).train()
input_ids = torch.randint(0, config.vocab_size, (options["batch_size"], options["length"]))
before = resident("VmRSS")
model(input_ids, labels=input_ids).loss.backward()
print(resident("VmHWM") - before)
"""


def training_peak_megabytes(config, length: int, batch_size: int) -> float | None:
    """The peak memory (MiB) one training step adds to the built model, in a fresh process; None without /proc."""
    if not sys.platform.startswith("linux"):
        return None
    options = {"config": config.to_dict(), "length": length, "batch_size": batch_size}
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], input=json.dumps(options), capture_output=True,
                            text=True, check=True)  # fmt: skip
    return float(result.stdout.strip().splitlines()[-1])


# The generation table: every layout next to a 🤗 Llama of the same size, byte vocabulary (issue 40's decoding goal).
BYTE_VOCABULARY = 258
SHORT_NAMES = {"DeltaNet (lmtool-fwp)": "deltanet", "Expire-Span (transformer-sequential)": "expire_span",
               "Feedback (transformer-sequential)": "feedback"}  # fmt: skip
LABELS = {"deltanet": "DeltaNet", "expire_span": "Expire-Span", "feedback": "Feedback"}
# From which context on each family should decode at least at Llama's speed (issue 40).
GOAL_CONTEXTS = {"deltanet": 64, "expire_span": 64, "feedback": 512}


def generation_models(quick: bool) -> dict:
    """Both layouts of each family (`deltanet_default`, `deltanet_official`, …) and `llama`, a 🤗 Llama with the
    default layouts' sizes (SDPA attention, its dynamic cache), byte vocabulary, seed 0, in evaluation mode."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import memlm  # noqa: F401  (registers memlm's classes)

    models = {}
    for family, (configs, _) in FAMILIES.items():
        for layout, config in zip(("default", "official"), configs(quick, BYTE_VOCABULARY)):
            torch.manual_seed(0)
            models[f"{SHORT_NAMES[family]}_{layout}"] = AutoModelForCausalLM.from_config(config).eval()
    default = models["expire_span_default"].config
    # No end-of-text token, as memlm's configs here: `generate` then runs the same processors for every model (with
    # LlamaConfig's default eos_token_id=2 and min_new_tokens, it would run two minimum-length processors and an
    # end-of-text check on Llama's tokens only).
    llama = LlamaConfig(**model_sizes(quick, BYTE_VOCABULARY), intermediate_size=default.intermediate_size,
                        max_position_embeddings=2**16, attn_implementation="sdpa", bos_token_id=None,
                        eos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    models["llama"] = AutoModelForCausalLM.from_config(llama).eval()
    return models


def measure_generation(args) -> list[dict]:
    """Greedy `generate()` at batch 1 after each context of `--generate-contexts` (random tokens, seed 0): tokens/s
    of the steps after the first new token (`report.generation_step_seconds`), the models timed in turns; each
    model's ratio to Llama's tokens/s is the median of the rounds' ratios (`report.paired_speedup`)."""
    models = generation_models(args.quick)
    rows = []
    for context in tqdm(args.generate_contexts, desc="generate", leave=False):
        prompt = torch.randint(0, BYTE_VOCABULARY, (1, context), generator=torch.Generator().manual_seed(0))
        functions = {
            name: functools.partial(report.generation_step_seconds, model, prompt, args.generate_tokens)
            for name, model in models.items()
        }
        times = report.interleaved_times(functions, 1, args.generate_repeats, timed_inside=True)
        row = {"context": context, **{f"{name}_tokens_per_s": 1 / statistics.median(times[name]) for name in models}}
        for name in models:
            if name != "llama":
                row[f"{name}_over_llama"] = report.paired_speedup(times, name, "llama")
        rows.append(row)
    return rows


def generation_columns() -> list[tuple[str, str, str]]:
    shown = [("context", "context", "d"), ("🤗 Llama tok/s", "llama_tokens_per_s", ".1f")]
    for family in LABELS:
        shown += [(f"{LABELS[family]}, {layout} / Llama", f"{family}_{layout}_over_llama", ".2f")
                  for layout in ("default", "official")]  # fmt: skip
    return shown


def generation_goals(rows: list[dict]) -> str:
    """Issue 40's first goal, judged from the rows: DeltaNet and Expire-Span, both layouts, at least at Llama's speed
    from 64 tokens of context up; the Feedback Transformer from 512 up."""
    verdicts = []
    for family, label in LABELS.items():
        for layout in ("default", "official"):
            key = f"{family}_{layout}_over_llama"
            measured = [row for row in rows if row["context"] >= GOAL_CONTEXTS[family]]
            if not measured:
                verdicts.append(f"{label}, {layout}: no context of {GOAL_CONTEXTS[family]} tokens or more measured")
                continue
            lowest = min(measured, key=lambda row: row[key])
            met = "met" if lowest[key] >= 1 else "missed"
            lowest_text = report.against(lowest[key], 1)
            verdicts.append(f"{label}, {layout}: {met} (lowest {lowest_text}× after {lowest['context']} tokens)")
    return (
        "At least 🤗 Llama's speed through `generate()` (DeltaNet and Expire-Span from 64 tokens of context up, the "
        "Feedback Transformer from 512 up): " + "; ".join(verdicts) + "."
    )


def measure(args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    import memlm  # noqa: F401  (registers memlm's classes)

    rows = []
    for family, (configs, sizes) in tqdm(FAMILIES.items(), desc="families", leave=False):
        length, batch_size, context = (
            min(sizes.get(name, getattr(args, name)), getattr(args, name))
            for name in ("length", "batch_size", "context")
        )
        models, peaks = {}, {}
        for name, config in zip(("default", "official"), configs(args.quick)):
            torch.manual_seed(0)
            models[name] = AutoModelForCausalLM.from_config(config).eval()
            peaks[name] = training_peak_megabytes(config, length, batch_size)
        parameters = {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}
        training = report.interleaved_times(
            {name: training_step(model, length, batch_size) for name, model in models.items()},
            1,
            args.repeats,
        )
        decodings = {name: report.Decoding(model, context, args.decode_steps) for name, model in models.items()}
        # What the memory holds after the prompt.
        cache_sizes = {name: report.cache_bytes(list(decoding.cache.layers)) for name, decoding in decodings.items()}
        decoding = report.interleaved_times(decodings, 1, args.repeats)
        row = {"family": family, "training_shape": f"{batch_size} × {length}", "context": context}
        for name in models:
            row[f"{name}_parameters"] = parameters[name]
            row[f"{name}_training_tokens_per_s"] = batch_size * length / statistics.median(training[name])
            row[f"{name}_decode_tokens_per_s"] = args.decode_steps / statistics.median(decoding[name])
            row[f"{name}_cache_megabytes"] = cache_sizes[name] / 2**20
            row[f"{name}_training_peak_megabytes"] = peaks[name]
        for kind, times in (("training", training), ("decode", decoding)):
            row[f"{kind}_official_over_default"] = report.paired_speedup(times, "official", "default")
        if peaks["default"] and peaks["official"] is not None:
            row["training_peak_official_over_default"] = peaks["official"] / peaks["default"]
        rows.append(row)
    return rows


COLUMNS = [
    ("", "family", "s"),
    ("parameters (default / official)", "parameters", "s"),
    ("training batch × tokens", "training_shape", "s"),
    ("decode context", "context", "d"),
    ("training tok/s, default", "default_training_tokens_per_s", ".0f"),
    ("training tok/s, official", "official_training_tokens_per_s", ".0f"),
    ("official / default", "training_official_over_default", ".2f"),
    ("decode tok/s, default", "default_decode_tokens_per_s", ".1f"),
    ("decode tok/s, official", "official_decode_tokens_per_s", ".1f"),
    ("official / default", "decode_official_over_default", ".2f"),
    ("cache MiB, default", "default_cache_megabytes", ".2f"),
    ("cache MiB, official", "official_cache_megabytes", ".2f"),
    ("training peak MiB, default", "default_training_peak_megabytes", ".0f"),
    ("training peak MiB, official", "official_training_peak_megabytes", ".0f"),
    ("official / default", "training_peak_official_over_default", ".2f"),
]


def _with_parameters(rows: list[dict]) -> list[dict]:
    return [
        {**row, "parameters": f"{row['default_parameters'] / 1e6:.2f}M / {row['official_parameters'] / 1e6:.2f}M"}
        for row in rows
    ]


def docs_section(results: dict) -> str:
    """The "papers' layouts" section of docs/performance/speed.md, from one full run's results."""
    settings = results["settings"]
    return "\n\n".join(
        [
            f"From `python benchmarks/paper_layouts.py` ({settings['repeats']} runs, the two layouts timed in "
            "turns: tokens/s the median of the runs, official / default the median of the rounds' ratios). "
            f"{report.measured_on(settings)} Hidden size {SIZES['hidden_size']}, "
            f"{SIZES['num_hidden_layers']} layers, {SIZES['num_attention_heads']} heads, vocabulary {VOCAB_SIZE}; "
            "training = forward + backward of the LM loss on the batch × tokens of the row; decoding = "
            f"{settings['decode_steps']} greedy steps at batch 1 after the row's context; cache = the bytes of the "
            "tensors the memory holds after that context; training peak = what one training step adds to the "
            "built model's resident memory at its highest, each in a fresh process.",
            report.markdown_table(COLUMNS, _with_parameters(results["rows"])),
            "Decoding through `generate()` next to a 🤗 Llama of the default layouts' size (SDPA attention, its "
            f"dynamic cache), byte vocabulary ({BYTE_VOCABULARY} tokens), in the same run: greedy, batch 1, after a "
            f"prompt of the row's context; tokens/s of the {settings['generate_tokens'] - 1} steps after the first "
            "new token, each timed from that token to the last inside `generate` (the prompt's forward left out, "
            f"`generate`'s own work in), medians of {settings['generate_repeats']} runs, the seven models timed in "
            "turns; each ratio to Llama is the median of the rounds' ratios (each model's run over Llama's run of the "
            "same round, seconds apart, so that a slower phase of the machine weighs on both).",
            report.markdown_table(generation_columns(), results["generation"]),
            generation_goals(results["generation"]),
        ]
    )


SECTION = report.Section(
    "paper_layouts", "python benchmarks/paper_layouts.py --report benchmarks/results/paper_layouts.json", docs_section
)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = report.arguments(__doc__, repeats=5, section=SECTION)
    parser.add_argument("--length", type=int, default=2048, help="tokens per training row")
    parser.add_argument("--batch-size", type=int, default=4, help="training rows per step")
    parser.add_argument("--context", type=int, default=2048, help="prompt before the timed decoding")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--generate-contexts", type=int, nargs="+", default=[64, 128, 256, 512, 1024],
                        help="prompts before the timed generate() tokens")  # fmt: skip
    parser.add_argument("--generate-tokens", type=int, default=33, help="new tokens per timed generate() call (>= 2)")
    parser.add_argument("--generate-repeats", type=int, default=9, help="timed generate() calls per model and context")
    quick = {"length": 64, "batch_size": 2, "context": 32, "decode_steps": 2, "repeats": 1,
             "generate_contexts": [8, 16], "generate_tokens": 3, "generate_repeats": 1}  # fmt: skip
    args = report.parse(parser, argv, quick, positive=("generate_repeats",))
    if args.generate_tokens < 2 or min(args.generate_contexts) < 1:
        parser.error(f"--generate-tokens must be at least 2 and --generate-contexts positive, got "
                     f"{args.generate_tokens} and {args.generate_contexts}")  # fmt: skip
    return args


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    saved = report.saved_run(args, SECTION)
    if saved is not None:
        return saved
    machine = report.start(args)
    rows = measure(args)
    generation = measure_generation(args)
    settings = report.own_settings(args)
    results = {"settings": {**settings, **machine}, "rows": rows, "generation": generation}
    report.print_table("The papers' layouts next to memlm's default", COLUMNS, _with_parameters(rows))
    report.print_table("generate() next to 🤗 Llama", generation_columns(), generation)
    print(generation_goals(generation))
    return report.finish(results, args, SECTION)


if __name__ == "__main__":
    main()
