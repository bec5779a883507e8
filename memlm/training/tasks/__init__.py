"""The papers' synthetic tasks as deterministic generators of 🤗 `datasets` (SPEC §7).

| name | module | paper |
| --- | --- | --- |
| `associative-retrieval` | `associative_retrieval` | DeltaNet Sec. 6.1, settings 1 (capacity) and 2 (update rules) |
| `far-copy` | `far_copy` | Expire-Span Sec. 5.3, "extremely long copy", scaled down |
| `corridor` | `corridor` | Expire-Span Sec. 5.2, Corridor: one token to remember across distractors |
| `random-walk` | `random_walk` | Feedback Transformer Sec. 4.1.2 and App. 7.1 |
| `algorithmic` | `algorithmic` | Feedback Transformer Sec. 4.1.2 and App. 7.4, programs over 3 or 5 variables |

Every module offers `<module>_dataset(...)` (a 🤗 `Dataset` with `input_ids` and `labels`), `<module>_tokenizer(...)`
(a word-level `PreTrainedTokenizerFast` over the task's symbols), `<module>_symbols(...)` and
`solve_<module>(input_ids, ...)` (a brute-force solver that gets every target right). `common` holds the example
format, the batching, accuracy and a small training loop. `task(name)` finds a task by name.
"""

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

TASKS = {
    "associative-retrieval": "associative_retrieval",
    "far-copy": "far_copy",
    "corridor": "corridor",
    "random-walk": "random_walk",
    "algorithmic": "algorithmic",
}


@dataclass(frozen=True)
class Task:
    """One task's functions. The dataset's keyword options that the tokenizer or the solver also take (e.g.
    `num_keys`, `grid_size`) are passed on to them by `tokenizer_for` and `solver_for`."""

    name: str
    dataset: Callable
    tokenizer: Callable
    solve: Callable

    def _shared(self, function: Callable, options: dict) -> dict:
        parameters = inspect.signature(function).parameters
        return {key: value for key, value in options.items() if key in parameters}

    def tokenizer_for(self, **options):
        """The task's tokenizer for a dataset built with these options (the dataset's defaults for the rest)."""
        return self.tokenizer(**self._shared(self.tokenizer, {**self.options(), **options}))

    def solver_for(self, **options) -> Callable[[list[int]], list[int]]:
        """The brute-force solver for a dataset built with these options (the dataset's defaults for the rest)."""
        shared = self._shared(self.solve, {**self.options(), **options})
        return lambda input_ids: self.solve(input_ids, **shared)

    def options(self) -> dict:
        """The dataset function's keyword options and their defaults."""
        return {
            name: parameter.default
            for name, parameter in inspect.signature(self.dataset).parameters.items()
            if parameter.default is not inspect.Parameter.empty
        }


def task(name: str) -> Task:
    """The task called `name` (one of `TASKS`)."""
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; the tasks are: {', '.join(TASKS)}.")
    module_name = TASKS[name]
    module = importlib.import_module(f"{__name__}.{module_name}")
    return Task(
        name=name,
        dataset=getattr(module, f"{module_name}_dataset"),
        tokenizer=getattr(module, f"{module_name}_tokenizer"),
        solve=getattr(module, f"solve_{module_name}"),
    )
