"""`memlm train` / `memlm finetune` on hostile input: numbers out of range, presets of the wrong type, resumes with
other settings, another run's folder, two runs at once, diverging runs, non-UTF-8 text, renamed checkpoints, a
damaged tokenizer folder, a full disk, pickled code in a checkpoint, and a fine-tune into its own model."""

import fcntl
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from memlm.tokenization import byte_level_tokenizer
from memlm.training import TrainingError, finetune, pretrain
from memlm.training.data import load_texts
from tests.training.test_pretrain import MODELS, SIZES, TEXT, TRAINING, _data, _preset

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENT = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def _train(tmp_path: Path, output: Path, *options: str, model: str = "deltanet", **training) -> dict:
    return pretrain.main(["--preset", str(_preset(tmp_path, model, **training)), "--output-dir", str(output),
                          "--data", str(_data(tmp_path)), *options])  # fmt: skip


@pytest.mark.parametrize(
    "option, value, allowed",
    [
        ("--batch-size", "0", "an integer ≥ 1, got 0"),
        ("--length", "0", "an integer ≥ 1, got 0"),
        ("--save-every", "0", "an integer ≥ 1, got 0"),
        ("--eval-every", "0", "an integer ≥ 1, got 0"),
        ("--gradient-accumulation-steps", "0", "an integer ≥ 1, got 0"),
        ("--keep-checkpoints", "-1", "an integer ≥ 0, got -1"),
        ("--max-grad-norm", "-1", "a finite number > 0.0, got -1.0"),
        ("--warmup-steps", "-5", "an integer ≥ 0, got -5"),
        ("--steps", "0", "an integer ≥ 1, got 0"),
        ("--eval-tokens", "0", "an integer ≥ 1, got 0"),
        ("--learning-rate", "nan", "a finite number > 0.0, got nan"),
        ("--weight-decay", "-0.1", "a finite number ≥ 0.0, got -0.1"),
        ("--steps", "2.5", "'2.5' is not an integer"),
        ("--vocab-size", "100", "an integer ≥ 258, got 100"),
        ("--seed", "-1", "an integer ≥ 0 and ≤ 4294967295, got -1"),
    ],
)
def test_numbers_out_of_range_are_usage_errors(option, value, allowed, capsys):
    with pytest.raises(SystemExit) as exit_status:
        pretrain.parse_arguments(["--preset", "tiny-deltanet", "--output-dir", "unused", option, value])
    assert exit_status.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: memlm train ")
    assert error.strip().splitlines()[-1] == f"memlm train: error: argument {option}: must be {allowed}" or (
        "is not" in allowed and error.strip().endswith(f"argument {option}: {allowed}")
    )


@pytest.mark.parametrize(
    "option, value", [("--length", "0"), ("--batch-size", "0"), ("--steps", "0"), ("--learning-rate", "-1"),
                      ("--warmup-steps", "-1"), ("--eval-blocks", "0")]
)  # fmt: skip
def test_finetune_numbers_out_of_range_are_usage_errors(option, value, capsys):
    with pytest.raises(SystemExit) as exit_status:
        finetune.parse_arguments(["--model", "unused", "--output-dir", "unused", option, value])
    assert exit_status.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: memlm finetune ") and f"argument {option}: must be" in error


