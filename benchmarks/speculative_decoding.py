"""How much faster does speculative decoding make greedy decoding of real text, for each memlm model and 🤗 Llama?

The text: a piece of a Python standard library module's source (``inspect.getsource``; the first 512 tokens of
``textwrap`` by default), then the same piece again, as when a model rewrites code it was given; the prompt holds the
piece and the first tokens of its copy, and the models continue the copy. That is where prompt lookup finds its drafts:
the tokens that followed an earlier occurrence of the last few tokens. DeltaNet, Expire-Span, the Feedback Transformer
and a 🤗 ``LlamaForCausalLM`` of about the same size (hidden 256, 4 layers, 4 heads, byte-level tokens; every memory
reaches back over the whole piece) are each trained on that doubled piece until their loss falls below
``--target-loss`` (at most ``--train-steps`` steps), so that they continue it as a model that copies its input would. Each then
continues the prompt greedily three ways, timed in turns in this one process: plain decoding (one forward per token),
prompt-lookup decoding (``prompt_lookup_num_tokens``) and assisted decoding (``assistant_model``: a small DeltaNet,
trained the same way, drafts the tokens; 🤗's defaults for how many). Printed per model: tokens/s of each way and its
ratio to plain decoding (the median of the rounds' ratios), the share of drafted tokens the model accepted, the
forwards it ran, and whether the tokens are plain decoding's (speculative decoding must not change them; the script
fails when they differ).

    python benchmarks/speculative_decoding.py [--json results.json]    # 20 minutes on 2 cores (training, mostly)
    python benchmarks/speculative_decoding.py --quick                  # tiny sizes: a smoke run
    python benchmarks/speculative_decoding.py --write-docs --json benchmarks/results/speculative_decoding.json
    python benchmarks/speculative_decoding.py --report benchmarks/results/speculative_decoding.json

``--write-docs`` (after a full run) and ``--report RESULTS_JSON`` rewrite the "speculative decoding" section of
docs/performance/speed.md from the results (see ``report.py``).
"""

import argparse
import importlib
import inspect
import statistics

import torch
from tqdm.auto import tqdm

try:  # run as a script (python benchmarks/speculative_decoding.py) or imported as benchmarks.speculative_decoding
    import report
except ImportError:
    from benchmarks import report

SIZES = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4}
ASSISTANT_SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
QUICK_SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
QUICK_ASSISTANT_SIZES = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1}
MODELS = ("deltanet", "expire_span", "feedback", "llama")
NAMES = {"deltanet": "DeltaNet", "expire_span": "Expire-Span", "feedback": "Feedback", "llama": "🤗 Llama"}
MODES = ("plain", "lookup", "assistant")
WARMUP_STEPS = 10


