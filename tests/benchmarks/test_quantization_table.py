"""benchmarks/quantization.py --quick in a real subprocess, with the quantization extra (run, not skipped, by
tests/installed/check_quantization.py): two models trained a few steps, each loaded by one quantizer of each package
in a process of its own, and the guide's table written from the run."""

import importlib
import os

import pytest

for package in ("torchao", "bitsandbytes", "optimum.quanto"):
    if os.environ.get("MEMLM_QUANTIZATION_REQUIRED"):
        importlib.import_module(package)
    else:
        pytest.importorskip(package, reason="the quantization extra: make test runs these with it")

from benchmarks import quantization  # noqa: E402
from tests.benchmarks.test_speed_scripts import run_script  # noqa: E402

MODELS = ("deltanet_fla", "llama")
QUANTIZERS = ("float32", "torchao-int8", "bitsandbytes-4bit", "quanto-int8")


def test_the_quantization_table_measures_each_model_loaded_by_each_quantizer(tmp_path):
    results = run_script("quantization.py", "--quick", "--models", *MODELS, "--quantizers", *QUANTIZERS[1:],
                         output=tmp_path / "results.json")  # fmt: skip
    rows = {(row["model"], row["quantizer"]): row for row in results["rows"]}
    assert list(rows) == [(model, quantizer) for model in MODELS for quantizer in QUANTIZERS]
    assert all(row["error"] is None for row in rows.values()), [row["error"] for row in rows.values()]
    for model in MODELS:
        assert results["trained"][model]["parameters"] > 0
        base = rows[model, "float32"]
        for row in (rows[model, quantizer] for quantizer in QUANTIZERS):
            assert row["peak_mib"] > 0 and row["tokens_per_second"] > 0 and 0 < row["bits_per_byte"] < 20
            assert abs(row["speed_ratio"] - row["tokens_per_second"] / base["tokens_per_second"]) < 1e-9
            assert abs(row["bits_per_byte_change"] - (row["bits_per_byte"] - base["bits_per_byte"])) < 1e-12
        assert base["bits_per_byte_change"] == 0 and base["checkpoint_mb"] > 0
        # int8 weights take a quarter of float32's bytes: the checkpoint shrinks (embeddings stay float)
        assert rows[model, "torchao-int8"]["checkpoint_mb"] < base["checkpoint_mb"]
        assert rows[model, "quanto-int8"]["checkpoint_mb"] is None and rows[model, "quanto-int8"]["not_saved"]
    section = quantization.docs_section(results)
    assert section.count("| DeltaNet (fla) |") == len(QUANTIZERS) and section.count("| 🤗 Llama |") == len(QUANTIZERS)
