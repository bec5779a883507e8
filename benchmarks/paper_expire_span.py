"""Expire-Span at small scale: accuracy against memory size on the Corridor and far-copy tasks (Sukhbaatar et al.,
2021, Sec. 5.2 and Fig. 4; Sec. 5.3 and Table 1).

The paper's claim: a model that learns to expire memories keeps only what matters (the colour seen at the start of
the corridor, the count of `A`s far in the past), so it reaches high accuracy with a small memory, while a fixed-span
model (Transformer-XL) needs a span as long as the distance to reach back. For each task this script trains, from the
same seed and on the same data (`memlm.training.tasks.corridor` and `.far_copy`):

- an Expire-Span model with maximum span L = the longest example (so it could keep everything) and a span loss
  (α = `--span-loss`) that pushes memories to expire;
- fixed-span models (`expire_memories=False`: every memory kept exactly S tokens): first the "matched" one, the
  shortest S whose mean memory size is at least the Expire-Span model's measured one, then `--fixed-spans` (default
  L/4, L/2 and L) to draw the accuracy-against-memory curve of Fig. 4.

All of this runs once per seed of `--seeds` (default 0 1 2; smoke 0 1): the seed s draws the training examples (and
s + 1 the held-out ones), initialises the models and orders the training batches. A model is the same row in every
seed's run ("fixed span, matched memory", "fixed span, S = 0.5 L", ...) although its span S may differ: the matched
span follows that seed's Expire-Span memory, and L that seed's longest example.

It reports, on held-out examples, the accuracy of the answer tokens (and of whole answers), the mean memory size
(`memory_size`: memories each query attends to, averaged over all queries and layers, as in Fig. 4) and, per layer, how
many memories the query that starts the answer can read and how far back the oldest of them lies; the tables show every
number as the mean over the seeds with the lowest and highest in parentheses. Tiny models (2 layers, hidden 32, ramp
R = 4), each sequence in one block so that the answer's gradient reaches the memory it reads. Two layers of span S reach
2S tokens back (a memory of layer 2 may itself have read S tokens back), so the matched fixed span is right on the
shortest corridors/gaps and at chance beyond.

The spans start at half of L (`--initial-span-fraction 0.5`), not at the paper's "small initial spans" (0.1): with
0.1 and this budget (300 steps) the span loss sometimes shrinks every memory before the task is learned (far copy,
1 seed of 3 in our runs); starting long, the model first learns the task, then the span loss trims what is not read.

    python benchmarks/paper_expire_span.py [--smoke] [--seeds 0 1 2] [--threads 2] [--json results.json] [--plot PATH]

writes `docs/performance/paper_expire_span.png` (accuracy against mean memory size, one panel per task: means over the
seeds, shaded from the lowest to the highest) unless `--plot` says otherwise (`--plot ""`: no plot). `--json` writes
every seed's rows and the summaries.
"""

import os
import time

import torch
from tqdm.auto import tqdm

from memlm import ExpireSpanConfig, ExpireSpanForCausalLM
from memlm.training.tasks.common import (
    IGNORE,
    across_seeds,
    collate,
    dataset_rows,
    evaluate_accuracy,
    format_across_seeds,
    seeds_problem,
    train_on_task,
)
from memlm.training.tasks.corridor import corridor_dataset, corridor_symbols
from memlm.training.tasks.far_copy import far_copy_dataset, far_copy_symbols

try:  # run as a script (python benchmarks/paper_expire_span.py) or imported as benchmarks.paper_expire_span
    import report
except ImportError:
    from benchmarks import report


DEFAULT_PLOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "performance", "paper_expire_span.png"
)
# Measurements summarised across seeds (besides the per-layer lists `query_memories` and `query_oldest`).
SUMMARISED = ("max_span", "memory_size", "accuracy", "sequence_accuracy", "final_train_loss", "train_seconds")


