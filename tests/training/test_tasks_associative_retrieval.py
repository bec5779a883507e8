"""The associative-retrieval generator (DeltaNet Sec. 6.1) is deterministic, balanced and solvable, and its
comparison script runs end to end on a tiny budget over two seeds and summarises them."""

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from memlm.training.tasks.associative_retrieval import (
    associative_retrieval_dataset,
    associative_retrieval_symbols,
    associative_retrieval_tokenizer,
    solve_associative_retrieval,
)
from memlm.training.tasks.common import IGNORE, solver_accuracy

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARK = os.path.join(REPOSITORY, "benchmarks", "paper_deltanet.py")


def rows(dataset):
    return list(zip(dataset["input_ids"], dataset["labels"]))


def pairs_of(input_ids):
    """(keys, values, query, answer) as task indices 0 … S-1, for S read off the ids."""
    *stream, query, answer = input_ids
    return stream[0::2], stream[1::2], query, answer


@pytest.mark.parametrize("setting", [1, 2])
def test_same_seed_same_dataset_and_other_seed_another(setting):
    first = associative_retrieval_dataset(30, setting=setting, num_keys=6, seed=3)
    again = associative_retrieval_dataset(30, setting=setting, num_keys=6, seed=3)
    other = associative_retrieval_dataset(30, setting=setting, num_keys=6, seed=4)
    assert rows(first) == rows(again)
    assert rows(first) != rows(other)


@pytest.mark.parametrize("setting, num_pairs", [(1, None), (2, None), (2, 5)])
def test_layout_and_labels(setting, num_pairs):
    num_keys = 6
    dataset = associative_retrieval_dataset(20, setting=setting, num_keys=num_keys, num_pairs=num_pairs, seed=0)
    expected_pairs = num_keys if setting == 1 else (num_pairs or 2 * num_keys)
    for input_ids, labels in rows(dataset):
        assert len(input_ids) == len(labels) == 2 * expected_pairs + 2
        keys, values, query, answer = pairs_of(input_ids)
        assert all(1 <= key <= num_keys for key in keys + [query])  # keys: ids 1 … S
        assert all(num_keys < value <= 2 * num_keys for value in values + [answer])  # values: S+1 … 2S
        assert query in keys
        assert labels[:-1] == [IGNORE] * (len(labels) - 1) and labels[-1] == answer


def test_setting_1_uses_every_key_and_value_once():
    for input_ids, _ in rows(associative_retrieval_dataset(50, setting=1, num_keys=7, seed=1)):
        keys, values, query, answer = pairs_of(input_ids)
        assert sorted(keys) == list(range(1, 8)) and sorted(values) == list(range(8, 15))
        assert answer == values[keys.index(query)]


def test_setting_2_rebinds_keys_and_answers_the_most_recent_value():
    dataset = associative_retrieval_dataset(300, setting=2, num_keys=5, num_pairs=12, seed=2)
    assert solver_accuracy(dataset, solve_associative_retrieval) == 1.0

    def first_value(input_ids):
        keys, values, query, _ = pairs_of(input_ids)
        return [IGNORE] * (len(input_ids) - 1) + [values[keys.index(query)]]

    # With 12 pairs over 5 keys most keys are re-bound, so answering with their first value must often be wrong.
    assert solver_accuracy(dataset, first_value) < 0.7
    repeated = sum(len(set(pairs_of(ids)[0])) < 12 for ids, _ in rows(dataset))
    assert repeated == 300


@pytest.mark.parametrize("setting", [1, 2])
def test_queries_and_answers_are_balanced(setting):
    num_keys, sequences = 5, 4000
    dataset = associative_retrieval_dataset(sequences, setting=setting, num_keys=num_keys, seed=5)
    queries = Counter(pairs_of(ids)[2] for ids, _ in rows(dataset))
    answers = Counter(pairs_of(ids)[3] for ids, _ in rows(dataset))
    expected = sequences / num_keys
    # Binomial standard deviation ≈ 25 here; ±15 % of 800 is about 5 standard deviations.
    for counter in (queries, answers):
        assert len(counter) == num_keys
        assert all(abs(count - expected) < 0.15 * expected for count in counter.values()), counter


@pytest.mark.parametrize("setting", [1, 2])
def test_evaluation_mode_asks_every_key_of_every_sequence(setting):
    num_keys = 6
    dataset = associative_retrieval_dataset(10, setting=setting, num_keys=num_keys, seed=7, all_queries=True)
    by_sequence = {}
    for input_ids, _ in rows(dataset):
        keys, _, query, _ = pairs_of(input_ids)
        by_sequence.setdefault(tuple(input_ids[:-2]), []).append(query)
    assert len(by_sequence) == 10
    for stream, queries in by_sequence.items():
        keys = list(stream[0::2])
        assert queries == list(dict.fromkeys(keys))  # each distinct key once, in order of first appearance
        if setting == 1:
            assert len(queries) == num_keys
    assert solver_accuracy(dataset, solve_associative_retrieval) == 1.0


