"""Language modelling on real text: memlm's three models against 🤗 Llama and 🤗 Mamba of the same size.

What is trained. On each corpus of `--corpus` and each seed of `--seeds` (the models of `--one-seed-models` with the
first seed only), eight byte-level language models with the same parameter count (within 5 %; the table prints each
count and its ratio to Llama's) are trained on the same tokens in the same order, with the same AdamW, linear
warm-up then cosine decay, gradient clipping and learning rate:

- DeltaNet, paper preset (DPFP-1, sum normalisation, delta rule) and fla preset (SiLU, L2, short convolution);
- linear Transformer: DeltaNet's paper preset with the sum rule and no β (S_t = S_{t-1} + k_t v_tᵀ);
- Expire-Span (maximum span `--max-span`) and the same model with expiration off (every memory kept L tokens);
- Feedback Transformer (memory span `--memory-span`);
- 🤗 Llama (`attn_implementation="sdpa"`), the reference for the parameter count;
- 🤗 Mamba (`MambaForCausalLM` on its PyTorch path: no mamba_ssm / causal_conv1d kernels are installed).

All have the same hidden size; the memlm models and Llama share layers and heads, and each one's gated-MLP width is
solved so that its parameter count equals Llama's; Mamba (no MLP) gets the number of layers that comes closest.
Input and output embeddings are untied everywhere.

Corpora (no download): `stdlib`, the embedded corpus of `memlm train` (the Python standard library's source,
`memlm.training.data.standard_library_corpus`), and `pydoc`, the English prose of the standard library's
`pydoc_data.topics` (the help texts of Python's statements and operators, about 0.5 MB in Python 3.11), both read
as bytes with memlm's byte-level tokenizer. Held-out text and batches come from `memlm.training.data` as in `memlm
train`: `split_held_out` holds out whole documents (every 20th) up to `--eval-tokens` tokens and shuffles the rest
with the seed; `TokenStream` in "segments" mode cuts the rest into `--batch-size` streams read in consecutive
segments of `--length` tokens. The memlm models carry their memory from one segment to the next with its gradient
cut (truncated BPTT, as `memlm train` and the papers train; `--no-carry-memory` turns that off). Llama and Mamba
read every segment alone: Llama's cache grows with the context (no bounded memory to carry), and the PyTorch scan
of 🤗 Mamba starts every multi-token input from a zero state.

What is measured (all in this one run, so the ratios to Llama compare like with like):

- held-out bits per byte (nats / ln 2 / UTF-8 bytes of the targets, as `memlm.training.pretrain.evaluate`), every
  `--eval-every` steps: the held-out tokens are read as `--eval-rows` streams in segments of `--length`, the
  memlm models with their memory carried (`pretrain.evaluate` itself), Llama and Mamba segment by segment; at the
  end the memlm models are also evaluated segment by segment ("alone"), which shows what the carried memory gives;
- at equal tokens: the last evaluation; at equal wall-clock: each model's curve of bits per byte against its
  training seconds (evaluations excluded), linearly interpolated at the training time of the fastest model of the
  same corpus and seed;
- training tokens/s: training tokens over training seconds (`time.perf_counter`, evaluations excluded);
- decoding (model trained with the first seed on the first corpus, batch 1): the context (held-out text, repeated
  as needed) is prefilled (in chunks of 1024 tokens; Mamba in one call), then `--decode-steps` greedy tokens are
  timed one forward each; tokens/s after 1K and after 16K tokens of context (`--decode-contexts`);
- cache bytes after 16K tokens of context: the bytes of every distinct tensor storage in the model's `cache`
  (`past_key_values` / Mamba's `cache_params` before 🤗 5.24), a view counted with its whole storage since it keeps that alive; for Expire-Span it depends on
  the spans the model learned;
- peak memory of a training step (forward, backward, optimizer step) at the training sizes: the rise of the
  resident set's high-water mark (VmHWM, reset through /proc/self/clear_refs) during one step of a freshly built
  model on random tokens, after one warm-up step whose memory the memlm models carry (so Expire-Span's memory holds
  one segment, not yet its steady state), over the resident size before it, in a fresh Python process per model
  with glibc returning large freed buffers to the system (MALLOC_MMAP_THRESHOLD_), so that the resident size
  follows the live tensors. Why not tracemalloc: it sees only Python's allocator, not torch's C++ tensors; why a
  fresh process: an earlier model's freed but still resident pages would hide part of the next model's rise.
  `--smoke` measures all models in one process to save the interpreter start-ups (its numbers mean nothing).

Seeds set the initialisation, the order of the training documents and nothing else; the tables show "mean
(low–high)" over the seeds (`across_seeds`, `format_across_seeds`), the JSON keeps every run.

    python benchmarks/lm_compare.py [--smoke] [--corpus stdlib pydoc] [--seeds 0 1 2] [--json results.json]
                                    [--plot docs/performance/lm_compare.png] [--steps N --hidden-size D ...]
                                    [--one-seed-models mamba] [--write-docs]
    python benchmarks/lm_compare.py --report results.json

Budget. The defaults (hidden 64, 2 layers, 4 heads, MLP 256 for Llama, so about 164K parameters each; 8 rows of
128 tokens per step, 270 steps = 276K training tokens per model, warm-up 27 steps; 4096 held-out tokens read every 30
steps; both corpora; seeds 0 1 2 for every model but 🤗 Mamba, which trains with seed 0 only, `--one-seed-models`)
are meant to fit about 30 minutes on 2 quiet cores: the projection is 26 minutes. How it was made (on a machine
loaded by other jobs, so from CPU time, which a quiet machine's wall-clock matches or undercuts, with one thread:
most operations at these sizes are too small for a second one): each model's CPU seconds per training step, as the
difference of a 12-step and a 4-step run at the default sizes, are DeltaNet 0.022, fla 0.018, sum rule 0.017,
Expire-Span 0.033, fixed span 0.029, Feedback 0.25, Llama 0.019, Mamba 1.37 (1.76 for all eight); an evaluation
costs 0.03 to 0.3 s (Feedback 0.9 s), decoding to 16K about 22 s for all (Feedback's prefill, token by token, 13 s),
the memory processes about 45 s (mostly interpreter start-ups) and the held-out splits about 30 s. Summed over the
runs: 23 minutes of training, 1.6 of evaluations, 1.6 of the rest. The same sum projected 180 CPU seconds for
`--steps 16 --eval-every 8 --warmup-steps 2 --seeds 0 1 --threads 1`, which took 179 (user + system, `time`).
🤗 Mamba is in none of the papers' comparisons and its PyTorch path costs three times the other seven models together
(12 of the 26 minutes with seed 0 alone; with every seed it would take 37 of 51): in one profiled step its backward
took about 80 times its forward (its scan loops over tokens reading `discrete_A[:, :, t]`, and the backward of each
such read likely writes a gradient of the whole (B, E, T, N) tensor). `--corpus stdlib` about halves the budget;
fewer `--seeds` cut it in proportion.

Report. `--write-docs` ends the run by writing its results into the documentation and the model cards, each time a
section between marker comments: docs/performance/language-modelling.md gets the tables, the plot, the papers' claims
judged from the seeds' ranges and a short reading; each model's page (docs/models/*.md) and each of `hub_cards/*.md`
(which become the model cards of saved checkpoints) a "Measured comparison" of its models against Llama and Mamba.
`--report results.json` does the same from the JSON of an earlier run, without training, and redraws its plot;
benchmarks/lm_compare.json is the JSON of the run the documentation shows.
"""

