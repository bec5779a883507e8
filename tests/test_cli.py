"""The `memlm` command's errors: one line `memlm: error: ...` and exit status 1 for bad input (the traceback only with
`--debug` or MEMLM_DEBUG=1), clear words for a missing folder, a missing tokenizer and an unknown model type, and
`memlm info` describing what it can of a folder with a broken file. Checkpoints are real save_pretrained folders."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memlm import DeltaNetConfig, DeltaNetForCausalLM, ExpireSpanConfig, ExpireSpanForCausalLM
from memlm.cli import main
from memlm.tokenization import byte_level_tokenizer

# 🤗-facing: also run under the newest and the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = pytest.mark.huggingface

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "vocab_size": 258,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny saved models: DeltaNet and Expire-Span with a tokenizer beside them, and DeltaNet without one."""
    folder = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    deltanet = DeltaNetForCausalLM(DeltaNetConfig(chunk_size=8, **SIZES))
    expire_span = ExpireSpanForCausalLM(ExpireSpanConfig(max_span=32, ramp=4, block_size=16, **SIZES))
    for name, model in (("deltanet", deltanet), ("expire_span", expire_span), ("no_tokenizer", deltanet)):
        model.save_pretrained(folder / name)
        if name != "no_tokenizer":
            byte_level_tokenizer().save_pretrained(folder / name)
    return {name: folder / name for name in ("deltanet", "expire_span", "no_tokenizer")}


