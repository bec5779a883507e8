"""The Feedback Transformer paper's state-tracking tasks (random walk, App. 7.1; algorithmic programs, App. 7.4):
deterministic, balanced, solvable by brute force and not by a solver that skips part of the state, and the
comparison script end to end on a tiny budget."""

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import pytest

from memlm.training.tasks.algorithmic import (
    VARIABLES,
    algorithmic_dataset,
    algorithmic_symbols,
    algorithmic_tokenizer,
    execute_program,
    generate_program,
    program_text,
    solve_algorithmic,
)
from memlm.training.tasks.common import IGNORE, dataset_rows, make_generator, solver_accuracy
from memlm.training.tasks.random_walk import (
    ACTIONS,
    random_walk_dataset,
    random_walk_symbols,
    random_walk_tokenizer,
    solve_random_walk,
    start_cell,
    walk,
)

REPOSITORY = Path(__file__).resolve().parents[2]


def scored_labels(dataset) -> list[int]:
    return [label for row in dataset_rows(dataset) for label in row["labels"] if label != IGNORE]


# Random walk


def test_random_walk_is_deterministic_and_seeded():
    first = random_walk_dataset(20, grid_size=4, episode_length=10, seed=3)
    again = random_walk_dataset(20, grid_size=4, episode_length=10, seed=3)
    other = random_walk_dataset(20, grid_size=4, episode_length=10, seed=4)
    assert first["input_ids"] == again["input_ids"] and first["labels"] == again["labels"]
    assert first["input_ids"] != other["input_ids"]


def test_random_walk_layout_keeps_cells_out_of_the_input():
    grid_size, length = 3, 7
    dataset = random_walk_dataset(10, grid_size=grid_size, episode_length=length, seed=0)
    symbols = random_walk_symbols(grid_size)
    action_ids = {symbols.index(action) + 1 for action in ACTIONS}
    cell_ids = set(range(6, len(symbols) + 1))
    for row in dataset_rows(dataset):
        assert len(row["input_ids"]) == len(row["labels"]) == length + 2
        assert row["input_ids"][0] == symbols.index("reset") + 1 and row["input_ids"][-1] == symbols.index("end") + 1
        assert set(row["input_ids"][1:-1]) <= action_ids
        assert row["labels"][:2] == [IGNORE, IGNORE] and set(row["labels"][2:]) <= cell_ids
        assert not set(row["input_ids"]) & cell_ids


def test_walk_turns_moves_and_ignores_walls():
    # From the centre of a 3×3 grid facing north: forward twice hits the wall after one step.
    assert start_cell(3) == (1, 1)
    assert walk(["forward", "forward"], 3) == [(0, 1), (0, 1)]
    assert walk(["right", "forward", "forward", "right", "forward"], 3) == [(1, 1), (1, 2), (1, 2), (1, 2), (2, 2)]
    assert walk(["left", "left", "forward", "reset", "forward"], 3) == [(1, 1), (1, 1), (2, 1), (1, 1), (0, 1)]
    with pytest.raises(ValueError, match="action"):
        walk(["jump"], 3)


def test_random_walk_is_balanced():
    grid_size = 4
    dataset = random_walk_dataset(300, grid_size=grid_size, episode_length=24, seed=0)
    actions = Counter(token for row in dataset_rows(dataset) for token in row["input_ids"][1:-1])
    assert len(actions) == 3 and max(actions.values()) < 1.1 * min(actions.values())
    cells = Counter(scored_labels(dataset))
    share = 1 / grid_size**2
    assert len(cells) == grid_size**2  # every cell is reached
    assert all(share / 4 < count / cells.total() < share * 4 for count in cells.values())


def test_random_walk_brute_force_solves_it_and_ignoring_turns_does_not():
    grid_size = 4
    dataset = random_walk_dataset(100, grid_size=grid_size, episode_length=20, seed=1)
    assert solver_accuracy(dataset, partial(solve_random_walk, grid_size=grid_size)) == 1.0
    symbols = random_walk_symbols(grid_size)
    ids = {symbol: index + 1 for index, symbol in enumerate(symbols)}

    def ignore_turns(input_ids):
        # A wrong solver: turns are no-ops, so the agent only ever walks north from the start.
        row, column = start_cell(grid_size)
        predictions = [IGNORE] * len(input_ids)
        for position, token in enumerate(input_ids[:-1]):
            if symbols[token - 1] in ACTIONS:
                if symbols[token - 1] == "forward":
                    row = max(row - 1, 0)
                predictions[position + 1] = ids[f"r{row}c{column}"]
        return predictions

    assert 0 < solver_accuracy(dataset, ignore_turns) < 0.5


