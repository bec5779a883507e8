"""devtools/gpu_check.py (`make gpu-check`) without a GPU: it refuses in one line, its stages keep to their time, the
test-result plugin records as tests finish, and its report is well formed (a sample report is built here from made-up
stage results; it is never a measurement)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools import gpu_check
from devtools.gpu_check import (
    GPU_TEST_PATHS,
    SCHEMA,
    STAGES,
    StageResult,
    build_report,
    report_problems,
    run_commands,
    stage_limit,
    summarize_tests,
)

ROOT = Path(__file__).resolve().parents[2]


def sample_report() -> dict:
    """A report as the check writes it, from made-up stage results: every kind of stage ending, test outcome and
    measurement (a failed one included). Not a measurement."""
    stages = [
        StageResult("install", "passed", 21.0, 60.0, 0),
        StageResult("tests", "failed", 150.5, 219.0, 1, "python -m pytest exited with 1"),
        StageResult("kernel_speed", "passed", 70.0, 158.5, 0),
        StageResult("model_speed", "timed_out", 200.0, 200.0, None, "stopped at its limit of 200 s"),
    ]
    tests = [
        {"test": "tests/kernels/test_a.py::test_one", "outcome": "passed", "when": "call", "seconds": 1.5, "message": ""},
        {"test": "tests/kernels/test_a.py::test_two", "outcome": "failed", "when": "call", "seconds": 2.0,
         "message": "AssertionError: 0.02 < 0.01"},
        {"test": "tests/kernels/test_a.py::test_three", "outcome": "passed", "when": "call", "seconds": 0.5, "message": ""},
        {"test": "tests/kernels/test_a.py::test_three", "outcome": "error", "when": "teardown", "seconds": 0.1,
         "message": "RuntimeError: teardown"},
        {"test": "tests/modeling/test_b.py::test_four", "outcome": "skipped", "when": "setup", "seconds": 0.0,
         "message": "Skipped: flash-linear-attention is not installed"},
    ]  # fmt: skip
    shape = {"heads": 8, "head_dim": 128, "dtype": "bfloat16"}
    kernels = []
    for tokens, batch in ((2048, 16), (8192, 4)):
        for operation, implementation, milliseconds in (("delta_rule", "memlm", 1.0), ("delta_rule", "fla", 2.0),
                                                        ("sdpa", "sdpa", 4.0), ("expire_span_attention", "memlm", 8.0)):  # fmt: skip
            for pass_, factor in (("forward", 1), ("forward_backward", 3)):
                kernels.append({"operation": operation, "implementation": implementation, "pass": pass_,
                                "batch_size": batch, "tokens": tokens, **shape, "milliseconds": milliseconds * factor,
                                "first_call_seconds": 3.0, "error": None})  # fmt: skip
    kernels.append({"operation": "delta_rule", "implementation": "fla", "pass": None, "batch_size": 1, "tokens": 32768,
                    **shape, "error": "OutOfMemoryError: CUDA out of memory"})  # fmt: skip
    sizes = {"dtype": "bfloat16", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
             "vocab_size": 32000}  # fmt: skip
    models = []
    for model, backend, speed in (("memlm", "triton", 30000.0), ("llama", "sdpa", 20000.0)):
        models.append({"family": "deltanet", "model": model, "backend": backend, "compiled": False,
                       "measure": "training", "batch_size": 8, "tokens": 2048, "new_tokens": None, **sizes,
                       "tokens_per_second": speed, "parameters": 100_000_000, "error": None})  # fmt: skip
        models.append({"family": "deltanet", "model": model, "backend": backend, "compiled": False,
                       "measure": "decoding", "batch_size": 1, "tokens": 2048, "new_tokens": 64, **sizes,
                       "tokens_per_second": speed / 100, "parameters": 100_000_000, "error": None})  # fmt: skip
    models.append({"family": "expire_span", "model": "memlm", "backend": "triton", "compiled": True,
                   "measure": "training", "batch_size": 8, "tokens": 2048, "new_tokens": None, **sizes,
                   "error": "BackendCompilerFailed: inductor"})  # fmt: skip
    machine = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.2, "multiprocessors": 132,
               "driver": "580.159.04", "torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0",
               "python": "3.12.3", "cpus": 16}  # fmt: skip
    installed = {"versions": {"transformers": "5.24.0", "flash-linear-attention": "0.6.0"}, "modules": {}, "unmet": []}
    return build_report(started="2026-11-27T10:00:00+00:00", seconds=441.5, machine=machine,
                        sources={"memlm_sha256": "0" * 64, "git": None}, wheels=None, installed=installed,
                        stages=stages, test_records=tests, kernels=kernels, models=models)  # fmt: skip


def test_without_cuda_the_check_refuses_in_one_line_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(out)}
    finished = subprocess.run([sys.executable, str(ROOT / "devtools" / "gpu_check.py")], capture_output=True, text=True,
                              env=environment, cwd=tmp_path, timeout=120)  # fmt: skip
    assert finished.returncode == 2
    assert re.fullmatch(r"gpu-check: refused, torch \S+ sees no CUDA device; run it on a GPU machine \(nothing was "
                        r"run\)\.\n", finished.stderr), finished.stderr  # fmt: skip
    assert finished.stdout == "" and not out.exists()


def test_a_stage_may_use_what_the_stages_before_it_left_never_past_the_whole_budget():
    budgets = {"first": 10.0, "second": 20.0, "third": 30.0}
    assert stage_limit("first", 0.0, budgets, 60.0) == 10.0
    assert stage_limit("second", 4.0, budgets, 60.0) == 26.0  # its 20 and the 6 the first left
    assert stage_limit("third", 35.0, budgets, 60.0) == 25.0
    assert stage_limit("third", 58.0, budgets, 60.0) == 2.0  # the whole budget ends first
    assert stage_limit("second", 40.0, budgets, 60.0) == 0.0  # the first overran
    assert sum(STAGES.values()) == gpu_check.BUDGET_SECONDS < 8 * 60  # inside the machine's 8 minutes


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie left to an init that does not reap counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_stage_out_of_time_is_stopped_with_what_it_started_and_the_next_one_runs(tmp_path):
    child = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "process = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(child)!r}, 'w').write(str(process.pid))\n"
        "print('begun', flush=True)\n"
        "time.sleep(60)\n"
    )
    log_path = tmp_path / "log"
    with open(log_path, "w") as log:
        began = time.monotonic()
        stopped = run_commands("slow", [[sys.executable, "-c", script]], 2.0, log, dict(os.environ), shortest=0.0)
        spent = time.monotonic() - began
        failed = run_commands("failing", [[sys.executable, "-c", "import sys; sys.exit(3)"],
                                          [sys.executable, "-c", "print('never')"]], 30.0, log, dict(os.environ))  # fmt: skip
        passed = run_commands("next", [[sys.executable, "-c", "print('ran')"]], 30.0, log, dict(os.environ))
        skipped = run_commands("late", [[sys.executable, "-c", "print('late')"]], 3.0, log, dict(os.environ))
    assert stopped.status == "timed_out" and stopped.returncode is None and spent < 10
    assert stopped.message == "stopped at its limit of 2 s"
    deadline = time.monotonic() + 5
    while _alive(int(child.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(int(child.read_text()))  # the stage's own child went with it
    assert (failed.status, failed.returncode) == ("failed", 3)
    assert (passed.status, passed.returncode) == ("passed", 0)
    assert skipped.status == "skipped" and skipped.message == "skipped: 3 s left, under 10 s"
    text = log_path.read_text()
    assert "begun" in text and "===== slow: stopped after" in text and "ran" in text
    assert "never" not in text and "late" not in text


def test_the_result_plugin_records_each_test_as_it_finishes(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\n"
        "def test_passes():\n    assert True\n\n"
        "def test_fails():\n    assert 1 == 2\n\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n\n"
        "@pytest.fixture\ndef broken():\n    yield\n    raise RuntimeError('teardown broke')\n\n"
        "def test_breaks_in_teardown(broken):\n    pass\n"
    )
    (tmp_path / "test_broken.py").write_text("import no_such_module\n")
    results = tmp_path / "results.jsonl"
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "MEMLM_TEST_RESULTS": str(results)}
    finished = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "devtools.pytest_results", "-p",
                               "no:cacheprovider", "--continue-on-collection-errors", "-c", os.devnull,
                               "--rootdir", str(tmp_path), str(tmp_path)], capture_output=True, text=True,
                              env=environment, cwd=tmp_path, timeout=120)  # fmt: skip
    assert finished.returncode == 1, finished.stdout[-2000:]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    outcomes = {(record["test"].split("::")[-1], record["when"]): record["outcome"] for record in records}
    assert outcomes == {
        ("test_broken.py", "collect"): "error",
        ("test_passes", "call"): "passed",
        ("test_fails", "call"): "failed",
        ("test_skipped", "setup"): "skipped",
        ("test_breaks_in_teardown", "call"): "passed",
        ("test_breaks_in_teardown", "teardown"): "error",
    }
    messages = {record["test"].split("::")[-1]: record["message"] for record in records}
    assert "assert 1 == 2" in messages["test_fails"] and messages["test_skipped"] == "Skipped: not here"
    assert "no_such_module" in messages["test_broken.py"]
    summary = summarize_tests(records)
    assert summary["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 2}


def test_the_report_of_made_up_stage_results_is_well_formed_and_each_defect_is_named():
    report = sample_report()
    assert report_problems(report) == []
    assert report["schema"] == SCHEMA and json.loads(json.dumps(report)) == report
    assert report["tests"]["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    three = next(case for case in report["tests"]["cases"] if case["test"].endswith("test_three"))
    assert three["outcome"] == "error" and three["message"] == "RuntimeError: teardown"
    broken = json.loads(json.dumps(report))
    del broken["machine"]["gpu"]
    broken["stages"][1]["status"] = "exploded"
    broken["tests"]["counts"]["passed"] = 7
    del broken["kernels"][0]["milliseconds"]
    broken["models"][0]["compiled"] = "no"
    assert report_problems(broken) == [
        "machine lacks gpu.",
        "stages[1].status is 'exploded', not one of passed, failed, timed_out, skipped.",
        "tests.counts {'passed': 7, 'failed': 1, 'skipped': 1, 'error': 1} are not the cases' {'passed': 1, "
        "'failed': 1, 'skipped': 1, 'error': 1}.",
        "kernels[0] lacks milliseconds.",
        "models[0].compiled is str, not bool.",
    ]
    assert report_problems({**report, "schema": "other/1"}) == [
        "the report's schema is 'other/1', not 'memlm-gpu-check/1'."
    ]
    assert report_problems({**report, "stages": report["stages"][1:]}) == [
        "the stages are not install, tests, kernel_speed, model_speed, in order."
    ]


def test_every_test_marked_gpu_is_where_the_check_looks():
    marked = sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(
            r"^\s*(@pytest\.mark\.gpu|pytestmark = .*pytest\.mark\.gpu)\b",
            path.read_text(encoding="utf-8"),
            flags=re.MULTILINE,
        )  # fmt: skip
    )
    assert "tests/modeling/test_generation_on_cuda.py" in marked and "tests/kernels/test_hub_kernels.py" in marked
    assert [path for path in marked if not path.startswith(tuple(f"{folder}/" for folder in GPU_TEST_PATHS))] == []


@pytest.mark.parametrize("installed", [(), ("xdist",), ("pytest_timeout",), ("xdist", "pytest_timeout")])
def test_the_test_stage_uses_xdist_and_timeouts_only_where_installed(installed, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: object() if name in installed else None)
    command = gpu_check.test_command("python3")
    assert command[:5] == ["python3", "-m", "pytest", "-m", "gpu"] and command[-2:] == list(GPU_TEST_PATHS)
    assert ["-p", "devtools.pytest_results"] == command[5:7]
    assert ("-n" in command and command[command.index("-n") + 1] == "8") is ("xdist" in installed)
    assert ("--timeout=150" in command) is ("pytest_timeout" in installed)