def _error(capsys, *arguments, status: int = 1) -> str:
    """Runs `memlm ARGUMENTS` in this process, expecting it to fail; returns stderr, which must be one line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(list(arguments))
    assert exit_info.value.code == status
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and "Traceback" not in error, error
    return error.strip()


def test_a_missing_folder_is_one_line_and_the_traceback_is_only_for_debugging(tmp_path, monkeypatch):
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    environment.pop("MEMLM_DEBUG", None)
    command = [sys.executable, "-m", "memlm.cli", "generate", str(tmp_path / "nonexistent")]
    result = subprocess.run(command, env=environment, capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip() == f"memlm: error: the folder {str(tmp_path / 'nonexistent')!r} does not exist; " \
        "give a folder written by save_pretrained."  # fmt: skip
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["--debug", "info", str(tmp_path / "nonexistent")])
    monkeypatch.setenv("MEMLM_DEBUG", "1")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["generate", str(tmp_path / "nonexistent")])


def test_generate_names_the_missing_tokenizer_and_the_files_it_needs(checkpoints, capsys):
    error = _error(capsys, "generate", str(checkpoints["no_tokenizer"]), "--max-new-tokens", "2")
    assert error.startswith(f"memlm: error: no tokenizer found in {str(checkpoints['no_tokenizer'])!r}")
    assert "tokenizer.json" in error and "tokenizer.save_pretrained" in error
    assert "sentencepiece" not in error.replace("a sentencepiece tokenizer.model", "")


@pytest.mark.parametrize("command", ["generate", "info", "plot-memory"])
def test_an_unknown_model_type_lists_memlm_s_model_types(checkpoints, tmp_path, capsys, command):
    # a real saved folder (with its code bundle and auto_map) whose model_type was edited
    folder = tmp_path / "nonsense"
    folder.mkdir()
    for file in checkpoints["deltanet"].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "memlm_nonsense"}))
    extra = ["--output", str(tmp_path / "x.png")] if command == "plot-memory" else []
    error = _error(capsys, command, str(folder), *extra)
    assert error.startswith("memlm: error: unknown model type 'memlm_nonsense'")
    assert "known: memlm_deltanet, memlm_expire_span, memlm_feedback_transformer" in error
    assert "trust_remote_code" not in error and not (tmp_path / "x.png").exists()


def test_a_flash_linear_attention_checkpoint_points_to_the_converter(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "delta_net", "hidden_size": 32}))
    assert "python -m memlm.conversion.flash_linear_attention" in _error(capsys, "info", str(tmp_path))


def test_a_file_or_a_broken_config_is_named(checkpoints, tmp_path, capsys):
    error = _error(capsys, "info", str(checkpoints["deltanet"] / "config.json"))
    assert "is a file, not a folder written by save_pretrained" in error
    (tmp_path / "config.json").write_text("{broken")
    assert f"{tmp_path / 'config.json'} is not valid JSON" in _error(capsys, "info", str(tmp_path))
    (tmp_path / "config.json").write_text('{"hidden_size": 32}')
    error = _error(capsys, "generate", str(tmp_path))
    assert f"{tmp_path / 'config.json'} names no model_type; memlm's are memlm_deltanet, " in error


@pytest.mark.parametrize(
    ("contents", "problem"),
    [
        ("{broken", "Expecting property name"),
        ("[1, 2]", "holds list, not a JSON object"),
        ('{"eval_after": {"loss": 1.0}}', "eval_after.bits_per_byte is None, not a number"),
    ],
)
def test_info_describes_the_rest_when_metrics_json_is_broken(checkpoints, tmp_path, capsys, contents, problem):
    folder = tmp_path / "run"
    folder.mkdir()
    for file in checkpoints["expire_span"].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / "metrics.json").write_text(contents)
    with pytest.raises(SystemExit) as exit_info:  # a script checking the status sees the broken file
        main(["info", str(folder)])
    assert exit_info.value.code == 1
    output, error = capsys.readouterr()
    assert error == f"memlm: error: {folder}: metrics.json cannot be read (see above).\n"
    count = ExpireSpanConfig(max_span=32, ramp=4, block_size=16, **SIZES).estimated_parameters()
    assert f"parameters: {count:,} in model.safetensors" in output
    assert "ExpireSpanConfig" in output and "tokenizer: saved beside the model" in output
    assert f"metrics.json: cannot be read, skipped ({problem}" in output
    assert "held-out bits per byte" not in output
    (folder / "metrics.json").write_text('{"eval_after": {"bits_per_byte": 2.5}, "steps": 7}')
    main(["info", str(folder)])
    assert "held-out bits per byte: 2.500 after 7 steps" in capsys.readouterr().out


def test_info_flags_an_unreadable_weights_file(checkpoints, tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    for file in checkpoints["deltanet"].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / "extra.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "truncated.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(SystemExit) as exit_info:
        main(["info", str(folder)])
    assert exit_info.value.code == 1
    output, error = capsys.readouterr()
    assert error == f"memlm: error: {folder}: extra.safetensors, truncated.safetensors cannot be read (see above).\n"
    assert "weights: truncated.safetensors cannot be read (" in output
    count = DeltaNetConfig(chunk_size=8, **SIZES).estimated_parameters()
    assert f"parameters: {count:,} in model.safetensors\n" in output
    assert "weights: extra.safetensors cannot be read (" in output and "DeltaNetConfig" in output


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["plot-memory", "MODEL", "--text", "x", "--width", "0", "--output", "OUT"],
         "argument --width: must be a positive integer, got 0"),
        (["generate", "MODEL", "--max-new-tokens", "0"], "argument --max-new-tokens: must be a positive integer"),
        (["generate", "MODEL", "--temperature", "0"], "argument --temperature: must be a number > 0, got 0"),
        (["generate", "MODEL", "--top-k", "-1"], "argument --top-k: must be an integer >= 0, got -1"),
    ],
)  # fmt: skip
def test_bad_numbers_are_refused_when_the_command_line_is_read(checkpoints, tmp_path, capsys, arguments, message):
    arguments = [
        {"MODEL": str(checkpoints["expire_span"]), "OUT": str(tmp_path / "x.png")}.get(item, item)
        for item in arguments
    ]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_errors_of_the_training_commands_and_of_text_files_are_one_line(checkpoints, tmp_path, capsys):
    error = _error(capsys, "train", "--preset", "no-such-preset", "--output-dir", str(tmp_path / "run"))
    assert error.startswith("memlm: error: Unknown preset 'no-such-preset'")
    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps({"model": {"model_type": "memlm_deltanet", "num_heads": 4}}))
    error = _error(capsys, "train", "--preset", str(preset), "--output-dir", str(tmp_path / "run"))
    assert "unknown option 'num_heads'" in error and "did you mean 'num_attention_heads'" in error
    (tmp_path / "text.bin").write_bytes(b"\xff\xfe\x00binary")
    error = _error(capsys, "plot-memory", str(checkpoints["expire_span"]), "--text-file", str(tmp_path / "text.bin"),
                   "--output", str(tmp_path / "x.png"))  # fmt: skip
    assert f"--text-file {str(tmp_path / 'text.bin')!r} is not UTF-8 text" in error


def test_plot_memory_errors_are_one_line(checkpoints, tmp_path, capsys):
    error = _error(capsys, "plot-memory", str(checkpoints["deltanet"]), "--output", str(tmp_path / "x.png"))
    assert error == (
        "memlm: error: plot-memory: 'memlm_deltanet' models have no memory picture; it draws memlm_expire_span "
        "and memlm_feedback_transformer models."
    )


def test_info_names_the_versions_it_runs_with(checkpoints, capsys):
    import transformers

    main(["info", str(checkpoints["deltanet"])])
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("running with: ")]
    assert len(line) == 1
    assert f"transformers {transformers.__version__}" in line[0] and f"torch {torch.__version__}" in line[0]
    assert "memlm " in line[0] and "accelerate " in line[0]


def _copy(folder: Path, destination: Path) -> Path:
    destination.mkdir()
    for file in folder.iterdir():
        (destination / file.name).write_bytes(file.read_bytes())
    return destination


def test_info_flags_a_code_bundle_of_another_memlm_and_rebundle_rewrites_it(checkpoints, tmp_path, capsys):
    folder = _copy(checkpoints["deltanet"], tmp_path / "run")
    main(["info", str(folder)])
    assert "code bundle: the installed memlm's" in capsys.readouterr().out
    weights = (folder / "model.safetensors").read_bytes()
    config = json.loads((folder / "config.json").read_text())
    # What an older memlm leaves: a module that differs, a helper file this memlm no longer bundles, an old auto_map.
    modeling = folder / "modeling_deltanet.py"
    modeling.write_text(modeling.read_text().replace("cache", "past_key_values"))
    (folder / "memlm_retired_helper.py").write_text("VALUE = 1\n")
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "old.Config"}}))
    main(["info", str(folder)])
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("code bundle: ")]
    assert line == [
        "code bundle: differs from the installed memlm's in 2 file(s) (memlm_retired_helper.py, modeling_deltanet.py): "
        "written by another (older?) memlm, whose code may not run under the installed 🤗 Transformers; "
        f"`memlm rebundle {folder}` rewrites it"
    ]
    main(["rebundle", str(folder)])
    assert (
        "rewrote modeling_deltanet.py, config.json (auto_map); deleted memlm_retired_helper.py (no longer bundled), "
        "with the code of memlm " in capsys.readouterr().out
    )
    main(["info", str(folder)])
    assert "code bundle: the installed memlm's" in capsys.readouterr().out
    assert not (folder / "memlm_retired_helper.py").exists()
    assert (folder / "model.safetensors").read_bytes() == weights
    rewritten = json.loads((folder / "config.json").read_text())
    assert rewritten == {**config, "auto_map": {"AutoConfig": "configuration_deltanet.DeltaNetConfig"}}
    main(["rebundle", str(folder)])
    assert "already the installed memlm's; nothing changed" in capsys.readouterr().out


def test_rebundle_refuses_a_checkpoint_that_is_not_memlm_s(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "llama")  # fmt: skip
    error = _error(capsys, "rebundle", str(tmp_path / "llama"))
    assert "holds a 'llama' model, not one of memlm's" in error


# The last commit before memlm knew 🤗 5.24's `cache`: its checkpoints carry code that 5.24 cannot generate with.
BEFORE_THE_RENAME = "eedcbb1"


def test_a_checkpoint_saved_by_the_memlm_before_the_rename_generates_again_after_rebundle(tmp_path, tokenizer):
    """A real old checkpoint: the memlm of BEFORE_THE_RENAME (from git) saves it; its bundle runs without memlm."""
    import transformers

    if subprocess.run(["git", "cat-file", "-e", f"{BEFORE_THE_RENAME}^{{commit}}"], cwd=ROOT).returncode != 0:
        pytest.skip(f"this clone lacks commit {BEFORE_THE_RENAME} (a shallow clone)")
    old_tree = tmp_path / "old"
    archive = subprocess.run(["git", "archive", BEFORE_THE_RENAME, "memlm", "hub_cards"], cwd=ROOT, capture_output=True,
                             check=True).stdout  # fmt: skip
    old_tree.mkdir()
    subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
    (old_tree / "memlm" / "hub_cards").symlink_to(old_tree / "hub_cards")  # installed, the cards live in the package
    folder = tmp_path / "checkpoint"
    save = ("import sys, torch, memlm; assert memlm.__file__.startswith(sys.argv[2]); torch.manual_seed(0); "
            "memlm.DeltaNetForCausalLM(memlm.DeltaNetConfig(vocab_size=258, hidden_size=32, num_hidden_layers=2, "
            "num_attention_heads=2, intermediate_size=64, chunk_size=8)).save_pretrained(sys.argv[1])")  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(old_tree)}
    saved = subprocess.run([sys.executable, "-c", save, str(folder), str(old_tree)], cwd=tmp_path, env=environment,
                           capture_output=True, text=True)  # fmt: skip
    assert saved.returncode == 0, saved.stderr[-2000:]
    tokenizer.save_pretrained(folder)
    generate = ("import sys; sys.modules['memlm'] = None; import torch; from transformers import AutoModelForCausalLM; "
                "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True); "
                "print(model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, min_new_tokens=4).tolist())")  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "m1")}
    before = subprocess.run([sys.executable, "-c", generate, str(folder)], cwd=tmp_path, env=environment,
                            capture_output=True, text=True)  # fmt: skip
    if "cache" in transformers.modeling_outputs.BaseModelOutputWithPast.__dataclass_fields__:
        assert before.returncode != 0 and "unexpected keyword argument(s): cache" in before.stderr, before.stderr[
            -2000:
        ]
    main(["rebundle", str(folder)])
    environment["HF_MODULES_CACHE"] = str(tmp_path / "m2")
    after = subprocess.run([sys.executable, "-c", generate, str(folder)], cwd=tmp_path, env=environment,
                           capture_output=True, text=True)  # fmt: skip
    assert after.returncode == 0, after.stderr[-2000:]
    expected = DeltaNetForCausalLM.from_pretrained(folder).generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4,
                                                                     min_new_tokens=4)  # fmt: skip
    assert json.loads(after.stdout.strip().splitlines()[-1]) == expected.tolist()


@pytest.mark.parametrize(("family", "layer"), [("deltanet", "DeltaNetAttention"),
                                               ("expire_span", "ExpireSpanAttention")])  # fmt: skip
def test_info_says_whether_hub_kernels_can_swap_the_layers(checkpoints, capsys, family, layer):
    import importlib.util

    from transformers.utils import import_utils

    main(["info", str(checkpoints[family])])
    output = capsys.readouterr().out
    [line] = [line for line in output.splitlines() if line.startswith("hub kernels: ")]
    if importlib.util.find_spec("kernels") is None:
        assert "not installed" in line and "memlm[kernels]" in line
        return
    from importlib.metadata import version

    assert f"kernels {version('kernels')} can swap {layer} " in line
    if import_utils.is_kernels_available():
        assert line.endswith("use_kernels=True works")
    else:
        expected = f"needs kernels>={import_utils.KERNELS_MIN_VERSION},<{import_utils.KERNELS_MAX_VERSION}"
        assert expected in line
    assert f"kernels {version('kernels')}" in [entry for entry in output.splitlines() if "running with" in entry][0]


def test_commands_on_weights_cut_short_name_the_file_in_one_line(checkpoints, tmp_path, capsys):
    folder = _copy(checkpoints["deltanet"], tmp_path / "cut")
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    expected = f"memlm: error: {folder}: model.safetensors cannot be read (Error while deserializing header"
    assert _error(capsys, "generate", str(folder)).startswith(expected)
    (tmp_path / "notes.txt").write_text("def f():\n    return 1\n" * 50)
    error = _error(capsys, "finetune", "--model", str(folder), "--output-dir", str(tmp_path / "tuned"), "--data",
                   str(tmp_path / "notes.txt"))  # fmt: skip
    assert error.startswith(expected) and "save the model again, or take an earlier checkpoint" in error
