"""devtools/recorded_numbers.py: memlm's tests compare with recorded numbers only within a tolerance that says why, and
the checker finds each way of doing otherwise (issue 38)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from devtools import recorded_numbers

ROOT = Path(__file__).resolve().parents[2]

HEADER = """
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

DATA = Path(__file__).parent / "data"
TOLERANCE = 1e-5  # float32 logits of order 1: another processor's summation order
"""


def read(tmp_path: Path, body: str, name: str = "test_snippet.py") -> recorded_numbers.Module:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return recorded_numbers.read_module(path)


def logits_test(comparison: str) -> str:
    expected = '    expected = load_file(DATA / "logits.safetensors")["logits"]\n'
    return "def test_logits(model, ids):\n" + expected + textwrap.indent(comparison, "    ") + "\n"


def test_memlm_s_tests_have_no_problem_and_the_recorded_ones_are_found():
    modules = recorded_numbers.read_tests(ROOT / "tests")
    assert [str(problem) for module in modules for problem in module.problems] == []
    found = {f"{module.path.relative_to(ROOT)}::{test}" for module in modules for test in module.tests}
    assert {
        "tests/modeling/test_old_checkpoints.py::test_a_checkpoint_of_the_earlier_memlm_gives_the_same_logits",
        "tests/modeling/test_modeling_feedback_layouts.py::"
        "test_a_checkpoint_saved_by_main_before_the_options_gives_the_same_logits",
        "tests/conversion/test_transformer_sequential.py::test_log_probabilities_and_losses_equal_the_official_code",
        "tests/conversion/test_lmtool_fwp.py::test_log_probabilities_losses_and_carried_memory_equal_the_official_code",
    } <= found


@pytest.mark.parametrize(
    "comparison, problem",
    [
        ("assert torch.equal(model(ids), expected)", "equal() against numbers recorded"),
        ("assert model(ids).equal(expected)", "equal() against numbers recorded"),
        ("np.testing.assert_array_equal(model(ids).numpy(), expected.numpy())", "assert_array_equal() against"),
        ("torch.testing.assert_close(model(ids), expected)", "without rtol= and atol="),
        ("torch.testing.assert_close(model(ids), expected, atol=1e-5)", "without rtol= and atol="),
        ("torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)", "with zero tolerance"),
        ("torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-5)", "with no comment saying why"),
        ("torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-5)  # fmt: skip", "with no comment"),
        ("assert torch.allclose(model(ids), expected)", "allclose() against numbers recorded in a file without"),
        ("assert (model(ids) - expected).abs().max() <= 0", "an error bounded by 0"),
        ("assert (model(ids) - expected).abs().max() == 0", "an error bounded by 0"),
    ],
)
def test_each_comparison_that_holds_on_one_processor_only_is_refused(tmp_path, comparison, problem):
    module = read(tmp_path, logits_test(comparison))
    assert len(module.problems) == 1 and problem in module.problems[0].message, module.problems
    assert module.problems[0].line == len(HEADER.splitlines()) + 3
    assert module.tests == {"test_logits"}


@pytest.mark.parametrize(
    "comparison",
    [
        "torch.testing.assert_close(model(ids), expected, rtol=0, atol=TOLERANCE)",
        "torch.testing.assert_close(model(ids), expected, **TOLERANCES)",
        "# float32, order 1: another processor's summation order\n"
        "torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-5)",
        "torch.testing.assert_close(\n    model(ids), expected, rtol=0, atol=1e-5  # float32 round-off\n)",
        "assert (model(ids) - expected).abs().max() <= TOLERANCE",
    ],
)
def test_a_tolerance_that_says_why_is_accepted_and_the_test_listed(tmp_path, comparison):
    module = read(tmp_path, logits_test(comparison))
    assert module.problems == [] and module.tests == {"test_logits"}


def test_values_are_followed_through_names_loops_helpers_fixtures_and_methods(tmp_path):
    module = read(
        tmp_path,
        """
        def load_case(case):
            with open(DATA / f"{case}.json") as file:
                meta = json.load(file)
            return meta, load_file(DATA / f"{case}.safetensors")

        @pytest.fixture
        def reference():
            return load_case("a")[1]

        def check(model, tensors):
            assert torch.equal(model(tensors["input_ids"]), tensors["log_probs"])

        def test_by_unpacking(model):
            meta, tensors = load_case("a")
            for name, value in tensors.items():
                assert torch.equal(model.state_dict()[name], value)

        def test_by_fixture(model, reference):
            assert torch.equal(model(1), torch.stack([reference["logits"]]).double())

        def test_by_helper(model):
            check(model, load_case("a")[1])

        class TestInAClass:
            def test_method(self, model):
                assert torch.equal(model(1), np.load(DATA / "logits.npy"))
        """,
    )
    assert module.tests == {"test_by_unpacking", "test_by_fixture", "test_by_helper", "TestInAClass::test_method"}
    assert sorted(problem.line - len(HEADER.splitlines()) for problem in module.problems) == [12, 17, 20, 27]


def test_what_this_process_computed_may_be_compared_bit_for_bit(tmp_path):
    module = read(
        tmp_path,
        """
        def test_written_by_the_test_itself(model, tmp_path):
            model.save_pretrained(tmp_path / "saved")
            assert torch.equal(load_file(tmp_path / "saved" / "model.safetensors")["w"], model.w)

        def test_outputs_of_recorded_inputs(model, loaded):
            input_ids = load_file(DATA / "inputs.safetensors")["input_ids"]
            assert torch.equal(model(input_ids), loaded(input_ids))

        def test_a_subprocess_run_from_the_repository(model):
            result = subprocess.run(["python", "-c", "print(1)"], cwd=DATA, capture_output=True)
            assert torch.equal(torch.tensor(json.loads(result.stdout)), model(1))

        def test_a_parameter_hides_a_module_name(model, DATA):
            assert torch.equal(load_file(DATA)["x"], model(1))
        """,
    )
    assert module.problems == [] and module.tests == set()


def test_the_command_lists_the_tests_and_fails_on_a_problem(tmp_path):
    read(tmp_path, "def test_ok(model):\n    assert model(1) == 1\n")
    (tmp_path / "test_bad.py").write_text(
        HEADER + 'def test_bad(model):\n    assert torch.equal(model(1), torch.load(DATA / "x.pt"))\n'
    )
    command = [sys.executable, ROOT / "devtools" / "recorded_numbers.py"]
    listed = subprocess.run([*command, "--list", tmp_path], capture_output=True, text=True, check=True)
    assert listed.stdout.splitlines() == [f"{tmp_path / 'test_bad.py'}::test_bad"]
    checked = subprocess.run([*command, tmp_path], capture_output=True, text=True)
    line = len(HEADER.splitlines()) + 2
    assert checked.returncode == 1
    assert checked.stdout == f"{tmp_path / 'test_bad.py'}:{line}: equal() against numbers recorded in a file: " + (
        "compare with a tolerance\n"
    )


def test_the_tests_that_compare_with_recorded_numbers_are_marked_for_the_second_run():
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "recorded", "-p", "no:cacheprovider",
         "tests/modeling/test_old_checkpoints.py", "tests/modeling/test_loss.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    selected = [line for line in collected.splitlines() if "::" in line]
    assert selected and all(line.startswith("tests/modeling/test_old_checkpoints.py::") for line in selected)
