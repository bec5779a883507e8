"""Writes the tiny checkpoints of this folder: one model of each family with seeded random weights, saved by
`save_pretrained` (config.json and model.safetensors kept; the code bundle is left out), and the logits of fixed
inputs (logits.safetensors). They were written by memlm at commit 3a1695e, before the block layout options (issue
30), so that tests/modeling/test_old_checkpoints.py checks that checkpoints of that memlm load with the same logits.

Usage (with the memlm to record on the path):  python tests/data/checkpoints_before_block_layout/make.py
"""

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import memlm

HERE = Path(__file__).resolve().parent
SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}
CONFIGS = {
    "deltanet": lambda: memlm.DeltaNetConfig.from_preset("paper", chunk_size=8, **SIZES),
    "deltanet_fla": lambda: memlm.DeltaNetConfig.from_preset("fla", chunk_size=8, **SIZES),
    "expire_span": lambda: memlm.ExpireSpanConfig(max_span=16, ramp=4, block_size=8, **SIZES),
    "feedback_transformer": lambda: memlm.FeedbackTransformerConfig(memory_span=8, **SIZES),
}
INPUT_IDS = torch.arange(2 * 13).reshape(2, 13) * 7 % 64


def main():
    logits = {}
    for name, make_config in CONFIGS.items():
        torch.manual_seed(0)
        config = make_config()
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for parameter in model.parameters():  # norms start at 1: move every weight off its initial value
                parameter.add_(torch.randn_like(parameter) * 0.1)
        model.eval()
        folder = HERE / name
        model.save_pretrained(folder)
        for path in folder.iterdir():
            if path.name not in ("config.json", "model.safetensors"):
                path.unlink()
        with torch.no_grad():
            logits[name] = model(input_ids=INPUT_IDS).logits.contiguous()
    save_file(logits, HERE / "logits.safetensors")


if __name__ == "__main__":
    main()
