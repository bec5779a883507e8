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


# Size of one character cell of the span picture, in inches, and the fewest columns a panel is drawn with (so that
# its "layer N" title fits above a text of a few characters).
CELL_WIDTH, CELL_HEIGHT, MINIMUM_COLUMNS = 0.16, 0.3, 5


@torch.no_grad()
def expire_span_figure(model, tokenizer, text: str, width: int = 64):
    """Runs an `ExpireSpanForCausalLM` on `text` and draws every layer's spans over the text: (the matplotlib figure,
    the spans as one (T,) tensor per layer). One panel per layer, sized by the text; one colour bar beside them all,
    its label above it so that it fits beside a single line of text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = model.config
    if getattr(config, "model_type", None) != "memlm_expire_span":
        raise ValueError(f"plot_expire_spans needs an Expire-Span model, got model_type {config.model_type!r}.")
    if not config.expire_memories:
        raise ValueError("This Expire-Span model has expire_memories=False: every memory lives max_span tokens.")
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(f"width (characters per line) must be a positive integer, got {width!r}.")
    input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if input_ids.shape[1] == 0:
        raise ValueError("plot_expire_spans needs a non-empty text.")
    model.eval()
    spans = [layer[0].float() for layer in model(input_ids=input_ids, output_spans=True, use_cache=False).spans]
    lines = _layout(_token_cells(tokenizer, input_ids[0].tolist()), width)
    columns = max(max(len(line) for line in lines), MINIMUM_COLUMNS)
    panel_height = len(lines) * CELL_HEIGHT + 0.35  # the cells and the panel's title
    figure, axes = plt.subplots(
        len(spans), 1, squeeze=False, layout="constrained",
        figsize=(columns * CELL_WIDTH + 1.2, len(spans) * panel_height + 0.6),  # + the colour bar and its label
    )  # fmt: skip
    axes = axes[:, 0].tolist()
    colour_map = matplotlib.colormaps["viridis"]
    for layer, (axis, layer_spans) in enumerate(zip(axes, spans)):
        grid = torch.full((len(lines), columns), float("nan"))
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
        axis.set_title(f"layer {layer + 1}", fontsize=9, loc="left")
    colour_bar = figure.colorbar(image, ax=axes, location="right", aspect=max(4, 12 * len(spans)))
    colour_bar.ax.tick_params(labelsize=8)
    colour_bar.ax.set_title(f"span e_i\n(tokens,\nL = {config.max_span})", fontsize=8, loc="left")
    return figure, spans


def plot_expire_spans(model, tokenizer, text: str, path: str | Path, width: int = 64) -> list[torch.Tensor]:
    """Runs an `ExpireSpanForCausalLM` on `text`, draws every layer's spans over the text into the PNG at `path`
    (`width` characters per line) and returns the spans (one (T,) tensor per layer)."""
    import matplotlib.pyplot as plt

    figure, spans = expire_span_figure(model, tokenizer, text, width)
    # "tight" grows the picture to whatever the colour bar's label needs beside a text of a few characters.
    figure.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.05)
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
