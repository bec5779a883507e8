"""DeltaNet at small scale: the two associative-retrieval comparisons of Schlag, Irie & Schmidhuber (2021, Sec. 6.1).

1. Update rules (Fig. 3, setting 2): S = 20 keys and values drawn with replacement into L = 40 pairs, so keys are
   re-bound and the answer is the most recent value. The paper's claim: with the same DPFP-1 features and sum
   normalisation, the delta rule ("ours") learns the task while the sum rule (linear attention) does not, since it
   can only add associations, never replace one. Two models trained from the same seed on the same data, evaluated
   every `--eval-every` steps (learning curves) on 20 held-out sequences with every possible query (the paper's
   evaluation).
2. Capacity (Fig. 2, setting 1): S keys and S values without replacement, L = S. The paper's claim: a sum-rule
   memory whose feature map has dimension d_φ retrieves without error only while S ≤ d_φ: `elu+1` (linear attention,
   d_φ = d_key) fails first, then DPFP-1 (d_φ = 2 d_key), then DPFP-2 (d_φ = 4 d_key). All three use the sum rule,
   as the paper's Fig. 2 (the capacity argument of Sec. 4.1 is about the sum rule; in setting 1 no key is re-bound,
   so the delta rule's overwrite is not what is measured), with sum-normalised features. The key head width is small
   (`--capacity-key-dim`, default 4, so d_φ = 4 / 8 / 16) so that the capacities fall inside a sweep of S that
   trains in minutes. For each model and S the best evaluation loss is reported (as the paper's Fig. 2). One
   difference: the paper regresses fixed one-hot values (exact retrieval needs orthogonal keys, a hard limit of
   d_φ), while here a learned output layer and a softmax read the retrieved vector, which only needs the right value
   to score highest, so the limit is soft and, at this budget, optimisation failures also show up as high loss.

Models: the paper preset (`DeltaNetConfig.from_preset("paper")`: DPFP features, sum normalisation, learned β) with
1 layer and 1 head (so the feature dimension is the memory's capacity), hidden size 64, values of width 64, tied
input/output embeddings, and a short causal convolution of width 2: in this language-model formulation a key and its
value are consecutive tokens, and the convolution lets the value token's key projection read the key token, so one
write binds the pair (see `memlm.training.tasks.associative_retrieval`). AdamW, linear warm-up then cosine decay.

Both comparisons run once per seed of `--seeds` (default 0 1 2; smoke 0 1). A seed sets the training sequences (the
held-out ones use seed + 1), the models' initialisation and the order of the batches. The tables show, for each cell,
the mean over the seeds with the lowest and highest value in brackets, "mean (low–high)"; the learning-curve table
shows the mean loss. The JSON file keeps every seed's results beside these summaries.

    python benchmarks/paper_deltanet.py [--smoke] [--seeds 0 1 2] [--threads 2] [--json results.json] [--plot PATH]

writes `docs/performance/paper_deltanet.png` (left: mean learning curves of the two update rules; right: mean best
evaluation loss against S for each feature map; shaded: lowest to highest over the seeds) unless `--plot` says
otherwise.
"""

import os
import time

import torch

from memlm import DeltaNetConfig, DeltaNetForCausalLM
from memlm.training.tasks.associative_retrieval import associative_retrieval_dataset
from memlm.training.tasks.common import (
    across_seeds,
    evaluate_accuracy,
    format_across_seeds,
    seeds_problem,
    train_on_task,
)

try:  # run as a script (python benchmarks/paper_deltanet.py) or imported as benchmarks.paper_deltanet
    import report
except ImportError:
    from benchmarks import report


DEFAULT_PLOT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "performance", "paper_deltanet.png"
)
# The feature maps of the capacity sweep: (name, feature_map, dpfp_nu); d_φ = d_key, 2 d_key, 4 d_key.
CAPACITY_FEATURE_MAPS = (("elu+1", "elu+1", 1), ("DPFP-1", "dpfp", 1), ("DPFP-2", "dpfp", 2))
UPDATE_RULES = (("delta rule (ours)", "delta"), ("sum rule", "sum"))
MEASURES = ("loss", "accuracy")


