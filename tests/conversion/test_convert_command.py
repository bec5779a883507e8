"""`memlm convert transformer-sequential` on checkpoint files as the official trainer writes them, for both of the
code base's models (Expire-Span and the Feedback Transformer), in a real subprocess: the folder it writes loads with
the Auto classes and gives the official log-probabilities; what memlm cannot express ends in one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import memlm  # noqa: F401  (registers memlm's classes)
from tests.tolerances import OFFICIAL_FLOAT64

REFERENCE = Path(__file__).resolve().parents[2].parent / "shared" / "official-reference" / "transformer-sequential"
CASES = ["expire_span_enwik8_small", "feedback_enwik8", "feedback_postnorm_shared_kv"]
TOLERANCE = OFFICIAL_FLOAT64  # absolute, float64, recorded by the official code elsewhere (tests/tolerances.py)

pytestmark = pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"no reference data in {REFERENCE}")


def official_checkpoint(case: str, folder: Path) -> tuple[dict, dict]:
    """utils/checkpoint.py save(): the DistributedDataParallel model's state dict (names under `module.`) and more."""
    meta = json.loads((REFERENCE / f"{case}.json").read_text(encoding="utf-8"))
    tensors = load_file(REFERENCE / f"{case}.safetensors")
    official = {
        name.removeprefix("official."): value for name, value in tensors.items() if name.startswith("official.")
    }
    checkpoint = {
        "epoch": 1,
        "model": {f"module.{name}": value for name, value in official.items()},
        "scheduler_epoch": 1,
    }
    torch.save(checkpoint, folder / "checkpoint.pt")
    (folder / "args.json").write_text(json.dumps(meta["official_args"]), encoding="utf-8")
    return meta, tensors


def convert(folder: Path, *arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "memlm.cli", "convert", "transformer-sequential", *arguments]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", CASES)
def test_memlm_convert_transformer_sequential_gives_the_official_log_probabilities(case, tmp_path):
    meta, tensors = official_checkpoint(case, tmp_path)
    result = convert(tmp_path, "checkpoint.pt", "converted", "--official-args", "args.json")
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    assert model.dtype == torch.float64
    assert type(model).__name__ == ("FeedbackTransformerForCausalLM" if case.startswith("feedback") else
                                    "ExpireSpanForCausalLM")  # fmt: skip
    length = meta["official_args"]["mem_sz"]
    cache, log_probs = None, []
    with torch.no_grad():
        for start in range(0, 2 * length, length):
            output = model(input_ids=tensors["input_ids"][:, start : start + length], cache=cache, use_cache=True)
            cache = output.cache
            log_probs.append(output.logits.log_softmax(-1))
    expected = tensors["log_probs"][:, : 2 * length]
    assert (torch.cat(log_probs, dim=1) - expected).abs().max() <= TOLERANCE


def test_the_feedback_sizes_come_from_the_checkpoint_and_a_refusal_is_one_line(tmp_path):
    meta, tensors = official_checkpoint("feedback_enwik8", tmp_path)
    # Without --official-args: the sizes (heads, head width, attn_lim) are the weights'; the rest main.py's defaults,
    # here the adaptive span's ramp, which the reference sets: so the same architecture, other settings.
    result = convert(tmp_path, "checkpoint.pt", "sized")
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((tmp_path / "sized" / "config.json").read_text())
    arguments = meta["official_args"]
    assert (config["num_attention_heads"], config["head_dim"], config["memory_span"]) == (
        arguments["nheads"], arguments["head_dim"], arguments["attn_lim"]
    )  # fmt: skip
    assert config["adaptive_span"] is True
    (tmp_path / "layer_span.json").write_text(json.dumps({**arguments, "adapt_span_layer": True}), encoding="utf-8")
    refused = convert(tmp_path, "checkpoint.pt", "refused", "--official-args", "layer_span.json")
    assert refused.returncode == 1 and "--adapt-span-layer" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "refused").exists()
