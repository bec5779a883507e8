"""The kernel repository in hub_kernels/ is generated from memlm's sources and kept current (issue 21). These tests
need no `kernels` package, so the suite runs them everywhere; tests/kernels/test_hub_kernels.py loads the repository."""

from pathlib import Path

from memlm.kernel_repository import repository_differences, write_repository
from memlm.kernels.hub import KERNEL_NAME

# Committed, so that a kernel change shows in review as the change of the repository users load, and a checkout can
# load it as a local folder; generated, so that nobody keeps it by hand.
COMMITTED = Path(__file__).resolve().parents[2] / "hub_kernels" / KERNEL_NAME


def test_committed_repository_is_current():
    """hub_kernels/ is what `python -m memlm.kernel_repository build` writes from today's sources."""
    assert repository_differences(COMMITTED) == [], (
        f"Regenerate with: python -m memlm.kernel_repository build hub_kernels/{KERNEL_NAME}"
    )


def test_staleness_is_detected(tmp_path):
    stale = tmp_path / "stale"
    write_repository(stale)
    layers = stale / "build" / "torch-cpu" / "memlm_kernels" / "layers_deltanet.py"
    layers.write_text(layers.read_text() + "# edited by hand\n")
    (stale / "build" / "torch-cuda" / "memlm_kernels" / "memlm_old.py").write_text("")
    assert repository_differences(stale) == [
        "build/torch-cpu/memlm_kernels/layers_deltanet.py",
        "build/torch-cuda/memlm_kernels/memlm_old.py",
    ]
    assert write_repository(stale) == ["build/torch-cuda/memlm_kernels/memlm_old.py"]
    assert repository_differences(stale) == []
