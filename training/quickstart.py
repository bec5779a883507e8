"""The main job for now: build a small DeltaNet, generate from a prompt, print the text and the speed.

The model is freshly initialised (the training scripts come later), so the text is noise; what this shows is the
🤗 workflow (config preset → model → tokenizer → generate) and that decoding cost does not grow with the context.

    python training/quickstart.py [--preset paper|fla] [--prompt TEXT] [--max-new-tokens N]
"""

import argparse
import time

import torch

from memlm import DeltaNetConfig, DeltaNetForCausalLM
from memlm.tokenization import byte_level_tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["paper", "fla"], default="paper")
    parser.add_argument("--prompt", default="Linear Transformers are secretly fast weight programmers.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args()

    torch.manual_seed(arguments.seed)
    tokenizer = byte_level_tokenizer()
    config = DeltaNetConfig.from_preset(
        arguments.preset, vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = DeltaNetForCausalLM(config).eval()
    parameters = sum(parameter.numel() for parameter in model.parameters())
    print(
        f"DeltaNet ({arguments.preset} preset): {parameters / 1e6:.2f}M parameters, "
        f"{config.num_hidden_layers} layers, memory per layer {config.num_attention_heads} × "
        f"{config.feature_dim} × {config.value_head_dim} fast weights"
    )

    inputs = tokenizer(arguments.prompt, return_tensors="pt")
    with torch.no_grad():
        start = time.perf_counter()
        prefill = model(**inputs, use_cache=True)
        prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        output = model.generate(
            **inputs,
            max_new_tokens=arguments.max_new_tokens,
            min_new_tokens=arguments.max_new_tokens,
            do_sample=True,
            top_k=50,
        )
        generate_seconds = time.perf_counter() - start
    new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
    print(f"prompt: {arguments.prompt!r}")
    print(f"generated (untrained model, so noise): {tokenizer.decode(output[0, -new_tokens:])!r}")
    print(
        f"prefill: {inputs['input_ids'].shape[1]} tokens in {prefill_seconds * 1e3:.1f} ms; "
        f"generate: {new_tokens} tokens in {generate_seconds:.2f} s = {new_tokens / generate_seconds:.1f} tokens/s"
    )
    print(
        f"cache after the prompt: {prefill.past_key_values.get_seq_length()} tokens seen, "
        f"{sum(layer.fast_weights.numel() for layer in prefill.past_key_values.layers) * 4 / 1024:.0f} KiB "
        "of fast weights (the same at any context length)"
    )


if __name__ == "__main__":
    main()
