"""Quantized through 🤗's quantizers (issue 41): each memlm family and a 🤗 Llama of the same size, trained here, then
loaded with `from_pretrained(..., quantization_config=...)` by every quantizer that runs on a CPU — the checkpoint's
size, the peak memory, the decoding speed and the held-out bits per byte, against the same model in float32.

Training, as benchmarks/lm_compare.py trains (its code: models, data, optimiser, memory carried across segments):
DeltaNet (fla preset), Expire-Span, the Feedback Transformer and 🤗 Llama, hidden 256, 2 layers, 4 heads, each other
model's MLP width solved for Llama's parameter count (then rounded to a multiple of 32, as torchao's int4 groups
need), `--steps` steps of 8 × 128 bytes of the Python standard
library's source (`memlm train`'s embedded corpus, whole documents held out); each saved with `save_pretrained`.

Then, for each model and each quantizer (float32 first, then `QUANTIZERS`, the configurations
tests/clients/test_quantization.py checks), a fresh Python process loads the saved model and measures:

- checkpoint MB: the files `save_pretrained` writes for the loaded model ("—" where 🤗 does not serialise it);
- peak MiB: the process's peak resident memory from just before loading (torch, 🤗 and the quantizer imported, the
  held-out text read; Linux's VmHWM, reset there) less its resident memory then: the weights as loaded, and what
  loading, evaluating and decoding took at their peak;
- held-out bits per byte: `memlm.training.pretrain.evaluate` (the memlm models carry their memory across segments;
  Llama reads each segment alone), on the text held out at training;
- decoding tokens/s: greedy steps of one token at batch 1 after a prompt of `--context` tokens, through the forward
  with the cache (`report.Decoding`), medians of `--repeats` calls of `--decode-steps` steps.

Needs the quantization extra (`pip install "memlm[quantization]"`: torchao, bitsandbytes, optimum-quanto).

    python benchmarks/quantization.py [--json results.json]        # about 25 minutes on 2 quiet cores
    python benchmarks/quantization.py --quick                      # tiny sizes: a run that checks the script
    python benchmarks/quantization.py --write-docs --json benchmarks/results/quantization.json
    python benchmarks/quantization.py --report benchmarks/results/quantization.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

try:  # run as a script (python benchmarks/quantization.py) or imported as benchmarks.quantization
    import lm_compare
    import report
except ImportError:
    from benchmarks import lm_compare, report

FAMILIES = ("deltanet_fla", "expire_span", "feedback", "llama")
NAMES = {"deltanet_fla": "DeltaNet (fla)", "expire_span": "Expire-Span", "feedback": "Feedback", "llama": "🤗 Llama"}
# name → the `quantization_config` it loads with, made in the measuring process (the packages import there).
QUANTIZERS = {
    "float32": None,
    "torchao-int8": ("torchao", "Int8WeightOnlyConfig"),
    "torchao-int8-dynamic": ("torchao", "Int8DynamicActivationInt8WeightConfig"),
    "torchao-int4": ("torchao", "int4"),
    "torchao-int8-dynamic-int4": ("torchao", "int8-int4"),
    "torchao-float8": ("torchao", "Float8WeightOnlyConfig"),
    "bitsandbytes-8bit": ("bitsandbytes", "8bit"),
    "bitsandbytes-4bit": ("bitsandbytes", "4bit"),
    "quanto-int8": ("quanto", "int8"),
    "quanto-int4": ("quanto", "int4"),
}
TRAINING = {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "intermediate_size": 704, "length": 128,
            "batch_size": 8, "eval_tokens": 4096, "eval_rows": 4, "max_span": 512, "memory_span": 128,
            "learning_rate": 2e-3, "weight_decay": 0.01, "max_grad_norm": 1.0, "carry_memory": True,
            "max_bytes": 8_000_000}  # fmt: skip
QUICK_TRAINING = {**TRAINING, "hidden_size": 64, "intermediate_size": 128, "length": 32, "batch_size": 2,
                  "eval_tokens": 256, "eval_rows": 2, "max_span": 64, "memory_span": 32, "max_bytes": 300_000}  # fmt: skip
# The MLP widths solved for Llama's parameter count are rounded to multiples of this: torchao's int4 takes whole
# groups of 32 inputs, and bitsandbytes' 4-bit layers on a CPU with AVX512-BF16 whole blocks of 64 (they repack their
# weight by such blocks at the first forward without gradients, and bitsandbytes 0.50.2 fails on a partial one).
GROUP = 64
COLUMNS = [
    ("model", "name", "s"),
    ("quantizer", "quantizer", "s"),
    ("checkpoint MB", "checkpoint_mb", ".2f"),
    ("peak MiB", "peak_mib", ".0f"),
    ("decoding tokens/s", "tokens_per_second", ".0f"),
    ("held-out bits/byte", "bits_per_byte", ".3f"),
    ("size / float32", "size_ratio", ".2f"),
    ("speed / float32", "speed_ratio", ".2f"),
    ("bits/byte − float32", "bits_per_byte_change", "+.3f"),
]


def quantization_config(quantizer: str):
    """The `quantization_config` of `quantizer` (None for float32)."""
    spec = QUANTIZERS[quantizer]
    if spec is None:
        return None
    package, kind = spec
    if package == "torchao":
        import torchao.quantization as ao
        from transformers import TorchAoConfig

        if kind == "int4":
            return TorchAoConfig(ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=ao.PerGroup(32)))
        if kind == "int8-int4":
            return TorchAoConfig(
                ao.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=ao.PerGroup(32))
            )
        return TorchAoConfig(getattr(ao, kind)())
    if package == "bitsandbytes":
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_8bit=kind == "8bit", load_in_4bit=kind == "4bit")
    from transformers import QuantoConfig

    return QuantoConfig(weights=kind)


def _status_mib(field: str) -> float:
    """A memory line of /proc/self/status in MiB: VmRSS (resident now) or VmHWM (the peak since the last reset)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def reset_peak_memory() -> None:
    """Start VmHWM again from the resident memory now (Linux: 5 into /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def folder_megabytes(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) / 1e6


def measure_one(model_folder: str, quantizer: str, family: str, settings: dict) -> dict:
    """In a fresh process: load the saved model with `quantizer`, then its checkpoint size, peak memory, held-out
    bits per byte and decoding tokens/s (the module docstring)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    import memlm  # noqa: F401  (registers memlm's model types)

    logging.set_verbosity_error()
    torch.set_num_threads(settings["threads"])
    folder = Path(model_folder)
    held_out = torch.load(folder / "held_out.pt")
    config = quantization_config(quantizer)  # imports the quantizer's package
    reset_peak_memory()  # the imports' own peak is not the model's
    before = _status_mib("VmRSS")
    options = {} if config is None else {"quantization_config": config}
    model = AutoModelForCausalLM.from_pretrained(folder / "model", **options).eval()
    with tempfile.TemporaryDirectory() as saved:
        try:
            model.save_pretrained(saved)
            checkpoint = folder_megabytes(Path(saved))
        except Exception as error:  # 🤗 refuses to serialise some quantized models (quanto's)
            checkpoint, not_saved = None, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        else:
            not_saved = None
    # As lm_compare evaluates: memlm's models carry their memory across segments, Llama reads each alone.
    sizes = argparse.Namespace(length=settings["length"], eval_rows=settings["eval_rows"])
    with torch.no_grad():
        evaluation = lm_compare.held_out(model, held_out["tokens"], sizes, held_out["byte_lengths"],
                                         lm_compare.CARRIES[family])  # fmt: skip
    decoding = report.Decoding(model, settings["context"], settings["decode_steps"])
    seconds = report.interleaved_median_times({"decode": decoding}, 1, settings["repeats"])["decode"]
    peak = _status_mib("VmHWM") - before
    return {"model": family, "quantizer": quantizer, "checkpoint_mb": checkpoint, "not_saved": not_saved,
            "peak_mib": peak, "bits_per_byte": evaluation["bits_per_byte"],
            "tokens_per_second": settings["decode_steps"] / seconds}  # fmt: skip


