"""The task registry and the two task commands (training/tasks/make_dataset.py and train_task.py), run as a user
would: real subprocesses, real save_to_disk folders, a saved model loaded back with the Auto classes."""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, AutoTokenizer

from memlm.training.tasks import TASKS, task
from memlm.training.tasks.commands import build_model, make_dataset, train_task
from memlm.training.tasks.common import evaluate_accuracy, solver_accuracy

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENT = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_builds_a_solvable_dataset_with_its_tokenizer(name):
    chosen = task(name)
    options = chosen.options()
    dataset = chosen.dataset(8, **options)
    assert {"input_ids", "labels"} <= set(dataset.column_names) and len(dataset) >= 8
    assert solver_accuracy(dataset, chosen.solver_for(**options)) == 1.0
    tokenizer = chosen.tokenizer_for(**options)
    largest = max(max(row) for row in list(dataset["input_ids"]) + list(dataset["labels"]))
    assert largest < len(tokenizer)
    text = tokenizer.decode(dataset[0]["input_ids"])
    assert tokenizer(text).input_ids == dataset[0]["input_ids"]


@pytest.mark.parametrize("name", list(TASKS))
def test_make_dataset_with_no_options_uses_the_defaults(name, tmp_path):
    """`make_dataset.py TASK` alone builds the dataset, its tokenizer and solver from the generator's defaults (the
    tokenizer and the solver used to get only the options given on the command line)."""
    folder = make_dataset([name, "--output-dir", str(tmp_path), "--train", "8", "--validation", "4", "--test", "4"])
    chosen = task(name)
    dataset = load_from_disk(str(folder))["train"]
    assert solver_accuracy(dataset, chosen.solver_for()) == 1.0
    assert len(AutoTokenizer.from_pretrained(folder / "tokenizer")) == len(chosen.tokenizer_for())


def test_unknown_task_and_option_are_named():
    with pytest.raises(ValueError, match="Unknown task 'copy'; the tasks are: associative-retrieval"):
        task("copy")
    with pytest.raises(ValueError, match="max_length=200"):
        make_dataset(["corridor", "--output-dir", "unused", "--option", "longest=3"])
    with pytest.raises(ValueError, match="is not KEY=VALUE with a KEY of the corridor task"):
        make_dataset(
            ["corridor", "--output-dir", "unused", "--option", "seed=3"]
        )  # the splits' seeds come from --seed


def test_make_dataset_then_train_task_then_load(tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(ROOT / "training" / "tasks" / "make_dataset.py"), "associative-retrieval",
                    "--output-dir", str(data), "--train", "64", "--validation", "16", "--test", "16", "--option",
                    "setting=2", "--option", "num_keys=4", "--option", "num_pairs=6"], env=ENVIRONMENT, check=True,
                   capture_output=True)  # fmt: skip
    described = json.loads((data / "task.json").read_text())
    assert described["options"] == {"setting": 2, "num_keys": 4, "num_pairs": 6}
    splits = load_from_disk(str(data))
    assert [len(splits[split]) for split in ("train", "validation", "test")] == [64, 16, 16]
    assert list(splits["train"]["input_ids"])[:16] != list(splits["validation"]["input_ids"])
    metrics = train_task(["--data", str(data), "--model", "deltanet", "--output-dir", str(tmp_path / "run"),
                          "--steps", "3", "--batch-size", "8", "--config", '{"short_convolution": true}'])  # fmt: skip
    assert metrics["config"] == {"short_convolution": True} and len(metrics["losses"]) == 3
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    assert model.config.short_convolution and model.config.vocab_size == len(
        AutoTokenizer.from_pretrained(data / "tokenizer")
    )
    assert evaluate_accuracy(model, splits["validation"]) == metrics["validation_after"]
    with pytest.raises(ValueError, match="--config must be a JSON object"):
        train_task(["--data", str(data), "--model", "llama", "--output-dir", str(tmp_path / "x"), "--config", "[1]"])
    with pytest.raises(FileNotFoundError, match="holds no task.json"):
        train_task(["--data", str(tmp_path), "--model", "llama", "--output-dir", str(tmp_path / "x")])


@pytest.mark.parametrize("kind", ["deltanet", "expire-span", "feedback", "llama"])
def test_build_model_applies_the_overrides(kind):
    model = build_model(kind, vocab_size=12, overrides={"hidden_size": 32, "num_attention_heads": 2})
    assert model.config.vocab_size == 12 and model.config.hidden_size == 32 and model.config.pad_token_id == 0


def _tiny_retrieval(count: int, seed: int = 0):
    return task("associative-retrieval").dataset(count, setting=2, num_keys=4, num_pairs=6, seed=seed)