import argparse
import copy
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

try:  # run as a script (python benchmarks/lm_compare.py) or imported as benchmarks.lm_compare
    import report
except ImportError:
    from benchmarks import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PLOT = os.path.join(ROOT, "docs", "performance", "lm_compare.png")
CORPORA = {
    "stdlib": "the Python standard library's source (memlm train's embedded corpus)",
    "pydoc": "the English help texts of the standard library's pydoc_data.topics",
}
# (name, label, whether the model is one of memlm's and carries its memory across segments)
MODELS = (
    ("deltanet", "DeltaNet (paper)", True),
    ("deltanet_fla", "DeltaNet (fla)", True),
    ("linear_transformer", "linear Transformer (sum rule)", True),
    ("expire_span", "Expire-Span", True),
    ("fixed_span", "Expire-Span, expiration off", True),
    ("feedback", "Feedback Transformer", True),
    ("llama", "Llama (transformers, SDPA)", False),
    ("mamba", "Mamba (transformers, PyTorch path)", False),
)
LABELS = {name: label for name, label, _ in MODELS}
CARRIES = {name: carries for name, _, carries in MODELS}
REFERENCE = "llama"
SMOKE = {"steps": 3, "eval_every": 2, "hidden_size": 16, "num_layers": 2, "num_heads": 2, "intermediate_size": 48,
         "length": 16, "batch_size": 2, "eval_tokens": 128, "eval_rows": 2, "max_span": 32, "memory_span": 16,
         "max_bytes": 200_000, "seeds": [0], "decode_contexts": [64, 256], "decode_steps": 2,
         "warmup_steps": 1, "one_seed_models": ["mamba"]}  # fmt: skip
FULL = {"steps": 270, "eval_every": 30, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 256,
        "length": 128, "batch_size": 8, "eval_tokens": 4096, "eval_rows": 4, "max_span": 512, "memory_span": 128,
        "max_bytes": 8_000_000, "seeds": [0, 1, 2], "decode_contexts": [1024, 16384], "decode_steps": 16,
        "warmup_steps": 27, "one_seed_models": ["mamba"]}  # fmt: skip
PARAMETER_TOLERANCE = 0.05


# --- data ------------------------------------------------------------------------------------------------------------


def corpus_documents(corpus: str, max_bytes: int) -> list[str]:
    """The documents of a corpus (see the module docstring)."""
    if corpus == "stdlib":
        from memlm.training.data import load_texts

        return load_texts(None, max_bytes=max_bytes)
    if corpus == "pydoc":
        from pydoc_data.topics import topics

        return [topics[name] for name in sorted(topics) if topics[name].strip()]
    raise ValueError(f"--corpus must be one of {', '.join(CORPORA)}, got {corpus!r}.")


# --- models ----------------------------------------------------------------------------------------------------------


def model_config(name: str, args, tokenizer, intermediate_size: int | None = None, mamba_layers: int | None = None):
    """The configuration of model `name` at the sizes of `args` (the MLP width or Mamba's depth as given)."""
    from transformers import LlamaConfig, MambaConfig

    from memlm import DeltaNetConfig, ExpireSpanConfig, FeedbackTransformerConfig

    tokens = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
              "tie_word_embeddings": False}  # fmt: skip
    if name == "mamba":
        return MambaConfig(**tokens, hidden_size=args.hidden_size, num_hidden_layers=mamba_layers)
    sizes = {**tokens, "hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers,
             "num_attention_heads": args.num_heads,
             "intermediate_size": intermediate_size or args.intermediate_size}  # fmt: skip
    if name == "llama":
        return LlamaConfig(**sizes, attn_implementation="sdpa", max_position_embeddings=max(args.length, 2048))
    if name == "deltanet":
        return DeltaNetConfig.from_preset("paper", **sizes)
    if name == "deltanet_fla":
        return DeltaNetConfig.from_preset("fla", **sizes)
    if name == "linear_transformer":
        return DeltaNetConfig.from_preset("paper", update_rule="sum", use_beta=False, **sizes)
    if name in ("expire_span", "fixed_span"):
        return ExpireSpanConfig(**sizes, max_span=args.max_span, ramp=max(1, args.max_span // 16),
                                block_size=args.length, expire_memories=name == "expire_span")  # fmt: skip
    if name == "feedback":
        return FeedbackTransformerConfig(**sizes, memory_span=args.memory_span)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(LABELS)}")


def build_model(config):
    from transformers import AutoModelForCausalLM

    import memlm  # noqa: F401  (registers memlm's model types)

    return AutoModelForCausalLM.from_config(config)


def parameter_count(config) -> int:
    return sum(parameter.numel() for parameter in build_model(config).parameters())


def matched_configs(args, tokenizer) -> dict:
    """One configuration per model with the parameter count of Llama's: the MLP width of each other model solved
    from two counts (the count is linear in it), Mamba's layers rounded to the nearest. Raises ValueError when a
    model cannot come within 5 %."""
    reference = parameter_count(model_config(REFERENCE, args, tokenizer))
    configs = {}
    for name in args.models:
        if name == "mamba":
            one = parameter_count(model_config(name, args, tokenizer, mamba_layers=1))
            two = parameter_count(model_config(name, args, tokenizer, mamba_layers=2))
            layers = max(1, round((reference - one) / (two - one)) + 1)
            config = model_config(name, args, tokenizer, mamba_layers=layers)
        elif name == REFERENCE:
            config = model_config(name, args, tokenizer)
        else:
            low, high = args.intermediate_size, 2 * args.intermediate_size
            at_low = parameter_count(model_config(name, args, tokenizer, intermediate_size=low))
            at_high = parameter_count(model_config(name, args, tokenizer, intermediate_size=high))
            width = max(1, round(low + (reference - at_low) * (high - low) / (at_high - at_low)))
            config = model_config(name, args, tokenizer, intermediate_size=width)
        count = parameter_count(config)
        if abs(count / reference - 1) > PARAMETER_TOLERANCE:
            raise ValueError(
                f"{LABELS[name]} has {count} parameters at these sizes, more than 5 % from Llama's {reference}; "
                "choose another --hidden-size, --num-layers or --intermediate-size."
            )
        configs[name] = config
    return configs


