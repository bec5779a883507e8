"""The main job: train a tiny DeltaNet on the embedded corpus for about two minutes, generate from it, and show
what sets it apart: decoding costs the same after a long context as after a short one, with a memory of fixed size.

The corpus is the source of the running Python's standard library, read at run time, so nothing is downloaded. The
text is cut by a byte-level BPE of 2048 tokens trained on it (each token about three bytes: more text per step than
with byte tokens, for the same model). Prints the held-out bits per byte before and after training, streams a sample
from the saved model through 🤗 `pipeline("text-generation")`, then times one decoded token after a short and after a
long context, beside a 🤗 Llama of the same sizes (untrained: only its speed and cache are shown). A finished earlier
run in the same folder is replaced (`memlm train --overwrite`); an unfinished one with the same settings is resumed.
No progress bar is drawn when the output is not a terminal.

    python training/quickstart.py [--preset tiny-deltanet] [--output-dir runs/quickstart] [--steps N] [--prompt TEXT]
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer, pipeline
from transformers.utils import logging

from memlm.cli import script_main
from memlm.compat import output_cache, with_cache
from memlm.training import pretrain


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-deltanet", help=", ".join(pretrain.available_presets()))
    parser.add_argument("--output-dir", type=Path, default=Path("runs/quickstart"))
    parser.add_argument("--steps", type=pretrain.number_option(int, 1), default=900, help="training steps")
    parser.add_argument("--vocab-size", type=pretrain.number_option(int, 258), default=2048,
                        help="of the BPE tokenizer")  # fmt: skip
    parser.add_argument("--contexts", type=pretrain.number_option(int, 1), nargs=2, default=[64, 8192],
                        metavar=("SHORT", "LONG"), help="context lengths before the timed decoding")  # fmt: skip
    parser.add_argument("--max-bytes", type=pretrain.number_option(int, 1), default=4_000_000,
                        help="of the embedded corpus")  # fmt: skip
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=pretrain.number_option(int, 1), default=200)
    parser.add_argument("--seed", type=pretrain.number_option(int, 0, maximum=2**32 - 1), default=0)
    arguments = parser.parse_args(argv)
    if not sys.stderr.isatty():  # logs: no progress bars (🤗's loading and saving bars, the training bar)
        logging.disable_progress_bar()

    training = ["--preset", arguments.preset, "--output-dir", str(arguments.output_dir), "--seed", str(arguments.seed),
                "--max-bytes", str(arguments.max_bytes), "--tokenizer", "bpe", "--vocab-size",
                str(arguments.vocab_size), "--steps", str(arguments.steps),
                "--eval-every", str(max(1, arguments.steps // 3)), "--save-every", str(max(1, arguments.steps // 3))]  # fmt: skip
    if (arguments.output_dir / "metrics.json").is_file():  # a finished earlier quickstart: start over
        training.append("--overwrite")
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
    print_decoding_costs(model, arguments.contexts)
    return metrics


def carried_bytes(cache) -> int:
    """Bytes of the tensors a cache's layers hold (memlm's memories, a Transformer's keys and values)."""
    return sum(
        value.numel() * value.element_size()
        for layer in cache.layers
        for value in vars(layer).values()
        if isinstance(value, torch.Tensor)
    )


# Steps each turn of `decoding_costs` takes before timing its four: the first steps after another model's turn find
# the caches cold (1.5, 1.1, then 0.9 ms for DeltaNet after 🤗 Llama's 8192-token step on the 2-core machine).
UNTIMED_STEPS = 2


def decoding_costs(models: dict, contexts: list[int], tokens: int = 32) -> dict:
    """{(name, context): (milliseconds per decoded token, bytes carried after the context)} for greedy steps of each of
    `models` after a random context of each length. Every model and context takes turns, four timed steps at a time
    after two untimed ones, in an order shuffled every round, so that a machine that slows down for a while slows
    each of them alike and none pays more than the others for the turn before it (a Transformer's step after 8192
    tokens leaves the caches cold for the next model's first steps); the median of `tokens` steps each."""
    states = {}
    with torch.no_grad():
        for name, model in models.items():
            for context in contexts:
                generator = torch.Generator().manual_seed(0)
                input_ids = torch.randint(0, model.config.vocab_size, (1, context), generator=generator)
                outputs = model(input_ids, use_cache=True)
                cache = output_cache(outputs)  # its bytes after the context, before the timed steps add to it
                states[name, context] = [model, cache, outputs.logits[:, -1:].argmax(-1), [], carried_bytes(cache)]
        order = random.Random(0)
        for _ in range(tokens // 4):
            turns = list(states.values())
            order.shuffle(turns)  # a new order every round: none always follows the same one
            for state in turns:
                for step in range(UNTIMED_STEPS + 4):
                    model, cache, token, times, _ = state
                    start = time.perf_counter()
                    outputs = model(token, **with_cache(cache), use_cache=True)
                    if step >= UNTIMED_STEPS:
                        times.append(time.perf_counter() - start)
                    state[1], state[2] = output_cache(outputs), outputs.logits[:, -1:].argmax(-1)
    return {key: (1000 * statistics.median(times), carried) for key, (*_, times, carried) in states.items()}


def print_decoding_costs(model, contexts: list[int]):
    """One line per model: the time of a decoded token and the memory carried, after a short and a long context."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = model.config
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                         intermediate_size=config.intermediate_size,
                                         num_hidden_layers=config.num_hidden_layers,
                                         num_attention_heads=config.num_attention_heads,
                                         max_position_embeddings=max(contexts) + 64)).eval()  # fmt: skip
    short, long = contexts
    models = {"DeltaNet (trained above)": model.eval(), "🤗 Llama, same sizes (untrained)": llama}
    costs = decoding_costs(models, contexts)
    print(
        f"\none decoded token after {short} and after {long} tokens of context (median of 32, in turns, this machine):"
    )
    for name in models:
        (short_ms, short_bytes), (long_ms, long_bytes) = costs[name, short], costs[name, long]
        print(f"  {name}: {short_ms:.2f} → {long_ms:.2f} ms per token; memory carried {short_bytes / 1024:.0f} → "
              f"{long_bytes / 1024:.0f} KiB")  # fmt: skip


if __name__ == "__main__":
    script_main(main)  # bad input: one line and exit status 1 (--debug: the traceback)
