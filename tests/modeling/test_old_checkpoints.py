"""Checkpoints saved by memlm before the block layout options (issue 30) load with the logits they gave then: the
new fields' defaults are the old layout. The folders and logits were written by
tests/data/checkpoints_before_block_layout/make.py run with memlm at commit 3a1695e, on an Intel Xeon: another
processor computes other bits (tests/tolerances.py)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import memlm  # noqa: F401  (registers memlm's classes)
from tests.tolerances import RECORDED_FLOAT32_LOGITS

FOLDER = Path(__file__).resolve().parents[1] / "data" / "checkpoints_before_block_layout"
INPUT_IDS = torch.arange(2 * 13).reshape(2, 13) * 7 % 64  # as make.py
FAMILIES = ("deltanet", "deltanet_fla", "expire_span", "feedback_transformer")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_of_the_earlier_memlm_gives_the_same_logits(family):
    model = AutoModelForCausalLM.from_pretrained(FOLDER / family).eval()
    with torch.no_grad():
        logits = model(input_ids=INPUT_IDS).logits
    torch.testing.assert_close(logits, load_file(FOLDER / "logits.safetensors")[family], **RECORDED_FLOAT32_LOGITS)
