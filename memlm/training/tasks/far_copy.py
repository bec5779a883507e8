"""Copy with a far-away key, the "Extremely Long Copy" task of Expire-Span (Sukhbaatar et al., 2021, Sec. 5.3),
at small scale.

The model sees a run of n `A` tokens far in the past, then a long gap of `B` tokens, then a query marker, and must
write the right quantity: n `A`s and an end token. Nothing in the gap tells n, and n is drawn independently of the gap
length, so a model whose memory does not reach back over the gap can only guess; a model that keeps the few `A`
memories (and lets the `B`s expire) answers with a small memory. The paper uses gaps of up to 128k tokens and compares
maximum spans (Table 1); here the gaps are tens of tokens, so that a tiny model trains on a CPU in seconds.

Layout ("answer in the stream", see `common`): with symbols `A`, `B`, `<query>`, `<end>` (ids 1-4), an example is

    A … A  B … B  <query>  A … A  <end>        labels: -100 on the prompt, then  A … A <end>
    └ n ┘  └ gap ┘         └ n ┘

so the logits at the query are scored against the first answer `A`, and those at the answer's last `A` against
`<end>`: n + 1 scored tokens. The counts n are balanced: each of 1 … max_count appears equally often (±1).
"""

from .common import IGNORE, check_integer, examples_to_dataset, make_generator, task_tokenizer

SYMBOLS = ("A", "B", "<query>", "<end>")
A, B, QUERY, END = range(1, len(SYMBOLS) + 1)  # ids: symbol i → i + 1, `<pad>` is 0


def far_copy_symbols() -> list[str]:
    """The task's symbols in vocabulary order: `A`, `B`, `<query>`, `<end>` (ids 1 … 4)."""
    return list(SYMBOLS)


def far_copy_tokenizer():
    """The word-level 🤗 tokenizer of the task: `<pad>` (id 0), then `A`, `B`, `<query>`, `<end>` (ids 1 … 4)."""
    return task_tokenizer(SYMBOLS)


def far_copy_dataset(
    num_examples: int,
    max_count: int = 4,
    min_gap: int = 16,
    max_gap: int = 64,
    seed: int = 0,
):
    """A 🤗 `Dataset` of far-copy examples, columns `input_ids`, `labels`, `count` (n) and `gap`.

    Args:
        num_examples: how many examples to draw.
        max_count: the largest n; n runs over 1 … max_count, each value equally often (±1), in random order.
        min_gap, max_gap: the number of `B` tokens between the last `A` and the query is drawn uniformly in
            [min_gap, max_gap]. The distance the answer must reach back is gap + 1 … gap + 2n.
        seed: seed of the `random.Random` that draws everything; the same seed gives the same dataset.
    """
    check_integer("num_examples", num_examples)
    check_integer("max_count", max_count)
    check_integer("min_gap", min_gap)
    check_integer("max_gap", max_gap)
    if max_gap < min_gap:
        raise ValueError(f"max_gap must be >= min_gap ({min_gap}), got {max_gap}.")
    generator = make_generator(seed)
    # Balanced answers: the counts 1 … max_count cycled, then shuffled.
    counts = [1 + index % max_count for index in range(num_examples)]
    generator.shuffle(counts)
    examples = []
    for count in counts:
        gap = generator.randint(min_gap, max_gap)
        prompt = [A] * count + [B] * gap + [QUERY]
        answer = [A] * count + [END]
        examples.append(
            {"input_ids": prompt + answer, "labels": [IGNORE] * len(prompt) + answer, "count": count, "gap": gap}
        )
    return examples_to_dataset(examples)


def solve_far_copy(input_ids: list[int]) -> list[int]:
    """Brute-force solver: counts the `A`s before the first `B` and, at every position of the answer (after
    `<query>`), predicts the next answer token: `A` while fewer than n have been written, then `<end>`; -100 on
    the prompt (the `labels` convention of `solver_accuracy`)."""
    if QUERY not in input_ids or B not in input_ids:
        raise ValueError(f"input_ids must hold a run of A, a gap of B and <query> (ids {A}, {B}, {QUERY}).")
    count = input_ids.index(B)
    query = input_ids.index(QUERY)
    predictions = [IGNORE] * len(input_ids)
    for position in range(query + 1, len(input_ids)):
        written = position - query - 1  # answer tokens before this position
        predictions[position] = A if written < count else END
    return predictions


__all__ = ["far_copy_dataset", "far_copy_symbols", "far_copy_tokenizer", "solve_far_copy"]
