"""Track an agent's position from its actions: the Random Walk task of the Feedback Transformer (Fan et al., 2021,
Sec. 4.1.2 "Limited state updates", App. 7.1).

An agent starts at a fixed cell of an N×N grid (the paper: 8×8), facing a fixed direction, and takes random actions:
`forward` (one cell in the direction it faces), `left` and `right` (turn on the spot). A forward move that would
leave the grid is ignored. The model must output the agent's cell after every action. The state (cell and
direction) is trivial to keep up to date one action at a time, but each action's effect depends on the direction at
that point and on whether the agent is at a wall, so solving it "all at once" from the list of actions is hard: the
paper's standard Transformer reaches 68 % where the Feedback Transformer reaches 100 % (Table 1).

Here the agent starts in the centre cell (row N // 2, column N // 2), facing north (towards row 0); the paper does
not say which cell or direction. Each action is drawn uniformly from the three.

Layout ("separate outputs", see `common`): an episode of K actions is

    input_ids:  reset  a_1  a_2  …  a_K  end
    labels:     -100   -100 c_1  …  c_{K-1}  c_K

where c_k is the cell symbol (`r{row}c{column}`) after action a_k: the output for input position t is `labels[t+1]`,
so the cells never appear in the input, and `end` only gives the last action's output a place. Every action's output
is scored; the reset's (the start cell) is not.
"""

from .common import IGNORE, check_integer, examples_to_dataset, make_generator, task_tokenizer

RESET = "reset"
END = "end"
ACTIONS = ("forward", "left", "right")
# Row and column steps of the four directions, clockwise from north: `right` turns to the next, `left` to the previous.
DIRECTION_STEPS = ((-1, 0), (0, 1), (1, 0), (0, -1))
START_DIRECTION = 0  # north


def random_walk_symbols(grid_size: int = 5) -> list[str]:
    """The task's symbols in vocabulary order: `reset`, `end`, the actions `forward left right`, then the N·N cells
    `r0c0 r0c1 …` row by row (symbol i has id i + 1)."""
    check_integer("grid_size", grid_size, minimum=2)
    cells = [f"r{row}c{column}" for row in range(grid_size) for column in range(grid_size)]
    return [RESET, END, *ACTIONS, *cells]


def random_walk_tokenizer(grid_size: int = 5):
    """The word-level 🤗 tokenizer of the task: `<pad>` (id 0), then the symbols of `random_walk_symbols`."""
    return task_tokenizer(random_walk_symbols(grid_size))


def start_cell(grid_size: int) -> tuple[int, int]:
    """The fixed cell every episode starts from: the centre (row N // 2, column N // 2)."""
    check_integer("grid_size", grid_size, minimum=2)
    return grid_size // 2, grid_size // 2


def walk(actions: list[str], grid_size: int = 5) -> list[tuple[int, int]]:
    """Executes `actions` (names from `ACTIONS`, or `reset`) from the start and returns the cell (row, column) after
    each one (App. 7.1: a forward move out of the grid is ignored; a reset puts the agent back at the start)."""
    check_integer("grid_size", grid_size, minimum=2)
    (row, column), direction = start_cell(grid_size), START_DIRECTION
    cells = []
    for action in actions:
        if action == RESET:
            (row, column), direction = start_cell(grid_size), START_DIRECTION
        elif action == "left":
            direction = (direction - 1) % 4
        elif action == "right":
            direction = (direction + 1) % 4
        elif action == "forward":
            row_step, column_step = DIRECTION_STEPS[direction]
            if 0 <= row + row_step < grid_size and 0 <= column + column_step < grid_size:
                row, column = row + row_step, column + column_step
        else:
            raise ValueError(f"An action must be one of {ACTIONS + (RESET,)}, got {action!r}.")
        cells.append((row, column))
    return cells


def random_walk_dataset(num_episodes: int, grid_size: int = 5, episode_length: int = 24, seed: int = 0):
    """A 🤗 `Dataset` of random-walk episodes, columns `input_ids` and `labels` (layout in the module docstring).

    Args:
        num_episodes: how many episodes (examples) to draw.
        grid_size: N, the side of the grid (the paper: 8); N·N cell symbols, chance level about 1 / (N·N).
        episode_length: K, the number of actions per episode (the paper: 100); an example has K + 2 tokens.
        seed: seed of the `random.Random` that draws the actions; the same seed gives the same dataset.
    """
    check_integer("num_episodes", num_episodes, minimum=1)
    check_integer("episode_length", episode_length, minimum=1)
    symbols = random_walk_symbols(grid_size)
    ids = {symbol: index + 1 for index, symbol in enumerate(symbols)}
    generator = make_generator(seed)
    examples = []
    for _ in range(num_episodes):
        actions = [generator.choice(ACTIONS) for _ in range(episode_length)]
        cells = walk(actions, grid_size)
        input_ids = [ids[RESET]] + [ids[action] for action in actions] + [ids[END]]
        labels = [IGNORE, IGNORE] + [ids[f"r{row}c{column}"] for row, column in cells]
        examples.append({"input_ids": input_ids, "labels": labels})
    return examples_to_dataset(examples)


def solve_random_walk(input_ids: list[int], grid_size: int = 5) -> list[int]:
    """Brute-force solver: replays the actions in `input_ids` (resets included, so concatenated episodes work too)
    and predicts, in the `labels` convention, the cell after the action at position t at position t + 1; -100
    elsewhere."""
    symbols = random_walk_symbols(grid_size)
    ids = {symbol: index + 1 for index, symbol in enumerate(symbols)}
    words = [symbols[token - 1] if 1 <= token <= len(symbols) else None for token in input_ids]
    predictions = [IGNORE] * len(input_ids)
    positions = [position for position, word in enumerate(words) if word in ACTIONS or word == RESET]
    cells = walk([words[position] for position in positions], grid_size)
    for position, (row, column) in zip(positions, cells):
        if words[position] != RESET and position + 1 < len(input_ids):
            predictions[position + 1] = ids[f"r{row}c{column}"]
    return predictions


__all__ = [
    "random_walk_dataset",
    "random_walk_symbols",
    "random_walk_tokenizer",
    "solve_random_walk",
    "start_cell",
    "walk",
]