def task_settings(smoke: bool) -> dict:
    """Per task: the dataset builder (train and test differ by seed only) and its options, the vocabulary size, and
    the chance level of a whole answer (guessing the colour, or the count n, without memory of it)."""
    if smoke:
        corridor = {"num_colours": 2, "num_distractors": 4, "min_length": 2, "max_length": 10}
        far_copy = {"max_count": 2, "min_gap": 2, "max_gap": 8}
    else:
        # Paper corridor: 2 colours, length U(3, 200); 4 colours make chance (25 %) easier to tell from success.
        corridor = {"num_colours": 4, "num_distractors": 8, "min_length": 3, "max_length": 48}
        far_copy = {"max_count": 4, "min_gap": 3, "max_gap": 48}
    return {
        "corridor": {
            "build": lambda count, seed: corridor_dataset(count, **corridor, seed=seed),
            "vocab_size": 1 + len(corridor_symbols(corridor["num_colours"], corridor["num_distractors"])),
            "chance": 1 / corridor["num_colours"],
            "options": corridor,
        },
        "far_copy": {
            "build": lambda count, seed: far_copy_dataset(count, **far_copy, seed=seed),
            "vocab_size": 1 + len(far_copy_symbols()),
            "chance": 1 / far_copy["max_count"],
            "options": far_copy,
        },
    }


def build_model(
    args, seed: int, vocab_size: int, max_span: int, block_size: int, expire: bool
) -> ExpireSpanForCausalLM:
    torch.manual_seed(seed)
    config = ExpireSpanConfig(
        vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=2, max_span=max_span, ramp=args.ramp,
        span_loss_coefficient=args.span_loss, initial_span_fraction=args.initial_span_fraction,
        block_size=block_size, expire_memories=expire,
    )  # fmt: skip
    return ExpireSpanForCausalLM(config)


@torch.no_grad()
def memory_statistics(model, dataset, batch_size: int = 64) -> dict:
    """Mean memory size over every real query of `dataset` (the model's `memory_size`, weighted by the number of
    queries of each batch) and, per layer, what the query that starts the answer can read: how many memories, and
    how far back the oldest one lies (m_ti > 0, Eq. 6, with the predicted spans; t − i ≤ S with a fixed span)."""
    rows = dataset_rows(dataset)
    was_training = model.training
    model.eval()
    config = model.config
    memory_sum = queries = 0.0
    readable = torch.zeros(config.num_hidden_layers)
    oldest = torch.zeros(config.num_hidden_layers)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        batch = collate(chunk)
        output = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
            output_spans=config.expire_memories,
        )  # fmt: skip
        real = int(batch["attention_mask"].sum())
        memory_sum += float(output.memory_size) * real
        queries += real
        width = batch["input_ids"].shape[1]
        for row, example in enumerate(chunk):
            offset = width - len(example["input_ids"])  # left padding
            query = next(index for index, label in enumerate(example["labels"]) if label != IGNORE) - 1
            distance = query - torch.arange(query + 1, dtype=torch.float32)  # t − i for the memories i ≤ t
            for layer in range(config.num_hidden_layers):
                if config.expire_memories:
                    spans = output.spans[layer][row, offset : offset + query + 1].float()
                    alive = distance < spans + config.ramp  # m_ti > 0
                else:
                    alive = distance <= config.max_span
                readable[layer] += int(alive.sum())
                oldest[layer] += float(distance[alive].max())
    model.train(was_training)
    return {
        "memory_size": memory_sum / queries,
        "query_memories": (readable / len(rows)).tolist(),
        "query_oldest": (oldest / len(rows)).tolist(),
    }


