"""The Expire-Span tasks (far copy, corridor): deterministic, balanced, solvable by brute force and not by a wrong
solver, options validated, tokenizers round-trip; and `benchmarks/paper_expire_span.py --smoke` runs end to end over
two seeds, its summaries being those seeds' values."""

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from memlm.training.tasks.common import IGNORE, solver_accuracy
from memlm.training.tasks.corridor import corridor_dataset, corridor_symbols, corridor_tokenizer, solve_corridor
from memlm.training.tasks.far_copy import (
    END,
    QUERY,
    A,
    B,
    far_copy_dataset,
    far_copy_symbols,
    far_copy_tokenizer,
    solve_far_copy,
)

ROOT = Path(__file__).resolve().parents[2]


def rows(dataset) -> list[dict]:
    return [dataset[index] for index in range(len(dataset))]


# Far copy ------------------------------------------------------------------------------------------------------------


def test_far_copy_is_deterministic_per_seed():
    first = far_copy_dataset(40, max_count=3, min_gap=2, max_gap=9, seed=5)
    assert rows(first) == rows(far_copy_dataset(40, max_count=3, min_gap=2, max_gap=9, seed=5))
    assert rows(first) != rows(far_copy_dataset(40, max_count=3, min_gap=2, max_gap=9, seed=6))


def test_far_copy_layout_counts_and_gaps():
    dataset = far_copy_dataset(103, max_count=4, min_gap=3, max_gap=7, seed=0)
    counts = Counter(dataset["count"])
    assert sorted(counts) == [1, 2, 3, 4] and max(counts.values()) - min(counts.values()) <= 1  # balanced answers
    gaps = Counter(dataset["gap"])
    assert set(gaps) == set(range(3, 8))
    for example in rows(dataset):
        count, gap = example["count"], example["gap"]
        prompt = [A] * count + [B] * gap + [QUERY]
        answer = [A] * count + [END]
        assert example["input_ids"] == prompt + answer
        assert example["labels"] == [IGNORE] * len(prompt) + answer


def test_far_copy_brute_force_solves_everything_and_a_wrong_count_does_not():
    dataset = far_copy_dataset(64, max_count=5, min_gap=1, max_gap=20, seed=1)
    assert solver_accuracy(dataset, solve_far_copy) == 1.0

    def one_too_many(input_ids):
        # Counts one A too many: writes n + 1 As, so it misses every <end>.
        predictions = solve_far_copy(input_ids)
        query = input_ids.index(QUERY)
        count = input_ids.index(B)
        if query + 1 + count < len(input_ids):
            predictions[query + 1 + count] = A
        return predictions

    accuracy = solver_accuracy(dataset, one_too_many)
    assert accuracy < 1.0
    # Exactly the <end> targets are lost: one of the n + 1 answer tokens of each example.
    scored = sum(count + 1 for count in dataset["count"])
    assert accuracy == pytest.approx(1 - len(dataset) / scored)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_examples": 0}, "num_examples"),
        ({"max_count": 0}, "max_count"),
        ({"max_count": True}, "max_count"),
        ({"min_gap": 0}, "min_gap"),
        ({"max_gap": 2.5}, "max_gap"),
        ({"min_gap": 9, "max_gap": 8}, "max_gap must be >= min_gap"),
    ],
)
def test_far_copy_rejects_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        far_copy_dataset(**{"num_examples": 4, **options})


def test_far_copy_solver_rejects_a_sequence_without_the_task_layout():
    with pytest.raises(ValueError, match="<query>"):
        solve_far_copy([A, A, END])


def test_far_copy_tokenizer_round_trip():
    tokenizer = far_copy_tokenizer()
    assert tokenizer.convert_ids_to_tokens(list(range(5))) == ["<pad>", *far_copy_symbols()]
    example = far_copy_dataset(1, max_count=3, min_gap=2, max_gap=4, seed=0)[0]
    text = tokenizer.decode(example["input_ids"])
    assert text.startswith("A ") and "<query>" in text and text.endswith("<end>")
    assert tokenizer(text, add_special_tokens=False).input_ids == example["input_ids"]


# Corridor ------------------------------------------------------------------------------------------------------------


