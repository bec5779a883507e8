"""The Expire-Span tasks (far copy, corridor): deterministic, balanced, solvable by brute force and not by a wrong
solver, options validated, tokenizers round-trip; and `benchmarks/paper_expire_span.py --smoke` runs end to end."""

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


def test_paper_expire_span_benchmark_smoke_run(tmp_path):
    output, image = tmp_path / "results.json", tmp_path / "plot.png"
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "paper_expire_span.py"), "--smoke", "--threads", "1",
         "--json", str(output), "--plot", str(image)],
        env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert "matched memory" in completed.stdout
    results = json.loads(output.read_text())["results"]
    assert set(results) == {"corridor", "far_copy"}
    for rows in results.values():
        expire, matched, *others = rows
        assert expire["model"] == "Expire-Span"
        assert matched["model"] == "fixed span" and matched["matched"]
        # The matched fixed span is the shortest with at least the Expire-Span model's mean memory.
        assert matched["memory_size"] >= expire["memory_size"] and matched["max_span"] <= expire["max_span"]
        assert others and others[-1]["max_span"] == expire["max_span"]  # smoke: the full span L as well
        for row in rows:
            assert 0.0 <= row["accuracy"] <= 1.0 and 0.0 <= row["sequence_accuracy"] <= 1.0
            assert row["memory_size"] > 0
            assert len(row["query_memories"]) == len(row["query_oldest"]) == 2  # per layer
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
def test_paper_expire_span_benchmark_rejects_bad_arguments(arguments, message):
    with pytest.raises(ValueError, match=message):
        load_benchmark().main(["--smoke", "--plot", "", *arguments])