def build_model(args, seed: int, num_keys: int, key_dim: int, feature_map: str, dpfp_nu: int, update_rule: str):
    torch.manual_seed(seed)
    config = DeltaNetConfig.from_preset(
        "paper", vocab_size=2 * num_keys + 1, pad_token_id=0, hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size, num_hidden_layers=1, num_attention_heads=1, key_head_dim=key_dim,
        value_head_dim=args.hidden_size, feature_map=feature_map, dpfp_nu=dpfp_nu, update_rule=update_rule,
        short_convolution=True, convolution_size=2, tie_word_embeddings=True,
        initializer_range=args.initializer_range,
    )  # fmt: skip
    return DeltaNetForCausalLM(config)


def train_and_evaluate(model, train, test, args, seed: int) -> dict:
    """Trains `model`, evaluating on `test` every `--eval-every` steps and at the end; returns the curve, the final
    result and the best (lowest-loss) evaluation."""
    curve = []

    def evaluate(step: int, _loss: float):
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append({"step": step + 1, **evaluate_accuracy(model, test)})

    started = time.perf_counter()
    train_on_task(model, train, args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                  warmup_steps=args.steps // 20, seed=seed, callback=evaluate)  # fmt: skip
    best = min(curve, key=lambda point: point["loss"])
    return {"curve": curve, "final": curve[-1], "best": best, "seconds": time.perf_counter() - started}


def update_rule_comparison(args, seed: int) -> list[dict]:
    """Fig. 3: delta rule against sum rule on setting 2, DPFP-1 features, d_φ = 2 d_key ≥ S."""
    train = associative_retrieval_dataset(args.train_sequences, setting=2, num_keys=args.rules_keys,
                                          num_pairs=args.rules_pairs, seed=seed)  # fmt: skip
    test = associative_retrieval_dataset(args.test_sequences, setting=2, num_keys=args.rules_keys,
                                         num_pairs=args.rules_pairs, seed=seed + 1, all_queries=True)  # fmt: skip
    rows = []
    for label, rule in UPDATE_RULES:
        model = build_model(args, seed, args.rules_keys, args.rules_key_dim, "dpfp", 1, rule)
        result = train_and_evaluate(model, train, test, args, seed)
        rows.append({"model": label, "update_rule": rule, "feature_dim": model.config.feature_dim, **result})
        final = result["final"]
        print(f"  seed {seed}  {label:18} loss {final['loss']:.3f}  accuracy {final['accuracy']:.1%}  "
              f"({result['seconds']:.0f} s)", flush=True)  # fmt: skip
    return rows


def capacity_sweep(args, seed: int) -> list[dict]:
    """Fig. 2: best evaluation loss of sum-rule memories against the number S of associations (setting 1)."""
    rows = []
    for num_keys in args.capacity_keys:
        train = associative_retrieval_dataset(args.train_sequences, setting=1, num_keys=num_keys, seed=seed)
        test = associative_retrieval_dataset(args.test_sequences, setting=1, num_keys=num_keys, seed=seed + 1,
                                             all_queries=True)  # fmt: skip
        for label, feature_map, nu in CAPACITY_FEATURE_MAPS:
            model = build_model(args, seed, num_keys, args.capacity_key_dim, feature_map, nu, "sum")
            result = train_and_evaluate(model, train, test, args, seed)
            rows.append({"model": label, "num_keys": num_keys, "feature_dim": model.config.feature_dim, **result})
            best = result["best"]
            print(f"  seed {seed}  S={num_keys:<3} {label:7} (d_φ={model.config.feature_dim:>2}) best loss "
                  f"{best['loss']:.3f}  accuracy {best['accuracy']:.1%}  ({result['seconds']:.0f} s)",
                  flush=True)  # fmt: skip
    return rows


def summarise(rows_per_seed: list[list[dict]], keys: tuple[str, ...]) -> list[dict]:
    """One row per model (and S) with every evaluation's loss and accuracy summarised by `across_seeds`. Rows are
    matched by position: every seed runs the same models in the same order."""
    summaries = []
    for rows in zip(*rows_per_seed):
        summary = {key: rows[0][key] for key in keys}
        summary["curve"] = [
            {"step": points[0]["step"], **{measure: across_seeds(point[measure] for point in points)
                                           for measure in MEASURES}}
            for points in zip(*(row["curve"] for row in rows))
        ]  # fmt: skip
        for moment in ("final", "best"):
            summary[moment] = {measure: across_seeds(row[moment][measure] for row in rows) for measure in MEASURES}
        summaries.append(summary)
    return summaries


def describe_seeds(seeds: list[int]) -> str:
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"mean (low–high) over {len(seeds)} seeds ({' '.join(str(seed) for seed in seeds)})"


def print_tables(rules: list[dict], capacity: list[dict], args) -> None:
    """Prints the summaries of `summarise`: each cell is 'mean (low–high)' over the seeds."""
    seeds = describe_seeds(args.seeds)
    if rules:
        print(f"\nUpdate rules, setting 2 (S={args.rules_keys}, L={args.rules_pairs}, DPFP-1, "
              f"d_φ={rules[0]['feature_dim']}), after {args.steps} steps, {seeds}:")  # fmt: skip
        steps = [point["step"] for point in rules[0]["curve"]]
        print(f"{'mean eval loss at step':22}" + "".join(f"{step:>8}" for step in steps))
        for row in rules:
            print(f"{row['model']:22}" + "".join(f"{point['loss']['mean']:8.3f}" for point in row["curve"]))
        print(f"\n{'model':22}{'final loss':>24}{'accuracy':>24}{'best loss':>24}")
        for row in rules:
            cells = (format_across_seeds(row["final"]["loss"], ".3f"),
                     format_across_seeds(row["final"]["accuracy"], ".1%"),
                     format_across_seeds(row["best"]["loss"], ".3f"))  # fmt: skip
            print(f"{row['model']:22}" + "".join(f"{cell:>24}" for cell in cells))
    if capacity:
        labels = [label for label, _, _ in CAPACITY_FEATURE_MAPS]
        dims = {row["model"]: row["feature_dim"] for row in capacity}
        header = f"{'S':>4}" + "".join(f"{f'{label} (d_φ={dims[label]})':>24}" for label in labels)
        for title, measure, format_spec in (("best eval loss", "loss", ".3f"),
                                            ("accuracy at the best eval", "accuracy", ".1%")):  # fmt: skip
            print(f"\nCapacity, setting 1 (sum rule, d_key={args.capacity_key_dim}): {title} after {args.steps} "
                  f"steps, {seeds}")  # fmt: skip
            print(header)
            for num_keys in args.capacity_keys:
                cells = {row["model"]: row["best"][measure] for row in capacity if row["num_keys"] == num_keys}
                print(f"{num_keys:>4}" + "".join(f"{format_across_seeds(cells[label], format_spec):>24}"
                                                 for label in labels))  # fmt: skip


def plot(rules: list[dict], capacity: list[dict], args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    seeds = f"{len(args.seeds)} seed{'s' if len(args.seeds) > 1 else ''}"
    band = "shaded: lowest to highest" if len(args.seeds) > 1 else None
    for row, color in zip(rules, ("C0", "C1")):
        steps = [point["step"] for point in row["curve"]]
        losses = [point["loss"] for point in row["curve"]]
        left.plot(steps, [loss["mean"] for loss in losses], "o-", markersize=3, color=color, label=row["model"])
        left.fill_between(steps, [loss["low"] for loss in losses], [loss["high"] for loss in losses], color=color,
                          alpha=0.2, linewidth=0)  # fmt: skip
    left.set_title(f"Update rules (setting 2: S={args.rules_keys}, L={args.rules_pairs}, DPFP-1)")
    left.set_xlabel("training step")
    left.set_ylabel(f"evaluation loss (mean over {seeds})")
    if rules:
        left.legend(title=band, title_fontsize=8)
    for (label, _, _), color in zip(CAPACITY_FEATURE_MAPS, ("C0", "C1", "C2")):
        rows = [row for row in capacity if row["model"] == label]
        if not rows:
            continue
        num_keys = [row["num_keys"] for row in rows]
        losses = [row["best"]["loss"] for row in rows]
        right.plot(num_keys, [loss["mean"] for loss in losses], "o-", color=color,
                   label=f"{label} (d_φ={rows[0]['feature_dim']})")  # fmt: skip
        right.fill_between(num_keys, [loss["low"] for loss in losses], [loss["high"] for loss in losses],
                           color=color, alpha=0.2, linewidth=0)  # fmt: skip
        right.axvline(rows[0]["feature_dim"], color=color, linestyle=":", linewidth=1)
    right.set_title(f"Capacity (setting 1, sum rule, d_key={args.capacity_key_dim}); dotted: d_φ")
    right.set_xlabel("number of unique keys S (= sequence length L)")
    right.set_ylabel(f"best evaluation loss (mean over {seeds})")
    if capacity:
        right.legend(title=band, title_fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None):
    parser = report.arguments(__doc__, threads=2, quick="tiny budget (a few seconds), for CI")
    parser.add_argument("--comparisons", nargs="+", choices=("rules", "capacity"), default=["rules", "capacity"])
    parser.add_argument("--steps", type=int, default=None, help="training steps per model (default 800, quick 4)")
    parser.add_argument("--eval-every", type=int, default=None, help="default 50, quick 2")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--initializer-range", type=float, default=0.1)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--train-sequences", type=int, default=None, help="default 20000, quick 64")
    parser.add_argument("--test-sequences", type=int, default=20, help="each with every possible query (paper)")
    parser.add_argument("--rules-keys", type=int, default=None, help="S of setting 2 (default 20, quick 4)")
    parser.add_argument("--rules-pairs", type=int, default=None, help="L of setting 2 (default 40, quick 8)")
    parser.add_argument("--rules-key-dim", type=int, default=16, help="d_key of the update-rule models")
    parser.add_argument("--capacity-keys", type=int, nargs="+", default=None,
                        help="the values of S of setting 1 (default 4 8 16 24, quick 4 8)")  # fmt: skip
    parser.add_argument("--capacity-key-dim", type=int, default=4, help="d_key of the capacity models")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="one run of every comparison per seed (default 0 1 2, quick 0 1)")  # fmt: skip
    parser.add_argument("--plot", default=DEFAULT_PLOT)
    unset = {"steps": (800, 4), "eval_every": (50, 2), "train_sequences": (20000, 64), "rules_keys": (20, 4),
             "rules_pairs": (40, 8), "capacity_keys": ([4, 8, 16, 24], [4, 8]), "seeds": ([0, 1, 2], [0, 1])}  # fmt: skip
    positive = ("steps", "eval_every", "batch_size", "hidden_size", "train_sequences", "test_sequences", "rules_keys",
                "rules_pairs", "rules_key_dim", "capacity_key_dim", "threads")  # fmt: skip
    args = report.parse(parser, argv, unset=unset, positive=positive)
    if any(num_keys < 1 for num_keys in args.capacity_keys):
        parser.error(f"--capacity-keys must be positive integers, got {args.capacity_keys}")
    if problem := seeds_problem(args.seeds):
        parser.error(problem)
    report.start(args)

    started = time.perf_counter()
    per_seed = []
    for seed in args.seeds:
        rules, capacity = [], []
        if "rules" in args.comparisons:
            print(f"Update rules (Fig. 3), seed {seed}:", flush=True)
            rules = update_rule_comparison(args, seed)
        if "capacity" in args.comparisons:
            print(f"Capacity (Fig. 2), seed {seed}:", flush=True)
            capacity = capacity_sweep(args, seed)
        per_seed.append({"seed": seed, "update_rules": rules, "capacity": capacity})
    summary = {
        "update_rules": summarise([run["update_rules"] for run in per_seed], ("model", "update_rule", "feature_dim")),
        "capacity": summarise([run["capacity"] for run in per_seed], ("model", "num_keys", "feature_dim")),
    }
    print_tables(summary["update_rules"], summary["capacity"], args)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.plot:
        plot(summary["update_rules"], summary["capacity"], args, args.plot)
        print(f"plot: {args.plot}")
    results = {"seeds": args.seeds, "per_seed": per_seed, "summary": summary}
    report.finish({"settings": report.own_settings(args), **results}, args)
    return results


if __name__ == "__main__":
    main()