def test_corridor_is_deterministic_per_seed():
    options = {"num_colours": 3, "num_distractors": 5, "min_length": 2, "max_length": 9}
    first = corridor_dataset(40, **options, seed=5)
    assert rows(first) == rows(corridor_dataset(40, **options, seed=5))
    assert rows(first) != rows(corridor_dataset(40, **options, seed=6))


def test_corridor_layout_colours_and_lengths():
    num_colours, num_distractors = 3, 5
    dataset = corridor_dataset(
        101, num_colours=num_colours, num_distractors=num_distractors, min_length=4, max_length=8, seed=0
    )
    colours = Counter(dataset["colour"])
    assert sorted(colours) == [0, 1, 2] and max(colours.values()) - min(colours.values()) <= 1  # balanced answers
    assert set(dataset["length"]) == set(range(4, 9))
    door = num_colours + num_distractors + 1
    distractors_seen = set()
    for example in rows(dataset):
        colour, length, input_ids = example["colour"], example["length"], example["input_ids"]
        assert input_ids[0] == input_ids[-1] == 1 + colour
        assert input_ids[-2] == door and len(input_ids) == length + 3
        corridor = input_ids[1:-2]
        assert all(num_colours < token <= num_colours + num_distractors for token in corridor)
        distractors_seen.update(corridor)
        assert example["labels"] == [IGNORE] * (len(input_ids) - 1) + [1 + colour]
    assert len(distractors_seen) == num_distractors


def test_corridor_brute_force_solves_everything_and_a_forgetful_solver_does_not():
    dataset = corridor_dataset(64, num_colours=4, num_distractors=6, min_length=3, max_length=30, seed=2)
    assert solver_accuracy(dataset, solve_corridor) == 1.0

    def always_first_colour(input_ids):
        # What a model that forgot the colour could do at best: one fixed guess, right for 1/C of the examples.
        return [IGNORE] * (len(input_ids) - 1) + [1]

    assert solver_accuracy(dataset, always_first_colour) == pytest.approx(0.25)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_examples": -1}, "num_examples"),
        ({"num_colours": 0}, "num_colours"),
        ({"num_distractors": 0}, "num_distractors"),
        ({"min_length": 0}, "min_length"),
        ({"max_length": "long"}, "max_length"),
        ({"min_length": 5, "max_length": 4}, "max_length must be >= min_length"),
    ],
)
def test_corridor_rejects_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        corridor_dataset(**{"num_examples": 4, **options})


def test_corridor_tokenizer_round_trip():
    tokenizer = corridor_tokenizer(num_colours=2, num_distractors=3)
    symbols = corridor_symbols(2, 3)
    assert symbols == ["colour0", "colour1", "cell0", "cell1", "cell2", "<door>"]
    assert tokenizer.convert_ids_to_tokens(list(range(7))) == ["<pad>", *symbols]
    example = corridor_dataset(1, num_colours=2, num_distractors=3, min_length=3, max_length=6, seed=0)[0]
    text = tokenizer.decode(example["input_ids"])
    assert text.startswith("colour") and "<door>" in text
    assert tokenizer(text, add_special_tokens=False).input_ids == example["input_ids"]


# Benchmark -----------------------------------------------------------------------------------------------------------


def run_paper_expire_span(directory: Path, *arguments: str) -> tuple[str, dict]:
    """Runs the script's smoke configuration in a subprocess; its standard output and the results of its JSON file."""
    output = directory / "results.json"
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "paper_expire_span.py"), "--smoke", "--threads", "1",
         "--json", str(output), *arguments],
        env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    return completed.stdout, json.loads(output.read_text())["results"]


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    """The smoke run with its default seeds (0 and 1): standard output, results and the plot's path."""
    directory = tmp_path_factory.mktemp("two_seeds")
    image = directory / "plot.png"
    stdout, results = run_paper_expire_span(directory, "--plot", str(image))
    return stdout, results, image