def train_and_save(args, sizes: dict, work: Path) -> dict:
    """Train each family (lm_compare's code) and save it with its held-out text; returns the training results."""
    from memlm.tokenization import byte_level_tokenizer
    from memlm.training.data import split_held_out
    from memlm.training.pretrain import token_byte_lengths

    # Llama's parameter count is the one the others' MLP widths are solved for: it is built, trained or not.
    training = argparse.Namespace(**sizes, steps=args.steps, warmup_steps=max(1, args.steps // 10),
                                  eval_every=args.steps, models=list(FAMILIES))  # fmt: skip
    tokenizer = byte_level_tokenizer()
    byte_lengths = token_byte_lengths(tokenizer)
    configs = lm_compare.matched_configs(training, tokenizer)
    for config in configs.values():  # whole groups of inputs (GROUP)
        config.intermediate_size = GROUP * round(config.intermediate_size / GROUP)
    documents = lm_compare.corpus_documents("stdlib", sizes["max_bytes"])
    train_tokens, eval_tokens = split_held_out(documents, tokenizer, sizes["eval_tokens"], seed=0)
    trained = {}
    for family in args.models:
        model, run = lm_compare.train_model(family, configs[family], train_tokens, eval_tokens, byte_lengths,
                                            training, seed=0)  # fmt: skip
        model.save_pretrained(work / family / "model")
        tokenizer.save_pretrained(work / family / "model")
        torch.save({"tokens": eval_tokens, "byte_lengths": byte_lengths}, work / family / "held_out.pt")
        parameters = sum(parameter.numel() for parameter in model.parameters())
        trained[family] = {"parameters": parameters, "training_seconds": run["training_seconds"],
                           "bits_per_byte_after_training": run["final"]}  # fmt: skip
        print(f"trained {NAMES[family]}: {parameters} parameters, {run['final']:.3f} bits/byte, "
              f"{run['training_seconds']:.0f} s", flush=True)  # fmt: skip
    return trained


def measure(args, sizes: dict, work: Path) -> tuple[dict, list[dict]]:
    trained = train_and_save(args, sizes, work)
    settings = {"length": sizes["length"], "eval_rows": sizes["eval_rows"], "context": args.context,
                "decode_steps": args.decode_steps, "repeats": args.repeats, "threads": torch.get_num_threads()}  # fmt: skip
    rows = []
    for family in args.models:
        for quantizer in args.quantizers:
            command = [sys.executable, os.path.abspath(__file__), "--measure-one", str(work / family), quantizer,
                       family, json.dumps(settings)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                message = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1][:300]
                row = {"model": family, "quantizer": quantizer, "error": message}
            else:
                row = {**json.loads(lines[-1]), "error": None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return trained, with_ratios(rows)


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with its size, speed and bits per byte against its model's float32 row."""
    base = {row["model"]: row for row in rows if row["quantizer"] == "float32" and row["error"] is None}
    for row in rows:
        reference = base.get(row["model"])
        if row["error"] is not None or reference is None:
            continue
        size = row["checkpoint_mb"]
        row["size_ratio"] = None if size is None else size / reference["checkpoint_mb"]
        row["speed_ratio"] = row["tokens_per_second"] / reference["tokens_per_second"]
        row["bits_per_byte_change"] = row["bits_per_byte"] - reference["bits_per_byte"]
    return rows


def _named(rows: list[dict]) -> list[dict]:
    return [{**row, "name": NAMES[row["model"]]} for row in rows if row["error"] is None]


def docs_section(results: dict) -> str:
    """The table of the quantization guide, from one full run's results."""
    settings, trained = results["settings"], results["trained"]
    sizes = TRAINING
    parameters = ", ".join(f"{NAMES[family]} {trained[family]['parameters'] / 1e6:.2f}M" for family in trained)
    parts = [
        f"From `python benchmarks/quantization.py` ({report.measured_on(settings)}) Hidden size "
        f"{sizes['hidden_size']}, {sizes['num_layers']} layers, {sizes['num_heads']} heads, byte vocabulary "
        f"({parameters} parameters), trained {settings['steps']} steps of {sizes['batch_size']} × {sizes['length']} "
        "bytes of the standard library's source, then loaded by each quantizer; held-out bits per byte on "
        f"{sizes['eval_tokens']} held-out bytes; decoding at batch 1 after {settings['context']} tokens, medians of "
        f"{settings['repeats']} calls of {settings['decode_steps']} steps; peak MiB: the loading process's peak "
        "resident memory above its memory before loading. Each row is a process of its own, run one after another "
        '(not in turns), so its speed carries that process\'s noise. Checkpoint "—": 🤗 does not save that '
        "quantizer's models.",
        report.markdown_table(COLUMNS, _named(results["rows"])),
    ]
    failed = [row for row in results["rows"] if row["error"] is not None]
    if failed:
        parts.append(
            "Did not load or run:\n\n"
            + "\n".join(f"- {NAMES[row['model']]}, {row['quantizer']}: {row['error']}" for row in failed)
        )
    return "\n\n".join(parts)


GUIDE = os.path.join(report.ROOT, "docs", "guides", "quantization.md")
SECTION = report.Section(
    "quantization", "python benchmarks/quantization.py --report benchmarks/results/quantization.json", docs_section
)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = report.arguments(__doc__, repeats=5, section=SECTION,
                              quick="tiny sizes, few steps, one repeat: a run that checks the script")  # fmt: skip
    parser.set_defaults(report_page=GUIDE)  # the section is the quantization guide's, not the speed page's
    parser.add_argument("--steps", type=int, default=200, help="training steps of each model")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens before the decoding")
    parser.add_argument("--decode-steps", type=int, default=32, help="greedy steps per timed call")
    parser.add_argument("--quantizers", nargs="+", choices=list(QUANTIZERS), default=list(QUANTIZERS),
                        help="float32 is always measured first")  # fmt: skip
    parser.add_argument("--models", nargs="+", choices=list(FAMILIES), default=list(FAMILIES),
                        help="the models trained and quantized (default: all four)")  # fmt: skip
    parser.add_argument("--measure-one", nargs=4, metavar=("FOLDER", "QUANTIZER", "FAMILY", "SETTINGS"),
                        help=argparse.SUPPRESS)  # fmt: skip
    quick = {"steps": 4, "context": 16, "decode_steps": 4, "repeats": 1}
    args = report.parse(parser, argv, quick)
    args.quantizers = ["float32"] + [name for name in args.quantizers if name != "float32"]
    args.models = [name for name in FAMILIES if name in args.models]
    return args


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    if args.measure_one is not None:
        folder, quantizer, family, settings = args.measure_one
        print(json.dumps(measure_one(folder, quantizer, family, json.loads(settings))))
        return {}
    saved = report.saved_run(args, SECTION)
    if saved is not None:
        return saved
    started = time.perf_counter()
    settings = {key: getattr(args, key) for key in ("steps", "context", "decode_steps", "repeats", "quantizers",
                                                    "models")}  # fmt: skip
    results = {"settings": {**settings, "quick": args.quick, **report.start(args)}}
    with tempfile.TemporaryDirectory() as work:
        results["trained"], results["rows"] = measure(args, QUICK_TRAINING if args.quick else TRAINING, Path(work))
    results["seconds"] = time.perf_counter() - started
    report.print_table("Quantized: size, memory, speed and held-out bits per byte", COLUMNS, _named(results["rows"]))
    return report.finish(results, args, SECTION)


if __name__ == "__main__":
    main()