# --- training and evaluation -----------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_segments_alone(model, tokens: torch.Tensor, length: int, rows: int, byte_lengths: torch.Tensor) -> dict:
    """Held-out bits per byte as `memlm.training.pretrain.evaluate` measures them (the same streams, segments and
    targets), but every segment read alone, with an empty memory."""
    was_training = model.training
    model.eval()
    stream_length = len(tokens) // rows
    streams = tokens[: rows * stream_length].view(rows, stream_length)
    total_nats, total_tokens, total_bytes = 0.0, 0, 0
    for start in range(0, stream_length - 1, length):
        window = streams[:, start : start + length + 1]
        inputs, targets = window[:, :-1], window[:, 1:]
        logits = model(input_ids=inputs, use_cache=False).logits.float()
        total_nats += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        ).item()
        total_tokens += targets.numel()
        total_bytes += int(byte_lengths[targets].sum())
    model.train(was_training)
    return {"loss": total_nats / max(total_tokens, 1), "bits_per_byte": total_nats / math.log(2) / max(total_bytes, 1),
            "tokens": total_tokens}  # fmt: skip


def held_out(model, tokens, args, byte_lengths, carry: bool) -> dict:
    from memlm.training.pretrain import evaluate

    if carry:
        return evaluate(model, tokens, args.length, args.eval_rows, byte_lengths, "cpu")
    return evaluate_segments_alone(model, tokens, args.length, args.eval_rows, byte_lengths)


def point(step: int, tokens: int, seconds: float, evaluation: dict) -> dict:
    """One point of a learning curve: after `step` steps, `tokens` training tokens and `seconds` of training."""
    return {"step": step, "tokens": tokens, "seconds": seconds, "bits_per_byte": evaluation["bits_per_byte"],
            "loss": evaluation["loss"], "held_out_tokens": evaluation["tokens"]}  # fmt: skip


