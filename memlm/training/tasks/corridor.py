"""Remember one token across distractors: the Corridor task of Expire-Span (Sukhbaatar et al., 2021, Sec. 5.2
"Remembering One Key Piece of Information", App. A.3.1), as a sequence task.

In the paper an agent sees an object of one of two colours at the start of a corridor of length U(3, 200), walks to
its end and must take the door of that colour. The memory needs almost nothing: one colour. A model that can forget
keeps that one memory and expires the corridor; a fixed-span model (Transformer-XL) needs a span as long as the
corridor (Fig. 4, left). Here the walk is a run of random distractor tokens, so that nothing but the colour is worth
keeping, and the door is a query token after which the colour must be written.

Layout ("answer in the stream", see `common`): the tokens are the colours `colour0 …`, the distractors `cell0 …` and
`<door>`; an example is

    colour  cell … cell  <door>  colour        labels: -100 … -100 colour
            └ length ┘

so the logits at `<door>` are scored against the colour; nothing else is scored. The colours are balanced: each
appears equally often (±1).
"""

from .common import IGNORE, check_integer, examples_to_dataset, make_generator, task_tokenizer


def corridor_symbols(num_colours: int = 2, num_distractors: int = 8) -> list[str]:
    """The task's symbols in vocabulary order: colours `colour0 …` (ids 1 … C), distractors `cell0 …` (ids C+1 …
    C+S), then `<door>` (id C+S+1)."""
    check_integer("num_colours", num_colours)
    check_integer("num_distractors", num_distractors)
    colours = [f"colour{index}" for index in range(num_colours)]
    return colours + [f"cell{index}" for index in range(num_distractors)] + ["<door>"]


def corridor_tokenizer(num_colours: int = 2, num_distractors: int = 8):
    """The word-level 🤗 tokenizer of the task: `<pad>` (id 0), then the symbols of `corridor_symbols`."""
    return task_tokenizer(corridor_symbols(num_colours, num_distractors))


def corridor_dataset(
    num_examples: int,
    num_colours: int = 2,
    num_distractors: int = 8,
    min_length: int = 3,
    max_length: int = 200,
    seed: int = 0,
):
    """A 🤗 `Dataset` of corridor examples, columns `input_ids`, `labels`, `colour` (0 … C-1) and `length`.

    Args:
        num_examples: how many examples to draw.
        num_colours: C, the number of colours (the paper: 2, red and blue); chance level is 1/C.
        num_distractors: S, the number of distractor symbols the corridor is drawn from (uniformly, independently
            of the colour, so they carry no information about it).
        min_length, max_length: the corridor length (distractor tokens between the colour and the door) is drawn
            uniformly in [min_length, max_length] (the paper: U(3, 200)). The answer reaches back length + 1 tokens.
        seed: seed of the `random.Random` that draws everything; the same seed gives the same dataset.
    """
    check_integer("num_examples", num_examples)
    symbols = corridor_symbols(num_colours, num_distractors)
    check_integer("min_length", min_length)
    check_integer("max_length", max_length)
    if max_length < min_length:
        raise ValueError(f"max_length must be >= min_length ({min_length}), got {max_length}.")
    door = len(symbols)  # the last symbol; symbol i has id i + 1
    generator = make_generator(seed)
    # Balanced answers: the colours cycled, then shuffled.
    colours = [index % num_colours for index in range(num_examples)]
    generator.shuffle(colours)
    examples = []
    for colour in colours:
        length = generator.randint(min_length, max_length)
        corridor = [1 + num_colours + generator.randrange(num_distractors) for _ in range(length)]
        answer = 1 + colour
        input_ids = [answer] + corridor + [door, answer]
        labels = [IGNORE] * (len(input_ids) - 1) + [answer]
        examples.append({"input_ids": input_ids, "labels": labels, "colour": colour, "length": length})
    return examples_to_dataset(examples)


def solve_corridor(input_ids: list[int]) -> list[int]:
    """Brute-force solver: the colour is the token at the start of the corridor; it is predicted at the answer
    position (after the door, the last position), -100 elsewhere (the `labels` convention of `solver_accuracy`)."""
    if len(input_ids) < 4:
        raise ValueError(f"input_ids must hold a colour, a corridor, the door and the answer, got {input_ids}.")
    return [IGNORE] * (len(input_ids) - 1) + [input_ids[0]]


__all__ = ["corridor_dataset", "corridor_symbols", "corridor_tokenizer", "solve_corridor"]
