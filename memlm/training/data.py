"""Training text for memlm's scripts: where it comes from, and how it is cut into batches.

Sources (`load_texts`):
- nothing: the embedded default corpus, the source of the running Python's standard library, read at run time (no
  download, the same on every machine with the same Python);
- plain text files (any extension but .json/.jsonl/.csv/.parquet), read whole; they must be UTF-8;
- JSON lines / JSON / CSV / Parquet files, or a directory written by 🤗 `datasets` `save_to_disk`, read with 🤗
  `datasets` (the `text_column` holds the documents);
- a dataset name already in the local 🤗 `datasets` cache (never downloaded here).

Batches (`TokenStream`): the documents, joined by the end-of-text token, form one token sequence.
- `"segments"` (segment-recurrent, truncated back-propagation through time, as the papers trained): the sequence is
  split into as many contiguous streams as there are rows in the global batch, and batch i holds tokens
  [i·T, (i+1)·T] of every stream, so consecutive batches continue the same streams and a model's memory can be
  carried from one batch to the next;
- `"independent"`: every row is a window of T + 1 tokens at a random offset drawn from (seed, step).
Either way batch i depends only on i and the seed, so a resumed run reads exactly what an uninterrupted one would.
"""

import sysconfig
from pathlib import Path

import torch

TABULAR_SUFFIXES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
BATCH_MODES = ("segments", "independent")


def standard_library_corpus(max_bytes: int = 8_000_000) -> list[str]:
    """The embedded default corpus: the Python standard library's `.py` files in sorted path order, up to
    `max_bytes` bytes of UTF-8 text (tests and third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents, total = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        documents.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    if not documents:
        raise FileNotFoundError(f"No Python source found under the standard library directory {root}.")
    return documents


def _load_with_datasets(source: str, text_column: str) -> list[str]:
    import datasets

    path = Path(source)
    try:
        if path.is_dir():
            dataset = datasets.load_from_disk(str(path))
        elif path.suffix in TABULAR_SUFFIXES:
            dataset = datasets.load_dataset(TABULAR_SUFFIXES[path.suffix], data_files=str(path))
        else:
            dataset = datasets.load_dataset(source)
    except FileNotFoundError:
        raise
    except Exception as error:  # datasets raises many types for "not cached" / "not a dataset"
        raise ValueError(
            f"Could not read the training data {source!r} with 🤗 datasets ({type(error).__name__}: {error}). Give "
            "a text file, a .json/.jsonl/.csv/.parquet file, a directory written by save_to_disk, or the name of a "
            "dataset already in the local cache."
        ) from error
    if isinstance(dataset, datasets.DatasetDict):
        split = "train" if "train" in dataset else next(iter(dataset))
        dataset = dataset[split]
    if text_column not in dataset.column_names:
        raise ValueError(
            f"The training data {source!r} has no column {text_column!r}; its columns are {dataset.column_names}. "
            "Choose one with --text-column."
        )
    return [text for text in dataset[text_column] if isinstance(text, str) and text]


def read_text_file(path: Path) -> str:
    """A text file's content. It must be UTF-8: the tokenizers read text, and replacing undecodable bytes (Latin-1
    text, binary files) by U+FFFD would train on something else than the file without a word."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"The training data {str(path)!r} is not UTF-8 text: byte 0x{data[error.start]:02x} at offset "
            f"{error.start} is not valid UTF-8. Convert it first (e.g. `iconv -f latin1 -t utf-8`), or give another "
            "file."
        ) from None


def load_texts(sources: list[str] | None, text_column: str = "text", max_bytes: int = 8_000_000) -> list[str]:
    """The documents of the training data (see the module docstring). Raises FileNotFoundError for a path that
    does not exist and ValueError for data with no text."""
    if not sources:
        return standard_library_corpus(max_bytes)
    documents = []
    for source in sources:
        path = Path(source)
        looks_like_path = path.suffix or "/" in source or source.startswith(".")
        if looks_like_path and not path.exists():
            raise FileNotFoundError(f"The training data {source!r} does not exist.")
        if path.is_file() and path.suffix not in TABULAR_SUFFIXES:
            documents.append(read_text_file(path))
        else:
            documents.extend(_load_with_datasets(source, text_column))
    documents = [document for document in documents if document.strip()]
    if not documents:
        raise ValueError(f"The training data {sources} holds no text: every document is empty.")
    return documents


