"""Execute a small program and print its variables: the Algorithmic task of the Feedback Transformer (Fan et al.,
2021, Sec. 4.1.2 "Limited state updates", App. 7.4, example program in Table 7).

A program is a run of random statements over 3 or 5 variables whose values stay in 1..10:

- initialisation `x = 5 ;`: once per variable, before any other use of it;
- increment and decrement `x ++ ;`, `x -- ;`;
- `print x ;`: the only statement with an output, the variable's current value;
- conditional `if x == 4 : y -- ;`, `if x < 7 : y ++ ;`, `if x > z : z -- ;`: the nested statement (an increment or
  decrement; no nested conditional, print or initialisation) runs only if the condition holds.

To print the right value the model has to keep every variable's value up to date statement by statement, and a
conditional cannot be executed without the current values, which may themselves depend on earlier conditionals. The
paper's standard Transformer reaches 33.7 % (3 variables) and 37.5 % (5 variables) where the Feedback Transformer
reaches 99.1 % and 92.6 % (Table 1).

Choices the paper leaves open, made here:

- conditions: `==` against a constant (App. 7.4: "if x==4"), `<` and `>` against a constant or another variable (as in
  Table 7). For `==` the constant is the variable's current value half of the time (else uniform in 1..10), so that
  equality tests hold about as often as the order tests;
- statement kinds: while a variable is uninitialised, an initialisation is drawn with probability 1/4 (always for the
  first statement); otherwise print, increment/decrement and conditional with weights 0.3, 0.35, 0.35; the last
  statement is always a print, so every program has an output;
- only statements that keep every value in 1..10 are drawn: an increment never applies to 10 and a decrement never
  to 1, the nested statement of a conditional included, whether or not its condition holds.

Tokens are words (`x`, `=`, `5`, `;`, `print`, `++`, `--`, `if`, `==`, `<`, `>`, `:`). Layout ("separate outputs",
see `common`): `input_ids` are the program's words; for `print x ;` with the variable at position t, `labels[t+1]`
(the position of the `;`) is the printed value, so the outputs never appear in the input. Nothing else is scored.
"""

from typing import NamedTuple

from .common import IGNORE, check_integer, examples_to_dataset, make_generator, task_tokenizer

VARIABLES = ("x", "y", "z", "u", "v")
VALUES = tuple(str(value) for value in range(1, 11))
MINIMUM_VALUE, MAXIMUM_VALUE = 1, 10
UPDATES = ("++", "--")
COMPARISONS = ("==", "<", ">")
KEYWORDS = ("=", *UPDATES, "print", "if", *COMPARISONS, ":", ";")
NUM_VARIABLES_CHOICES = (3, 5)
INITIALISE_PROBABILITY = 0.25
KIND_WEIGHTS = {"print": 0.3, "update": 0.35, "conditional": 0.35}


class Execution(NamedTuple):
    """What running a program gives: `outputs`, one (label position, printed value) per print, the position being
    the one right after the printed variable; `trace`, the variables' values after each statement."""

    outputs: list[tuple[int, int]]
    trace: list[dict[str, int]]


def algorithmic_symbols() -> list[str]:
    """The task's symbols in vocabulary order: the variables `x y z u v`, the values `1 … 10`, then the keywords
    `= ++ -- print if == < > : ;` (symbol i has id i + 1). The same for 3 and 5 variables."""
    return [*VARIABLES, *VALUES, *KEYWORDS]


def algorithmic_tokenizer():
    """The word-level 🤗 tokenizer of the task: `<pad>` (id 0), then the symbols of `algorithmic_symbols`."""
    return task_tokenizer(algorithmic_symbols())


def generate_program(generator, num_variables: int = 3, num_statements: int = 12) -> list[list[str]]:
    """One random program as a list of statements, each a list of words ending with `;` (drawn from `generator`, a
    `random.Random`, with the rules of the module docstring)."""
    _check_choice("num_variables", num_variables, NUM_VARIABLES_CHOICES)
    check_integer("num_statements", num_statements, minimum=2)
    values: dict[str, int] = {}
    statements = []
    for index in range(num_statements):
        uninitialised = [name for name in VARIABLES[:num_variables] if name not in values]
        last = index == num_statements - 1
        if not values or (not last and uninitialised and generator.random() < INITIALISE_PROBABILITY):
            name, value = generator.choice(uninitialised), generator.randint(MINIMUM_VALUE, MAXIMUM_VALUE)
            values[name] = value
            statements.append([name, "=", str(value), ";"])
            continue
        names = sorted(values)
        kind = "print" if last else generator.choices(*zip(*KIND_WEIGHTS.items()))[0]
        if kind == "print":
            statements.append(["print", generator.choice(names), ";"])
            continue
        target = generator.choice(names)
        update = _draw_update(generator, values[target])
        if kind == "update":
            statements.append([target, update, ";"])
            values[target] += 1 if update == "++" else -1
            continue
        subject, comparison = generator.choice(names), generator.choice(COMPARISONS)
        others = [name for name in names if name != subject]
        if comparison == "==":
            constant = values[subject] if generator.random() < 0.5 else generator.randint(MINIMUM_VALUE, MAXIMUM_VALUE)
            operand = str(constant)
        elif others and generator.random() < 0.5:
            operand = generator.choice(others)
        else:
            operand = str(generator.randint(MINIMUM_VALUE, MAXIMUM_VALUE))
        statements.append(["if", subject, comparison, operand, ":", target, update, ";"])
        if _holds(values[subject], comparison, values[operand] if operand in values else int(operand)):
            values[target] += 1 if update == "++" else -1
    return statements


