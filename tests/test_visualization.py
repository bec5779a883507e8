"""memlm.visualization: the span picture's layout and values, the Feedback weights, and wrong models refused."""

import pytest
import torch

from memlm import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    ExpireSpanConfig,
    ExpireSpanForCausalLM,
    FeedbackTransformerConfig,
    FeedbackTransformerForCausalLM,
)
from memlm.tokenization import byte_level_tokenizer
from memlm.training.tasks.common import task_tokenizer
from memlm.visualization import _layout, _token_cells, plot_expire_spans, plot_feedback_layer_weights

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


def test_token_cells_keep_words_apart_and_show_whitespace():
    words = task_tokenizer(["red", "door", "?"])
    assert _token_cells(words, words("red door ?").input_ids) == ["red ", "door ", "? "]
    assert _token_cells(byte_level_tokenizer(), list(b"a b\n")) == ["a", "·", "b", "↵"]


def test_layout_wraps_at_the_width_and_after_newlines():
    lines = _layout(["ab", "cd", "e↵", "fgh"], width=4)
    assert ["".join(character for _, character in line) for line in lines] == ["abcd", "e↵", "fgh"]
    assert [index for index, _ in lines[0]] == [0, 0, 1, 1]


def test_plot_expire_spans_returns_the_model_spans(tmp_path):
    torch.manual_seed(0)
    model = ExpireSpanForCausalLM(ExpireSpanConfig(vocab_size=258, max_span=32, ramp=4, block_size=16, **SIZES))
    with torch.no_grad():
        model.model.layers[1].attention.span_predictor.weight.normal_()
    tokenizer = byte_level_tokenizer()
    spans = plot_expire_spans(model, tokenizer, "memories expire", tmp_path / "spans.png")
    expected = model(input_ids=tokenizer("memories expire", return_tensors="pt").input_ids, output_spans=True).spans
    assert len(spans) == 2 and all(torch.equal(got, want[0]) for got, want in zip(spans, expected))
    assert spans[1].std() > 0 and (tmp_path / "spans.png").stat().st_size > 1000


def test_plot_feedback_layer_weights_is_the_softmax(tmp_path):
    model = FeedbackTransformerForCausalLM(FeedbackTransformerConfig(vocab_size=16, memory_span=8, **SIZES))
    with torch.no_grad():
        model.model.layer_weights.copy_(torch.tensor([0.0, 1.0, 2.0]))
    weights = plot_feedback_layer_weights(model, tmp_path / "weights.png")
    assert torch.allclose(weights, torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0))
    assert (tmp_path / "weights.png").is_file()


def test_models_without_a_picture_are_refused(tmp_path):
    deltanet = DeltaNetForCausalLM(DeltaNetConfig(vocab_size=258, **SIZES))
    with pytest.raises(ValueError, match="needs an Expire-Span model"):
        plot_expire_spans(deltanet, byte_level_tokenizer(), "x", tmp_path / "x.png")
    with pytest.raises(ValueError, match="needs a Feedback Transformer"):
        plot_feedback_layer_weights(deltanet, tmp_path / "x.png")
    fixed = ExpireSpanForCausalLM(ExpireSpanConfig(vocab_size=258, max_span=8, expire_memories=False, **SIZES))
    with pytest.raises(ValueError, match="expire_memories=False"):
        plot_expire_spans(fixed, byte_level_tokenizer(), "x", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