def tokenize_documents(documents: list[str], tokenizer) -> torch.Tensor:
    """One 1-D int64 tensor: the documents' tokens, each document followed by the end-of-text token."""
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '') or 'unsaved'}) has "
            "no end-of-text token (eos_token), which ends every training document. A folder with tokenizer.json but "
            "no tokenizer_config.json loses it: save the tokenizer with save_pretrained (both files), or set "
            "tokenizer.eos_token."
        )
    ids = []
    for document in documents:
        ids.extend(tokenizer(document, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def split_held_out(
    documents: list[str], tokenizer, eval_tokens: int, every: int = 20, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(training tokens, held-out tokens). Whole documents are held out, every `every`-th one (spread over the
    corpus, so the held-out text is like the rest, not one corner of it), until they hold `eval_tokens` tokens;
    a single document is cut instead. The held-out text never appears in training. The training documents are
    shuffled (with `seed`), so that each stream of segments reads a mix of the corpus rather than one stretch of
    related files in a row."""
    held_out = []
    count = 0
    for index in range(every // 2, len(documents), every):
        if count >= eval_tokens:
            break
        held_out.append(index)
        count += len(tokenizer(documents[index], add_special_tokens=False)["input_ids"]) + 1
    if len(documents) == 1 or not held_out:
        tokens = tokenize_documents(documents, tokenizer)
        if eval_tokens >= len(tokens) // 2:
            raise ValueError(
                f"The data has {len(tokens)} tokens: too few to hold out {eval_tokens} for evaluation and train on "
                "the rest. Give more text or lower --eval-tokens."
            )
        return tokens[: len(tokens) - eval_tokens], tokens[len(tokens) - eval_tokens :]
    chosen = set(held_out)
    kept = [document for index, document in enumerate(documents) if index not in chosen]
    order = torch.randperm(len(kept), generator=torch.Generator().manual_seed(seed)).tolist()
    training = tokenize_documents([kept[index] for index in order], tokenizer)
    evaluation = tokenize_documents([documents[index] for index in held_out], tokenizer)[:eval_tokens]
    if len(evaluation) < eval_tokens or len(training) < len(evaluation):
        raise ValueError(
            f"The data has too little text to hold out {eval_tokens} tokens for evaluation and train on the rest "
            f"({len(documents)} documents). Give more text or lower --eval-tokens."
        )
    return training, evaluation


class TokenStream:
    """Batches of (input_ids, labels), both (rows, length), for a global batch of `rows` rows (see the module
    docstring for the two modes). `batch(step)` is a pure function of the step and the seed."""

    def __init__(self, tokens: torch.Tensor, rows: int, length: int, mode: str = "segments", seed: int = 0):
        if mode not in BATCH_MODES:
            raise ValueError(f"batch mode {mode!r} is not one of {BATCH_MODES}.")
        self.tokens, self.rows, self.length, self.mode, self.seed = tokens, rows, length, mode, seed
        self.stream_length = len(tokens) // rows
        if mode == "segments":
            self.segments_per_pass = (self.stream_length - 1) // length
            if self.segments_per_pass < 1:
                raise ValueError(
                    f"{len(tokens)} training tokens cannot fill {rows} streams with a segment of {length} + 1 tokens; "
                    "give more text, fewer rows (--batch-size) or a shorter --length."
                )
            self.streams = tokens[: rows * self.stream_length].view(rows, self.stream_length)
        elif len(tokens) < rows * (length + 1):
            raise ValueError(
                f"{len(tokens)} training tokens are fewer than one batch of {rows} windows of {length} + 1 tokens; "
                "give more text, fewer rows (--batch-size) or a shorter --length."
            )

    def starts_pass(self, step: int) -> bool:
        """Whether batch `step` begins a new pass over the streams (carried memory must then be reset)."""
        return self.mode == "independent" or step % self.segments_per_pass == 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "segments":
            start = (step % self.segments_per_pass) * self.length
            window = self.streams[:, start : start + self.length + 1]
        else:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            offsets = torch.randint(0, len(self.tokens) - self.length - 1, (self.rows,), generator=generator)
            window = torch.stack([self.tokens[offset : offset + self.length + 1] for offset in offsets.tolist()])
        return window[:, :-1], window[:, 1:]
