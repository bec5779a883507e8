"""The `memlm` command.

memlm train --preset tiny-deltanet --output-dir runs/tiny      pretrain (see memlm.training.pretrain)
memlm finetune --model runs/tiny --output-dir runs/tuned ...    fine-tune with the 🤗 Trainer
memlm generate runs/tiny --prompt "def "                        stream text from a saved model
memlm serve runs/tiny --port 8000                               an OpenAI-compatible server (🤗's transformers serve)
memlm info runs/tiny                                            what a checkpoint is, and the versions memlm runs with
memlm rebundle runs/tiny                                        rewrite a checkpoint's code with the installed memlm's
memlm plot-memory runs/tiny --text "..." --output memory.png     what an Expire-Span / Feedback model remembers
memlm kernels build DIR | check DIR | push REPO_ID               memlm's kernels as a repository of 🤗's `kernels`
memlm convert lmtool-fwp STATE_DICT OUT --official-args ARGS.json a model of the papers' official code as a memlm
memlm convert transformer-sequential CHECKPOINT OUT                 checkpoint folder (docs: "The papers' models")
memlm export onnx runs/tiny runs/tiny-onnx                      DeltaNet / Feedback as ONNX graphs with a runner

A bad input ends with one line `memlm: error: ...` on stderr and exit status 1; `memlm --debug COMMAND ...` (or the
environment variable MEMLM_DEBUG=1) shows the Python traceback instead.
"""

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path