def test_random_walk_tokenizer_round_trip():
    tokenizer = random_walk_tokenizer(4)
    dataset = random_walk_dataset(3, grid_size=4, episode_length=8, seed=0)
    text = tokenizer.decode(dataset["input_ids"][0])
    assert text.split()[0] == "reset" and text.split()[-1] == "end"
    assert tokenizer(text)["input_ids"] == dataset["input_ids"][0]
    cells = tokenizer.decode([label for label in dataset["labels"][0] if label != IGNORE]).split()
    assert all(cell.startswith("r") and "c" in cell for cell in cells) and len(cells) == 8
    assert tokenizer.pad_token_id == 0 and len(tokenizer) == 1 + 5 + 16


@pytest.mark.parametrize(
    "arguments, name",
    [
        ({"num_episodes": 0}, "num_episodes"),
        ({"num_episodes": 2, "grid_size": 1}, "grid_size"),
        ({"num_episodes": 2, "grid_size": 4.0}, "grid_size"),
        ({"num_episodes": 2, "episode_length": 0}, "episode_length"),
        ({"num_episodes": True}, "num_episodes"),
    ],
)
def test_random_walk_rejects_bad_options(arguments, name):
    with pytest.raises(ValueError, match=name):
        random_walk_dataset(**arguments)


# Algorithmic programs


def test_algorithmic_is_deterministic_and_seeded():
    first = algorithmic_dataset(20, num_variables=3, num_statements=10, seed=5)
    again = algorithmic_dataset(20, num_variables=3, num_statements=10, seed=5)
    other = algorithmic_dataset(20, num_variables=3, num_statements=10, seed=6)
    assert first["input_ids"] == again["input_ids"] and first["labels"] == again["labels"]
    assert first["input_ids"] != other["input_ids"]


@pytest.mark.parametrize("num_variables", [3, 5])
def test_algorithmic_programs_follow_the_rules(num_variables):
    generator = make_generator(0)
    symbols = algorithmic_symbols()
    kinds = Counter()
    conditions = Counter()
    for _ in range(200):
        statements = generate_program(generator, num_variables, num_statements=20)
        assert len(statements) == 20 and statements[-1][0] == "print"
        words = [word for statement in statements for word in statement]
        assert set(words) <= set(symbols)
        used = {word for word in words if word in VARIABLES}
        assert used <= set(VARIABLES[:num_variables])
        # Initialised once, before any other use: the first time a variable appears is `x = …`.
        seen = set()
        for statement in statements:
            names = [word for word in statement if word in VARIABLES]
            if statement[1] == "=":
                assert statement[0] not in seen
            assert set(names) - {statement[0] if statement[1] == "=" else None} <= seen
            seen |= set(names)
            kinds[statement[0] if statement[0] in ("print", "if") else statement[1]] += 1
        # Every value stays in 1..10 after every statement (execute_program checks it too).
        execution = execute_program(words)
        assert all(1 <= value <= 10 for values in execution.trace for value in values.values())
        for statement_index, statement in enumerate(statements):
            if statement[0] == "if":
                before = execution.trace[statement_index - 1]
                after = execution.trace[statement_index]
                conditions[before != after] += 1
    assert set(kinds) == {"=", "++", "--", "print", "if"}
    # Conditionals matter: both outcomes are common.
    assert 0.25 < conditions[True] / conditions.total() < 0.75


def test_execute_program_rejects_rule_breaking_programs():
    assert execute_program("x = 3 ; x ++ ; print x ;".split()).outputs == [(9, 4)]
    assert execute_program("x = 3 ; y = 9 ; if x < y : y ++ ; print y ;".split()).outputs == [(18, 10)]
    assert execute_program("x = 4 ; if x == 5 : x -- ; print x ;".split()).outputs == [(14, 4)]
    for program, problem in [
        ("x ++ ;", "before its initialisation"),
        ("x = 3 ; x = 4 ;", "initialised twice"),
        ("x = 10 ; x ++ ;", "leaves"),
        ("x = 1 ; if x == 1 : x -- ;", "leaves"),
        ("x = 1 ; print x ; if x > 0 : print x ;", "Malformed"),
        ("x = 1 ; x ++", "end with"),
    ]:
        with pytest.raises(ValueError, match=problem):
            execute_program(program.split())
    # Without the check, the rule-breaking value is still computed.
    assert execute_program("x = 10 ; x ++ ; print x ;".split(), check=False).outputs == [(9, 11)]
    assert execute_program("x = 1 ; x = 4 ; print x ;".split(), check=False).outputs == [(10, 4)]
    with pytest.raises(ValueError, match="before its initialisation"):
        execute_program("print x ;".split(), check=False)


