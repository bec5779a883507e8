"""benchmarks/gpu_speed.py without a GPU: the speed page's GPU section from a `make gpu-check` report (a sample built
from made-up stage results, never a measurement) and without one, and its measurements on tiny shapes on CPU."""

import json
import shutil

import pytest
import torch

from benchmarks import gpu_speed, report
from tests.devtools.test_gpu_check import sample_report

CPU = torch.device("cpu")
TINY = {"vocab_size": 258, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}


def test_the_gpu_section_is_written_from_a_report():
    section = gpu_speed.docs_section(sample_report())
    assert section.startswith(
        "From `make gpu-check` (devtools/gpu_check.py) on 2026-11-27 on one NVIDIA H100 80GB HBM3 (compute capability "
        "9.0, 79 GiB), torch 2.11.0+cu130 (CUDA 13.0), Triton 3.6.0, flash-linear-attention 0.6.0, 🤗 Transformers "
        "5.24.0. The tests marked gpu: 1 passed, 1 failed, 1 errored, 1 skipped (did not pass: "
        "`tests/kernels/test_a.py::test_two`, `tests/kernels/test_a.py::test_three`). Out of time (stopped; their "
        "missing figures read —): model_speed.\n\nKernels, bfloat16, 32768 tokens per call, 8 heads of width 128;"
    )
    # memlm 1 ms, FLA 2 ms, SDPA (measured once per T, for both operations) 4 ms; forward + backward three times that.
    assert "| delta rule | 2048 | 16 | forward | 1.00 | 2.00 | 4.00 | 2.00 | 4.00 |" in section
    assert "| expire span attention | 8192 | 4 | forward + backward | 24.00 | — | 12.00 | — | 0.50 |" in section
    assert "| deltanet | triton | no | training | 8 × 2048 | 30000 | 20000 | 1.50 |" in section
    assert "| deltanet | triton | no | decoding | 1, 64 steps after 2048 | 300 | 200 | 1.50 |" in section
    assert "| expire-span | triton | yes | training | 8 × 2048 | — | — | — |" in section
    assert section.endswith(
        "Failed measurements:\n\n- delta rule fla at T = 32768: OutOfMemoryError: CUDA out of memory\n"
        "- expire span memlm triton training at T = 2048, compiled: BackendCompilerFailed: inductor"
    )
    assert section.count("| delta rule |") == 4 and section.count("| expire span attention |") == 4


def test_the_gpu_section_names_the_commit_checked():
    results = sample_report()
    results["sources"]["git"] = "6aba9facafed7a46da2a858df79635796b82f65e+changes"
    assert "5.24.0, at commit 6aba9facafed with changes not committed. The tests" in gpu_speed.docs_section(results)
    results["sources"]["git"] = "6aba9facafed7a46da2a858df79635796b82f65e"
    assert "5.24.0, at commit 6aba9facafed. The tests" in gpu_speed.docs_section(results)


def test_without_a_report_the_page_says_not_measured_and_with_one_shows_it(tmp_path):
    assert gpu_speed.docs_section(None) == gpu_speed.NOT_MEASURED and "Not measured yet" in gpu_speed.NOT_MEASURED
    page = tmp_path / "speed.md"
    shutil.copy(report.SPEED_PAGE, page)
    gpu_speed.main(["--report", str(tmp_path / "absent.json"), "--report-page", str(page)])
    assert report.section_text(str(page), gpu_speed.REPORT_SECTION) == gpu_speed.NOT_MEASURED
    saved = tmp_path / "gpu_check.json"
    saved.write_text(json.dumps(sample_report()))
    gpu_speed.main(["--report", str(saved), "--report-page", str(page)])
    assert report.section_text(str(page), gpu_speed.REPORT_SECTION) == gpu_speed.docs_section(sample_report())
    assert report.section_text(str(page), "delta_rule") == report.section_text(report.SPEED_PAGE, "delta_rule")


def test_the_kernel_measurements_run_on_tiny_shapes():
    """In Triton's interpreter: the cases, the forward and forward + backward timings of each."""
    cases = list(gpu_speed.kernel_cases((16,), 32, 2, 16, CPU, torch.float32))
    assert [(case["operation"], case["implementation"], case["batch_size"]) for case, _ in cases] == [
        ("delta_rule", "memlm", 2), ("sdpa", "sdpa", 2), ("expire_span_attention", "memlm", 2),
        ("expire_span_attention_official", "memlm", 2), ("delta_rule", "fla", 2),
    ]  # fmt: skip
    builds = {(case["operation"], case["implementation"]): build for case, build in cases}
    for name in (("sdpa", "sdpa"), ("expire_span_attention", "memlm"), ("expire_span_attention_official", "memlm")):
        results = gpu_speed.measure_kernel(builds[name], CPU, repeats=1)
        assert [result["pass"] for result in results] == ["forward", "forward_backward"]
        assert all(result["milliseconds"] > 0 and result["first_call_seconds"] > 0 for result in results)
    with pytest.raises(RuntimeError, match="flash-linear-attention's kernels are timed on CUDA only"):
        builds["delta_rule", "fla"]()


def test_the_model_plan_measures_each_family_beside_its_llama_and_compiles_last():
    plan = gpu_speed.model_plan(compiled=True)
    eager = gpu_speed.model_plan(compiled=False)
    assert plan[: len(eager)] == eager and all(item[3] for item in plan[len(eager) :])
    for family in gpu_speed.TRAINING_SHAPES:
        llama = [item for item in eager if item[:2] == (family, "llama")]
        assert [item[4] for item in llama] == ["training", "decoding"]
    assert ("deltanet", "memlm", "fla", False, "decoding") in eager
    assert ("deltanet", "llama", "sdpa", True, "training") in plan


@pytest.mark.parametrize(("model", "measure"), [("memlm", "decoding"), ("llama", "training")])
def test_a_model_measurement_runs_on_a_tiny_model(model, measure, monkeypatch):
    monkeypatch.setenv("MEMLM_KERNELS", "reference")
    result = gpu_speed._measure_model("deltanet", model, "torch", False, measure, TINY, 2, 12, 2, CPU, torch.float32)
    assert result["tokens_per_second"] > 0 and result["parameters"] > 70_000
    assert gpu_speed.os.environ["MEMLM_KERNELS"] == "reference"  # the backend it forced is given back


def test_show_prints_the_section_of_a_report(tmp_path, capsys):
    """What `make gpu-check` ends with (devtools/gpu_check.py runs the command, importing nothing from benchmarks/)."""
    saved = tmp_path / "gpu_check.json"
    saved.write_text(json.dumps(sample_report()))
    gpu_speed.main(["--show", str(saved)])
    assert capsys.readouterr().out == gpu_speed.docs_section(sample_report()) + "\n"