from memlm.checkpoint_files import check_tokenizer, checkpoint_folder, load_model, one_line, read_weights


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    value = float(text)
    if not value > 0 or value == math.inf:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def generate(argv) -> None:
    parser = argparse.ArgumentParser(prog="memlm generate", description="Stream text from a saved model.")
    parser.add_argument("model", help="a folder written by save_pretrained")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=positive_int, default=200)
    parser.add_argument("--temperature", type=positive_float, default=0.8)
    parser.add_argument("--top-k", type=non_negative_int, default=20, help="0 samples from the whole vocabulary")
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)
    folder, _ = checkpoint_folder(arguments.model)
    check_tokenizer(folder)

    import torch
    from transformers import AutoTokenizer, TextStreamer, pipeline

    import memlm  # noqa: F401

    torch.manual_seed(arguments.seed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_model(folder)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    options = {"do_sample": False} if arguments.greedy else {
        "do_sample": True, "temperature": arguments.temperature, "top_k": arguments.top_k
    }  # fmt: skip
    generator(arguments.prompt or tokenizer.bos_token, max_new_tokens=arguments.max_new_tokens,
              streamer=TextStreamer(tokenizer), **options)  # fmt: skip


def describe(path: str, broken: list[str] | None = None) -> list[str]:
    """What a checkpoint folder holds: model, size, memory settings, and the kernel backend it would run. A weights or
    metrics file that cannot be read is flagged on its line (and its name appended to `broken`); the rest is still
    described."""
    import torch
    from transformers import AutoConfig

    import memlm  # noqa: F401
    from memlm.configuration.validation import MEMLM_MODEL_TYPES
    from memlm.kernels import describe_backend, resolve_backend
    from memlm.kernels.hub import describe_hub_kernels

    folder, _ = checkpoint_folder(path)
    config = AutoConfig.from_pretrained(folder)
    lines = [f"{folder}: {type(config).__name__} (model_type {config.model_type})"]
    counts, unreadable = read_weights(folder)
    count, readable = sum(counts.values()), list(counts)
    if broken is not None:
        broken += list(unreadable)
    unreadable = [f"{name} cannot be read ({reason})" for name, reason in unreadable.items()]
    if readable:
        lines.append(f"parameters: {count:,} in {', '.join(readable)}")
    lines += [f"weights: {entry}" for entry in unreadable]
    lines += [f"- {line}" for line in config.describe()] if hasattr(config, "describe") else []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines.append(
        f"kernels: {resolve_backend(None, torch.device(device))} backend on {device} (MEMLM_KERNELS overrides)"
    )
    operation = {"memlm_deltanet": "sum_rule" if getattr(config, "update_rule", "delta") == "sum" else "delta_rule",
                 "memlm_expire_span": "expire_span_attention",
                 "memlm_feedback_transformer": "feedback"}.get(config.model_type)  # fmt: skip
    if operation is not None:
        lines.append(f"kernels run: {describe_backend(operation, device, getattr(config, 'dtype', None))}")
        hub_layer = {"memlm_deltanet": "DeltaNetAttention", "memlm_expire_span": "ExpireSpanAttention",
                     "memlm_feedback_transformer": "FeedbackRecurrence"}[config.model_type]  # fmt: skip
        lines.append(describe_hub_kernels([hub_layer]))
    if (folder / "metrics.json").is_file():
        try:
            lines += _describe_metrics(json.loads((folder / "metrics.json").read_text()))
        except (ValueError, OSError) as error:
            lines.append(f"metrics.json: cannot be read, skipped ({one_line(error)})")
            if broken is not None:
                broken.append("metrics.json")
    if (folder / "tokenizer.json").is_file():
        lines.append("tokenizer: saved beside the model")
    if config.model_type in MEMLM_MODEL_TYPES:
        lines.append(_describe_bundle(folder, config))
    lines.append(f"running with: {versions()}")
    return lines


def versions() -> str:
    """The versions of memlm and of the packages it runs on, as installed here; torch's with its build (2.11.0+cu130:
    a CUDA build; the registry's metadata says only 2.11.0)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    installed = []
    for package in ("memlm", "transformers", "accelerate", "torch", "triton", "kernels"):
        try:
            installed.append(f"{package} {torch.__version__ if package == 'torch' else version(package)}")
        except PackageNotFoundError:
            installed.append(f"{package} not installed")
    return ", ".join(installed)


def _describe_bundle(folder: Path, config) -> str:
    """Whether the code the checkpoint carries (for `trust_remote_code` without memlm) is the installed memlm's."""
    from memlm.export import bundle_differences, bundled_modules

    differing = bundle_differences(folder, bundled_modules(config))
    if not differing:
        return "code bundle: the installed memlm's (trust_remote_code runs this very code)"
    return (
        f"code bundle: differs from the installed memlm's in {len(differing)} file(s) ({', '.join(differing)}): "
        f"written by another (older?) memlm, whose code may not run under the installed 🤗 Transformers; "
        f"`memlm rebundle {folder}` rewrites it"
    )


def rebundle(argv) -> None:
    parser = argparse.ArgumentParser(
        prog="memlm rebundle",
        description="Rewrite the code a checkpoint carries (what trust_remote_code runs where memlm is not installed) "
        "with the installed memlm's, e.g. after a 🤗 Transformers release that the old code does not run under. The "
        "weights and the config's values are left as they are.",
    )
    parser.add_argument("model", help="a folder written by save_pretrained")
    folder, config_json = checkpoint_folder(parser.parse_args(argv).model)
    from transformers import AutoConfig

    import memlm
    from memlm.configuration.validation import MEMLM_MODEL_TYPES
    from memlm.export import bundle_auto_map, bundle_differences, bundled_modules, write_bundle

    if config_json["model_type"] not in MEMLM_MODEL_TYPES:
        raise ValueError(
            f"{folder} holds a {config_json['model_type']!r} model, not one of memlm's; it carries no memlm code."
        )
    config = AutoConfig.from_pretrained(folder)
    modules = bundled_modules(config)
    differing = bundle_differences(folder, modules)
    removed = write_bundle(folder, modules)
    changes = [name for name in differing if name not in removed]
    # auto_map names the bundled classes: set as save_pretrained sets it, leaving the rest of config.json as it is.
    keys = [
        key for key in ("AutoConfig", "AutoModel", "AutoModelForCausalLM") if key in config_json.get("auto_map", {})
    ]
    auto_map = bundle_auto_map(config, keys or ["AutoConfig", "AutoModel", "AutoModelForCausalLM"])
    if config_json.get("auto_map") != auto_map:
        config_json["auto_map"] = auto_map
        (folder / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        changes.append("config.json (auto_map)")
    if changes or removed:
        deleted = f"; deleted {', '.join(removed)} (no longer bundled)" if removed else ""
        print(
            f"{folder}: rewrote {', '.join(changes) or 'nothing'}{deleted}, with the code of memlm {memlm.__version__}."
        )
    else:
        print(f"{folder}: the code bundle was already the installed memlm's; nothing changed.")


def _describe_metrics(metrics) -> list[str]:
    """The line `memlm info` shows from a training run's metrics.json, or a ValueError saying what is malformed."""
    if not isinstance(metrics, dict):
        raise ValueError(f"holds {type(metrics).__name__}, not a JSON object")
    after = metrics.get("eval_after")
    if not after:
        return []
    bits = after.get("bits_per_byte") if isinstance(after, dict) else None
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        raise ValueError(f"eval_after.bits_per_byte is {bits!r}, not a number")
    return [f"held-out bits per byte: {bits:.3f} after {metrics.get('steps')} steps"]


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--text-file {path!r} is not UTF-8 text ({error.reason} at byte {error.start}).") from error


def plot_memory(argv) -> None:
    parser = argparse.ArgumentParser(
        prog="memlm plot-memory",
        description="Draw what a saved model remembers: an Expire-Span model's span per token and layer over a text, "
        "or a Feedback Transformer's memory weight per layer.",
    )
    parser.add_argument("model", help="a folder written by save_pretrained (Expire-Span or Feedback Transformer)")
    parser.add_argument("--output", required=True, help="the PNG to write")
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--text", help="Expire-Span: the text whose spans are drawn")
    text.add_argument("--text-file", help="Expire-Span: a file holding that text")
    parser.add_argument(
        "--width", type=positive_int, default=64, help="Expire-Span: characters per line of the drawing"
    )
    arguments = parser.parse_args(argv)

    from transformers import AutoTokenizer

    import memlm  # noqa: F401
    from memlm.visualization import plot_expire_spans, plot_feedback_layer_weights

    folder, config = checkpoint_folder(arguments.model)
    model_type = config["model_type"]
    if model_type == "memlm_expire_span":
        if arguments.text is None and arguments.text_file is None:
            raise ValueError("plot-memory: an Expire-Span model needs --text or --text-file.")
        text = arguments.text if arguments.text is not None else _read_text(arguments.text_file)
        check_tokenizer(folder)
        model = load_model(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        spans = plot_expire_spans(model, tokenizer, text, arguments.output, width=arguments.width)
        for layer, layer_spans in enumerate(spans, start=1):
            print(f"layer {layer}: mean span {float(layer_spans.mean()):.1f} tokens, "
                  f"longest {float(layer_spans.max()):.1f} (max_span {model.config.max_span})")  # fmt: skip
    elif model_type == "memlm_feedback_transformer":
        weights = plot_feedback_layer_weights(load_model(folder), arguments.output)
        print("memory weights softmax(w): " + ", ".join(f"{weight:.3f}" for weight in weights.tolist()))
    else:
        raise ValueError(
            f"plot-memory: {model_type!r} models have no memory picture; it draws memlm_expire_span and "
            "memlm_feedback_transformer models."
        )
    print(f"wrote {arguments.output}")


# What `memlm train` and `memlm finetune` cannot run without, from the `train` extra (matplotlib, also in it, only
# draws loss.png: without it the picture is skipped). `datasets` is needed by train for non-text data files only.
TRAIN_EXTRA_NEEDED = {"train": ("accelerate",), "finetune": ("accelerate", "datasets")}


def _training_command(command: str):
    """The `main` of memlm.training's `pretrain` or `finetune`, or a one-line error naming the missing extra (checked
    first: the training code imports those packages only once it runs)."""
    import importlib.util

    missing = [name for name in TRAIN_EXTRA_NEEDED[command] if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"memlm {command} needs the train extra, and {', '.join(map(repr, missing))} "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install 'memlm[train]'."
        )
    if command == "train":
        from memlm.training.pretrain import main
    else:
        from memlm.training.finetune import main
    return main


# The official code bases `memlm convert` reads, and the memlm.conversion module of each.
OFFICIAL_CODE_BASES = {
    "lmtool-fwp": "lmtool_fwp",  # IDSIA/lmtool-fwp: DeltaNet (Schlag et al., 2021)
    "transformer-sequential": "transformer_sequential",  # facebookresearch: Feedback Transformer, Expire-Span
}


def convert(argv) -> None:
    parser = argparse.ArgumentParser(
        prog="memlm convert",
        description="Convert a model of a paper's official code into a memlm checkpoint folder (safetensors, config, "
        "code bundle, model card) that AutoModelForCausalLM loads. What memlm cannot express is refused in words.",
    )
    parser.add_argument("code_base", choices=list(OFFICIAL_CODE_BASES), help="the official repository")
    parser.add_argument("checkpoint", help="the official checkpoint (read with torch.load(weights_only=True))")
    parser.add_argument("output", help="the folder to write (must not exist or be empty)")
    parser.add_argument(
        "--official-args",
        help="a JSON file of the official arguments (names and values as the official argparse gives them); "
        "lmtool-fwp's checkpoints do not hold them, so lmtool-fwp needs it",
    )
    arguments = parser.parse_args(argv)
    import importlib

    module = importlib.import_module(f"memlm.conversion.{OFFICIAL_CODE_BASES[arguments.code_base]}")
    output = Path(arguments.output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"{arguments.output!r} exists and is not an empty folder; choose a new folder.")
    if arguments.code_base == "lmtool-fwp":
        if arguments.official_args is None:
            raise ValueError(
                "lmtool-fwp checkpoints do not hold train.py's arguments: pass --official-args ARGS.json (a JSON "
                'object such as {"attn_type": 24, "n_head": 8, "d_head": 16, ...}; missing ones take '
                "train.py's defaults)."
            )
        state_dict = module.read_checkpoint(arguments.checkpoint)
        official_args = module.read_official_args(arguments.official_args)
    else:
        state_dict, official_args = module.read_checkpoint(arguments.checkpoint)
        if arguments.official_args is not None:
            official_args = {**official_args, **module.read_official_args(arguments.official_args)}
    try:
        config, converted = module.convert_state_dict(state_dict, official_args)
    except NotImplementedError as error:  # what memlm cannot express, in the converter's words
        raise ValueError(str(error)) from error
    from transformers import AutoModelForCausalLM

    import memlm  # noqa: F401  (registers memlm's classes with the Auto classes)

    dtype = next(iter(converted.values())).dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(converted, strict=True)
    model.save_pretrained(output)
    print(f"wrote {output} ({type(model).__name__}, {model.num_parameters():,} parameters, {dtype})")


def export(argv) -> None:
    parser = argparse.ArgumentParser(
        prog="memlm export",
        description="Export a saved DeltaNet or Feedback Transformer to ONNX: a prefill graph (a block of P tokens) "
        "and a decoding step (one token), each taking the memory and returning the next as explicit tensors, with "
        "the initial memory, the tokenizer and run_onnx.py, which decodes with ONNX Runtime and NumPy alone "
        "(docs/guides/onnx.md).",
    )
    parser.add_argument("format", choices=["onnx"], help="the format to write")
    parser.add_argument("model", help="a saved model folder (save_pretrained, memlm train)")
    parser.add_argument("output", help="the folder to write (must not exist or be empty)")
    parser.add_argument(
        "--block-size",
        type=positive_int,
        help="P, the prefill graph's tokens (default: DeltaNet's chunk size; 16 for the Feedback Transformer, whose "
        "steps the graph unrolls)",
    )
    parser.add_argument(
        "--no-batch-axis",
        action="store_true",
        help="graphs for one row at a time (default: any number of rows per call)",
    )
    arguments = parser.parse_args(argv)
    from memlm.onnx_export import export_onnx

    manifest = export_onnx(arguments.model, arguments.output, arguments.block_size, not arguments.no_batch_axis)
    print(
        f"wrote {arguments.output} (prefill.onnx: blocks of {manifest['block_size']} tokens, step.onnx, "
        f"{len(manifest['memory'])} memory tensors; {manifest['export_seconds']} s); decode with: python "
        f"{Path(arguments.output) / 'run_onnx.py'} --prompt TEXT"
    )


def run(command: str, rest: list[str]) -> None:
    if command in ("train", "finetune"):
        _training_command(command)(rest)
    elif command == "generate":
        generate(rest)
    elif command == "serve":
        from memlm.serving import serve

        serve(rest)
    elif command == "plot-memory":
        plot_memory(rest)
    elif command == "rebundle":
        rebundle(rest)
    elif command == "convert":
        convert(rest)
    elif command == "export":
        export(rest)
    elif command == "kernels":
        from memlm.kernel_repository import main as kernel_repository

        status = kernel_repository(rest, prog="memlm kernels")
        if status:
            raise SystemExit(status)  # `check` found a stale repository
    else:
        parser = argparse.ArgumentParser(prog="memlm info", description="Describe a saved checkpoint.")
        parser.add_argument("model")
        arguments = parser.parse_args(rest)
        broken = []
        print("\n".join(describe(arguments.model, broken)))
        if broken:  # described as far as it could be, but a script checking the status must not see success
            raise ValueError(f"{arguments.model}: {', '.join(broken)} cannot be read (see above).")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("MEMLM_DEBUG", "").strip() not in ("", "0")
    if argv and argv[0] == "--debug":
        debug, argv = True, argv[1:]
    commands = (
        "train",
        "finetune",
        "generate",
        "serve",
        "info",
        "rebundle",
        "plot-memory",
        "kernels",
        "convert",
        "export",
    )
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            raise SystemExit(f"memlm: unknown command {argv[0]!r}; choose one of {', '.join(commands)}.")
        return
    with one_line_errors("memlm", debug):
        run(argv[0], argv[1:])


@contextlib.contextmanager
def one_line_errors(program: str, debug: bool = False):
    """Turn the library's errors for bad input (ValueError and its subclasses, missing or unreadable files, a full
    disk) into one line `PROGRAM: error: ...` on stderr and exit status 1; Ctrl-C into exit status 130. Anything else
    is a bug and keeps its traceback; so does everything with `debug` (or MEMLM_DEBUG=1)."""
    debug = debug or os.environ.get("MEMLM_DEBUG", "").strip() not in ("", "0")
    try:
        yield
    except (ValueError, OSError) as error:
        if debug:
            raise
        print(f"{program}: error: {one_line(error)}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{program}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def script_main(function, argv=None):
    """Run a script's `function(argv)` (training/*.py) with `one_line_errors`, named after the script; a leading
    `--debug` shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(argv) and argv[0] == "--debug"
    with one_line_errors(Path(sys.argv[0]).name, debug):
        return function(argv[1:] if debug else argv)


if __name__ == "__main__":
    main()
