"""The kernel repository is generated from memlm's sources (issue 21), and `check` finds a stale one. These tests need
no `kernels` package, so the suite runs them everywhere; tests/kernels/test_hub_kernels.py loads the repository."""

import subprocess
import sys

from memlm.kernel_repository import repository_differences, write_repository


def test_a_fresh_generation_is_current_and_staleness_is_detected(tmp_path):
    stale = tmp_path / "stale"
    write_repository(stale)
    assert repository_differences(stale) == []
    layers = stale / "build" / "torch-cpu" / "memlm_kernels" / "layers_deltanet.py"
    layers.write_text(layers.read_text() + "# edited by hand\n")
    (stale / "build" / "torch-cuda" / "memlm_kernels" / "memlm_old.py").write_text("")
    assert repository_differences(stale) == [
        "build/torch-cpu/memlm_kernels/layers_deltanet.py",
        "build/torch-cuda/memlm_kernels/memlm_old.py",
    ]
    check = [sys.executable, "-m", "memlm.kernel_repository", "check", str(stale)]
    result = subprocess.run(check, capture_output=True, text=True)
    assert result.returncode == 1 and "layers_deltanet.py" in result.stdout + result.stderr
    assert write_repository(stale) == ["build/torch-cuda/memlm_kernels/memlm_old.py"]
    assert repository_differences(stale) == []
    assert subprocess.run(check, capture_output=True, text=True).returncode == 0