def matched_span(args, seed: int, setting: dict, test, longest: int, target: float) -> int:
    """The shortest fixed span S whose mean memory size on `test` is at least `target`. The memory size of a
    fixed-span model depends only on S and the lengths, and grows with S, so untrained models measure it and a
    bisection finds S."""

    def memory(span: int) -> float:
        model = build_model(args, seed, setting["vocab_size"], span, longest, expire=False)
        return memory_statistics(model, test)["memory_size"]

    low, high = 1, longest
    while low < high:
        middle = (low + high) // 2
        if memory(middle) >= target:
            high = middle
        else:
            low = middle + 1
    return low


def train_and_measure(
    args, seed: int, setting: dict, train, test, max_span: int, block_size: int, expire: bool
) -> dict:
    model = build_model(args, seed, setting["vocab_size"], max_span, block_size, expire)
    label = f"{'Expire-Span' if expire else 'fixed span'} {max_span}"
    started = time.perf_counter()
    with tqdm(total=args.steps, desc=label, leave=False, disable=True if args.quick else None) as progress:

        def advance(step: int, loss: float) -> None:
            progress.set_postfix(loss=f"{loss:.3f}", refresh=False)
            progress.update(1)

        losses = train_on_task(
            model, train, args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
            warmup_steps=min(20, args.steps // 10), seed=seed, callback=advance,
        )  # fmt: skip
    seconds = time.perf_counter() - started
    scores = evaluate_accuracy(model, test)
    return {
        "seed": seed,
        "model": "Expire-Span" if expire else "fixed span",
        "max_span": max_span,
        "accuracy": scores["accuracy"],
        "sequence_accuracy": scores["sequence_accuracy"],
        **memory_statistics(model, test),
        "final_train_loss": losses[-1],
        "train_seconds": seconds,
    }


def run_task(args, name: str, setting: dict, seed: int) -> list[dict]:
    """One seed's rows: the Expire-Span model, the fixed span matched to its memory, then one per `--fixed-spans`.
    A span met twice (the matched one may equal L, say) is trained once and its row repeated, so that every seed has
    the same rows in the same order."""
    train = setting["build"](args.train_examples, seed)
    test = setting["build"](args.test_examples, seed + 1)
    # L: the longest example, so the Expire-Span model and the full fixed span can reach anything they need.
    longest = max(len(row["input_ids"]) for row in dataset_rows(train) + dataset_rows(test))
    expire = train_and_measure(args, seed, setting, train, test, longest, longest, expire=True)
    print(f"  {name}, seed {seed}: Expire-Span trained in {expire['train_seconds']:.0f} s", flush=True)
    rows = [{**expire, "label": "Expire-Span", "fraction": None, "matched": False}]
    matched = matched_span(args, seed, setting, test, longest, expire["memory_size"])
    wanted = [("fixed span, matched memory", None, matched)]
    for fraction in args.fixed_spans:
        label = "fixed span, S = L" if fraction == 1 else f"fixed span, S = {fraction:g} L"
        wanted.append((label, fraction, max(1, round(fraction * longest))))
    trained = {}
    for label, fraction, span in wanted:
        if span in trained:
            print(f"  {name}, seed {seed}: fixed span {span} already trained ({label})", flush=True)
        else:
            trained[span] = train_and_measure(args, seed, setting, train, test, span, longest, expire=False)
            seconds = trained[span]["train_seconds"]
            print(f"  {name}, seed {seed}: fixed span {span} trained in {seconds:.0f} s ({label})", flush=True)
        rows.append({**trained[span], "label": label, "fraction": fraction, "matched": fraction is None})
    return rows


def summarise(runs: list[list[dict]]) -> list[dict]:
    """One row per model across seeds (`runs`: every seed's rows, which come in the same order): each measurement as
    `across_seeds` gives it (mean, low, high, values), the per-layer ones layer by layer."""
    summary = []
    for rows in zip(*runs):
        first = rows[0]
        summary.append({
            **{key: first[key] for key in ("label", "model", "fraction", "matched")},
            **{key: across_seeds(row[key] for row in rows) for key in SUMMARISED},
            **{key: [across_seeds(layer) for layer in zip(*(row[key] for row in rows))]
               for key in ("query_memories", "query_oldest")},
        })  # fmt: skip
    return summary


def print_columns(lines: list[list[str]]) -> None:
    """The first column left-aligned, the others right-aligned, each as wide as its widest cell."""
    widths = [max(len(line[column]) for line in lines) for column in range(len(lines[0]))]
    for line in lines:
        print(line[0].ljust(widths[0]) + "".join(f"  {cell:>{width}}" for cell, width in zip(line[1:], widths[1:])))


def print_table(name: str, summary: list[dict], chance: float, seeds: list[int]) -> None:
    count = f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''} ({', '.join(map(str, seeds))})"
    print(f"\n{name}: accuracy on held-out examples (a whole answer guessed without memory: {chance:.0%})")
    print(f"mean (lowest–highest) over {count}; the matched fixed span is chosen per seed (the shortest with at least")
    print("that seed's Expire-Span memory), so its max span is summarised too, as is L (the longest example).")
    lines = [["model", "max span", "mean memory", "accuracy", "whole answer"]]
    for row in summary:
        lines.append([
            row["label"], format_across_seeds(row["max_span"], ".1f"), format_across_seeds(row["memory_size"], ".1f"),
            format_across_seeds(row["accuracy"], ".1%"), format_across_seeds(row["sequence_accuracy"], ".1%"),
        ])  # fmt: skip
    print_columns(lines)
    print("\nat the query that starts the answer, per layer: how many memories it reads, how far back the oldest lies")
    layers = range(1, len(summary[0]["query_memories"]) + 1)
    lines = [["model"] + [f"layer {layer} {what}" for layer in layers for what in ("memories", "oldest")]]
    for row in summary:
        cells = [row["label"]]
        for memories, oldest in zip(row["query_memories"], row["query_oldest"]):
            cells += [format_across_seeds(memories, ".1f"), format_across_seeds(oldest, ".0f")]
        lines.append(cells)
    print_columns(lines)