def test_tokenizer_round_trip():
    tokenizer = associative_retrieval_tokenizer(4)
    assert associative_retrieval_symbols(2) == ["k0", "k1", "v0", "v1"]
    assert tokenizer.convert_tokens_to_ids(["<pad>", "k0", "k3", "v0", "v3"]) == [0, 1, 4, 5, 8]
    input_ids = associative_retrieval_dataset(1, setting=2, num_keys=4, seed=0)["input_ids"][0]
    text = tokenizer.decode(input_ids)
    assert text.split()[0].startswith("k") and text.split()[1].startswith("v")
    assert tokenizer(text)["input_ids"] == input_ids


@pytest.mark.parametrize(
    "arguments, name",
    [
        ({"num_sequences": 0}, "num_sequences"),
        ({"num_sequences": 2, "num_keys": 0}, "num_keys"),
        ({"num_sequences": 2, "num_keys": 2.5}, "num_keys"),
        ({"num_sequences": 2, "setting": 3}, "setting"),
        ({"num_sequences": 2, "setting": True}, "setting"),
        ({"num_sequences": 2, "setting": 1, "num_keys": 4, "num_pairs": 5}, "num_pairs"),
        ({"num_sequences": 2, "setting": 2, "num_pairs": 0}, "num_pairs"),
        ({"num_sequences": 2, "all_queries": "yes"}, "all_queries"),
    ],
)
def test_bad_arguments_raise(arguments, name):
    with pytest.raises(ValueError, match=name):
        associative_retrieval_dataset(**arguments)


def test_bad_solver_input_and_tokenizer_size_raise():
    with pytest.raises(ValueError, match="input_ids"):
        solve_associative_retrieval([1, 5, 1])
    with pytest.raises(ValueError, match="num_keys"):
        associative_retrieval_tokenizer(0)


def load_benchmark():
    """The script `benchmarks/paper_deltanet.py` as a module (benchmarks/ is not a package)."""
    specification = importlib.util.spec_from_file_location("paper_deltanet", BENCHMARK)
    module = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(module)
    return module


def test_benchmark_smoke_run(tmp_path):
    output, image = tmp_path / "results.json", tmp_path / "plot.png"
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [sys.executable, BENCHMARK, "--smoke", "--seeds", "0", "1", "--threads", "1", "--json", str(output),
         "--plot", str(image)],
        cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "Update rules, setting 2" in completed.stdout and "Capacity, setting 1" in completed.stdout
    assert "over 2 seeds (0 1)" in completed.stdout
    results = json.loads(output.read_text())
    assert results["seeds"] == [0, 1] and [run["seed"] for run in results["per_seed"]] == [0, 1]
    for run in results["per_seed"]:
        assert [row["update_rule"] for row in run["update_rules"]] == ["delta", "sum"]
        assert {(row["model"], row["num_keys"]) for row in run["capacity"]} == {
            (model, keys) for model in ("elu+1", "DPFP-1", "DPFP-2") for keys in (4, 8)
        }
        assert {row["model"]: row["feature_dim"] for row in run["capacity"]} == {"elu+1": 4, "DPFP-1": 8, "DPFP-2": 16}
        for row in run["update_rules"] + run["capacity"]:
            assert [point["step"] for point in row["curve"]] == [2, 4]
            assert 0 <= row["final"]["accuracy"] <= 1 and row["best"]["loss"] <= row["final"]["loss"]
    # The seed reaches the data and the models: the two seeds' runs differ.
    first, second = (
        [point["loss"] for row in run["update_rules"] for point in row["curve"]] for run in results["per_seed"]
    )
    assert first != second
    # Each summary cell is the mean, lowest and highest of the per-seed values, in seed order.
    for comparison in ("update_rules", "capacity"):
        summaries = results["summary"][comparison]
        assert len(summaries) == len(results["per_seed"][0][comparison])
        for index, summary in enumerate(summaries):
            seed_rows = [run[comparison][index] for run in results["per_seed"]]
            assert {summary["model"]} == {row["model"] for row in seed_rows}
            cells = [(summary[moment][measure], [row[moment][measure] for row in seed_rows])
                     for moment in ("final", "best") for measure in ("loss", "accuracy")]  # fmt: skip
            cells += [(point["loss"], [row["curve"][step]["loss"] for row in seed_rows])
                      for step, point in enumerate(summary["curve"])]  # fmt: skip
            for cell, values in cells:
                assert cell["values"] == values
                assert cell["mean"] == pytest.approx(sum(values) / len(values))
                assert (cell["low"], cell["high"]) == (min(values), max(values))
    assert image.stat().st_size > 10_000


@pytest.mark.parametrize(
    "seeds, problem",
    [(["1", "1"], "repeated [1]"), (["0", "-3"], "negative [-3]"), (["-2", "5", "5"], "negative [-2], repeated [5]")],
)
def test_benchmark_rejects_bad_seeds(seeds, problem, capsys):
    benchmark = load_benchmark()
    with pytest.raises(SystemExit) as raised:
        benchmark.main(["--smoke", "--threads", "1", "--plot", "", "--seeds", *seeds])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert "--seeds must be distinct non-negative integers" in error and problem in error
