"""training/train.py (memlm.training.pretrain): end-to-end runs for the three models, exact resume after SIGKILL,
carried memory, batches, and bad inputs."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from memlm.tokenization import CHAT_TEMPLATE, byte_level_tokenizer
from memlm.training import TrainingError, pretrain
from memlm.training.data import TokenStream, load_texts, tokenize_documents

ROOT = Path(__file__).resolve().parents[2]
TEXT = "".join(f"def function_{index}(value):\n    return value * {index} + {index % 7}\n\n" for index in range(400))
MODELS = {
    "deltanet": {"model_type": "memlm_deltanet", "preset": "paper", "chunk_size": 8},
    "expire_span": {"model_type": "memlm_expire_span", "max_span": 64, "ramp": 8, "block_size": 16},
    "feedback": {"model_type": "memlm_feedback_transformer", "memory_span": 16},
}
SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
TRAINING = {"steps": 6, "batch_size": 2, "length": 16, "learning_rate": 0.01, "warmup_steps": 1, "eval_every": 3,
            "save_every": 3, "eval_tokens": 256}  # fmt: skip


def _preset(tmp_path: Path, model: str, **training) -> Path:
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps({"model": {**MODELS[model], **SIZES}, "training": {**TRAINING, **training}}))
    return path


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.parametrize("model", list(MODELS))
def test_a_run_trains_evaluates_and_saves_a_loadable_model(tmp_path, model):
    output = tmp_path / "run"
    metrics = pretrain.main(["--preset", str(_preset(tmp_path, model)), "--output-dir", str(output),
                             "--data", str(_data(tmp_path))])  # fmt: skip
    assert metrics["eval_after"]["bits_per_byte"] < metrics["eval_before"]["bits_per_byte"]
    assert [entry["step"] for entry in metrics["history"]["eval"]] == [0, 3, 6]
    saved = json.loads((output / "metrics.json").read_text())
    assert saved["eval_after"] == pytest.approx(metrics["eval_after"])
    assert (output / "loss.png").stat().st_size > 1000
    card = (output / "README.md").read_text()
    assert "## Evaluation" in card and f"{metrics['eval_after']['bits_per_byte']:.3f}" in card
    results = ModelCard.load(output / "README.md").data.eval_results  # valid model-index metadata
    assert results[0].metric_type == "bits_per_byte"
    assert results[0].metric_value == pytest.approx(metrics["eval_after"]["bits_per_byte"], abs=1e-4)
    assert sorted(path.name for path in (output / "checkpoints").iterdir()) == ["step-0000003"]

    loaded = AutoModelForCausalLM.from_pretrained(output)
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert loaded.config.model_type == MODELS[model]["model_type"]
    inputs = tokenizer("def function_", return_tensors="pt")
    generated = loaded.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 8


def _command(preset: Path, output: Path, data: Path) -> list[str]:
    return [sys.executable, str(ROOT / "training" / "train.py"), "--preset", str(preset), "--output-dir", str(output),
            "--data", str(data), "--steps", "14", "--save-every", "2", "--eval-every", "100"]  # fmt: skip


def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(tmp_path):
    preset, data = _preset(tmp_path, "deltanet", batch_mode="segments"), _data(tmp_path)
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    uninterrupted = tmp_path / "uninterrupted"
    subprocess.run(_command(preset, uninterrupted, data), check=True, env=environment, capture_output=True)

    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen(_command(preset, interrupted, data), env=environment, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (interrupted / "checkpoints" / "step-0000004").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before its second checkpoint"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert not (interrupted / "model.safetensors").exists()  # killed mid-run

    resumed = subprocess.run(_command(preset, interrupted, data), check=True, env=environment, capture_output=True,
                             text=True)  # fmt: skip
    assert "Resuming from" in resumed.stdout + resumed.stderr
    expected, weights = load_file(uninterrupted / "model.safetensors"), load_file(interrupted / "model.safetensors")
    assert expected.keys() == weights.keys()
    for name in expected:
        assert torch.equal(weights[name], expected[name]), name


def test_carried_memory_is_detached_and_changes_training(tmp_path):
    data = _data(tmp_path)
    runs = {}
    for carry in (True, False):
        output = tmp_path / f"carry-{carry}"
        flag = "--carry-memory" if carry else "--no-carry-memory"
        runs[carry] = pretrain.main(["--preset", str(_preset(tmp_path, "deltanet")), "--output-dir", str(output),
                                     "--data", str(data), flag, "--steps", "4"])  # fmt: skip
    # The first batch starts every stream, so it is the same; later ones see the previous segment only when carried.
    assert runs[True]["history"]["train"][0] == runs[False]["history"]["train"][0]
    assert runs[True]["history"]["train"][2] != runs[False]["history"]["train"][2]

    from memlm import DeltaNetConfig, DeltaNetForCausalLM

    model = DeltaNetForCausalLM(DeltaNetConfig(vocab_size=258, **SIZES)).train()
    output = model(torch.randint(0, 256, (2, 8)), use_cache=True)
    assert output.cache.layers[0].fast_weights.grad_fn is not None  # the graph reaches into the memory
    memory = pretrain.detach_memory(output.cache)
    assert all(layer.fast_weights.grad_fn is None and not layer.fast_weights.requires_grad for layer in memory.layers)


def test_segments_continue_the_same_streams_and_independent_windows_are_reproducible():
    tokens = torch.arange(1000)
    stream = TokenStream(tokens, rows=4, length=10, mode="segments")
    first_inputs, first_labels = stream.batch(0)
    second_inputs, _ = stream.batch(1)
    assert torch.equal(first_labels[:, :-1], first_inputs[:, 1:])  # labels are the next tokens
    assert torch.equal(second_inputs[:, 0], first_labels[:, -1])  # batch 1 continues batch 0, row by row
    assert torch.equal(first_inputs[:, 0], torch.tensor([0, 250, 500, 750]))  # one contiguous stream per row
    assert stream.starts_pass(0) and not stream.starts_pass(1) and stream.starts_pass(stream.segments_per_pass)
    independent = TokenStream(tokens, rows=4, length=10, mode="independent", seed=3)
    assert torch.equal(independent.batch(5)[0], independent.batch(5)[0])
    assert not torch.equal(independent.batch(5)[0], independent.batch(6)[0])


def test_the_embedded_corpus_is_python_source_read_at_run_time():
    documents = load_texts(None, max_bytes=200_000)
    assert sum(len(document.encode()) for document in documents) >= 200_000
    assert any("def " in document for document in documents)
    tokens = tokenize_documents(documents[:2], byte_level_tokenizer())
    assert tokens[-1] == 256 and int((tokens == 256).sum()) == 2  # each document ends with <|endoftext|>


def test_bad_inputs_give_clear_errors_and_keep_earlier_checkpoints(tmp_path):
    preset, data = _preset(tmp_path, "deltanet"), _data(tmp_path)
    with pytest.raises(ValueError, match="Unknown preset 'giant'.*tiny-deltanet"):
        pretrain.main(["--preset", "giant", "--output-dir", str(tmp_path / "x")])
    with pytest.raises(FileNotFoundError, match="missing.txt' does not exist"):
        pretrain.main(
            ["--preset", str(preset), "--output-dir", str(tmp_path / "x"), "--data", str(tmp_path / "missing.txt")]
        )
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="holds no text"):
        pretrain.main(["--preset", str(preset), "--output-dir", str(tmp_path / "x"), "--data", str(empty)])
    bad_preset = tmp_path / "bad.json"
    bad_preset.write_text(json.dumps({"model": MODELS["deltanet"], "training": {"stepz": 3}}))
    with pytest.raises(ValueError, match="unknown training options \\['stepz'\\]"):
        pretrain.main(["--preset", str(bad_preset), "--output-dir", str(tmp_path / "x")])

    output = tmp_path / "run"
    pretrain.main(["--preset", str(preset), "--output-dir", str(output), "--data", str(data), "--steps", "4",
                   "--save-every", "1", "--keep-checkpoints", "3"])  # fmt: skip
    checkpoints = sorted(path.name for path in (output / "checkpoints").iterdir())
    assert checkpoints == ["step-0000001", "step-0000002", "step-0000003"]
    latest = output / "checkpoints" / "step-0000003"
    (latest / "progress.json").write_text("{not json")
    with pytest.raises(TrainingError, match="step-0000003 cannot be read.*left as is"):
        pretrain.main(["--preset", str(preset), "--output-dir", str(output), "--data", str(data), "--steps", "4"])
    assert sorted(path.name for path in (output / "checkpoints").iterdir()) == checkpoints  # nothing deleted


def test_the_main_command_trains_then_generates(tmp_path):
    """The README's main command (training/quickstart.py), end to end on a tiny budget."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "training" / "quickstart.py"), "--output-dir", str(tmp_path / "quickstart"),
         "--steps", "3", "--max-bytes", "150000", "--max-new-tokens", "12", "--vocab-size", "512",
         "--contexts", "8", "40"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "held-out bits per byte" in result.stdout and "→" in result.stdout
    assert "sample from" in result.stdout and re.search(r"\n\d+ tokens in ", result.stdout)
    # What sets DeltaNet apart, beside a Transformer: its memory has the same size after 8 and after 40 tokens.
    assert "one decoded token after 8 and after 40 tokens of context" in result.stdout
    deltanet, llama = (line for line in result.stdout.splitlines() if " ms per token; memory carried " in line)
    assert "DeltaNet (trained above)" in deltanet and "🤗 Llama, same sizes (untrained)" in llama
    carried = [line.split("memory carried ")[1].removesuffix(" KiB").split(" → ") for line in (deltanet, llama)]
    assert carried[0][0] == carried[0][1] and int(carried[1][1]) > int(carried[1][0])
    assert "training:" not in result.stderr and "it/s" not in result.stderr  # no progress bar in logs
    assert (tmp_path / "quickstart" / "model.safetensors").is_file()
    assert len(AutoTokenizer.from_pretrained(tmp_path / "quickstart")) == 512  # --vocab-size: the BPE's size


