"""Pictures of what a trained model remembers.

- `plot_expire_spans`: an Expire-Span model's text coloured by the span e_i each token's memory gets, one panel per
  layer (as the Expire-Span paper's Fig. 8 and 11): bright tokens are kept long, dark ones expire at once.
- `plot_feedback_layer_weights`: the Feedback Transformer's memory mix softmax(w)_l over the embedding and the
  layers (paper Eq. 1), i.e. how much each layer's output contributes to the memory every layer reads.

`memlm plot-memory MODEL --text ... --output memory.png` draws the one that fits the saved model.
"""

from pathlib import Path

import torch

WHITESPACE_GLYPHS = {"\n": "↵", "\t": "→", " ": "·"}


def _token_cells(tokenizer, input_ids: list[int]) -> list[str]:
    """One display string per token. Word-level tokenizers (whose decoded text puts spaces between tokens) get a
    trailing space cell so words stay apart; whitespace inside a token is drawn as a visible glyph."""
    pieces = [tokenizer.decode([token]) for token in input_ids]
    spaced = len(pieces) > 1 and tokenizer.decode(input_ids) == " ".join(pieces) != "".join(pieces)
    return [
        "".join(WHITESPACE_GLYPHS.get(character, character) for character in piece) + (" " if spaced else "")
        for piece in pieces
    ]


def _layout(cells: list[str], width: int) -> list[list[tuple[int, str]]]:
    """Wraps the token cells into lines of at most `width` characters, also after every newline: per line,
    (token index, character) pairs."""
    lines, line = [], []
    for index, cell in enumerate(cells):
        if line and len(line) + len(cell) > width:
            lines.append(line)
            line = []
        line += [(index, character) for character in cell[:width]]
        if WHITESPACE_GLYPHS["\n"] in cell:
            lines.append(line)
            line = []
    return lines + ([line] if line else [])


@torch.no_grad()
def plot_expire_spans(model, tokenizer, text: str, path: str | Path, width: int = 64) -> list[torch.Tensor]:
    """Runs an `ExpireSpanForCausalLM` on `text`, draws every layer's spans over the text into the PNG at `path`
    and returns the spans (one (T,) tensor per layer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = model.config
    if getattr(config, "model_type", None) != "memlm_expire_span":
        raise ValueError(f"plot_expire_spans needs an Expire-Span model, got model_type {config.model_type!r}.")
    if not config.expire_memories:
        raise ValueError("This Expire-Span model has expire_memories=False: every memory lives max_span tokens.")
    input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if input_ids.shape[1] == 0:
        raise ValueError("plot_expire_spans needs a non-empty text.")
    model.eval()
    spans = [layer[0].float() for layer in model(input_ids=input_ids, output_spans=True, use_cache=False).spans]
    lines = _layout(_token_cells(tokenizer, input_ids[0].tolist()), width)
    width = max(len(line) for line in lines)
    figure, axes = plt.subplots(len(spans), 1, figsize=(width * 0.16 + 1.5, len(spans) * (len(lines) * 0.3 + 0.6)))
    axes = [axes] if len(spans) == 1 else list(axes)
    colour_map = matplotlib.colormaps["viridis"]
    for layer, (axis, layer_spans) in enumerate(zip(axes, spans)):
        grid = torch.full((len(lines), width), float("nan"))
        for row, line in enumerate(lines):
            for column, (index, _) in enumerate(line):
                grid[row, column] = layer_spans[index]
        image = axis.imshow(grid.numpy(), cmap=colour_map, vmin=0, vmax=config.max_span, aspect="auto")
        for row, line in enumerate(lines):
            for column, (index, character) in enumerate(line):
                bright = float(layer_spans[index]) > 0.6 * config.max_span
                axis.text(column, row, character, ha="center", va="center", fontsize=8, family="monospace",
                          color="black" if bright else "white")  # fmt: skip
        axis.set_xticks([])
        axis.set_yticks([])
        axis.set_title(f"layer {layer + 1}: span e_i of each token's memory (max_span L = {config.max_span})")
        figure.colorbar(image, ax=axis, fraction=0.02, pad=0.01, label="span (tokens)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return spans


def plot_feedback_layer_weights(model, path: str | Path) -> torch.Tensor:
    """Draws the Feedback Transformer's memory mix softmax(w) (embedding, layer 1..L) as bars into the PNG at
    `path` and returns the weights."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if getattr(model.config, "model_type", None) != "memlm_feedback_transformer":
        raise ValueError(
            f"plot_feedback_layer_weights needs a Feedback Transformer, got model_type {model.config.model_type!r}."
        )
    base = getattr(model, "model", model)
    weights = torch.softmax(base.layer_weights.detach().float(), dim=0)
    names = ["embedding"] + [f"layer {index}" for index in range(1, len(weights))]
    figure, axis = plt.subplots(figsize=(max(6.0, 1.2 * len(names) + 2), 3.2))
    axis.bar(names, weights.numpy(), color="tab:blue")
    for position, weight in enumerate(weights.tolist()):
        axis.text(position, weight, f"{weight:.2f}", ha="center", va="bottom")
    axis.set_ylim(0, max(1.0, float(weights.max()) * 1.15))
    axis.set_ylabel("softmax(w)_l")
    axis.set_title("Feedback memory: the weight of each layer's output\nin m_t = Σ_l softmax(w)_l x_t^l (Eq. 1)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return weights
