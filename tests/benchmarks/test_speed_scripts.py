"""The speed scripts' model tables (benchmarks/delta_rule.py, benchmarks/expire_span.py) in a real subprocess with
their shortest settings: the tables that README's figures come from run, and their options do what they say."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *arguments: str, output: Path) -> dict:
    environment = os.environ | {"HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / name), *arguments, "--json", str(output)]
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(output.read_text())


def test_deltanet_model_table_compares_same_size_llama_and_mamba(tmp_path):
    results = run_script("delta_rule.py", "--quick", "--tables", "models", output=tmp_path / "results.json")
    assert set(results) == {"settings", "models"}  # --tables models: only the model comparison ran
    models = results["models"]
    counts = models["parameters"]
    assert set(counts) == {"deltanet", "llama", "mamba"}
    assert max(counts.values()) / min(counts.values()) < 1.05  # same size within 5 %
    for row in models["training"]:
        assert row["deltanet_tokens_per_s"] > 0 and row["llama_tokens_per_s"] > 0
        assert row["mamba_tokens_per_s"] is None  # Mamba's training is timed only with --mamba-training
        assert abs(row["deltanet_over_llama"] - row["deltanet_tokens_per_s"] / row["llama_tokens_per_s"]) < 1e-9
    assert [row["context"] for row in models["decode"]] == list(results["settings"]["model_decode_contexts"])
    for row in models["decode"]:
        assert min(row["deltanet_tokens_per_s"], row["llama_tokens_per_s"], row["mamba_tokens_per_s"]) > 0
        assert abs(row["deltanet_over_mamba"] - row["deltanet_tokens_per_s"] / row["mamba_tokens_per_s"]) < 1e-9


def test_expire_span_generation_table_at_the_contexts_asked(tmp_path):
    arguments = ("--tables", "generation", "--contexts", "64", "160", "--decode-steps", "2", "--repeats", "1")
    results = run_script("expire_span.py", *arguments, "--threads", "1", output=tmp_path / "results.json")
    assert not results.get("training")  # --tables generation: the training table did not run
    decode = results["decode"]
    for model in ("expire_span", "fixed"):
        assert [row["context"] for row in decode[model]] == [64, 160]
        assert all(row["ms_per_token"] > 0 and row["memory_entries"] > 0 for row in decode[model])