def test_two_processes_with_gloo_match_one_process_with_the_same_global_batch(tmp_path):
    """DDP on CPU (gloo), launched with the shipped training/accelerate/cpu.yaml: both ranks end with the same
    weights, and the run matches one process reading the same global batch (2 rows: one per rank, or both in one
    process)."""
    data = _data(tmp_path)
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "1",
                   "OMP_NUM_THREADS": "1"}  # fmt: skip
    two = tmp_path / "two"
    subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                    str(ROOT / "training" / "accelerate" / "cpu.yaml"), str(ROOT / "training" / "train.py"), "--preset", str(_preset(tmp_path, "deltanet", batch_size=1)),
                    "--output-dir", str(two), "--data", str(data), "--steps", "4"],
                   check=True, env=environment, capture_output=True)  # fmt: skip
    one = tmp_path / "one"
    subprocess.run([sys.executable, str(ROOT / "training" / "train.py"), "--preset",
                    str(_preset(tmp_path, "deltanet", batch_size=2)), "--output-dir", str(one), "--data", str(data),
                    "--steps", "4"], check=True, env=environment, capture_output=True)  # fmt: skip
    distributed, single = (json.loads((folder / "metrics.json").read_text()) for folder in (two, one))
    assert distributed["processes"] == 2 and len(set(distributed["weight_checksums"])) == 1
    assert [loss for _, loss in distributed["history"]["train"]] == pytest.approx(
        [loss for _, loss in single["history"]["train"]], rel=1e-4
    )
    expected, weights = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], atol=1e-5, rtol=1e-4)


