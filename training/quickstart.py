"""The main job: train a tiny DeltaNet on the embedded corpus for a few minutes, then generate from it.

The corpus is the source of the running Python's standard library, read at run time, so nothing is downloaded.
Prints the held-out bits per byte before and after training, then streams a sample from the saved model through
🤗 `pipeline("text-generation")`. A finished earlier run in the same folder is replaced (`memlm train --overwrite`);
an unfinished one with the same settings is resumed. No progress bar is drawn when the output is not a terminal.

    python training/quickstart.py [--preset tiny-deltanet] [--output-dir runs/quickstart] [--steps N] [--prompt TEXT]
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer, pipeline
from transformers.utils import logging

from memlm.cli import script_main
from memlm.training import pretrain


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-deltanet", help=", ".join(pretrain.available_presets()))
    parser.add_argument("--output-dir", type=Path, default=Path("runs/quickstart"))
    parser.add_argument("--steps", type=pretrain.number_option(int, 1), default=None,
                        help="training steps (default: the preset's)")  # fmt: skip
    parser.add_argument("--max-bytes", type=pretrain.number_option(int, 1), default=4_000_000,
                        help="of the embedded corpus")  # fmt: skip
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=pretrain.number_option(int, 1), default=200)
    parser.add_argument("--seed", type=pretrain.number_option(int, 0, maximum=2**32 - 1), default=0)
    arguments = parser.parse_args(argv)
    if not sys.stderr.isatty():  # logs: no progress bars (🤗's loading and saving bars, the training bar)
        logging.disable_progress_bar()

    training = ["--preset", arguments.preset, "--output-dir", str(arguments.output_dir), "--seed", str(arguments.seed),
                "--max-bytes", str(arguments.max_bytes)]  # fmt: skip
    if (arguments.output_dir / "metrics.json").is_file():  # a finished earlier quickstart: start over
        training.append("--overwrite")
    if arguments.steps is not None:
        training += ["--steps", str(arguments.steps)]
    metrics = pretrain.main(training)
    before, after = metrics["eval_before"], metrics["eval_after"]
    print(
        f"\n{metrics['model_type']} with {metrics['parameters'] / 1e6:.2f}M parameters, {metrics['steps']} steps in "
        f"{metrics['training_seconds_this_run']:.0f} s; held-out bits per byte "
        f"{before['bits_per_byte']:.3f} before → {after['bits_per_byte']:.3f} after training"
    )

    torch.manual_seed(arguments.seed)
    tokenizer = AutoTokenizer.from_pretrained(arguments.output_dir)
    model = AutoModelForCausalLM.from_pretrained(arguments.output_dir)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    print(f"\nsample from {arguments.output_dir} (prompt {arguments.prompt!r}):\n")
    start = time.perf_counter()
    result = generator(arguments.prompt, max_new_tokens=arguments.max_new_tokens, do_sample=True, top_k=20,
                       temperature=0.8, streamer=TextStreamer(tokenizer), return_tensors=True)  # fmt: skip
    seconds = time.perf_counter() - start
    new_tokens = len(result[0]["generated_token_ids"]) - len(tokenizer(arguments.prompt)["input_ids"])
    print(f"\n{new_tokens} tokens in {seconds:.2f} s = {new_tokens / seconds:.1f} tokens/s")
    return metrics


if __name__ == "__main__":
    script_main(main)  # bad input: one line and exit status 1 (--debug: the traceback)