@pytest.mark.parametrize(
    "option",
    [{"learning_rate": 3e-2}, {"warmup_steps": 3}, {"weight_decay": 0.5}, {"max_grad_norm": 1e-3},
     {"batch_size": 4}, {"seed": 1}],
)  # fmt: skip
def test_every_training_option_changes_the_trained_weights(option):
    from memlm.training.tasks.common import train_on_task

    data = _tiny_retrieval(32)

    def trained(**options):
        torch.manual_seed(0)
        model = build_model("deltanet", vocab_size=9, overrides={"hidden_size": 16, "num_attention_heads": 2})
        train_on_task(model, data, steps=4, **{"batch_size": 8, "learning_rate": 1e-2, **options})
        return torch.cat([parameter.detach().flatten() for parameter in model.parameters()])

    assert torch.equal(trained(), trained())  # deterministic, so a difference is the option's doing
    assert not torch.allclose(trained(), trained(**option))


def test_train_task_and_make_dataset_pass_their_options_on(tmp_path):
    for seed in ("0", "1"):
        make_dataset(["corridor", "--output-dir", str(tmp_path / seed), "--train", "16", "--validation", "4",
                      "--test", "4", "--seed", seed, "--option", "max_length=6"])  # fmt: skip
    first, second = (load_from_disk(str(tmp_path / seed)) for seed in ("0", "1"))
    assert list(first["train"]["input_ids"]) != list(second["train"]["input_ids"])

    def losses(*options) -> list[float]:
        return train_task(["--data", str(tmp_path / "0"), "--model", "llama", "--output-dir", str(tmp_path / "run"),
                           "--steps", "3", "--batch-size", "4", "--warmup-steps", "0", *options])["losses"]  # fmt: skip

    baseline = losses()
    assert losses() == baseline
    for options in (["--learning-rate", "0.03"], ["--warmup-steps", "2"], ["--batch-size", "8"], ["--seed", "1"]):
        assert losses(*options) != baseline, options


def test_across_seeds_summarises_and_formats():
    from memlm.training.tasks.common import across_seeds, format_across_seeds

    summary = across_seeds([0.5, 1.0, 0.75])
    assert summary == {"mean": 0.75, "low": 0.5, "high": 1.0, "values": [0.5, 1.0, 0.75]}
    assert format_across_seeds(summary, ".1%") == "75.0% (50.0%–100.0%)"
    assert format_across_seeds(across_seeds([0.25])) == "0.250"
    with pytest.raises(ValueError, match="at least one value"):
        across_seeds([])


def test_seeds_problem_names_negative_and_repeated_seeds():
    from memlm.training.tasks.common import seeds_problem

    assert seeds_problem([0, 1, 2]) is None
    assert seeds_problem([3, -1, 3]) == (
        "--seeds must be distinct non-negative integers, got [3, -1, 3] (negative [-1], repeated [3])"
    )


@pytest.mark.parametrize(
    ("script", "arguments", "message"),
    [
        ("tasks/train_task.py", ["--data", "/nonexistent", "--model", "deltanet", "--output-dir", "/tmp/unused"],
         "train_task.py: error: --data '/nonexistent' holds no task.json: write it with make_dataset.py."),
        ("tasks/make_dataset.py", ["far-copy", "--output-dir", "/tmp/unused", "--option", "no_such_option=1"],
         "make_dataset.py: error: --option 'no_such_option=1' is not KEY=VALUE with a KEY of the far-copy task"),
        ("finetune.py", ["--model", "/nonexistent", "--output-dir", "/tmp/unused", "--data", "/nonexistent"],
         "finetune.py: error: --model '/nonexistent' is not a folder written by save_pretrained."),
        ("train.py", ["--preset", "no-such-preset", "--output-dir", "/tmp/unused"],
         "train.py: error: Unknown preset 'no-such-preset'"),
    ],
)  # fmt: skip
def test_the_scripts_say_bad_input_in_one_line_and_show_the_traceback_with_debug(
    script, arguments, message, monkeypatch
):
    command = [sys.executable, str(ROOT / "training" / script)]
    result = subprocess.run(command + arguments, env=ENVIRONMENT, capture_output=True, text=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr
    # --debug: the script, run as __main__ in this process (a second process costs ~10 s of imports here), lets the
    # error itself through (its traceback) instead of the one line and SystemExit
    monkeypatch.setattr(sys, "argv", [str(ROOT / "training" / script), "--debug", *arguments])
    with pytest.raises(Exception, match=re.escape(message.split(": error: ", 1)[1])):
        runpy.run_path(str(ROOT / "training" / script), run_name="__main__")