def test_every_shipped_preset_builds_its_model():
    """The tiny presets and the papers' configurations (built on the meta device: no memory, no time)."""
    tokenizer = byte_level_tokenizer()
    names = pretrain.available_presets()
    assert {"tiny-deltanet", "tiny-expire-span", "tiny-feedback", "deltanet-small", "deltanet-medium",
            "expire-span-enwik8-small", "feedback-enwik8"} <= set(names)  # fmt: skip
    sizes = {}
    for name in names:
        preset = pretrain.load_preset(name)
        config = pretrain.build_config(preset, tokenizer)
        for field, value in preset["model"].items():
            if field not in ("model_type", "preset"):
                assert getattr(config, field) == value, (name, field)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert model.config.model_type == preset["model"]["model_type"]
        sizes[name] = sum(parameter.numel() for parameter in model.parameters())
    # 16 layers of width 128 with a gated MLP of 2048: 16 · (4·128² + 3·128·2048) ≈ 13.6M, plus byte embeddings.
    assert 13e6 < sizes["deltanet-small"] < 14.5e6
    assert sizes["tiny-deltanet"] < 1e6 < sizes["deltanet-medium"] < sizes["feedback-enwik8"]


def test_a_byte_level_bpe_trained_on_the_text(tmp_path):
    output = tmp_path / "bpe"
    metrics = pretrain.main(["--preset", str(_preset(tmp_path, "deltanet")), "--output-dir", str(output), "--data",
                             str(_data(tmp_path)), "--tokenizer", "bpe", "--vocab-size", "320"])  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert len(tokenizer) == 320 and AutoModelForCausalLM.from_pretrained(output).config.vocab_size == 320
    ids = tokenizer("def function_12(value):")["input_ids"]
    assert len(ids) < len("def function_12(value):")  # merges learned from the text
    assert tokenizer.decode(ids) == "def function_12(value):"
    lengths = pretrain.token_byte_lengths(tokenizer)
    assert int(lengths[ids].sum()) == len(b"def function_12(value):")  # bits per byte count real bytes
    assert metrics["eval_after"]["bits_per_byte"] < metrics["eval_before"]["bits_per_byte"]
    # The run's model stops at the tokenizer's end of text, and its tokenizer chats (`memlm serve`'s chat endpoints).
    generation_config = GenerationConfig.from_pretrained(output)
    assert (generation_config.bos_token_id, generation_config.eos_token_id, generation_config.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
    ) == (318, 318, 319)  # fmt: skip
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_dataset_files_and_folders_accumulation_and_bfloat16(tmp_path):
    """--data also takes JSON lines and `save_to_disk` folders (read with 🤗 datasets); gradient accumulation and
    bfloat16 autocast run (on CPU)."""
    from datasets import Dataset

    lines = TEXT.split("\n\n")
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"content": line}) + "\n" for line in lines))
    folder = tmp_path / "saved"
    Dataset.from_dict({"content": lines}).save_to_disk(str(folder))
    documents = load_texts([str(jsonl)], text_column="content")
    assert documents == [line for line in lines if line.strip()] == load_texts([str(folder)], text_column="content")
    with pytest.raises(ValueError, match="has no column 'text'.*\\['content'\\]"):
        load_texts([str(jsonl)])

    preset = _preset(tmp_path, "feedback")
    accumulated = pretrain.main(["--preset", str(preset), "--output-dir", str(tmp_path / "accumulated"), "--data",
                                 str(folder), "--text-column", "content", "--gradient-accumulation-steps", "2",
                                 "--steps", "3", "--batch-mode", "independent"])  # fmt: skip
    assert accumulated["tokens_per_step"] == 2 * 16 * 2
    # Accelerate keeps one precision per process: bfloat16 runs in its own.
    subprocess.run([sys.executable, str(ROOT / "training" / "train.py"), "--preset", str(_preset(tmp_path, "deltanet")),
                    "--output-dir", str(tmp_path / "bf16"), "--data", str(jsonl), "--text-column", "content", "--mixed-precision",
                    "bf16", "--steps", "3"], check=True, capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})  # fmt: skip
    mixed = json.loads((tmp_path / "bf16" / "metrics.json").read_text())
    assert mixed["settings"]["mixed_precision"] == "bf16"
    assert all(math.isfinite(loss) for _, loss in mixed["history"]["train"])