def train_model(name: str, config, train_tokens, eval_tokens, byte_lengths, args, seed: int, progress=None):
    """Trains one model; returns it with its curve (bits per byte against steps, tokens and training seconds)."""
    from transformers import get_cosine_schedule_with_warmup

    from memlm.training.data import TokenStream
    from memlm.training.pretrain import detach_memory, language_model_loss

    torch.manual_seed(seed)
    model = build_model(config).train()
    carry = CARRIES[name] and args.carry_memory
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.steps)
    stream = TokenStream(train_tokens, args.batch_size, args.length, "segments", seed)
    tokens_per_step = args.batch_size * args.length
    curve = [point(0, 0, 0.0, held_out(model, eval_tokens, args, byte_lengths, carry))]
    losses, memory, seconds = [], None, 0.0
    for step in range(args.steps):
        started = time.perf_counter()
        if not carry or stream.starts_pass(step):
            memory = None
        inputs, labels = stream.batch(step)
        if carry:
            outputs = model(input_ids=inputs, cache=memory, use_cache=True)
        else:
            outputs = model(input_ids=inputs, use_cache=False)
        loss = language_model_loss(outputs, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        memory = detach_memory(outputs.cache) if carry else None
        losses.append(loss.item())
        seconds += time.perf_counter() - started
        if progress is not None:
            progress.update(1)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            result = held_out(model, eval_tokens, args, byte_lengths, carry)
            curve.append(point(step + 1, (step + 1) * tokens_per_step, seconds, result))
    if not math.isfinite(losses[-1]):
        raise RuntimeError(f"{LABELS[name]} diverged (loss {losses[-1]}); lower --learning-rate.")
    run = {"curve": curve, "train_losses": losses, "training_seconds": seconds,
           "tokens_per_second": args.steps * tokens_per_step / seconds,
           "final": curve[-1]["bits_per_byte"]}  # fmt: skip
    if carry:
        run["final_segments_alone"] = evaluate_segments_alone(model, eval_tokens, args.length, args.eval_rows,
                                                              byte_lengths)["bits_per_byte"]  # fmt: skip
    return model, run


def at_seconds(curve: list[dict], budget: float) -> float:
    """Bits per byte at `budget` training seconds, linearly interpolated between the evaluations around it."""
    for before, after in zip(curve, curve[1:]):
        if after["seconds"] >= budget:
            span = after["seconds"] - before["seconds"]
            weight = 0.0 if span <= 0 else (budget - before["seconds"]) / span
            return before["bits_per_byte"] + weight * (after["bits_per_byte"] - before["bits_per_byte"])
    return curve[-1]["bits_per_byte"]


# --- decoding, cache and memory --------------------------------------------------------------------------------------


def forward_with_cache(model, name: str, tokens, cache):
    """(logits, cache) of `tokens` after `cache`, through the keyword the model takes on the installed 🤗 (`cache`;
    before 🤗 5.24 `past_key_values`, or `cache_params` for 🤗 Mamba)."""
    from memlm.compat import cache_keyword, output_cache

    output = model(input_ids=tokens, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
    return output.logits, output_cache(output)


@torch.no_grad()
def decode_measurements(model, name: str, context_tokens: torch.Tensor, args) -> list[dict]:
    """Decode tokens/s after each context length of `--decode-contexts`, and the cache's bytes there."""
    model.eval()
    rows, cache, done = [], None, 0
    for context in sorted(args.decode_contexts):
        if name == "mamba":  # its multi-token PyTorch scan starts from zero: the whole context in one call
            logits, cache = forward_with_cache(model, name, context_tokens[None, :context], None)
        else:
            for start in range(done, context, 1024):
                chunk = context_tokens[None, start : min(start + 1024, context)]
                logits, cache = forward_with_cache(model, name, chunk, cache)
        done = context
        stored = report.cache_bytes(cache)
        decoding = copy.deepcopy(cache)
        token = logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        for _ in range(args.decode_steps):
            logits, decoding = forward_with_cache(model, name, token, decoding)
            token = logits[:, -1:].argmax(-1)
        seconds = time.perf_counter() - started
        rows.append({"context": context, "decode_tokens_per_second": args.decode_steps / seconds,
                     "cache_bytes": stored})  # fmt: skip
    return rows


def _resident_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} is not in /proc/self/status")


def training_step_memory(requests: list[dict]) -> list[dict]:
    """In a fresh process: for each (model, config, sizes), the VmHWM rise of one training step after a warm-up."""
    from transformers import AutoConfig

    import memlm  # noqa: F401  (registers memlm's model types)
    from memlm.training.pretrain import detach_memory, language_model_loss

    results = []
    for request in requests:
        config = AutoConfig.for_model(**request["config"])
        model = build_model(config).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        inputs = torch.randint(0, config.vocab_size - 2, (request["batch_size"], request["length"]))
        memory = None
        for measured in (False, True):
            if measured:
                with open("/proc/self/clear_refs", "w") as clear:
                    clear.write("5")  # reset the high-water mark VmHWM
                before = _resident_kib("VmRSS")
            if request["carry"]:
                outputs = model(input_ids=inputs, cache=memory, use_cache=True)
            else:
                outputs = model(input_ids=inputs, use_cache=False)
            language_model_loss(outputs, inputs).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            memory = detach_memory(outputs.cache) if request["carry"] else None
            del outputs
        # Linux batches its per-thread RSS counters (a few pages), so a step that allocates nothing new can read a
        # high-water mark a few KiB below `before`: that is a rise of 0.
        rise = max(0, _resident_kib("VmHWM") - before)
        results.append({"model": request["model"], "peak_rise_bytes": rise * 1024,
                        "peak_resident_bytes": _resident_kib("VmHWM") * 1024})  # fmt: skip
        del model, optimizer, memory
    return results


def measure_memory(configs: dict, args) -> dict:
    """Peak memory of a training step per model, each in a fresh process (all in one with --smoke)."""
    requests = [{"model": name, "config": config.to_dict(), "batch_size": args.batch_size, "length": args.length,
                 "carry": CARRIES[name] and args.carry_memory} for name, config in configs.items()]  # fmt: skip
    groups = [requests] if args.quick else [[request] for request in requests]
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    results = {}
    for group in groups:
        command = [sys.executable, os.path.abspath(__file__), "--measure-memory", json.dumps(group),
                   "--threads", str(args.threads)]  # fmt: skip
        finished = subprocess.run(command, capture_output=True, text=True, env=environment)
        if finished.returncode != 0:
            raise RuntimeError(f"the memory measurement failed:\n{finished.stderr[-3000:]}")
        for row in json.loads(finished.stdout.strip().splitlines()[-1]):
            results[row["model"]] = row
    return results


# --- summaries, tables, plot -----------------------------------------------------------------------------------------


def summarise(runs: dict, corpora: list[str], models: list[str]) -> dict:
    """Per corpus and model: bits per byte at equal tokens and at equal wall-clock, tokens/s, over the seeds."""
    from memlm.training.tasks.common import across_seeds

    summary = {}
    for corpus in corpora:
        per_seed = runs[corpus]
        # The wall-clock budget of a seed: the training time of the fastest of the models trained with every seed.
        every_seed = [name for name in models if all(name in seed_runs for seed_runs in per_seed.values())]
        for seed_runs in per_seed.values():
            budget = min(seed_runs[name]["training_seconds"] for name in every_seed)
            for run in seed_runs.values():
                run["equal_seconds_budget"] = budget
                run["at_equal_seconds"] = at_seconds(run["curve"], budget)
        summary[corpus] = {}
        for name in models:
            seeds = [seed_runs[name] for seed_runs in per_seed.values() if name in seed_runs]
            entry = {key: across_seeds(run[key] for run in seeds)
                     for key in ("final", "at_equal_seconds", "tokens_per_second")}  # fmt: skip
            if "final_segments_alone" in seeds[0]:
                entry["final_segments_alone"] = across_seeds(run["final_segments_alone"] for run in seeds)
            entry["curve"] = [
                {"step": points[0]["step"], "tokens": points[0]["tokens"],
                 "seconds": across_seeds(point["seconds"] for point in points),
                 "bits_per_byte": across_seeds(point["bits_per_byte"] for point in points)}
                for points in zip(*(run["curve"] for run in seeds))
            ]  # fmt: skip
            summary[corpus][name] = entry
    return summary


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}")
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    for index, line in enumerate([header, *rows]):
        print("  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                        for column, (cell, width) in enumerate(zip(line, widths))))  # fmt: skip
        if index == 0:
            print("  ".join("-" * width for width in widths))


def ratio(value: float, reference: float, smallest: float = 0.0) -> str:
    """value / reference, or "—" when the reference is not above `smallest` (a ratio to nothing means nothing)."""
    return f"{value / reference:.2f}" if reference > smallest else "—"


def print_tables(results: dict, args) -> None:
    from memlm.training.tasks.common import format_across_seeds

    models, summary = args.models, results["summary"]
    seeds = f"{len(args.seeds)} seed{'s' if len(args.seeds) > 1 else ''} ({' '.join(map(str, args.seeds))})"
    parameters = results["parameters"]
    print_table("Parameters (each model's MLP width, or Mamba's depth, solved to match Llama's count)",
                ["model", "parameters", "/ Llama"],
                [[LABELS[name], f"{parameters[name]:,}", f"{parameters[name] / parameters[REFERENCE]:.3f}"]
                 for name in models])  # fmt: skip
    for corpus in args.corpus:
        rows = []
        reference = summary[corpus][REFERENCE]
        for name in models:
            entry = summary[corpus][name]
            alone = entry.get("final_segments_alone")
            count = len(entry["final"]["values"])
            rows.append([
                LABELS[name] + (f" ({count} seed{'s' if count > 1 else ''})" if count < len(args.seeds) else ""),
                format_across_seeds(entry["final"]),
                f"{entry['final']['mean'] / reference['final']['mean']:.3f}",
                format_across_seeds(alone) if alone else "—",
                format_across_seeds(entry["at_equal_seconds"]),
                f"{entry['at_equal_seconds']['mean'] / reference['at_equal_seconds']['mean']:.3f}",
                format_across_seeds(entry["tokens_per_second"], ".0f"),
                f"{entry['tokens_per_second']['mean'] / reference['tokens_per_second']['mean']:.2f}",
            ])  # fmt: skip
        tokens = args.steps * args.batch_size * args.length
        print_table(
            f"{corpus}: held-out bits per byte after {tokens:,} training tokens and at equal training seconds (the "
            f"fastest model's time), training tokens/s; mean (low–high) over {seeds}",
            ["model", "bpb, equal tokens", "/ Llama", "segments alone", "bpb, equal time", "/ Llama", "train tok/s",
             "/ Llama"],
            rows,
        )  # fmt: skip
    speed = results["speed"]
    contexts = sorted(args.decode_contexts)
    rows = []
    for name in models:
        measured = {row["context"]: row for row in speed[name]["decode"]}
        reference = {row["context"]: row for row in speed[REFERENCE]["decode"]}
        memory, reference_memory = results["memory"][name], results["memory"][REFERENCE]
        line = [LABELS[name]]
        for context in contexts:
            tokens_per_second = measured[context]["decode_tokens_per_second"]
            reference_speed = reference[context]["decode_tokens_per_second"]
            line += [f"{tokens_per_second:.1f}", f"{tokens_per_second / reference_speed:.2f}"]
        last = contexts[-1]
        line += [f"{measured[last]['cache_bytes'] / 2**10:,.0f}",
                 f"{measured[last]['cache_bytes'] / reference[last]['cache_bytes']:.3f}",
                 f"{memory['peak_rise_bytes'] / 2**20:.1f}",
                 ratio(memory["peak_rise_bytes"], reference_memory["peak_rise_bytes"], 2**20)]  # fmt: skip
        rows.append(line)
    header = ["model"]
    for context in contexts:
        header += [f"decode tok/s @{context}", "/ Llama"]
    header += [f"cache KiB @{contexts[-1]}", "/ Llama", "train step peak MiB", "/ Llama"]
    print_table(
        f"Decoding (batch 1, greedy, seed {args.seeds[0]} on {args.corpus[0]}), cache size, and the peak memory rise "
        f"of a training step ({args.batch_size} × {args.length} tokens; VmHWM rise, "
        f"{'all models in one process (smoke)' if args.quick else 'in a fresh process per model'})",
        header,
        rows,
    )


def plot(results: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = args.corpus
    figure, axes = plt.subplots(len(corpora), 2, figsize=(12, 4.2 * len(corpora)), squeeze=False)
    band = "shaded: lowest to highest seed" if len(args.seeds) > 1 else None
    for row, corpus in enumerate(corpora):
        axes_of_row = (("tokens", "training tokens"), ("seconds", "training seconds (evaluations excluded)"))
        for column, (axis_key, axis_label) in enumerate(axes_of_row):
            axis = axes[row][column]
            for index, name in enumerate(args.models):
                curve = results["summary"][corpus][name]["curve"]
                x = [point[axis_key] if axis_key == "tokens" else point[axis_key]["mean"] for point in curve]
                values = [point["bits_per_byte"] for point in curve]
                color = f"C{index}"
                axis.plot(x, [value["mean"] for value in values], "o-", markersize=3, color=color, label=LABELS[name])
                axis.fill_between(x, [value["low"] for value in values], [value["high"] for value in values],
                                  color=color, alpha=0.15, linewidth=0)  # fmt: skip
            axis.set_xlabel(axis_label)
            if axis_key == "seconds":  # the slowest model takes many times the fastest one's time: log scale above
                first = min(curve[1]["seconds"]["mean"] for curve in
                            (results["summary"][corpus][name]["curve"] for name in args.models))  # fmt: skip
                axis.set_xscale("symlog", linthresh=max(first, 1e-6))
                axis.set_xlabel(f"{axis_label}; log scale above {max(first, 1e-6):.2g} s")
            axis.set_ylabel("held-out bits per byte")
            axis.set_title(f"{corpus}: {'equal tokens' if column == 0 else 'equal wall-clock'}")
            axis.legend(fontsize=7, title=band, title_fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --- the report: the documentation's pages and the hub cards, written from a run's JSON ------------------------------

REPORT_PAGE = os.path.join(ROOT, "docs", "performance", "language-modelling.md")
MODEL_PAGES = os.path.join(ROOT, "docs", "models")
HUB_CARDS = os.path.join(ROOT, "hub_cards")
BEGIN = "<!-- lm_compare: begin; written by `python benchmarks/lm_compare.py --report results.json`, do not edit -->"
END = "<!-- lm_compare: end -->"
# Each hub card's models (the first is the card's own), shown with Llama and Mamba for reference; the model page of
# the documentation with the same file name shows the same.
CARD_MODELS = {
    "deltanet.md": ("deltanet", "deltanet_fla", "linear_transformer"),
    "expire_span.md": ("expire_span", "fixed_span"),
    "feedback_transformer.md": ("feedback",),
}
# The papers' claims checked here: (key, claim, paper, model that should have the lower bits per byte, the other).
CLAIMS = (
    ("delta_rule", "the delta rule beats the sum rule (linear Transformer)", "Schlag et al., 2021, Table 2",
     "deltanet", "linear_transformer"),
    ("feedback", "the Feedback Transformer beats a Transformer of the same size", "Fan et al., 2021, Table 3",
     "feedback", "llama"),
    ("expire_span", "Expire-Span matches or beats a fixed span's bits per byte", "Sukhbaatar et al., 2021, Fig. 5",
     "expire_span", "fixed_span"),
)  # fmt: skip
LANGUAGE_MODELLING_TITLE = "Language modelling against 🤗 Llama and 🤗 Mamba"
CARD_CLAIMS = {"deltanet.md": ("delta_rule",), "expire_span.md": ("expire_span", "expire_span_memory"),
               "feedback_transformer.md": ("feedback",)}  # fmt: skip


def verdict(lower: dict, higher: dict) -> str:
    """Whether `lower` (mean, low, high over seeds) is below `higher`: "reproduced" when every seed of one lies below
    every seed of the other, "not reproduced" when every one lies above, "within the spread" when the ranges meet;
    marked "(one seed)" when either has a single seed, so no spread to judge by."""
    if lower["high"] < higher["low"]:
        result = "reproduced"
    elif lower["low"] > higher["high"]:
        result = "not reproduced"
    else:
        result = "within the spread"
    return result + (" (one seed)" if min(len(lower["values"]), len(higher["values"])) < 2 else "")


def claim_verdicts(results: dict) -> list[dict]:
    """The papers' claims (CLAIMS) judged on held-out bits per byte at equal tokens, per corpus, and Expire-Span's
    memory against the fixed span's (cache bytes at the longest decoding context, one measurement)."""
    summary, verdicts = results["summary"], []
    for key, claim, paper, lower, higher in CLAIMS:
        for corpus, entries in summary.items():
            if lower in entries and higher in entries:
                verdicts.append({"key": key, "claim": claim, "paper": paper, "corpus": corpus, "lower": lower,
                                 "higher": higher, "values": (entries[lower]["final"], entries[higher]["final"]),
                                 "verdict": verdict(entries[lower]["final"], entries[higher]["final"])})  # fmt: skip
    speed = results["speed"]
    if "expire_span" in speed and "fixed_span" in speed:
        expire, fixed = speed["expire_span"]["decode"][-1], speed["fixed_span"]["decode"][-1]
        share = expire["cache_bytes"] / fixed["cache_bytes"]
        verdicts.append({"key": "expire_span_memory", "claim": "Expire-Span keeps far less memory than a fixed span",
                         "paper": "Sukhbaatar et al., 2021, Fig. 5", "corpus": None, "context": expire["context"],
                         "seed": results["settings"]["seeds"][0],
                         "share": share, "verdict": "reproduced" if share <= 0.5 else "not reproduced"})  # fmt: skip
    return verdicts


def verdict_lines(verdicts: list[dict]) -> list[str]:
    """One markdown item per claim: its verdict on each corpus with the numbers behind it."""
    from memlm.training.tasks.common import format_across_seeds

    lines = {}
    for entry in verdicts:
        if entry["key"] == "expire_span_memory":
            said = (f"**{entry['verdict']}**: its cache after {entry['context']:,} tokens of context is "
                    f"{entry['share']:.2f} of the fixed span's (reproduced when at most half; seed "
                    f"{entry['seed']})")  # fmt: skip
        else:
            lower, higher = entry["values"]
            said = (f"{entry['corpus']} **{entry['verdict']}**, {format_across_seeds(lower)} against "
                    f"{format_across_seeds(higher)} bits per byte")  # fmt: skip
        lines.setdefault((entry["claim"], entry["paper"]), []).append(said)
    return [f"- {claim} ({paper}): {'; '.join(said)}." for (claim, paper), said in lines.items()]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def seed_count(results: dict, corpus: str, name: str) -> int:
    return len(results["summary"][corpus][name]["final"]["values"])


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def run_description(results: dict) -> str:
    """How the run was made: sizes, tokens, seeds, machine and wall time."""
    from memlm.hub_card import human_count

    settings, host = results["settings"], results.get("machine", {})
    tokens = settings["steps"] * settings["batch_size"] * settings["length"]
    seeds = " ".join(map(str, settings["seeds"]))
    threads = f"{host['threads']} thread{'s' if host['threads'] > 1 else ''}" if host else ""
    where = (f"torch {host['torch']}, {threads} on {host['cores']} cores ({host['cpu']}), {host['date']}"
             if host else "machine not recorded")  # fmt: skip
    parameters = human_count(results["parameters"][REFERENCE])
    return (f"hidden {settings['hidden_size']}, {settings['num_layers']} layers, {settings['num_heads']} heads, about "
            f"{parameters} parameters each; {settings['steps']} steps of {settings['batch_size']} × "
            f"{settings['length']} tokens ({tokens:,} training tokens per model), {settings['eval_tokens']:,} "
            f"held-out tokens; seeds {seeds}; {where}; the whole run took {duration(results['seconds'])}")  # fmt: skip


def quality_table(results: dict, corpus: str, models) -> str:
    from memlm.training.tasks.common import format_across_seeds

    entries, parameters = results["summary"][corpus], results["parameters"]
    reference = entries[REFERENCE]
    rows = []
    for name in models:
        entry = entries[name]
        alone = entry.get("final_segments_alone")
        rows.append([LABELS[name], f"{parameters[name]:,}", str(seed_count(results, corpus, name)),
                     format_across_seeds(entry["final"]), format_across_seeds(alone) if alone else "—",
                     format_across_seeds(entry["at_equal_seconds"]),
                     format_across_seeds(entry["tokens_per_second"], ".0f"),
                     ratio(entry["tokens_per_second"]["mean"], reference["tokens_per_second"]["mean"])])  # fmt: skip
    return markdown_table(["model", "parameters", "seeds", "bpb, equal tokens", "bpb, memory not carried",
                           "bpb, equal time", "train tokens/s", "/ Llama"], rows)  # fmt: skip


def speed_table(results: dict, models) -> str:
    speed, memory = results["speed"], results["memory"]
    contexts = [row["context"] for row in speed[REFERENCE]["decode"]]
    rows = []
    for name in models:
        measured = {row["context"]: row for row in speed[name]["decode"]}
        reference = {row["context"]: row for row in speed[REFERENCE]["decode"]}
        line = [LABELS[name]]
        for context in contexts:
            tokens_per_second = measured[context]["decode_tokens_per_second"]
            line += [
                f"{tokens_per_second:.1f}",
                ratio(tokens_per_second, reference[context]["decode_tokens_per_second"]),
            ]
        line += [f"{measured[contexts[-1]]['cache_bytes'] / 2**10:,.0f}",
                 f"{memory[name]['peak_rise_bytes'] / 2**20:.1f}"]  # fmt: skip
        rows.append(line)
    header = ["model"]
    for context in contexts:
        header += [f"decode tokens/s after {context:,}", "/ Llama"]
    header += [f"cache KiB after {contexts[-1]:,}", "training step peak MiB"]
    return markdown_table(header, rows)


def report_section(results: dict, plot_path: str | None) -> str:
    """The section of docs/performance/language-modelling.md: tables, plot and the verdicts, every number from
    `results`."""
    settings, models = results["settings"], list(results["models"])
    command = "python benchmarks/lm_compare.py --json results.json --write-docs"
    parts = [
        "## Language modelling on real text: memlm's models against 🤗 Llama and 🤗 Mamba of the same size",
        f"```bash\n{command}    # or, from a saved run: --report results.json\n```",
        f"Measured by `benchmarks/lm_compare.py` ({run_description(results)}). Every model has Llama's parameter "
        "count within 5 % and trains on the same tokens with the same optimiser and schedule; the memlm models carry "
        "their memory from segment to segment, Llama and Mamba read each segment alone (see the script's docstring). "
        'Cells are "mean (low–high)" over the seeds in the column "seeds"; bits per byte (bpb) are held-out, '
        'lower is better; "equal time" is each curve read at the training seconds of the fastest model of the same '
        "corpus and seed.",
    ]
    for corpus in settings["corpus"]:
        parts.append(f"**{corpus}** ({results['corpora'][corpus]})\n\n{quality_table(results, corpus, models)}")
    first_corpus, first_seed = settings["corpus"][0], settings["seeds"][0]
    parts.append(f"**Decoding** (batch 1, greedy, the models of seed {first_seed} on {first_corpus}), the cache's "
                 f"size there, and the peak memory rise of one training step ({settings['batch_size']} × "
                 f"{settings['length']} tokens)\n\n{speed_table(results, models)}")  # fmt: skip
    if plot_path:
        parts.append(f"![held-out bits per byte against training tokens and seconds]({plot_path})")
    lines = verdict_lines(claim_verdicts(results))
    parts.append("The papers' claims, judged from the numbers above (\"reproduced\" when every seed of the "
                 "claimed winner beats every seed of the other, \"not reproduced\" when every seed loses, \"within "
                 "the spread\" when the seeds' ranges overlap):\n\n" + "\n".join(lines))  # fmt: skip
    parts.append(discussion(results))
    return "\n\n".join(parts)


def per_corpus(models: dict) -> str:
    """ "A on stdlib; B on pydoc", or "A on every corpus" when one model is named for all."""
    if len(set(models.values())) == 1 and len(models) > 1:
        return f"{LABELS[next(iter(models.values()))]} on every corpus"
    return "; ".join(f"{LABELS[name]} on {corpus}" for corpus, name in models.items())


def discussion(results: dict) -> str:
    """A short reading of the run: what carries the comparison and what this scale cannot test."""
    from memlm.hub_card import human_count

    settings, summary, speed = results["settings"], results["summary"], results["speed"]
    tokens = settings["steps"] * settings["batch_size"] * settings["length"]
    best = {corpus: min(entries, key=lambda name: entries[name]["final"]["mean"]) for corpus, entries in
            summary.items()}  # fmt: skip
    fastest = {corpus: max(entries, key=lambda name: entries[name]["tokens_per_second"]["mean"])
               for corpus, entries in summary.items()}  # fmt: skip
    longest = speed[REFERENCE]["decode"][-1]["context"]
    decoding = {name: rows["decode"][-1]["decode_tokens_per_second"] for name, rows in speed.items()}
    quickest = max(decoding, key=decoding.get)
    text = [
        f"Lowest bits per byte at equal tokens: {per_corpus(best)}. Fastest training: {per_corpus(fastest)}. "
        f"Fastest decoding after {longest:,} tokens of context: {LABELS[quickest]} "
        f"({decoding[quickest] / decoding[REFERENCE]:.2f}× Llama's).",
        f"The scale is tiny next to the papers' ({human_count(results['parameters'][REFERENCE])} parameters and "
        f"{human_count(tokens)} training tokens per model here, tens of millions of parameters and hundreds of "
        "millions of tokens there): a verdict here says which way the mechanisms lean early in training on CPU, "
        "not what they reach at the papers' sizes.",
    ]
    return " ".join(text)


def card_section(results: dict, card: str, report_link: str | None = None) -> str:
    """The "Measured comparison" section of a hub card (or, with `report_link`, the link to the whole comparison, of
    the documentation's model page): its models against Llama and Mamba, from `results`."""
    from memlm.training.tasks.common import format_across_seeds

    settings, summary, speed = results["settings"], results["summary"], results["speed"]
    models = [name for name in (*CARD_MODELS[card], REFERENCE, "mamba") if name in results["models"]]
    contexts = [row["context"] for row in speed[REFERENCE]["decode"]]
    rows = []
    for name in models:
        decode = {row["context"]: row for row in speed[name]["decode"]}
        rows.append([LABELS[name], f"{results['parameters'][name]:,}",
                     str(seed_count(results, settings["corpus"][0], name)),
                     *(format_across_seeds(summary[corpus][name]["final"]) for corpus in settings["corpus"]),
                     format_across_seeds(summary[settings["corpus"][0]][name]["tokens_per_second"], ".0f"),
                     *(f"{decode[context]['decode_tokens_per_second']:.1f}" for context in contexts),
                     f"{decode[contexts[-1]]['cache_bytes'] / 2**10:,.0f}"])  # fmt: skip
    header = ["model", "parameters", "seeds", *(f"bpb, {corpus}" for corpus in settings["corpus"]),
              f"train tokens/s ({settings['corpus'][0]})", *(f"decode tokens/s after {context:,}" for context in
              contexts), f"cache KiB after {contexts[-1]:,}"]  # fmt: skip
    verdicts = verdict_lines([entry for entry in claim_verdicts(results) if entry["key"] in CARD_CLAIMS[card]])
    subject = "Small models of this architecture" + (", not this checkpoint," if report_link is None else "")
    whole = f" The whole comparison: [{LANGUAGE_MODELLING_TITLE}]({report_link})." if report_link else ""
    text = "\n\n".join([
        "## Measured comparison",
        f"{subject} trained side by side with 🤗 Llama and 🤗 Mamba of the same parameter count by memlm's "
        f"`benchmarks/lm_compare.py` ({run_description(results)}). Held-out bits per byte (bpb, lower is better) are "
        f"\"mean (low–high)\" over the seeds; decoding is batch 1, greedy.{whole}",
        markdown_table(header, rows),
        *(["The paper's claim at this scale:\n\n" + "\n".join(verdicts)] if verdicts else []),
    ])  # fmt: skip
    if report_link is not None:
        return text
    return text.replace("$", "$$")  # the card is a string.Template: a "$" in the text must stay one


def replace_section(text: str, section: str, before: str | None = None) -> str:
    """`text` with the part between the markers replaced by `section`; without markers, the marked section is put
    before the line starting with `before` (or at the end)."""
    marked = f"{BEGIN}\n{section}\n{END}"
    start, end = text.find(BEGIN), text.find(END)
    if start >= 0 and end > start:
        return text[:start] + marked + text[end + len(END) :]
    if before is not None and (index := text.find("\n" + before)) >= 0:
        return text[: index + 1] + marked + "\n\n" + text[index + 1 :]
    return text.rstrip("\n") + "\n\n" + marked + "\n"


def _rewrite(path: str, section: str, before: str | None = None) -> None:
    with open(path, encoding="utf-8") as file:
        text = file.read()
    with open(path, "w", encoding="utf-8") as file:
        file.write(replace_section(text, section, before))


def write_report(results: dict, page: str = REPORT_PAGE, cards: str = HUB_CARDS, plot_path: str | None = None,
                 model_pages: str | None = MODEL_PAGES) -> None:  # fmt: skip
    """Writes the section of `page` from `results` (a run's JSON), with the plot `plot_path` (a PNG; linked from the
    page relative to it) when given, and the "Measured comparison" of every hub card in `cards` and of every model
    page in `model_pages` (the documentation's pages of the same file names; None: none)."""
    page_folder = os.path.dirname(os.path.abspath(page))
    link = os.path.relpath(plot_path, page_folder) if plot_path else None
    _rewrite(page, report_section(results, link))
    for card in CARD_MODELS:
        if CARD_MODELS[card][0] not in results["models"]:
            continue
        if os.path.isfile(path := os.path.join(cards, card)):
            _rewrite(path, card_section(results, card), before="## Citation")
        if model_pages is not None and os.path.isfile(path := os.path.join(model_pages, card)):
            report_link = os.path.relpath(page, os.path.dirname(os.path.abspath(path)))
            _rewrite(path, card_section(results, card, report_link))


# --- the run ---------------------------------------------------------------------------------------------------------


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = report.arguments(__doc__, threads=2, quick="tiny sizes and a few steps of every model (CI)")
    parser.add_argument("--corpus", nargs="+", choices=list(CORPORA), default=["stdlib", "pydoc"])
    parser.add_argument("--models", nargs="+", choices=list(LABELS), default=list(LABELS),
                        help="which models (Llama, the reference, is always included)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (smoke: 0)")
    for option, kind in (("steps", int), ("eval_every", int), ("hidden_size", int), ("num_layers", int),
                         ("num_heads", int), ("intermediate_size", int), ("length", int), ("batch_size", int),
                         ("eval_tokens", int), ("eval_rows", int), ("max_span", int), ("memory_span", int),
                         ("max_bytes", int), ("decode_steps", int), ("warmup_steps", int)):  # fmt: skip
        parser.add_argument("--" + option.replace("_", "-"), type=kind, default=None,
                            help=f"default {FULL[option]} (smoke {SMOKE[option]})")  # fmt: skip
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=None, help="default 1024 16384")
    parser.add_argument("--one-seed-models", nargs="*", choices=list(LABELS), default=None,
                        help=f"models trained with the first seed only (default {' '.join(FULL['one_seed_models'])}; "
                        "none: every model with every seed)")  # fmt: skip
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--carry-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="the memlm models carry their memory across segments (default)")  # fmt: skip
    parser.add_argument("--plot", default=None, help=f"PNG of the curves (default {DEFAULT_PLOT}, with --smoke a "
                        "temporary folder; '' for none)")  # fmt: skip
    parser.add_argument("--write-docs", action="store_true",
                        help="at the end, write the results into docs/performance/language-modelling.md, the model "
                        "pages docs/models/*.md and hub_cards/*.md")  # fmt: skip
    parser.add_argument("--report", default=None, metavar="RESULTS_JSON",
                        help="train nothing: write the documentation's sections and the hub cards' from this JSON "
                        "of a run (and redraw its plot)")  # fmt: skip
    parser.add_argument("--report-page", default=REPORT_PAGE, help=argparse.SUPPRESS)
    parser.add_argument("--model-pages", default=MODEL_PAGES, help=argparse.SUPPRESS)
    parser.add_argument("--hub-cards", default=HUB_CARDS, help=argparse.SUPPRESS)
    parser.add_argument("--measure-memory", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_memory is not None or args.report is not None:
        if args.plot is None:
            args.plot = DEFAULT_PLOT
        return args
    for option, full in FULL.items():
        if getattr(args, option) is None:
            setattr(args, option, SMOKE[option] if args.quick else full)
    if args.plot is None:
        # A smoke run's curves mean nothing: they go to one file of the temporary folder, each smoke run's over the
        # last (parsing creates nothing), not over the measured picture.
        args.plot = DEFAULT_PLOT
        if args.quick:
            args.plot = os.path.join(tempfile.gettempdir(), "memlm_lm_compare_smoke.png")
    for option in ("steps", "eval_every", "hidden_size", "num_layers", "num_heads", "intermediate_size", "length",
                   "batch_size", "eval_tokens", "eval_rows", "max_span", "memory_span", "max_bytes", "decode_steps",
                   "threads"):  # fmt: skip
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be a positive integer, got {getattr(args, option)}")
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps must be >= 0 and below --steps ({args.steps}), got {args.warmup_steps}")
    if REFERENCE in args.one_seed_models:
        parser.error(f"--one-seed-models cannot hold {REFERENCE}: it sets the equal-time budget of every seed")
    if any(context < 1 for context in args.decode_contexts):
        parser.error(f"--decode-contexts must be positive integers, got {args.decode_contexts}")
    if not (args.learning_rate > 0 and math.isfinite(args.learning_rate)):
        parser.error(f"--learning-rate must be a finite number > 0, got {args.learning_rate}")
    from memlm.training.tasks.common import seeds_problem

    if problem := seeds_problem(args.seeds):
        parser.error(problem)
    args.models = [name for name in LABELS if name in args.models or name == REFERENCE]
    args.corpus = list(dict.fromkeys(args.corpus))
    return args


def trains(name: str, seed: int, args) -> bool:
    """Whether model `name` is trained with `seed`: every model with the first seed, the others but --one-seed-models
    with every seed."""
    return seed == args.seeds[0] or name not in args.one_seed_models


def machine() -> dict:
    """What the run ran on, for the report: `report.machine()`'s facts under the names the docs read, and Python's
    version and the time."""
    measured = report.machine()
    return {"torch": measured["torch"], "threads": measured["threads"], "cores": measured["cpus"],
            "cpu": measured["processor"], "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip


def report_saved_run(path: str, args) -> dict:
    """Writes the documentation's and the hub cards' sections from the JSON of a run, redrawing its plot (--report)."""
    with open(path, encoding="utf-8") as file:
        results = json.load(file)
    if args.plot:
        plot(results, argparse.Namespace(**results["settings"]), args.plot)
    write_report(results, args.report_page, args.hub_cards, args.plot or None, args.model_pages)
    print(f"wrote {args.report_page}, the model pages in {args.model_pages} and the hub cards in {args.hub_cards} "
          f"from {path}")  # fmt: skip
    return results


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    torch.set_num_threads(args.threads)
    if args.measure_memory is not None:
        result = training_step_memory(json.loads(args.measure_memory))
        print(json.dumps(result))
        return {"memory": result}
    if args.report is not None:
        return report_saved_run(args.report, args)
    from tqdm.auto import tqdm
    from transformers.utils import logging

    from memlm.tokenization import byte_level_tokenizer
    from memlm.training.data import split_held_out
    from memlm.training.pretrain import token_byte_lengths

    logging.set_verbosity_error()  # 🤗 Mamba says at every build that its CUDA kernels are not installed
    report.start(args)
    started = time.perf_counter()
    tokenizer = byte_level_tokenizer()
    byte_lengths = token_byte_lengths(tokenizer)
    configs = matched_configs(args, tokenizer)
    parameters = {name: parameter_count(config) for name, config in configs.items()}
    runs, speed, context_tokens = {}, {}, None
    trained = [(seed, name) for seed in args.seeds for name in args.models if trains(name, seed, args)]
    progress = tqdm(total=len(args.corpus) * len(trained) * args.steps, desc="training", disable=None)
    for corpus in args.corpus:
        documents = corpus_documents(corpus, args.max_bytes)
        runs[corpus] = {}
        for seed in args.seeds:
            train_tokens, eval_tokens = split_held_out(documents, tokenizer, args.eval_tokens, seed=seed)
            runs[corpus][seed] = {}
            for name in args.models:
                if not trains(name, seed, args):
                    continue
                model, run = train_model(name, configs[name], train_tokens, eval_tokens, byte_lengths, args, seed,
                                         progress)  # fmt: skip
                runs[corpus][seed][name] = run
                progress.write(f"{corpus} seed {seed} {LABELS[name]:32} bits per byte {run['final']:.3f}  "
                               f"{run['tokens_per_second']:.0f} tokens/s")  # fmt: skip
                if corpus == args.corpus[0] and seed == args.seeds[0]:
                    if context_tokens is None:
                        repeats = -(-max(args.decode_contexts) // len(eval_tokens))
                        context_tokens = eval_tokens.repeat(repeats)[: max(args.decode_contexts)]
                    speed[name] = {"decode": decode_measurements(model, name, context_tokens, args)}
                del model
    progress.close()
    memory = measure_memory(configs, args)
    results = {
        "settings": {
            key: value
            for key, value in report.own_settings(args).items()
            if key not in ("measure_memory", "model_pages", "hub_cards")
        },
        "machine": machine(),
        "corpora": {corpus: CORPORA[corpus] for corpus in args.corpus},
        "models": {name: LABELS[name] for name in args.models},
        "parameters": parameters,
        "configs": {name: config.to_dict() for name, config in configs.items()},
        "runs": {
            corpus: {str(seed): seed_runs for seed, seed_runs in per_seed.items()} for corpus, per_seed in runs.items()
        },
        "summary": summarise(runs, args.corpus, args.models),
        "speed": speed,
        "memory": memory,
    }
    print_tables(results, args)
    results["seconds"] = time.perf_counter() - started
    print(f"\ntotal {results['seconds']:.0f} s")
    if args.plot:
        plot(results, args, args.plot)
        print(f"plot: {args.plot}")
    report.finish(results, args)
    if args.write_docs:
        write_report(results, args.report_page, args.hub_cards, args.plot or None, args.model_pages)
        print(f"wrote {args.report_page}, the model pages in {args.model_pages} and the hub cards in {args.hub_cards}")
    return results


if __name__ == "__main__":
    main()
