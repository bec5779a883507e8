"""Associative retrieval, the synthetic task of DeltaNet (Schlag, Irie & Schmidhuber, 2021, Sec. 6.1).

A sequence of L key-value pairs is shown, then one of its keys is asked for; the model must answer with the value
bound to that key. The query comes after every pair, so the model cannot know which pair matters while it reads
them: it has to store all the associations in its memory without interference.

- Setting 1 (Sec. 6.1.1, capacity): L = S pairs over S keys and S values, both drawn *without* replacement, so every
  key and every value appears once. A sum-rule fast-weight memory whose feature dimension is below S must fail.
- Setting 2 (Sec. 6.1.2, update rules): L pairs (the paper: L = 40, S = 20) with keys and values drawn *with*
  replacement; a key may be re-bound, and the answer is its most recent value. The memory must overwrite.

Layout ("answer in the stream", see `common`): the tokens are `k0 … k{S-1}` and `v0 … v{S-1}`, and an example is

    k v k v … k v  q  a        labels: -100 … -100 a

so the logits at the query position are scored against the answer `a`; nothing else is scored. In training mode
each sequence comes with one query, drawn uniformly among its keys; in evaluation mode (`all_queries=True`) each
sequence yields one example per distinct key it holds, as the paper's evaluation ("20 sequences, all possible
queries").

Formulation note. In the paper the key and its value enter the memory in one write (k_t, v_t); here they are two
consecutive tokens. A 1-layer DeltaNet binds them in one write with its short causal convolution of width 2
(`short_convolution=True, convolution_size=2`): at the value token the key projection reads the previous token (the
key) and the value projection the current one (`benchmarks/paper_deltanet.py` trains such models). Without it a
single layer cannot see the key when the value arrives, so a second layer would first have to copy the key onto the
value token: more to learn, and not the memory being measured (we did not try that variant).
"""

from .common import IGNORE, check_integer, examples_to_dataset, make_generator, task_tokenizer

SETTINGS = (1, 2)


def associative_retrieval_symbols(num_keys: int) -> list[str]:
    """The task's symbols in vocabulary order: keys `k0 … k{S-1}` then values `v0 … v{S-1}` (ids 1 … 2S)."""
    check_integer("num_keys", num_keys)
    return [f"k{index}" for index in range(num_keys)] + [f"v{index}" for index in range(num_keys)]


def associative_retrieval_tokenizer(num_keys: int):
    """The word-level 🤗 tokenizer of the task: `<pad>` (id 0), keys `k0 …` (ids 1 … S), values `v0 …` (S+1 … 2S)."""
    return task_tokenizer(associative_retrieval_symbols(num_keys))


def associative_retrieval_dataset(
    num_sequences: int,
    setting: int = 1,
    num_keys: int = 20,
    num_pairs: int | None = None,
    seed: int = 0,
    all_queries: bool = False,
):
    """A 🤗 `Dataset` of associative-retrieval examples (columns `input_ids`, `labels`).

    Args:
        num_sequences: how many key-value sequences to draw.
        setting: 1 (L = S pairs, keys and values without replacement) or 2 (keys and values with replacement, the
            answer is the most recent value of the queried key).
        num_keys: S, the number of distinct keys, and of distinct values.
        num_pairs: L, the number of pairs of a sequence; setting 1 requires L = S (the default), setting 2 defaults
            to 2S (the paper: L = 40, S = 20).
        seed: seed of the `random.Random` that draws everything; the same seed gives the same dataset.
        all_queries: evaluation mode: one example per distinct key of each sequence (in order of first
            appearance) instead of one random query per sequence.
    """
    check_integer("num_sequences", num_sequences)
    check_integer("num_keys", num_keys)
    if setting not in SETTINGS or isinstance(setting, bool):
        raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}.")
    if setting == 1:
        if num_pairs is not None and num_pairs != num_keys:
            raise ValueError(
                f"num_pairs must equal num_keys ({num_keys}) in setting 1, where every key appears once; got "
                f"{num_pairs!r}. Leave it as None."
            )
        num_pairs = num_keys
    elif num_pairs is None:
        num_pairs = 2 * num_keys
    check_integer("num_pairs", num_pairs)
    if not isinstance(all_queries, bool):
        raise ValueError(f"all_queries must be True or False, got {all_queries!r}.")

    generator = make_generator(seed)
    examples = []
    for _ in range(num_sequences):
        if setting == 1:
            keys = generator.sample(range(num_keys), num_pairs)
            values = generator.sample(range(num_keys), num_pairs)
        else:
            keys = [generator.randrange(num_keys) for _ in range(num_pairs)]
            values = [generator.randrange(num_keys) for _ in range(num_pairs)]
        # Later pairs overwrite earlier ones: the binding of each key is its most recent value (Sec. 6.1.2).
        binding = dict(zip(keys, values))
        stream = [token for key, value in zip(keys, values) for token in (1 + key, 1 + num_keys + value)]
        present = list(dict.fromkeys(keys))
        queries = present if all_queries else [generator.choice(present)]
        for query in queries:
            answer = 1 + num_keys + binding[query]
            input_ids = stream + [1 + query, answer]
            labels = [IGNORE] * (len(input_ids) - 1) + [answer]
            examples.append({"input_ids": input_ids, "labels": labels})
    return examples_to_dataset(examples)


def solve_associative_retrieval(input_ids: list[int]) -> list[int]:
    """Brute-force solver: reads the pairs `k v k v …`, the query after them, and predicts the most recent value
    bound to the query at the answer position (-100 elsewhere, the `labels` convention of `solver_accuracy`)."""
    if len(input_ids) < 4 or len(input_ids) % 2:
        raise ValueError(f"input_ids must hold pairs, a query and an answer (even length >= 4), got {input_ids}.")
    *pairs, query, _answer = input_ids
    binding = dict(zip(pairs[0::2], pairs[1::2]))
    return [IGNORE] * (len(input_ids) - 1) + [binding.get(query, IGNORE)]


__all__ = [
    "associative_retrieval_dataset",
    "associative_retrieval_symbols",
    "associative_retrieval_tokenizer",
    "solve_associative_retrieval",
]