def test_optimizer_options_reach_the_optimizer(tmp_path):
    """--learning-rate and --warmup-steps shape the schedule, --weight-decay reaches AdamW, --max-grad-norm clips,
    --seed changes the initial weights."""
    data = _data(tmp_path)

    def run(name, *options):
        return pretrain.main(["--preset", str(_preset(tmp_path, "deltanet")), "--output-dir", str(tmp_path / name),
                              "--data", str(data), "--steps", "6", "--save-every", "3", *options])  # fmt: skip

    plain = run("plain", "--learning-rate", "0.02", "--warmup-steps", "2", "--weight-decay", "0.3")
    rates = [entry["learning_rate"] for entry in plain["history"]["optimizer"]]
    assert rates[:3] == pytest.approx([0.0, 0.01, 0.02])  # linear warm-up over 2 steps (🤗's schedule starts at 0)
    assert rates[2] > rates[3] > rates[4] > rates[5] > 0  # then cosine decay
    optimizer = torch.load(tmp_path / "plain" / "checkpoints" / "step-0000003" / "optimizer.bin", weights_only=False)
    assert {group["weight_decay"] for group in optimizer["param_groups"]} == {0.3}

    norms = [entry["gradient_norm"] for entry in plain["history"]["optimizer"]]
    clipped = run("clipped", "--learning-rate", "0.02", "--warmup-steps", "2", "--weight-decay", "0.3",
                  "--max-grad-norm", "1e-9")  # fmt: skip
    assert clipped["history"]["train"][0] == plain["history"]["train"][0] and min(norms) > 1e-3
    expected, weights = (
        load_file(tmp_path / "plain" / "model.safetensors"),
        load_file(tmp_path / "clipped" / "model.safetensors"),
    )
    assert any(not torch.allclose(weights[name], expected[name], atol=1e-4) for name in expected)
    seeded = run("seed", "--seed", "1", "--learning-rate", "0.02", "--warmup-steps", "2")
    assert seeded["eval_before"]["bits_per_byte"] != plain["eval_before"]["bits_per_byte"]