def test_the_commands_name_themselves_and_draw_no_progress_bar_in_logs(tmp_path, capsys):
    """--help names the subcommand and a bad number exits 2 with one line (`memlm.cli.main` in this process), and
    through the real `memlm` command a run whose output is not a terminal writes no progress bar (one line per step
    before)."""
    from memlm.cli import main as memlm_main

    helps = {}
    for command in ("train", "finetune"):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            memlm_main([command, "--help"])
        assert exit_info.value.code == 0
        helps[command] = capsys.readouterr().out
        assert helps[command].startswith(f"usage: memlm {command} ")
    assert "0 keeps every one" in " ".join(helps["train"].split()) and "--overwrite" in helps["train"]
    with pytest.raises(SystemExit) as exit_info:
        memlm_main(["train", "--preset", "tiny-deltanet", "--output-dir", str(tmp_path / "x"), "--batch-size", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "memlm train: error: argument --batch-size: must be an integer ≥ 1, got 0"
    )
    assert not (tmp_path / "x").exists()
    run = subprocess.run([sys.executable, "-m", "memlm.cli", "train", "--preset", str(_preset(tmp_path, "deltanet")),
                          "--output-dir", str(tmp_path / "run"), "--data", str(_data(tmp_path)), "--steps", "4"],
                         env=ENVIRONMENT, capture_output=True, text=True, check=True)  # fmt: skip
    assert "training:" not in run.stderr and "it/s" not in run.stderr
    assert "held-out bits per byte after training" in run.stdout


@pytest.mark.parametrize(
    "training, message",
    [
        ({"steps": "5"}, "'steps' must be an integer ≥ 1, not str '5'"),
        ({"batch_size": 0}, "'batch_size' must be an integer ≥ 1, got 0"),
        ({"learning_rate": "3e-3"}, "'learning_rate' must be a finite number > 0.0, not str '3e-3'"),
        ({"length": 16.5}, "'length' must be an integer ≥ 1, not float 16.5"),
        ({"carry_memory": "yes"}, "'carry_memory' must be true or false, not str 'yes'"),
        ({"batch_mode": "random"}, "'batch_mode' must be one of \\['segments', 'independent'\\], got 'random'"),
        ({"keep_checkpoints": True}, "'keep_checkpoints' must be an integer ≥ 0, not bool True"),
    ],
)
def test_preset_values_of_the_wrong_type_are_named(tmp_path, training, message):
    preset = tmp_path / "typed.json"
    preset.write_text(json.dumps({"model": {**MODELS["deltanet"], **SIZES}, "training": training}))
    with pytest.raises(ValueError, match=f"The preset {preset}: training option {message}"):
        pretrain.main(["--preset", str(preset), "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_resume_with_other_settings_is_refused_and_names_them(tmp_path):
    output = tmp_path / "run"
    _train(tmp_path, output, "--steps", "4", "--save-every", "2")
    assert json.loads((output / "run.json").read_text())["settings"]["length"] == TRAINING["length"]
    weights = (output / "model.safetensors").read_bytes()
    other_text = tmp_path / "other.txt"
    other_text.write_text(TEXT.replace("value", "number"))
    refused = {
        ("--length", "8"): "length: 16 → 8",
        ("--steps", "1"): "steps: 4 → 1",
        ("--tokenizer", "bpe", "--vocab-size", "300"): "tokenizer: 'bytes' → 'bpe'; vocab_size: None → 300",
        ("--data", str(other_text)): f"data: \\['{_data(tmp_path)}'\\] → \\['{other_text}'\\]",
        ("--learning-rate", "0.5"): "learning_rate: 0.01 → 0.5",
        ("--no-carry-memory",): "carry_memory: True → False",
    }
    for options, difference in refused.items():
        with pytest.raises(TrainingError, match=f"{output} holds a run with other settings \\({difference}\\).*"
                                                 "another --output-dir or with --overwrite"):  # fmt: skip
            _train(tmp_path, output, "--steps", "4", *options)
    # The same text named by another path resumes; the same file with other text in it does not.
    os.symlink(_data(tmp_path), tmp_path / "link.txt")
    with pytest.raises(TrainingError, match="other settings \\(length: 16 → 8\\)"):  # data not named
        _train(tmp_path, output, "--steps", "4", "--data", str(tmp_path / "link.txt"), "--length", "8")
    _data(tmp_path).write_text(TEXT.upper())
    with pytest.raises(TrainingError, match="other settings \\(data: its text changed\\)"):
        pretrain.main(["--preset", str(tmp_path / "deltanet.json"), "--output-dir", str(output), "--data",
                       str(tmp_path / "corpus.txt"), "--steps", "4"])  # fmt: skip
    # Another model size: the settings differ (the checkpoint is intact, nothing asks to move it away).
    wider = tmp_path / "wider.json"
    wider.write_text(json.dumps({"model": {**MODELS["deltanet"], **SIZES, "hidden_size": 64}, "training": TRAINING}))
    with pytest.raises(TrainingError, match="other settings \\(model.hidden_size: 32 → 64\\)") as refusal:
        pretrain.main(["--preset", str(wider), "--output-dir", str(output), "--data", str(_data(tmp_path)),
                       "--steps", "4"])  # fmt: skip
    assert "cannot be read" not in str(refusal.value)
    assert (output / "model.safetensors").read_bytes() == weights  # nothing touched

    # Options that only say when to evaluate and save may change.
    resumed = _train(tmp_path, output, "--steps", "4", "--eval-every", "1", "--keep-checkpoints", "1")
    assert [entry["step"] for entry in resumed["history"]["eval"]] == [0, 3, 4]  # resumed after step 2
    # A checkpoint of another run copied in is refused by its own settings.
    _train(tmp_path, tmp_path / "short", "--steps", "4", "--save-every", "3", "--length", "8")
    shutil.rmtree(output / "checkpoints" / "step-0000003")
    shutil.copytree(tmp_path / "short" / "checkpoints" / "step-0000003", output / "checkpoints" / "step-0000003")
    with pytest.raises(TrainingError, match="step-0000003 was written with other settings \\(length: 8 → 16\\)"):
        _train(tmp_path, output, "--steps", "4")

    # --overwrite starts afresh with the new settings.
    fresh = _train(tmp_path, output, "--steps", "3", "--length", "8", "--save-every", "2", "--overwrite")
    assert fresh["steps"] == 3 and fresh["eval_before"] is not None
    assert sorted(path.name for path in (output / "checkpoints").iterdir()) == ["step-0000002"]
    assert json.loads((output / "run.json").read_text())["settings"]["length"] == 8


def test_another_runs_folder_is_refused_unless_overwrite(tmp_path):
    """An OUTPUT holding a finished model of another run (no run marker, no checkpoints) is not replaced silently;
    --overwrite replaces that run's files and leaves the others."""
    from memlm import ExpireSpanConfig, ExpireSpanForCausalLM

    output = tmp_path / "previous"
    tokenizer = byte_level_tokenizer()
    config = ExpireSpanConfig(vocab_size=len(tokenizer), max_span=64, ramp=8, block_size=16, **SIZES)
    ExpireSpanForCausalLM(config).save_pretrained(output)
    tokenizer.save_pretrained(output / "tokenizer")
    (output / "notes.txt").write_text("mine")
    before = {path.name: path.read_bytes() for path in output.iterdir() if path.is_file()}
    with pytest.raises(
        TrainingError,
        match=f"{output} is not empty \\(README.md, config.json, .*\\) and holds no run marker.*--overwrite",
    ):
        _train(tmp_path, output, "--steps", "2")
    assert {path.name: path.read_bytes() for path in output.iterdir() if path.is_file() and path.name != ".lock"} == (
        before
    )
    _train(tmp_path, output, "--steps", "2", "--overwrite")
    assert AutoModelForCausalLM.from_pretrained(output).config.model_type == "memlm_deltanet"
    assert (output / "notes.txt").read_text() == "mine"
    assert not any(path.name.startswith("modeling_expire_span") for path in output.iterdir())


def test_a_second_run_on_the_same_folder_is_refused(tmp_path):
    output = tmp_path / "run"
    first = subprocess.Popen([sys.executable, str(ROOT / "training" / "train.py"), "--preset",
                              str(_preset(tmp_path, "deltanet")), "--output-dir", str(output), "--data",
                              str(_data(tmp_path)), "--steps", "100000", "--save-every", "100000"], env=ENVIRONMENT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (output / "tokenizer").is_dir():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.05)
        with pytest.raises(TrainingError, match=f"Another run is writing into {output} .*choose another --output-dir"):
            _train(tmp_path, output, "--steps", "100000", "--save-every", "100000")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with open(output / ".lock") as lock:  # the lock dies with its run
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(tmp_path):
    output = tmp_path / "run"
    with pytest.raises(TrainingError, match="Training diverged at step (\\d+): loss .*, gradient norm .*without saving a final model "
                                            "\\(the last checkpoint, .*step-\\d+, is kept\\)") as stop:  # fmt: skip
        _train(tmp_path, output, "--steps", "40", "--save-every", "1", "--keep-checkpoints", "0",
               "--learning-rate", "1e4", "--warmup-steps", "0")  # fmt: skip
    step = int(str(stop.value).split("step ")[1].split(":")[0])
    assert not (output / "model.safetensors").exists() and not (output / "metrics.json").exists()
    checkpoints = pretrain.complete_checkpoints(output)
    assert checkpoints[-1].name == f"step-{step - 1:07d}"
    last = load_file(checkpoints[-1] / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in last.values())


def test_text_that_is_not_utf8_or_too_small_is_refused(tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes(TEXT.encode() + "café\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin.txt' is not UTF-8 text: byte 0xe9 at offset \\d+"):
        pretrain.main(["--preset", str(_preset(tmp_path, "deltanet")), "--output-dir", str(tmp_path / "a"),
                       "--data", str(latin)])  # fmt: skip
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ValueError, match="weights.bin' is not UTF-8 text: byte 0x80 at offset 128"):
        load_texts([str(binary)])  # what finetune reads too
    small = tmp_path / "small.txt"
    small.write_text("def f(x):\n    return x\n" * 4)  # 92 bytes
    with pytest.raises(
        ValueError, match="85 training tokens are fewer than one batch of 8 windows of 16 \\+ 1 tokens"
    ):
        _train(tmp_path, tmp_path / "c", "--data", str(small), "--eval-tokens", "8", "--batch-mode", "independent",
               "--batch-size", "8")  # fmt: skip
    with pytest.raises(ValueError, match="cannot fill 4 streams with a segment of 32 \\+ 1 tokens"):
        _train(tmp_path, tmp_path / "d", "--data", str(small), "--eval-tokens", "8", "--batch-size", "4",
               "--length", "32")  # fmt: skip


def test_only_step_folders_are_checkpoints_and_a_damaged_tokenizer_stops_a_resume_in_words(tmp_path, capsys):
    output = tmp_path / "run"
    _train(tmp_path, output, "--steps", "4", "--save-every", "2")
    checkpoints = output / "checkpoints"
    shutil.copytree(checkpoints / "step-0000002", checkpoints / "step-0000003.corrupt")
    shutil.copytree(checkpoints / "step-0000002", checkpoints / "step-0000003.tmp")
    (checkpoints / "step-0000009.corrupt").mkdir()
    (checkpoints / "step-x").mkdir()
    assert [path.name for path in pretrain.complete_checkpoints(output)] == ["step-0000002"]
    tokenizer_file = output / "tokenizer" / "tokenizer.json"
    original = tokenizer_file.read_text()
    tokenizer_file.write_text(original[:100])  # cut short
    # The checkpoints were trained with it: the resume stops, saying what to do (issue 33; it used to go on).
    with pytest.raises(ValueError, match="cannot be read .* the checkpoints of this run were trained with it: "
                                         "restore the folder from a copy, or delete it"):  # fmt: skip
        _train(tmp_path, output, "--steps", "4", "--save-every", "2")
    shutil.rmtree(output / "tokenizer")  # what the message offers: the same text and settings make the same one
    capsys.readouterr()
    _train(tmp_path, output, "--steps", "4", "--save-every", "2")
    assert f"Resuming from {checkpoints / 'step-0000002'} (step 2)" in capsys.readouterr().out
    assert tokenizer_file.read_text() == original
    assert (output / "tokenizer" / "tokenizer_config.json").is_file()


def test_memlm_train_resuming_with_a_damaged_tokenizer_exits_1_with_one_line(tmp_path):
    output = tmp_path / "run"
    _train(tmp_path, output, "--steps", "4", "--save-every", "2")
    (output / "tokenizer" / "tokenizer.json").write_text("{")
    command = [sys.executable, "-m", "memlm.cli", "train", "--preset", str(_preset(tmp_path, "deltanet")),
               "--output-dir", str(output), "--data", str(_data(tmp_path)), "--steps", "4", "--save-every", "2"]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=os.environ | {"HF_HUB_OFFLINE": "1"}
    )
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert (
        len(errors) == 1
        and errors[0].startswith("memlm: error: The tokenizer in")
        and "Traceback" not in result.stderr
    )


def test_keep_checkpoints_0_keeps_every_checkpoint(tmp_path):
    output = tmp_path / "run"
    _train(tmp_path, output, "--steps", "4", "--save-every", "1", "--keep-checkpoints", "0")
    names = [path.name for path in pretrain.complete_checkpoints(output)]
    assert names[:3] == [f"step-000000{step}" for step in (1, 2, 3)]  # the default, 2, would keep the newest two


def test_a_tokenizer_json_without_its_config_is_refused_in_words(tmp_path, capsys):
    """tokenizer.json alone loads, but without tokenizer_config.json it has no end-of-text token: the library refuses
    such a tokenizer in words, and a run whose checkpoints depend on it stops; a run with no checkpoint yet makes its
    tokenizer again (derived data)."""
    from transformers import AutoTokenizer

    from memlm.training.data import tokenize_documents

    output = tmp_path / "run"
    _train(tmp_path, output, "--steps", "4", "--save-every", "2")
    (output / "tokenizer" / "tokenizer_config.json").unlink()
    alone = AutoTokenizer.from_pretrained(output / "tokenizer")
    with pytest.raises(ValueError, match="has no end-of-text token .* tokenizer.json but no tokenizer_config.json"):
        tokenize_documents(["def f():\n    return 1\n"], alone)
    with pytest.raises(ValueError, match="has no end-of-text token.*the checkpoints of this run were trained"):
        _train(tmp_path, output, "--steps", "4", "--save-every", "2")
    shutil.rmtree(output / "checkpoints")  # nothing depends on it any more: made again
    _train(tmp_path, output, "--steps", "4", "--save-every", "2")
    assert (output / "tokenizer" / "tokenizer_config.json").is_file()


def test_no_pickled_code_runs_when_resuming(tmp_path):
    """A checkpoint folder from elsewhere: pickles that would run code (here: create a file) are refused. The
    carried memory is read from safetensors only, Accelerate's optimizer/scheduler/random states with
    `weights_only=True`; random states it cannot read (which Accelerate would skip) stop the run too."""
    output = tmp_path / "run"
    _train(tmp_path, output, "--steps", "3", "--save-every", "2")
    checkpoint = output / "checkpoints" / "step-0000002"
    assert (checkpoint / "memory-0.safetensors").is_file() and not (checkpoint / "memory-0.pt").exists()
    ran = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return Path.touch, (ran,)

    for name in ("memory-0.pt", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        damaged = tmp_path / "damaged"
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(output, damaged)
        folder = damaged / "checkpoints" / "step-0000002"
        if name == "memory-0.pt":
            (folder / "memory-0.safetensors").unlink()
        torch.save({"state": Payload()}, folder / name, pickle_protocol=pickle.DEFAULT_PROTOCOL)
        with pytest.raises(TrainingError, match="step-0000002 cannot be read"):
            _train(tmp_path, damaged, "--steps", "3", "--save-every", "2")
        assert not ran.exists(), name


@pytest.mark.parametrize("model", list(MODELS))
def test_the_carried_memory_survives_a_safetensors_round_trip(tmp_path, model):
    config = pretrain.build_config({"model": {**MODELS[model], **SIZES}}, byte_level_tokenizer())
    network = AutoModelForCausalLM.from_config(config).train()
    inputs = torch.randint(0, 256, (2, 24))
    memory = pretrain.detach_memory(network(input_ids=inputs[:, :16], use_cache=True).cache)
    pretrain.save_memory(memory, tmp_path / "memory.safetensors")
    loaded = pretrain.load_memory(tmp_path / "memory.safetensors", "cpu")
    assert type(loaded) is type(memory) and len(loaded.layers) == len(memory.layers)
    expected = network(input_ids=inputs[:, 16:], cache=memory, use_cache=True).logits
    torch.testing.assert_close(
        network(input_ids=inputs[:, 16:], cache=loaded, use_cache=True).logits, expected, rtol=0, atol=0
    )
    pretrain.save_memory(None, tmp_path / "empty.safetensors")
    assert pretrain.load_memory(tmp_path / "empty.safetensors", "cpu") is None


def test_a_full_disk_stops_the_run_and_keeps_the_previous_checkpoint(tmp_path):
    """A real full disk: a 1.5 MB tmpfs (needs root; skipped elsewhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        output = disk / "run"
        with pytest.raises(TrainingError, match="no space left on device.* while writing checkpoint .*step-(\\d+): "
                                                "the run stopped at step \\d+ and the previous checkpoint "
                                                ".*step-\\d+ is intact") as stop:  # fmt: skip
            _train(tmp_path, output, "--steps", "50", "--save-every", "1", "--keep-checkpoints", "0")
        assert "inline_container" not in str(stop.value).split("(")[0]
        checkpoints = pretrain.complete_checkpoints(output)
        assert checkpoints and not list((output / "checkpoints").glob("*.tmp"))  # the partial one was removed
        assert json.loads((checkpoints[-1] / "progress.json").read_text())["step"] == len(checkpoints)
        assert load_file(checkpoints[-1] / "model.safetensors")
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_file_size_limit_is_named_instead_of_pytorchs_enforce_fail(tmp_path):
    """PyTorch's writer reports a failed write as `[enforce fail at inline_container.cc]`: a real file-size limit
    (RLIMIT_FSIZE, so EFBIG; no root needed) that the first checkpoint's optimizer state exceeds."""
    import resource

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    output = tmp_path / "run"
    result = subprocess.run([sys.executable, str(ROOT / "training" / "train.py"), "--preset",
                             str(_preset(tmp_path, "deltanet")), "--output-dir", str(output), "--data",
                             str(_data(tmp_path)), "--steps", "3", "--save-every", "1"], env=ENVIRONMENT,
                            capture_output=True, text=True, preexec_fn=limit_file_size)  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "enforce fail" not in result.stderr  # one line (--debug: the trace)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: file too large for the file system or its size limit while writing "
                           f"checkpoint {output / 'checkpoints' / 'step-0000001'}: the run stopped at step 1 and "
                           "there is no earlier checkpoint"), last  # fmt: skip
    assert list((output / "checkpoints").iterdir()) == []  # the partial checkpoint was removed


def test_a_failed_final_save_is_one_line_and_the_same_command_then_writes_the_model(tmp_path):
    """The final model (151 KB here) meets a real file-size limit (100 KB; every file written before it is smaller):
    one line naming the cause and what to do, exit status 1; the same command without the limit writes the model."""
    import resource

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    output = tmp_path / "run"
    command = [sys.executable, str(ROOT / "training" / "train.py"), "--preset", str(_preset(tmp_path, "deltanet")),
               "--output-dir", str(output), "--data", str(_data(tmp_path)), "--steps", "2", "--save-every", "100"]  # fmt: skip
    result = subprocess.run(command, env=ENVIRONMENT, capture_output=True, text=True, preexec_fn=limit_file_size)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"train.py: error: file too large for the file system or its size limit while writing the final model into "
        f"{output}: the training finished but the model is not saved; free space and run the same command again, "
        "which resumes from the start (no checkpoint was written) and writes it."
    )
    result = subprocess.run(command, env=ENVIRONMENT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_file(output / "model.safetensors")


def test_finetune_refuses_to_write_into_its_own_model(tmp_path):
    from memlm import DeltaNetConfig, DeltaNetForCausalLM

    tokenizer = byte_level_tokenizer()
    model = tmp_path / "model"
    DeltaNetForCausalLM(DeltaNetConfig(vocab_size=len(tokenizer), **SIZES)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    before = {path.name: path.read_bytes() for path in model.iterdir()}
    (tmp_path / "link").symlink_to(model)
    for output in (model, model / "tuned", tmp_path / "link", tmp_path / "link" / "tuned"):
        with pytest.raises(TrainingError, match="--output-dir .* the model folder .*: fine-tuning would overwrite"):
            finetune.main(["--model", str(model), "--output-dir", str(output), "--steps", "1"])
    assert {path.name: path.read_bytes() for path in model.iterdir()} == before
