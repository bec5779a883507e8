"""The `memlm` command (train, finetune, generate, info) and training/finetune.py, run as a user would."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from memlm.cli import main as memlm_main
from memlm.training import finetune
from tests.training.test_pretrain import MODELS, SIZES, TEXT, TRAINING

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENT = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _memlm(*arguments) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memlm.cli", *arguments], env=ENVIRONMENT, capture_output=True,
                          text=True, check=True)  # fmt: skip


def _memlm_here(capsys, *arguments) -> str:
    """What `memlm ARGUMENTS` prints, run in this process (its own process costs ~10 s of imports here; the real
    command is run by `_memlm` where the process matters)."""
    capsys.readouterr()
    memlm_main(list(arguments))
    return capsys.readouterr().out


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
        # (in this process: `memlm train` itself runs as a command in test_train_options.py and the wheel check)
        memlm_main(
            [
                "train",
                "--preset",
                str(preset),
                "--output-dir",
                str(outputs[name]),
                "--data",
                str(folder / "corpus.txt"),
            ]
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


def test_generate_and_info_describe_a_saved_model(trained, capsys):
    result = _memlm("generate", str(trained["feedback"]), "--prompt", "def ", "--max-new-tokens", "10", "--greedy")
    assert result.stdout.startswith("def ") and len(result.stdout) > len("def ")
    assert "kernels run: torch: memlm's PyTorch step loop" in _memlm_here(capsys, "info", str(trained["feedback"]))
    info = _memlm_here(capsys, "info", str(trained["expire_span"]))
    assert "ExpireSpanConfig" in info and "parameters:" in info and "kernels: torch backend on cpu" in info
    assert "held-out bits per byte" in info
    assert "kernels run: torch: scaled_dot_product_attention with the expire-span mask" in info
    assert "kernels run: torch: memlm's PyTorch chunkwise" in _memlm_here(capsys, "info", str(trained["deltanet"]))


def test_bad_command_lines_give_clear_errors(tmp_path):
    unknown = subprocess.run([sys.executable, "-m", "memlm.cli", "translate"], env=ENVIRONMENT, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert unknown.returncode != 0 and "unknown command 'translate'" in unknown.stderr
    missing = subprocess.run([sys.executable, "-m", "memlm.cli", "info", str(tmp_path)], env=ENVIRONMENT,
                             capture_output=True, text=True)  # fmt: skip
    assert missing.returncode != 0 and "holds no config.json" in missing.stderr
    with pytest.raises(FileNotFoundError, match="is not a folder written by save_pretrained"):
        finetune.main(["--model", str(tmp_path / "nothing"), "--output-dir", str(tmp_path / "out")])


def test_finetune_warmup_and_batch_size_take_effect(trained, tmp_path):
    data = tmp_path / "tune.txt"
    data.write_text("fast weights remember; expired memories do not. " * 60)
    common = ["--model", str(trained["deltanet"]), "--data", str(data), "--length", "16", "--steps", "10",
              "--learning-rate", "0.01", "--eval-blocks", "2"]  # fmt: skip
    with warnings.catch_warnings():  # on a CPU the Trainer's data loader pins no memory (torch would warn)
        warnings.filterwarnings("error", message=".*pin_memory.*")
        runs = {
            name: finetune.main([*common, "--output-dir", str(tmp_path / name), *options])
            for name, options in {
                "plain": ["--batch-size", "2", "--warmup-steps", "0"],
                "warm": ["--batch-size", "2", "--warmup-steps", "8"],
                "wide": ["--batch-size", "4", "--warmup-steps", "0"],
            }.items()
        }
    # every step feeds batch × length tokens
    assert runs["plain"]["tokens_seen"] == 10 * 2 * 16 and runs["wide"]["tokens_seen"] == 10 * 4 * 16
    # warm-up: the learning rate is still climbing at step 1, where the cosine schedule without warm-up is near 0.01
    assert runs["warm"]["learning_rates"][1] < 0.3 * runs["plain"]["learning_rates"][1]
    assert runs["plain"]["learning_rates"][1] > 0.009


def test_generate_sampling_options_take_effect(trained, capsys):
    from memlm.cli import generate

    def sample(*options) -> str:
        generate([str(trained["expire_span"]), "--prompt", "def ", "--max-new-tokens", "24", *options])
        return capsys.readouterr().out

    greedy = sample("--greedy")
    assert sample("--seed", "3", "--temperature", "2.0") == sample("--seed", "3", "--temperature", "2.0")
    assert sample("--seed", "3", "--temperature", "2.0") != sample("--seed", "4", "--temperature", "2.0")
    # top-k 1 and a near-zero temperature both leave only the most likely token: sampling becomes greedy
    assert sample("--seed", "5", "--top-k", "1", "--temperature", "2.0") == greedy
    assert sample("--seed", "5", "--top-k", "258", "--temperature", "0.01") == greedy
    assert sample("--seed", "5", "--top-k", "258", "--temperature", "2.0") != greedy


def test_plot_memory_draws_spans_and_layer_weights(trained, tmp_path, capsys):
    spans = _memlm("plot-memory", str(trained["expire_span"]), "--text", "def f(x):\n    return x", "--output",
                   str(tmp_path / "spans.png"))  # fmt: skip
    assert "layer 1: mean span" in spans.stdout and (tmp_path / "spans.png").stat().st_size > 1000
    # in process: --text-file and --width (a narrower drawing of the same text is a taller, narrower picture)
    from PIL import Image

    from memlm.cli import plot_memory

    (tmp_path / "text.txt").write_text("def f(x):\n    return x")
    for width in ("8", "64"):
        plot_memory([str(trained["expire_span"]), "--text-file", str(tmp_path / "text.txt"), "--width", width,
                     "--output", str(tmp_path / f"width{width}.png")])  # fmt: skip
    narrow, wide = (Image.open(tmp_path / f"width{width}.png").size for width in ("8", "64"))
    assert narrow[0] < wide[0] and narrow[1] > wide[1]
    weights = _memlm_here(capsys, "plot-memory", str(trained["feedback"]), "--output", str(tmp_path / "weights.png"))
    values = [float(value) for value in weights.split("softmax(w): ")[1].splitlines()[0].split(", ")]
    assert len(values) == SIZES["num_hidden_layers"] + 1 and abs(sum(values) - 1) < 1e-2
    assert (tmp_path / "weights.png").stat().st_size > 1000
    for arguments, message in [
        ((str(trained["deltanet"]), "--output", str(tmp_path / "x.png")), "have no memory picture"),
        ((str(trained["expire_span"]), "--output", str(tmp_path / "x.png")), "needs --text or --text-file"),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            memlm_main(["plot-memory", *arguments])
        assert exit_info.value.code not in (0, None) and message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
