"""`python -m memlm.conversion.flash_linear_attention SRC DST` refuses a destination that is, or is inside, the source
(symlinks resolved), and leaves the FLA checkpoint untouched; a destination outside it still converts."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from memlm import DeltaNetForCausalLM
from memlm.conversion.flash_linear_attention import main
from tests.conversion.test_flash_linear_attention import FLA_CONFIG, fla_state_dict

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENT = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture
def sharded_checkpoint(tmp_path) -> Path:
    """A tiny FLA DeltaNet checkpoint saved in two shards with the index 🤗 writes beside them."""
    torch.manual_seed(0)
    folder = tmp_path / "fla"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(FLA_CONFIG))
    state = {name: tensor.contiguous() for name, tensor in fla_state_dict(FLA_CONFIG).items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    for shard, shard_names in shards.items():
        save_file({name: state[name] for name in shard_names}, folder / shard)
    index = {"metadata": {"total_size": sum(tensor.numel() * 4 for tensor in state.values())},
             "weight_map": {name: shard for shard, shard_names in shards.items() for name in shard_names}}  # fmt: skip
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _contents(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path) with the hash of its bytes."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _refusal(capsys, source, destination) -> str:
    """Runs the converter's command line in this process; returns its error output, which must be one line."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(source), str(destination)])
    assert exit_info.value.code == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error and len(error.strip().splitlines()) == 1
    return error


def test_the_command_refuses_to_convert_a_checkpoint_onto_itself(sharded_checkpoint):
    before = _contents(sharded_checkpoint)
    result = subprocess.run(
        [sys.executable, "-m", "memlm.conversion.flash_linear_attention", str(sharded_checkpoint),
         str(sharded_checkpoint)],
        env=ENVIRONMENT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"error: the destination {str(sharded_checkpoint)!r} is the source folder" in result.stderr
    assert _contents(sharded_checkpoint) == before


@pytest.mark.parametrize("where", ["same with a trailing dot", "inside", "symlink to it", "inside a symlink"])
def test_a_destination_in_the_source_is_refused_and_nothing_is_written(sharded_checkpoint, tmp_path, capsys, where):
    source = sharded_checkpoint
    (tmp_path / "link").symlink_to(source, target_is_directory=True)
    destination = {
        "same with a trailing dot": source / ".",
        "inside": source / "memlm",
        "symlink to it": tmp_path / "link",
        "inside a symlink": tmp_path / "link" / "converted",
    }[where]
    before = _contents(source)
    error = _refusal(capsys, source, destination)
    assert "would overwrite the FLA checkpoint" in error
    assert ("is inside the source folder" if where.startswith("inside") else "is the source folder") in error
    assert _contents(source) == before
    # the source given through the symlink instead is refused alike
    assert "would overwrite the FLA checkpoint" in _refusal(capsys, tmp_path / "link", source / "memlm")
    assert _contents(source) == before


def test_a_destination_beside_the_source_converts_and_the_source_is_unchanged(sharded_checkpoint, tmp_path):
    before = _contents(sharded_checkpoint)
    (tmp_path / "link").symlink_to(sharded_checkpoint, target_is_directory=True)
    # the source given through a symlink, the destination a sibling whose name starts like the source's
    main([str(tmp_path / "link"), str(tmp_path / "fla-memlm")])
    assert _contents(sharded_checkpoint) == before
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fla-memlm")
    assert type(model) is DeltaNetForCausalLM
    assert model.num_parameters() == model.config.estimated_parameters()
