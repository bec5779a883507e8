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
from memlm.visualization import (
    _layout,
    _token_cells,
    expire_span_figure,
    plot_expire_spans,
    plot_feedback_layer_weights,
)

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


def _expire_span_model(layers: int) -> ExpireSpanForCausalLM:
    torch.manual_seed(0)
    sizes = {**SIZES, "num_hidden_layers": layers}
    model = ExpireSpanForCausalLM(ExpireSpanConfig(vocab_size=258, max_span=1000, ramp=4, block_size=16, **sizes))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attention.span_predictor.weight.normal_()
    return model


@pytest.mark.parametrize(
    ("layers", "text", "width"), [(1, "hi", 64), (2, "hi there", 64), (3, "def f(x):\n    return x", 8)]
)
def test_the_span_picture_of_a_short_text_is_whole(tmp_path, layers, text, width):
    """Nothing is cut at the picture's edges (its outer frame is blank background), whatever the text's length."""
    from PIL import Image

    plot_expire_spans(_expire_span_model(layers), byte_level_tokenizer(), text, tmp_path / "spans.png", width=width)
    pixels = torch.tensor(list(Image.open(tmp_path / "spans.png").convert("L").tobytes()))  # one byte per pixel
    picture_width, picture_height = Image.open(tmp_path / "spans.png").size
    pixels = pixels.view(picture_height, picture_width)
    frame = torch.cat([pixels[:2].flatten(), pixels[-2:].flatten(), pixels[:, :2].flatten(), pixels[:, -2:].flatten()])
    assert (frame == 255).all(), "something is drawn across the picture's edge (clipped)"


@pytest.mark.parametrize(("layers", "text"), [(1, "hi"), (2, "hi there"), (4, "a longer text that wraps " * 4)])
def test_the_span_picture_labels_overlap_nothing(layers, text):
    import matplotlib.pyplot as plt

    figure, spans = expire_span_figure(_expire_span_model(layers), byte_level_tokenizer(), text)
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        panels, colour_bar = figure.axes[:layers], figure.axes[layers]
        assert len(figure.axes) == layers + 1 and len(spans) == layers
        titles = [panel.title if panel.title.get_text() else panel._left_title for panel in panels]
        assert [title.get_text() for title in titles] == [f"layer {index + 1}" for index in range(layers)]
        label = colour_bar.title if colour_bar.title.get_text() else colour_bar._left_title
        assert "span e_i" in label.get_text() and "L = 1000" in label.get_text()
        colour_bar_texts = [label, *colour_bar.get_yticklabels()]
        boxes = [panel.get_window_extent(renderer) for panel in panels]
        for text_artist in colour_bar_texts:
            box = text_artist.get_window_extent(renderer)
            assert not any(box.overlaps(panel) for panel in boxes), text_artist.get_text()
            assert not any(box.overlaps(title.get_window_extent(renderer)) for title in titles), text_artist.get_text()
        for index, title in enumerate(titles):
            box = title.get_window_extent(renderer)
            assert not any(box.overlaps(panel) for panel in boxes), f"title of layer {index + 1}"
    finally:
        plt.close(figure)


def test_the_span_picture_needs_a_positive_width(tmp_path):
    with pytest.raises(ValueError, match="width .* must be a positive integer, got 0"):
        plot_expire_spans(_expire_span_model(1), byte_level_tokenizer(), "x", tmp_path / "x.png", width=0)
    assert not (tmp_path / "x.png").exists()


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
