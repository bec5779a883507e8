"""How fast is the Feedback Transformer next to a same-size 🤗 Llama (SDPA attention) on this machine?

Prints one side-by-side table, all measured in this one process:

- training throughput: tokens/s of forward + backward + optimizer-free step on a batch of B=32 sequences of T=256
  tokens (the Feedback Transformer runs its step loop over the 256 positions, Llama runs in parallel);
- decoding throughput: tokens/s of greedy steps (batch 1) after a prefill of 512 and of 2048 tokens;
- cache bytes per token: the Feedback cache holds one key/value set for all layers (shared projections), Llama's
  one per layer.

Both models: hidden 256, 4 layers, 4 heads, gated MLP of width 768, byte vocabulary; the Feedback memory span
τ = 2048 so both see the whole context. Times are medians of `--repeats` runs after a warm-up.

    python benchmarks/feedback.py [--json results.json]
"""

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memlm import FeedbackTransformerConfig, FeedbackTransformerForCausalLM
from memlm.compat import cache_keyword, output_cache

SIZES = {"vocab_size": 258, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 4}  # fmt: skip
DECODE_CONTEXTS = (512, 2048)


def build_models():
    torch.manual_seed(0)
    feedback = FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**SIZES, memory_span=2048))
    llama = LlamaForCausalLM(LlamaConfig(**SIZES, max_position_embeddings=4096, attn_implementation="sdpa"))
    return {"feedback": feedback, "llama": llama}


def median_seconds(function, repeats: int) -> float:
    function()  # warm-up
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def training_tokens_per_second(model, batch_size: int, length: int, repeats: int) -> float:
    model.train()
    tokens = torch.randint(0, 258, (batch_size, length), generator=torch.Generator().manual_seed(0))

    def step():
        model.zero_grad(set_to_none=True)
        model(tokens, labels=tokens).loss.backward()

    return batch_size * length / median_seconds(step, repeats)


def decode_tokens_per_second(model, context: int, steps: int, repeats: int) -> tuple[float, int]:
    model.eval()
    prompt = torch.randint(0, 258, (1, context), generator=torch.Generator().manual_seed(1))
    cache_argument = cache_keyword(model)  # `cache`, or `past_key_values` before 🤗 5.24
    with torch.no_grad():
        cache = output_cache(model(prompt, use_cache=True, logits_to_keep=1))

        def run():
            nonlocal cache
            token = prompt[:, -1:]
            for _ in range(steps):
                output = model(token, use_cache=True, logits_to_keep=1, **{cache_argument: cache})
                cache = output_cache(output)
                token = output.logits[:, -1:].argmax(-1)

        seconds = median_seconds(run, repeats)
    return steps / seconds, cache


def cache_bytes(cache) -> int:
    if hasattr(cache, "memory_bytes"):
        return cache.memory_bytes()
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    models = build_models()
    results = {}
    for name, model in models.items():
        row = {"train_tokens_per_s": training_tokens_per_second(model, args.batch_size, args.length, args.repeats)}
        for context in DECODE_CONTEXTS:
            speed, cache = decode_tokens_per_second(model, context, args.decode_steps, args.repeats)
            row[f"decode_{context}_tokens_per_s"] = speed
            if context == DECODE_CONTEXTS[-1]:
                # The Feedback ring holds τ slots; Llama holds every token seen: per token of context.
                seen = cache.get_seq_length()
                slots = model.config.memory_span if name == "feedback" else seen
                row["cache_bytes_per_token"] = cache_bytes(cache) / slots
        results[name] = row
    feedback, llama = results["feedback"], results["llama"]
    columns = (
        ["train_tokens_per_s"] + [f"decode_{c}_tokens_per_s" for c in DECODE_CONTEXTS] + ["cache_bytes_per_token"]
    )
    headers = [f"training tokens/s (B={args.batch_size}, T={args.length})"] + [
        f"decode tokens/s at {c}" for c in DECODE_CONTEXTS
    ] + ["cache bytes/token"]  # fmt: skip
    print(f"\n{'':28}{'Feedback':>14}{'Llama (sdpa)':>14}{'ratio':>10}")
    for column, header in zip(columns, headers):
        print(f"{header:28}{feedback[column]:14.1f}{llama[column]:14.1f}{feedback[column] / llama[column]:10.2f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"settings": vars(args), "results": results}, file, indent=2)
    return results


if __name__ == "__main__":
    main()
