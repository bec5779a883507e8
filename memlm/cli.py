"""The `memlm` command.

memlm train --preset tiny-deltanet --output-dir runs/tiny      pretrain (see memlm.training.pretrain)
memlm finetune --model runs/tiny --output-dir runs/tuned ...    fine-tune with the 🤗 Trainer
memlm generate runs/tiny --prompt "def "                        stream text from a saved model
memlm info runs/tiny                                            what a checkpoint is
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


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("train", "finetune", "generate", "info")
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
    else:
        parser = argparse.ArgumentParser(prog="memlm info", description="Describe a saved checkpoint.")
        parser.add_argument("model")
        print("\n".join(describe(parser.parse_args(rest).model)))


if __name__ == "__main__":
    main()