def test_paper_expire_span_benchmark_smoke_run(two_seeds):
    stdout, results, image = two_seeds
    assert "fixed span, matched memory" in stdout and "over 2 seeds (0, 1)" in stdout
    assert "corridor, seed 0: Expire-Span trained" in stdout and "far_copy, seed 1: Expire-Span trained" in stdout
    assert results["seeds"] == [0, 1]
    assert [run["seed"] for run in results["per_seed"]] == [0, 1]
    for run in results["per_seed"]:
        assert set(run["tasks"]) == {"corridor", "far_copy"}
        for rows in run["tasks"].values():
            expire, matched, *others = rows
            assert expire["model"] == "Expire-Span"
            assert matched["model"] == "fixed span" and matched["matched"]
            # The matched fixed span is the shortest with at least the Expire-Span model's mean memory.
            assert matched["memory_size"] >= expire["memory_size"] and matched["max_span"] <= expire["max_span"]
            assert [row["label"] for row in others] == ["fixed span, S = L"]  # smoke: the full span L as well
            assert others[0]["max_span"] == expire["max_span"]
            for row in rows:
                assert row["seed"] == run["seed"]
                assert 0.0 <= row["accuracy"] <= 1.0 and 0.0 <= row["sequence_accuracy"] <= 1.0
                assert row["memory_size"] > 0
                assert len(row["query_memories"]) == len(row["query_oldest"]) == 2  # per layer
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_paper_expire_span_benchmark_summaries_are_the_per_seed_values(two_seeds):
    _, results, _ = two_seeds
    assert set(results["summary"]) == {"corridor", "far_copy"}
    spread = False
    for name, summary in results["summary"].items():
        runs = [run["tasks"][name] for run in results["per_seed"]]
        assert (
            [row["label"] for row in summary] == [row["label"] for row in runs[0]] == [row["label"] for row in runs[1]]
        )
        for index, row in enumerate(summary):
            for key in ("max_span", "memory_size", "accuracy", "sequence_accuracy", "final_train_loss"):
                values = [rows[index][key] for rows in runs]
                assert row[key]["values"] == values
                assert row[key]["mean"] == pytest.approx(sum(values) / len(values))
                assert (row[key]["low"], row[key]["high"]) == (min(values), max(values))
                spread = spread or row[key]["low"] < row[key]["high"]
            for key in ("query_memories", "query_oldest"):
                for layer, layer_summary in enumerate(row[key]):
                    values = [rows[index][key][layer] for rows in runs]
                    assert layer_summary["mean"] == pytest.approx(sum(values) / len(values))
    assert spread  # the seeds change the data and the models, so some measurement differs between them


def test_paper_expire_span_benchmark_one_seed_repeats_that_seed_of_a_longer_run(two_seeds, tmp_path):
    _, two, _ = two_seeds
    image = tmp_path / "plot.png"
    stdout, one = run_paper_expire_span(tmp_path, "--seeds", "1", "--tasks", "corridor", "--plot", str(image))
    assert "over 1 seed (1)" in stdout
    assert one["seeds"] == [1] and [run["seed"] for run in one["per_seed"]] == [1]
    rows, earlier = one["per_seed"][0]["tasks"]["corridor"], two["per_seed"][1]["tasks"]["corridor"]
    for row, other in zip(rows, earlier, strict=True):
        assert {**row, "train_seconds": None} == {**other, "train_seconds": None}  # the same models, trained alike
    for row in one["summary"]["corridor"]:
        assert row["accuracy"]["low"] == row["accuracy"]["mean"] == row["accuracy"]["high"]
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def load_benchmark():
    specification = importlib.util.spec_from_file_location(
        "paper_expire_span", ROOT / "benchmarks" / "paper_expire_span.py"
    )
    module = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "arguments, message",
    [(["--steps", "0"], "--steps"), (["--threads", "0"], "--threads"), (["--fixed-spans", "1.5"], "--fixed-spans")],
)
def test_paper_expire_span_benchmark_rejects_bad_arguments(arguments, message, capsys):
    with pytest.raises(SystemExit) as error:
        load_benchmark().main(["--smoke", "--plot", "", *arguments])
    assert error.value.code == 2 and f"error: {message} must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    "seeds, problem",
    [(["0", "0"], "repeated [0]"), (["-1"], "negative [-1]"), (["2", "-3", "2"], "negative [-3], repeated [2]")],
)
def test_paper_expire_span_benchmark_rejects_bad_seeds(seeds, problem, capsys):
    with pytest.raises(SystemExit) as error:
        load_benchmark().main(["--smoke", "--plot", "", "--seeds", *seeds])
    assert error.value.code == 2
    assert (
        f"--seeds must be distinct non-negative integers, got [{', '.join(seeds)}] ({problem})"
        in capsys.readouterr().err
    )
