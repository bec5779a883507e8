"""FSDP2 on CPU: two gloo processes shard each memlm model as Accelerate's TRANSFORMER_BASED_WRAP does, and the
gradients they compute together equal one process's on the whole batch.

Accelerate cannot launch FSDP on a CPU (`ACCELERATE_USE_CPU=1` turns the FSDP config into plain multi-CPU data
parallel), so the worker calls `fully_shard` itself, on the units Accelerate would pick from `_no_split_modules`.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memlm import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    ExpireSpanConfig,
    ExpireSpanForCausalLM,
    FeedbackTransformerConfig,
    FeedbackTransformerForCausalLM,
)

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"vocab_size": 16, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 64}  # fmt: skip


def build_models() -> dict:
    """One tiny model of each kind, the same weights on every call."""
    builders = {
        "deltanet": lambda: DeltaNetForCausalLM(DeltaNetConfig(**SIZES, chunk_size=8)),
        # blocks of 8 over 16 tokens: the second block reads (and prunes) the first block's memories
        "expire_span": lambda: ExpireSpanForCausalLM(ExpireSpanConfig(**SIZES, max_span=16, ramp=4, block_size=8)),
        "feedback": lambda: FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**SIZES, memory_span=8)),
    }
    models = {}
    for name, build in builders.items():
        torch.manual_seed(0)
        models[name] = build()
    return models


def fixed_batch() -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_fsdp_two_processes_give_the_gradients_of_one(tmp_path):
    output = tmp_path / "gradients.pt"
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # --standalone: the rendezvous takes a free port (a fixed one failed once when it was still held).
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(ROOT / "tests" / "training" / "fsdp_worker.py"), str(output)], env=environment,
                         capture_output=True, text=True, timeout=420)  # fmt: skip
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-4000:]
    # A view among a wrapped layer's outputs loses FSDP's pre-backward hook to an in-place operation (DeltaNet's state).
    assert "returned a view tensor" not in run.stderr, run.stderr[-4000:]
    sharded = torch.load(output)
    batch = fixed_batch()
    for name, model in build_models().items():
        model(input_ids=batch, labels=batch).loss.backward()
        assert set(sharded[name]) == {key for key, _ in model.named_parameters()}
        for key, parameter in model.named_parameters():
            # each rank's loss is the mean over its half; FSDP averages the ranks: the mean over the whole batch
            torch.testing.assert_close(sharded[name][key], parameter.grad, rtol=1e-4, atol=1e-6, msg=f"{name}.{key}")
