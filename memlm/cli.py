"""The `memlm` command.

memlm train --preset tiny-deltanet --output-dir runs/tiny      pretrain (see memlm.training.pretrain)
memlm finetune --model runs/tiny --output-dir runs/tuned ...    fine-tune with the 🤗 Trainer
memlm generate runs/tiny --prompt "def "                        stream text from a saved model
memlm info runs/tiny                                            what a checkpoint is
memlm plot-memory runs/tiny --text "..." --output memory.png     what an Expire-Span / Feedback model remembers
"""

import argparse
import json
import math
import sys
from pathlib import Path


def generate(argv) -> None:
    parser = argparse.ArgumentParser(prog="memlm generate", description="Stream text from a saved model.")
    parser.add_argument("model", help="a folder written by save_pretrained")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer, pipeline

    import memlm  # noqa: F401

    torch.manual_seed(arguments.seed)
    tokenizer = AutoTokenizer.from_pretrained(arguments.model)
    model = AutoModelForCausalLM.from_pretrained(arguments.model)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    options = {"do_sample": False} if arguments.greedy else {
        "do_sample": True, "temperature": arguments.temperature, "top_k": arguments.top_k
    }  # fmt: skip
    generator(arguments.prompt or tokenizer.bos_token, max_new_tokens=arguments.max_new_tokens,
              streamer=TextStreamer(tokenizer), **options)  # fmt: skip


def describe(path: str) -> list[str]:
    """What a checkpoint folder holds: model, size, memory settings, and the kernel backend it would run."""
    import torch
    from transformers import AutoConfig

    import memlm  # noqa: F401
    from memlm.kernels import resolve_backend

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{path!r} holds no config.json: not a folder written by save_pretrained.")
    config = AutoConfig.from_pretrained(folder)
    lines = [f"{folder}: {type(config).__name__} (model_type {config.model_type})"]
    weights = sorted(folder.glob("*.safetensors"))
    if weights:
        from safetensors import safe_open

        count = 0
        for file in weights:
            with safe_open(str(file), framework="pt") as handle:
                count += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
        lines.append(f"parameters: {count:,} in {', '.join(file.name for file in weights)}")
    lines += [f"- {line}" for line in config.describe()] if hasattr(config, "describe") else []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines.append(
        f"kernels: {resolve_backend(None, torch.device(device))} backend on {device} (MEMLM_KERNELS overrides)"
    )
    if (folder / "metrics.json").is_file():
        metrics = json.loads((folder / "metrics.json").read_text())
        after = metrics.get("eval_after")
        if after:
            lines.append(f"held-out bits per byte: {after['bits_per_byte']:.3f} after {metrics.get('steps')} steps")
    if (folder / "tokenizer.json").is_file():
        lines.append("tokenizer: saved beside the model")
    return lines


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
    parser.add_argument("--width", type=int, default=64, help="Expire-Span: characters per line of the drawing")
    arguments = parser.parse_args(argv)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import memlm  # noqa: F401
    from memlm.visualization import plot_expire_spans, plot_feedback_layer_weights

    if not (Path(arguments.model) / "config.json").is_file():
        raise SystemExit(
            f"memlm plot-memory: {arguments.model!r} holds no config.json (not a save_pretrained folder)."
        )
    model_type = AutoConfig.from_pretrained(arguments.model).model_type
    if model_type == "memlm_expire_span":
        if arguments.text is None and arguments.text_file is None:
            raise SystemExit("memlm plot-memory: an Expire-Span model needs --text or --text-file.")
        text = arguments.text if arguments.text is not None else Path(arguments.text_file).read_text()
        model = AutoModelForCausalLM.from_pretrained(arguments.model)
        tokenizer = AutoTokenizer.from_pretrained(arguments.model)
        spans = plot_expire_spans(model, tokenizer, text, arguments.output, width=arguments.width)
        for layer, layer_spans in enumerate(spans, start=1):
            print(f"layer {layer}: mean span {float(layer_spans.mean()):.1f} tokens, "
                  f"longest {float(layer_spans.max()):.1f} (max_span {model.config.max_span})")  # fmt: skip
    elif model_type == "memlm_feedback_transformer":
        weights = plot_feedback_layer_weights(AutoModelForCausalLM.from_pretrained(arguments.model), arguments.output)
        print("memory weights softmax(w): " + ", ".join(f"{weight:.3f}" for weight in weights.tolist()))
    else:
        raise SystemExit(
            f"memlm plot-memory: {model_type!r} models have no memory picture; it draws memlm_expire_span and "
            "memlm_feedback_transformer models."
        )
    print(f"wrote {arguments.output}")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("train", "finetune", "generate", "info", "plot-memory")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            raise SystemExit(f"memlm: unknown command {argv[0]!r}; choose one of {', '.join(commands)}.")
        return
    command, rest = argv[0], argv[1:]
    if command == "train":
        from memlm.training.pretrain import main as train

        train(rest)
    elif command == "finetune":
        from memlm.training.finetune import main as finetune

        finetune(rest)
    elif command == "generate":
        generate(rest)
    elif command == "plot-memory":
        plot_memory(rest)
    else:
        parser = argparse.ArgumentParser(prog="memlm info", description="Describe a saved checkpoint.")
        parser.add_argument("model")
        print("\n".join(describe(parser.parse_args(rest).model)))


if __name__ == "__main__":
    main()
