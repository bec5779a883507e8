"""The official trainer's last rule: the adaptive span's ratios z are clamped to [0, 1] after every optimizer step, in
`memlm train`, in `memlm finetune` and in a 🤗 `Trainer` given `ClampAdaptiveSpans` (issue 39)."""

import json

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments

from memlm import FeedbackTransformerConfig, FeedbackTransformerForCausalLM
from memlm.modeling.modeling_feedback_transformer import clamp_adaptive_spans
from memlm.training import pretrain
from memlm.training.callbacks import ClampAdaptiveSpans
from tests.training.test_pretrain import SIZES, TEXT, TRAINING

# A span loss so large that the optimizer's first step pushes every z from 0 below 0.
ADAPTIVE = {"memory_span": 8, "position_encoding": "learned_relative", "adaptive_span": True,
            "adaptive_span_ramp": 2, "adaptive_span_loss_coefficient": 10.0, "adaptive_span_initial_ratio": 0.0}  # fmt: skip


def _model(**options) -> FeedbackTransformerForCausalLM:
    torch.manual_seed(0)
    return FeedbackTransformerForCausalLM(FeedbackTransformerConfig(vocab_size=64, **SIZES, **options))


def _ratios(model) -> torch.Tensor:
    return torch.cat([layer.attention.span_ratio.detach() for layer in model.model.layers])


def test_clamping_puts_every_ratio_in_zero_one_and_leaves_other_models_alone():
    model = _model(**ADAPTIVE)
    with torch.no_grad():
        for layer, values in zip(model.model.layers, ([-0.5, 0.3], [1.7, 1.0])):
            layer.attention.span_ratio.copy_(torch.tensor(values))
    assert clamp_adaptive_spans(model) == 2
    assert _ratios(model).tolist() == [0.0, pytest.approx(0.3), 1.0, 1.0]
    plain = _model(memory_span=8)
    before = {name: parameter.clone() for name, parameter in plain.named_parameters()}
    assert clamp_adaptive_spans(plain) == 0
    assert all(torch.equal(parameter, before[name]) for name, parameter in plain.named_parameters())


@pytest.mark.parametrize("clamped", [False, True])
def test_a_trainer_with_the_callback_clamps_after_every_step(tmp_path, clamped):
    model = _model(**ADAPTIVE)
    data = Dataset.from_dict({"input_ids": [[index % 60 + 1 for index in range(row, row + 12)] for row in range(8)]})
    data = data.map(lambda row: {"labels": row["input_ids"]})
    arguments = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                  learning_rate=0.05, report_to=[], save_strategy="no", use_cpu=True,
                                  disable_tqdm=True)  # fmt: skip
    callbacks = [ClampAdaptiveSpans()] if clamped else []
    Trainer(model=model, args=arguments, train_dataset=data, callbacks=callbacks).train()
    ratios = _ratios(model)
    if clamped:
        assert ratios.min() == 0 and ratios.max() <= 1
    else:  # what the optimizer leaves: below 0
        assert ratios.max() < 0


def test_memlm_train_clamps_after_every_step(tmp_path):
    preset = tmp_path / "adaptive.json"
    model = {"model_type": "memlm_feedback_transformer", **SIZES, **ADAPTIVE}
    preset.write_text(json.dumps({"model": model, "training": {**TRAINING, "steps": 3, "save_every": 3}}))
    (tmp_path / "corpus.txt").write_text(TEXT)
    pretrain.main(["--preset", str(preset), "--output-dir", str(tmp_path / "run"), "--data",
                   str(tmp_path / "corpus.txt")])  # fmt: skip
    weights = load_file(tmp_path / "run" / "model.safetensors")
    ratios = torch.cat([tensor for name, tensor in weights.items() if name.endswith("span_ratio")])
    assert ratios.numel() == 2 * SIZES["num_attention_heads"]
    assert ratios.min() == 0 and ratios.max() <= 1  # the span loss pushed them below 0: clamped back