def build(name: str, sizes: dict, tokenizer):
    """An untrained model of family `name` (or 🤗 Llama) at `sizes`, for the byte-level `tokenizer`."""
    import memlm

    common = {**sizes, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
    torch.manual_seed(0)
    if name == "deltanet":
        return memlm.DeltaNetForCausalLM(memlm.DeltaNetConfig.from_preset("fla", **common))
    if name == "expire_span":
        return memlm.ExpireSpanForCausalLM(memlm.ExpireSpanConfig(max_span=1024, ramp=32, block_size=128, **common))
    if name == "feedback":  # τ = 1024: the copy's tokens lie a piece (up to 514 tokens) back
        return memlm.FeedbackTransformerForCausalLM(memlm.FeedbackTransformerConfig(memory_span=1024, **common))
    from transformers import LlamaConfig, LlamaForCausalLM

    reference = memlm.DeltaNetConfig.from_preset("fla", **common)  # Llama gets DeltaNet's MLP width
    return LlamaForCausalLM(
        LlamaConfig(**common, intermediate_size=reference.intermediate_size, num_key_value_heads=sizes[
            "num_attention_heads"], tie_word_embeddings=reference.tie_word_embeddings, attn_implementation="sdpa")
    )  # fmt: skip


def texts(tokenizer, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The training sequence (the piece, a blank line, the piece again) and the prompt (it, but the copy's first
    `lead` tokens only), as (1, T) token ids."""
    source = tokenizer(inspect.getsource(importlib.import_module(args.module))).input_ids
    if len(source) < args.piece_length or args.lead + args.new_tokens > args.piece_length:
        raise SystemExit(
            f"--piece-length {args.piece_length} must hold --lead {args.lead} and --new-tokens {args.new_tokens}, "
            f"within the {len(source)} tokens of {args.module}'s source"
        )
    piece, gap = source[: args.piece_length], tokenizer("\n\n").input_ids
    return torch.tensor([piece + gap + piece]), torch.tensor([piece + gap + piece[: args.lead]])


def train(model, sequence: torch.Tensor, args) -> tuple[float, int]:
    """AdamW steps of the language-model loss on `sequence` (the rate warmed up over the first WARMUP_STEPS) until the
    loss falls below `args.target_loss`, at most `args.train_steps`; returns the last loss and the steps taken."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP_STEPS))
    model.train()
    loss, steps = float("nan"), 0
    while steps < args.train_steps and not loss < args.target_loss:
        loss = model(sequence, labels=sequence).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss, steps = loss.detach().item(), steps + 1
    model.eval()
    return loss, steps


def decode(model, prompt: torch.Tensor, new_tokens: int, **speculation):
    """One greedy continuation; returns a function that runs it, and (run once here) its tokens, forwards and the
    tokens it drafted."""
    settings = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, **speculation}

    def run():
        return model.generate(prompt, **settings)

    lengths = []
    hook = model.register_forward_pre_hook(
        lambda module, inputs, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        tokens = run()
    finally:
        hook.remove()
    # Every forward reads the tokens it verifies (the first: the prompt too) and one more: the rest were drafts.
    drafted = lengths[0] - prompt.shape[1] + sum(length - 1 for length in lengths[1:])
    return run, {"tokens": tokens, "forwards": len(lengths), "drafted": drafted}


def measure(args) -> tuple[list[dict], dict]:
    from transformers import GenerationConfig

    import memlm  # noqa: F401  (registers memlm's classes)
    from memlm.tokenization import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    sequence, prompt = texts(tokenizer, args)
    sizes, assistant_sizes = (QUICK_SIZES, QUICK_ASSISTANT_SIZES) if args.quick else (SIZES, ASSISTANT_SIZES)
    # No end of text: every way generates all its tokens.
    generation = GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    assistant = build("deltanet", assistant_sizes, tokenizer)
    assistant_loss, assistant_steps = train(assistant, sequence, args)
    assistant.generation_config = generation
    info = {"module": args.module, "prompt_tokens": prompt.shape[1], "assistant_final_loss": assistant_loss,
            "assistant_train_steps": assistant_steps,
            "assistant_parameters": sum(p.numel() for p in assistant.parameters())}  # fmt: skip
    rows = []
    for name in tqdm(args.models, desc="models", leave=False):
        model = build(name, sizes, tokenizer)
        loss, steps = train(model, sequence, args)
        model.generation_config = generation
        speculations = {
            "plain": {},
            "lookup": {"prompt_lookup_num_tokens": args.lookup_tokens},
            "assistant": {"assistant_model": assistant},
        }
        with torch.no_grad():
            runs = {mode: decode(model, prompt, args.new_tokens, **options) for mode, options in speculations.items()}
        times = report.interleaved_times({mode: run for mode, (run, _) in runs.items()}, 1, args.repeats)
        plain = runs["plain"][1]["tokens"]
        row = {"model": NAMES[name], "parameters": sum(p.numel() for p in model.parameters()), "final_loss": loss,
               "train_steps": steps}  # fmt: skip
        for mode, (_, outcome) in runs.items():
            row[f"{mode}_tokens_per_s"] = args.new_tokens / statistics.median(times[mode])
            row[f"{mode}_forwards"] = outcome["forwards"]
            row[f"{mode}_identical"] = bool(torch.equal(outcome["tokens"], plain))
            if mode != "plain":
                row[f"{mode}_over_plain"] = report.paired_speedup(times, mode, "plain")
                # Each forward gives one token beyond the drafts it accepted.
                accepted = args.new_tokens - outcome["forwards"]
                row[f"{mode}_acceptance"] = accepted / outcome["drafted"] if outcome["drafted"] else None
        rows.append(row)
    return rows, info


COLUMNS = [
    ("", "model", "s"),
    ("parameters", "parameters_text", "s"),
    ("training steps", "train_steps", "d"),
    ("loss after training", "final_loss", ".2f"),
    ("plain tok/s", "plain_tokens_per_s", ".1f"),
    ("prompt lookup tok/s", "lookup_tokens_per_s", ".1f"),
    ("lookup / plain", "lookup_over_plain", ".2f"),
    ("lookup: drafts accepted", "lookup_acceptance", ".0%"),
    ("lookup: forwards", "lookup_forwards", "d"),
    ("assistant tok/s", "assistant_tokens_per_s", ".1f"),
    ("assistant / plain", "assistant_over_plain", ".2f"),
    ("assistant: drafts accepted", "assistant_acceptance", ".0%"),
    ("assistant: forwards", "assistant_forwards", "d"),
    ("same tokens as plain", "identical", "s"),
]


def _shown(rows: list[dict]) -> list[dict]:
    return [
        {**row, "parameters_text": f"{row['parameters'] / 1e6:.2f}M",
         "identical": "yes" if row["lookup_identical"] and row["assistant_identical"] else "NO"}
        for row in rows
    ]  # fmt: skip


def docs_section(results: dict) -> str:
    """The "speculative decoding" section of docs/performance/speed.md, from one full run's results."""
    settings, info = results["settings"], results["text"]
    return "\n\n".join(
        [
            f"From `python benchmarks/speculative_decoding.py` ({settings['repeats']} runs, the three ways timed in "
            "turns: tokens/s the median of the runs, a ratio to plain decoding the median of the rounds' ratios). "
            f"{report.measured_on(settings)} Hidden size {SIZES['hidden_size']}, "
            f"{SIZES['num_hidden_layers']} layers, {SIZES['num_attention_heads']} heads, byte-level tokens; each model "
            f"trained (AdamW, rate {settings['learning_rate']:g}) until its loss fell below {settings['target_loss']:g} "
            f"or for at most {settings['train_steps']} steps on the first {settings['piece_length']} tokens of "
            f"`{info['module']}`'s source followed by the same tokens again, then continuing the copy from its "
            f"{settings['lead']}th token ({info['prompt_tokens']} tokens of prompt) with {settings['new_tokens']} greedy "
            f"tokens, at batch 1. Prompt lookup drafts up to {settings['lookup_tokens']} tokens; the assistant is a "
            "DeltaNet of "
            f"{info['assistant_parameters'] / 1e6:.2f}M parameters trained the same way, drafting as 🤗's defaults "
            "say. Drafts accepted: the share of drafted tokens the model kept; forwards: the model's own.",
            report.markdown_table(COLUMNS, _shown(results["rows"])),
        ]
    )


SECTION = report.Section(
    "speculative_decoding",
    "python benchmarks/speculative_decoding.py --report benchmarks/results/speculative_decoding.json",
    docs_section,
)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = report.arguments(__doc__, repeats=3, section=SECTION,
                              quick="tiny models, short texts, one repeat: a run that checks the script")  # fmt: skip
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="the models to time")
    parser.add_argument("--module", default="textwrap", help="the standard library module whose source is the text")
    parser.add_argument("--piece-length", type=int, default=512, help="tokens of the source, written twice")
    parser.add_argument("--lead", type=int, default=64, help="tokens of the copy that the prompt already holds")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens generated each way")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--train-steps", type=int, default=400, help="the most training steps per model")
    parser.add_argument("--target-loss", type=float, default=0.05, help="training stops below this loss")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    quick = {"piece_length": 64, "lead": 16, "new_tokens": 16, "lookup_tokens": 4, "train_steps": 2, "repeats": 1}
    return report.parse(parser, argv, quick)


SETTINGS = ("module", "piece_length", "lead", "new_tokens", "lookup_tokens", "train_steps", "target_loss",
            "learning_rate", "repeats")  # fmt: skip


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    saved = report.saved_run(args, SECTION)
    if saved is not None:
        return saved
    machine = report.start(args)
    rows, info = measure(args)
    settings = {key: getattr(args, key) for key in SETTINGS}
    results = {"settings": {**settings, "quick": args.quick, **machine}, "text": info, "rows": rows}
    report.print_table("Speculative decoding next to plain greedy decoding", COLUMNS, _shown(rows))
    differing = [row["model"] for row in rows if not (row["lookup_identical"] and row["assistant_identical"])]
    # The JSON is kept either way; the docs never quote a run whose tokens changed.
    report.finish(results, args, SECTION, write_docs=not differing)
    if differing:
        raise SystemExit(f"speculative decoding changed the tokens of {', '.join(differing)}")
    return results


if __name__ == "__main__":
    main()