def spread(rows: list[dict], key: str) -> list[list[float]]:
    """Error-bar lengths below and above each mean: down to the lowest seed, up to the highest."""
    return [
        [row[key]["mean"] - row[key]["low"] for row in rows],
        [row[key]["high"] - row[key]["mean"] for row in rows],
    ]


def plot(summaries: dict, settings: dict, seeds: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(summaries), figsize=(5 * len(summaries), 4), squeeze=False)
    for axis, (name, summary) in zip(axes[0], summaries.items()):
        # A span trained twice in every seed (the matched one equal to L, say) is one point.
        unique = {}
        for row in summary:
            if row["model"] == "fixed span":
                unique.setdefault(tuple(row["max_span"]["values"]), row)
        fixed = sorted(unique.values(), key=lambda row: row["memory_size"]["mean"])
        expire = [row for row in summary if row["model"] == "Expire-Span"]
        # With one answer token (corridor) the two accuracies are the same; draw whole answers only when they differ.
        metrics = [("accuracy", "answer tokens", "-")]
        if any(row["accuracy"]["values"] != row["sequence_accuracy"]["values"] for row in summary):
            metrics.append(("sequence_accuracy", "whole answers", "--"))
        memory = [row["memory_size"]["mean"] for row in fixed]
        for key, description, style in metrics:
            solid = style == "-"
            axis.fill_between(memory, [row[key]["low"] for row in fixed], [row[key]["high"] for row in fixed],
                              color="C0", alpha=0.2 if solid else 0.1, linewidth=0)  # fmt: skip
            axis.errorbar(memory, [row[key]["mean"] for row in fixed], xerr=spread(fixed, "memory_size"),
                          yerr=spread(fixed, key), fmt="o" + style, color="C0", mfc="C0" if solid else "white",
                          capsize=2, label=f"fixed span, {description}")  # fmt: skip
            axis.errorbar([row["memory_size"]["mean"] for row in expire], [row[key]["mean"] for row in expire],
                          xerr=spread(expire, "memory_size"), yerr=spread(expire, key), fmt="*", markersize=14,
                          color="C1", mfc="C1" if solid else "white", capsize=2, zorder=4 if solid else 3,
                          label=f"Expire-Span (L={expire[0]['max_span']['mean']:.4g}), {description}")  # fmt: skip
        for row in fixed:
            axis.annotate(f"S={row['max_span']['mean']:.3g}", (row["memory_size"]["mean"], row["accuracy"]["mean"]),
                          textcoords="offset points", xytext=(4, 6), fontsize=8)  # fmt: skip
        axis.axhline(settings[name]["chance"], color="grey", linestyle=":", label="whole answer guessed")
        title = name.replace("_", " ")
        if len(seeds) > 1:
            title += f": mean of {len(seeds)} seeds, lowest to highest shaded"
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("mean memory size (memories per query)")
        axis.set_ylabel("accuracy on held-out examples")
        axis.set_ylim(0, 1.05)
        axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None):
    parser = report.arguments(__doc__, threads=2, quick="tiny tasks and budget (a few seconds), for CI")
    parser.add_argument("--tasks", nargs="+", choices=("corridor", "far_copy"), default=["corridor", "far_copy"])
    parser.add_argument("--steps", type=int, default=None, help="training steps per model (default 300, quick 3)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 32, quick 8")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--train-examples", type=int, default=None, help="default 2048, quick 32")
    parser.add_argument("--test-examples", type=int, default=None, help="default 256, quick 8")
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ramp", type=float, default=4.0, help="R of the soft mask")
    parser.add_argument("--span-loss", type=float, default=1e-3, help="α of the span loss")
    parser.add_argument("--initial-span-fraction", type=float, default=0.5)
    parser.add_argument("--fixed-spans", type=float, nargs="*", default=None,
                        help="further fixed spans as fractions of L (default 0.25 0.5 1; quick 1)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="every model once per seed, which sets the data, initialisation and batch order "
                        "(default 0 1 2, quick 0 1)")  # fmt: skip
    parser.add_argument("--plot", default=DEFAULT_PLOT)
    unset = {"steps": (300, 3), "batch_size": (32, 8), "train_examples": (2048, 32), "test_examples": (256, 8),
             "fixed_spans": ([0.25, 0.5, 1.0], [1.0]), "seeds": ([0, 1, 2], [0, 1])}  # fmt: skip
    positive = ("steps", "batch_size", "train_examples", "test_examples", "hidden_size", "layers", "threads")
    args = report.parse(parser, argv, unset=unset, positive=positive)
    if any(not 0 < fraction <= 1 for fraction in args.fixed_spans):
        parser.error(f"--fixed-spans must be fractions of L in (0, 1], got {args.fixed_spans}")
    args.fixed_spans = sorted(set(args.fixed_spans))
    if problem := seeds_problem(args.seeds):
        parser.error(problem)
    report.start(args)

    settings = task_settings(args.quick)
    started = time.perf_counter()
    per_seed = [
        {"seed": seed, "tasks": {name: run_task(args, name, settings[name], seed) for name in args.tasks}}
        for seed in args.seeds
    ]
    summaries = {name: summarise([run["tasks"][name] for run in per_seed]) for name in args.tasks}
    for name, summary in summaries.items():
        print_table(name, summary, settings[name]["chance"], args.seeds)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.plot:
        plot(summaries, settings, args.seeds, args.plot)
        print(f"plot: {args.plot}")
    results = {"seeds": args.seeds, "per_seed": per_seed, "summary": summaries}
    tasks = {name: settings[name]["options"] for name in args.tasks}
    report.finish({"settings": report.own_settings(args), "tasks": tasks, "results": results}, args)
    return results


if __name__ == "__main__":
    main()