def algorithmic_dataset(num_programs: int, num_variables: int = 3, num_statements: int = 12, seed: int = 0):
    """A 🤗 `Dataset` of programs, columns `input_ids` and `labels` (layout in the module docstring).

    Args:
        num_programs: how many programs (examples) to draw.
        num_variables: 3 or 5 (the paper's two settings); the variables are the first of `x y z u v`.
        num_statements: statements per program, at least 2 (the paper: 100); about 4.5 tokens per statement.
        seed: seed of the `random.Random` that draws the programs; the same seed gives the same dataset.
    """
    check_integer("num_programs", num_programs, minimum=1)
    ids = {symbol: index + 1 for index, symbol in enumerate(algorithmic_symbols())}
    generator = make_generator(seed)
    examples = []
    for _ in range(num_programs):
        words = [
            word for statement in generate_program(generator, num_variables, num_statements) for word in statement
        ]
        labels = [IGNORE] * len(words)
        for position, value in execute_program(words).outputs:
            labels[position] = ids[str(value)]
        examples.append({"input_ids": [ids[word] for word in words], "labels": labels})
    return examples_to_dataset(examples)


def execute_program(words: list[str], check: bool = True) -> Execution:
    """Runs a program given as words and returns its `Execution`. Raises `ValueError` on a malformed statement or a
    variable used before its initialisation, and, with `check`, on a variable initialised twice or a value leaving
    1..10: every generated program runs without error. `check=False` runs programs that break those two rules (a
    value may then leave 1..10), e.g. to score a solver that executes the program wrongly."""
    values: dict[str, int] = {}
    outputs, trace = [], []

    def value_of(word: str, start: int) -> int:
        if word in VALUES:
            return int(word)
        if word not in values:
            raise ValueError(f"Variable {word!r} is used before its initialisation (statement at word {start}).")
        return values[word]

    def apply(name: str, update: str, start: int) -> None:
        values[name] = value_of(name, start) + (1 if update == "++" else -1)
        if check and not MINIMUM_VALUE <= values[name] <= MAXIMUM_VALUE:
            raise ValueError(f"{name} leaves {MINIMUM_VALUE}..{MAXIMUM_VALUE} (statement at word {start}).")

    for start, statement in _split_statements(words):
        match statement:
            case [name, "=", value] if name in VARIABLES and value in VALUES:
                if check and name in values:
                    raise ValueError(f"Variable {name!r} is initialised twice (statement at word {start}).")
                values[name] = int(value)
            case [name, update] if name in VARIABLES and update in UPDATES:
                apply(name, update, start)
            case ["print", name] if name in VARIABLES:
                outputs.append((start + 2, value_of(name, start)))
            case ["if", subject, comparison, operand, ":", name, update] if (
                subject in VARIABLES
                and comparison in COMPARISONS
                and (operand in VARIABLES or operand in VALUES)
                and name in VARIABLES
                and update in UPDATES
            ):
                if _holds(value_of(subject, start), comparison, value_of(operand, start)):
                    apply(name, update, start)
            case _:
                raise ValueError(f"Malformed statement at word {start}: {' '.join(statement)!r}.")
        trace.append(dict(values))
    return Execution(outputs, trace)


def solve_algorithmic(input_ids: list[int]) -> list[int]:
    """Brute-force solver: runs the program in `input_ids` and predicts, in the `labels` convention, each printed
    value at the position right after the printed variable; -100 elsewhere."""
    symbols = algorithmic_symbols()
    words = [symbols[token - 1] if 1 <= token <= len(symbols) else "<pad>" for token in input_ids]
    predictions = [IGNORE] * len(input_ids)
    for position, value in execute_program(words).outputs:
        predictions[position] = symbols.index(str(value)) + 1
    return predictions


def program_text(input_ids: list[int], labels: list[int] | None = None) -> str:
    """A program as plain text, one statement per line in the style of Table 7 (`if x > z: z --;`); with `labels`,
    each print is followed by its output (`print x;  -> 7`)."""
    symbols = algorithmic_symbols()
    words = [symbols[token - 1] if 1 <= token <= len(symbols) else "<pad>" for token in input_ids]
    if labels is not None and len(labels) != len(words):
        raise ValueError(f"labels must have one entry per input id ({len(words)}), got {len(labels)}.")
    lines = []
    for start, statement in _split_statements(words):
        line = " ".join(statement).replace(" :", ":") + ";"
        output_position = start + 2
        if labels is not None and statement[0] == "print" and labels[output_position] != IGNORE:
            line += f"  -> {symbols[labels[output_position] - 1]}"
        lines.append(line)
    return "\n".join(lines)


def _split_statements(words: list[str]) -> list[tuple[int, list[str]]]:
    """(position of the first word, words without the `;`) of each statement; left padding is skipped."""
    statements, start = [], 0
    while start < len(words) and words[start] == "<pad>":
        start += 1
    for position in range(start, len(words)):
        if words[position] == ";":
            statements.append((start, words[start:position]))
            start = position + 1
    if start < len(words):
        raise ValueError(f"The program must end with ';', got {' '.join(words[start:])!r} at its end.")
    return statements


def _draw_update(generator, value: int) -> str:
    """`++` or `--`, whichever keep `value` in 1..10 (both when it is inside)."""
    allowed = [update for update in UPDATES if MINIMUM_VALUE <= value + (1 if update == "++" else -1) <= MAXIMUM_VALUE]
    return generator.choice(allowed)


def _holds(left: int, comparison: str, right: int) -> bool:
    return left == right if comparison == "==" else left < right if comparison == "<" else left > right


def _check_choice(name: str, value, choices: tuple) -> None:
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


__all__ = [
    "Execution",
    "algorithmic_dataset",
    "algorithmic_symbols",
    "algorithmic_tokenizer",
    "execute_program",
    "generate_program",
    "program_text",
    "solve_algorithmic",
]