@pytest.mark.parametrize("num_variables", [3, 5])
def test_algorithmic_outputs_are_balanced(num_variables):
    dataset = algorithmic_dataset(300, num_variables=num_variables, num_statements=16, seed=0)
    values = Counter(scored_labels(dataset))
    assert len(values) == 10
    assert all(0.1 / 2.5 < count / values.total() < 0.1 * 2.5 for count in values.values())
    printed = Counter(
        token for row in dataset_rows(dataset) for position, token in enumerate(row["input_ids"][:-1])
        if row["labels"][position + 1] != IGNORE
    )  # fmt: skip
    assert len(printed) == num_variables  # every variable gets printed


def test_algorithmic_layout_keeps_outputs_out_of_the_input():
    dataset = algorithmic_dataset(30, num_variables=3, num_statements=12, seed=2)
    symbols = algorithmic_symbols()
    for row in dataset_rows(dataset):
        words = [symbols[token - 1] for token in row["input_ids"]]
        for position, label in enumerate(row["labels"]):
            if label != IGNORE:
                assert words[position - 2] == "print" and words[position - 1] in VARIABLES
                assert words[position] == ";" and symbols[label - 1] in [str(value) for value in range(1, 11)]
        assert sum(label != IGNORE for label in row["labels"]) == words.count("print")


def test_algorithmic_brute_force_solves_it_and_skipping_conditionals_does_not():
    dataset = algorithmic_dataset(100, num_variables=3, num_statements=20, seed=1)
    assert solver_accuracy(dataset, solve_algorithmic) == 1.0
    symbols = algorithmic_symbols()
    ids = {symbol: index + 1 for index, symbol in enumerate(symbols)}

    def skip_conditionals(input_ids):
        # A wrong solver: every condition becomes `subject < 1`, never true, so nested statements never run (values
        # may then leave 1..10: run without the check; an 11 or a 0 is a wrong prediction).
        rewritten = list(input_ids)
        for position, token in enumerate(input_ids):
            if token == ids["if"]:
                rewritten[position + 2 : position + 4] = [ids["<"], ids["1"]]
        predictions = [IGNORE] * len(input_ids)
        for position, value in execute_program([symbols[token - 1] for token in rewritten], check=False).outputs:
            predictions[position] = ids.get(str(value), -1)
        return predictions

    accuracy = solver_accuracy(dataset, skip_conditionals)
    assert 0.3 < accuracy < 0.95


def test_algorithmic_tokenizer_and_text_rendering():
    tokenizer = algorithmic_tokenizer()
    dataset = algorithmic_dataset(2, num_variables=5, num_statements=8, seed=0)
    input_ids, labels = dataset["input_ids"][0], dataset["labels"][0]
    text = tokenizer.decode(input_ids)
    assert tokenizer(text)["input_ids"] == input_ids
    rendered = program_text(input_ids, labels)
    lines = rendered.splitlines()
    assert len(lines) == 8 and all(line.split("  -> ")[0].endswith(";") for line in lines)
    printed = [line.split("  -> ") for line in lines if line.startswith("print")]
    outputs = [tokenizer.decode([label]) for label in labels if label != IGNORE]
    assert [output for _, output in printed] == outputs and len(outputs) >= 1
    assert program_text(input_ids) == "\n".join(line.split("  -> ")[0] for line in lines)
    program = tokenizer("x = 3 ; if x > 2 : x -- ; print x ;")["input_ids"]
    assert program_text(program) == "x = 3;\nif x > 2: x --;\nprint x;"
    assert program_text(program, solve_algorithmic(program)) == "x = 3;\nif x > 2: x --;\nprint x;  -> 2"
    with pytest.raises(ValueError, match="labels"):
        program_text(input_ids, labels[:-1])


@pytest.mark.parametrize(
    "arguments, name",
    [
        ({"num_programs": 0}, "num_programs"),
        ({"num_programs": 2, "num_variables": 4}, "num_variables"),
        ({"num_programs": 2, "num_variables": True}, "num_variables"),
        ({"num_programs": 2, "num_statements": 1}, "num_statements"),
    ],
)
def test_algorithmic_rejects_bad_options(arguments, name):
    with pytest.raises(ValueError, match=name):
        algorithmic_dataset(**arguments)


# The comparison script


