"""The `memlm` command (train, finetune, generate, info) and training/finetune.py, run as a user would."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memlm.training import finetune
from tests.training.test_pretrain import MODELS, SIZES, TEXT, TRAINING

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENT = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _memlm(*arguments) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memlm.cli", *arguments], env=ENVIRONMENT, capture_output=True,
                          text=True, check=True)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """A tiny pretrained checkpoint of each model, written by `memlm train`."""
    folder = tmp_path_factory.mktemp("cli")
    (folder / "corpus.txt").write_text(TEXT)
    outputs = {}
    for name, model in MODELS.items():
        preset = folder / f"{name}.json"
        preset.write_text(json.dumps({"model": {**model, **SIZES}, "training": {**TRAINING, "steps": 2}}))
        outputs[name] = folder / name
        _memlm(
            "train", "--preset", str(preset), "--output-dir", str(outputs[name]), "--data", str(folder / "corpus.txt")
        )
    return outputs


@pytest.mark.parametrize("name", list(MODELS))
def test_finetune_with_the_trainer_lowers_the_held_out_loss(trained, tmp_path, name):
    data = tmp_path / "tune.txt"
    data.write_text("the delta rule writes what the memory does not yet know. " * 80)
    metrics = finetune.main(["--model", str(trained[name]), "--output-dir", str(tmp_path / "tuned"), "--data",
                             str(data), "--length", "32", "--steps", "20", "--learning-rate", "0.01",
                             "--eval-blocks", "4", "--batch-size", "4"])  # fmt: skip
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"]
    assert (
        json.loads((tmp_path / "tuned" / "metrics.json").read_text())["eval_loss_after"] == metrics["eval_loss_after"]
    )
    assert (tmp_path / "tuned" / "model.safetensors").is_file() and (tmp_path / "tuned" / "tokenizer.json").is_file()


def test_generate_and_info_describe_a_saved_model(trained):
    result = _memlm("generate", str(trained["feedback"]), "--prompt", "def ", "--max-new-tokens", "10", "--greedy")
    assert result.stdout.startswith("def ") and len(result.stdout) > len("def ")
    info = _memlm("info", str(trained["expire_span"])).stdout
    assert "ExpireSpanConfig" in info and "parameters:" in info and "kernels: torch backend on cpu" in info
    assert "held-out bits per byte" in info


def test_bad_command_lines_give_clear_errors(tmp_path):
    unknown = subprocess.run([sys.executable, "-m", "memlm.cli", "serve"], env=ENVIRONMENT, capture_output=True,
                             text=True)  # fmt: skip
    assert unknown.returncode != 0 and "unknown command 'serve'" in unknown.stderr
    missing = subprocess.run([sys.executable, "-m", "memlm.cli", "info", str(tmp_path)], env=ENVIRONMENT,
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode != 0 and "holds no config.json" in missing.stderr
    with pytest.raises(FileNotFoundError, match="is not a folder written by save_pretrained"):
        finetune.main(["--model", str(tmp_path / "nothing"), "--output-dir", str(tmp_path / "out")])