def test_paper_feedback_benchmark_smoke(tmp_path):
    json_path, plot_path = tmp_path / "results.json", tmp_path / "curves.png"
    command = [sys.executable, "benchmarks/paper_feedback.py", "--smoke", "--threads", "1", "--memory-span", "3",
               "--tasks", "random_walk,algorithmic3", "--json", str(json_path), "--plot", str(plot_path)]  # fmt: skip
    completed = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert "Feedback layer weights" in completed.stdout and "seed 1  random_walk" in completed.stdout
    report = json.loads(json_path.read_text())
    assert report["seeds"] == [0, 1]  # the --smoke default
    assert set(report["per_seed"]) == set(report["summary"]) == {"random_walk", "algorithmic3"}
    for task, runs in report["per_seed"].items():
        assert [run["seed"] for run in runs] == [0, 1]
        for result in runs:
            for name in ("llama", "feedback"):
                model = result[name]
                assert 0 <= model["accuracy"] <= 1 and model["seconds"] > 0
                assert [point["step"] for point in model["curve"]] == [0, 1, 2]
            assert result["feedback"]["memory_span"] == 3
            weights = result["feedback"]["layer_weights"]
            assert len(weights) == 2 and abs(sum(weights) - 1) < 1e-5
            assert result["llama"]["parameters"] == pytest.approx(result["feedback"]["parameters"], rel=0.2)
        # The seed changes the data and the initialisation, so the two runs train differently.
        assert runs[0]["llama"]["curve"][1]["train_loss"] != runs[1]["llama"]["curve"][1]["train_loss"]

        summary = report["summary"][task]
        for name in ("llama", "feedback"):
            for key in ("accuracy", "sequence_accuracy", "seconds"):
                values = [run[name][key] for run in runs]
                assert summary[name][key]["values"] == values
                assert summary[name][key]["mean"] == pytest.approx(sum(values) / 2)
                assert (summary[name][key]["low"], summary[name][key]["high"]) == (min(values), max(values))
            for index, point in enumerate(summary[name]["curve"]):
                values = [run[name]["curve"][index]["accuracy"] for run in runs]
                assert point["step"] == index and point["accuracy"]["mean"] == pytest.approx(sum(values) / 2)
        weights = [run["feedback"]["layer_weights"][0] for run in runs]
        assert summary["feedback"]["layer_weights"][0]["mean"] == pytest.approx(sum(weights) / 2)
        winners = [
            "tie" if run["llama"]["accuracy"] == run["feedback"]["accuracy"]
            else "feedback" if run["feedback"]["accuracy"] > run["llama"]["accuracy"] else "llama"
            for run in runs
        ]  # fmt: skip
        assert summary["winners"] == winners and summary["feedback_wins"] == winners.count("feedback")
        assert f"{task}: Feedback beat Llama in {winners.count('feedback')} of 2 seeds" in completed.stdout
    assert "mean (low–high) over 2 seeds" in completed.stdout
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot_path.stat().st_size > 10_000


def load_benchmark():
    specification = importlib.util.spec_from_file_location(
        "paper_feedback", REPOSITORY / "benchmarks/paper_feedback.py"
    )
    module = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(module)
    return module


def test_paper_feedback_benchmark_arguments():
    benchmark = load_benchmark()
    args = benchmark.parse_arguments(["--tasks", "algorithmic5", "--num-statements", "6", "--train-examples", "4"])
    assert args.tasks == ["algorithmic5"] and args.plot == benchmark.DEFAULT_PLOT and args.seeds == [0, 1, 2]
    train, held_out, vocabulary = benchmark.task_data("algorithmic5", args, 0)
    assert len(train) == 4 and len(held_out) == args.eval_examples and vocabulary == len(algorithmic_symbols()) + 1
    assert train["input_ids"] != held_out["input_ids"][:4]
    assert benchmark.task_data("algorithmic5", args, 1)[0]["input_ids"] != train["input_ids"]
    smoke = benchmark.parse_arguments(["--smoke"])
    assert smoke.plot is None and smoke.seeds == [0, 1]
    assert benchmark.parse_arguments(["--smoke", "--seeds", "7", "3"]).seeds == [7, 3]
    for bad in (["--tasks", "copy"], ["--steps", "0"], ["--seeds"], ["--seeds", "one"]):
        with pytest.raises(SystemExit):
            benchmark.parse_arguments(bad)


@pytest.mark.parametrize(
    "seeds, message",
    [
        (["0", "1", "0"], "--seeds must be distinct non-negative integers, got [0, 1, 0] (repeated [0])"),
        (["2", "-1", "-3"], "--seeds must be distinct non-negative integers, got [2, -1, -3] (negative [-3, -1])"),
    ],
)
def test_paper_feedback_benchmark_rejects_bad_seeds(seeds, message, capsys):
    with pytest.raises(SystemExit) as raised:
        load_benchmark().parse_arguments(["--smoke", "--seeds", *seeds])
    assert raised.value.code == 2 and message in capsys.readouterr().err
