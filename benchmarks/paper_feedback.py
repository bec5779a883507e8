"""Can a standard Transformer keep track of a state that every input updates? The Feedback Transformer paper's
"limited state updates" tasks (Fan et al., 2021, Sec. 4.1.2, Table 1), at CPU scale.

Two tasks, both in the "separate outputs" layout (the outputs are labels, never inputs; see
`memlm.training.tasks.common`):

- random walk (App. 7.1, `memlm.training.tasks.random_walk`): output the agent's cell after each action;
- algorithmic programs (App. 7.4, `memlm.training.tasks.algorithmic`): output the value of each printed variable,
  with 3 variables (and with 5 when `--tasks` asks for `algorithmic5`).

On each task a Feedback Transformer and a 🤗 Llama of the same sizes (hidden size, layers, heads, gated-MLP width)
are trained on the same examples in the same order, for the same steps, with the same AdamW and schedule
(`train_on_task`). Both see the whole example: the Feedback memory span is the longest example (unless
`--memory-span`; the paper used 100 for both, with longer, concatenated episodes). Every
`--eval-every` steps the token accuracy on held-out examples (drawn with another seed) is measured. The paper's
Table 1 (4 layers, hidden 256, 10k examples of 100 actions or statements): random walk 68 % vs 100 %; algorithmic
33.7 % vs 99.1 % (3 variables) and 37.5 % vs 92.6 % (5 variables).

Each seed in `--seeds` (default 0 1 2) repeats the whole comparison with its own training examples (the held-out
ones come from the seed + 1), model initialisation and order of batches; the sizes, steps and schedule stay the same.
Prints, over the seeds: the held-out token and sequence accuracy and the seconds of training (evaluations included)
as mean (low–high); the mean held-out accuracy at each evaluation step; which model won in each seed and in how
many seeds Feedback beat Llama; and the Feedback models' learned layer weights softmax(w) (Eq. 1: how much the
embedding and each layer contribute to the memory). `--plot` draws the mean held-out accuracy against the training
step per model and task, shaded from the lowest to the highest seed; `--json` keeps every seed's results and the
summaries.

    python benchmarks/paper_feedback.py [--smoke] [--seeds 0 1 2 ...] [--json results.json] [--plot curves.png]
    python benchmarks/paper_feedback.py --tasks algorithmic3 --steps 500 --plot docs/performance/paper_feedback_programs.png

The default run is the random walk for 1500 steps (the Feedback model learns its step-by-step recurrence slowly:
at 500 steps it is still behind Llama). A Feedback step on the programs (up to 67 tokens) costs about 2.5 times one
on the walk, so the programs run as a second command with fewer steps. Each seed adds the time of one run.
"""

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memlm import FeedbackTransformerConfig, FeedbackTransformerForCausalLM
from memlm.training.tasks.algorithmic import algorithmic_dataset, algorithmic_symbols
from memlm.training.tasks.common import (
    across_seeds,
    evaluate_accuracy,
    format_across_seeds,
    seeds_problem,
    train_on_task,
)
from memlm.training.tasks.random_walk import random_walk_dataset, random_walk_symbols

try:  # run as a script (python benchmarks/paper_feedback.py) or imported as benchmarks.paper_feedback
    import report
except ImportError:
    from benchmarks import report


DEFAULT_PLOT = "docs/performance/paper_feedback.png"
TASKS = ("random_walk", "algorithmic3", "algorithmic5")
MODELS = ("llama", "feedback")
LABELS = {"llama": "Llama", "feedback": "Feedback"}
ACCURACIES = ("accuracy", "sequence_accuracy")  # held-out token and whole-sequence accuracy
# Table 1 of the paper: token accuracy (%) of the standard Transformer and the Feedback Transformer.
PAPER = {"random_walk": (68.0, 100.0), "algorithmic3": (33.7, 99.1), "algorithmic5": (37.5, 92.6)}
SMOKE = {"steps": 2, "eval_every": 1, "train_examples": 16, "eval_examples": 8, "batch_size": 4, "hidden_size": 16,
         "intermediate_size": 32, "num_layers": 1, "num_heads": 2, "episode_length": 6, "num_statements": 4,
         "warmup_steps": 0}  # fmt: skip


def task_data(task: str, args, seed: int) -> tuple[object, object, int]:
    """Training (from `seed`) and held-out (from `seed + 1`) datasets of `task` and the vocabulary size."""
    if task == "random_walk":

        def build(count, seed):
            return random_walk_dataset(count, args.grid_size, args.episode_length, seed=seed)

        vocabulary = len(random_walk_symbols(args.grid_size)) + 1
    else:
        variables = int(task.removeprefix("algorithmic"))

        def build(count, seed):
            return algorithmic_dataset(count, variables, args.num_statements, seed=seed)

        vocabulary = len(algorithmic_symbols()) + 1
    return build(args.train_examples, seed), build(args.eval_examples, seed + 1), vocabulary


def build_model(name: str, vocabulary: int, longest: int, args, seed: int):
    """A Feedback Transformer or a Llama of the sizes in `args`, initialised from `seed`."""
    sizes = {"vocab_size": vocabulary, "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
             "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_heads, "pad_token_id": 0}  # fmt: skip
    torch.manual_seed(seed)
    if name == "feedback":
        span = args.memory_span or longest
        return FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**sizes, memory_span=span))
    return LlamaForCausalLM(LlamaConfig(**sizes, max_position_embeddings=max(longest, 64)))


def run_task(task: str, args, seed: int) -> dict:
    """Both models trained and evaluated on `task` with one seed (datasets, initialisation and data order)."""
    train, held_out, vocabulary = task_data(task, args, seed)
    longest = max(max(len(ids) for ids in train["input_ids"]), max(len(ids) for ids in held_out["input_ids"]))
    results = {"seed": seed, "sequence_length": longest, "vocabulary": vocabulary}
    for name in MODELS:
        model = build_model(name, vocabulary, longest, args, seed)
        curve = [{"step": 0, **evaluate_accuracy(model, held_out)}]

        def evaluate_every(step: int, loss: float, model=model, curve=curve, name=name) -> None:
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                curve.append({"step": step + 1, "train_loss": loss, **evaluate_accuracy(model, held_out)})
                print(f"  seed {seed}  {task:13} {name:9} step {step + 1:5}  loss {loss:.3f}  "
                      f"held-out accuracy {curve[-1]['accuracy']:.3f}", flush=True)  # fmt: skip

        start = time.perf_counter()
        train_on_task(model, train, args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                      warmup_steps=args.warmup_steps, seed=seed, callback=evaluate_every)  # fmt: skip
        results[name] = {"seconds": time.perf_counter() - start, "curve": curve, **curve[-1]}
        results[name]["parameters"] = sum(parameter.numel() for parameter in model.parameters())
        if name == "feedback":
            results[name]["memory_span"] = model.config.memory_span
            results[name]["layer_weights"] = torch.softmax(model.model.layer_weights.detach(), 0).tolist()
    return results


def winner(run: dict) -> str:
    """'feedback', 'llama' or 'tie': the model with the higher final held-out token accuracy in one seed's run."""
    llama, feedback = run["llama"]["accuracy"], run["feedback"]["accuracy"]
    if feedback == llama:
        return "tie"
    return "feedback" if feedback > llama else "llama"


def summarize(runs: list[dict]) -> dict:
    """One task's measurements across seeds (`across_seeds`: mean, low, high, values), the winner of each seed and
    the number of seeds Feedback won."""
    summary = {"sequence_length": across_seeds(run["sequence_length"] for run in runs)}
    for name in MODELS:
        models = [run[name] for run in runs]
        summary[name] = {key: across_seeds(model[key] for model in models) for key in (*ACCURACIES, "seconds")}
        # Every seed evaluates at the same steps, so the curves line up point by point.
        curves = zip(*(model["curve"] for model in models))
        summary[name]["curve"] = [
            {"step": points[0]["step"], **{key: across_seeds(point[key] for point in points) for key in ACCURACIES}}
            for points in curves
        ]
    weights = zip(*(run["feedback"]["layer_weights"] for run in runs))
    summary["feedback"]["layer_weights"] = [across_seeds(column) for column in weights]
    summary["winners"] = [winner(run) for run in runs]
    summary["feedback_wins"] = summary["winners"].count("feedback")
    return summary


def count_seeds(seeds: list) -> str:
    """'1 seed', '3 seeds'."""
    return f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''}"


def plot(summaries: dict, path: str) -> None:
    """Held-out token accuracy against the training step: the mean over seeds, shaded from the lowest to the highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(summaries), figsize=(4.5 * len(summaries), 3.6), squeeze=False)
    labels = {"llama": "Transformer (Llama)", "feedback": "Feedback Transformer"}
    colors = {"llama": "C0", "feedback": "C1"}
    for axis, (task, summary) in zip(axes[0], summaries.items()):
        for name in MODELS:
            curve = summary[name]["curve"]
            steps = [point["step"] for point in curve]
            axis.plot(steps, [point["accuracy"]["mean"] for point in curve], marker="o", markersize=3,
                      color=colors[name], label=labels[name])  # fmt: skip
            lows, highs = ([point["accuracy"][end] for point in curve] for end in ("low", "high"))
            axis.fill_between(steps, lows, highs, color=colors[name], alpha=0.2)
        for name, value in zip(MODELS, PAPER[task]):
            axis.axhline(value / 100, linestyle=":", linewidth=1, color=colors[name])
        length = format_across_seeds(summary["sequence_length"], ".0f")
        axis.set_title(f"{task} (T = {length}, {count_seeds(summary['winners'])})")
        axis.set_xlabel("training step")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out token accuracy")
    axes[0][0].legend(loc="lower right", fontsize=8, title="mean, band: min–max over seeds\ndotted: paper, Table 1",
                      title_fontsize=7)  # fmt: skip
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_arguments(argv=None):
    parser = report.arguments(__doc__, threads=2, quick="a few seconds: tiny models, data and steps (CI)")
    parser.add_argument("--tasks", default="random_walk", help=f"comma-separated, from {TASKS}")
    parser.add_argument("--grid-size", type=int, default=4, help="random walk grid side (paper: 8)")
    parser.add_argument("--episode-length", type=int, default=24, help="random walk actions per episode (paper: 100)")
    parser.add_argument("--num-statements", type=int, default=10, help="statements per program (paper: 100)")
    parser.add_argument("--train-examples", type=int, default=10000, help="paper: 10k")
    parser.add_argument("--eval-examples", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument(
        "--memory-span",
        type=int,
        default=0,
        help="Feedback memory span τ; 0 (default): the longest example, so it sees all as Llama does",
    )
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="one run per seed (datasets, initialisation, data order); default 0 1 2, with --quick 0 1",
    )
    parser.add_argument("--plot", default=None, help=f"PNG path (default {DEFAULT_PLOT}; none with --quick)")
    positive = ("steps", "eval_every", "train_examples", "eval_examples", "batch_size", "threads")
    args = report.parse(parser, argv, quick=SMOKE, unset={"seeds": ([0, 1, 2], [0, 1])}, positive=positive)
    if args.plot is None and not args.quick:
        args.plot = DEFAULT_PLOT
    args.tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    for task in args.tasks:
        if task not in TASKS:
            parser.error(f"--tasks: unknown task {task!r}; choose from {TASKS}")
    if problem := seeds_problem(args.seeds):
        parser.error(problem)
    return args


def print_tables(summaries: dict, per_seed: dict, args) -> None:
    """The final accuracies across seeds, the mean learning curves, each seed's winner and the layer weights."""
    seeds = count_seeds(args.seeds)
    print(f"\nHeld-out accuracy after {args.steps} steps and seconds of training (evaluations included), "
          f"mean (low–high) over {seeds} {args.seeds}:")  # fmt: skip
    print(f"{'task':14}{'model':10}{'T':>12}{'token accuracy':>22}{'sequence accuracy':>22}{'paper %':>9}"
          f"{'seconds':>22}")  # fmt: skip
    for task, summary in summaries.items():
        length = format_across_seeds(summary["sequence_length"], ".0f")
        for name, paper in zip(MODELS, PAPER[task]):
            model = summary[name]
            cells = [format_across_seeds(model[key]) for key in ACCURACIES]
            print(f"{task:14}{LABELS[name]:10}{length:>12}{cells[0]:>22}{cells[1]:>22}{paper:9.1f}"
                  f"{format_across_seeds(model['seconds'], '.1f'):>22}")  # fmt: skip

    columns = [(task, name, f"{task} {LABELS[name]}") for task in summaries for name in MODELS]
    print(f"\nHeld-out token accuracy during training, mean over {seeds}:")
    print(f"{'step':>6}" + "".join(f"{label:>{len(label) + 2}}" for _, _, label in columns))
    steps = [point["step"] for point in next(iter(summaries.values()))["llama"]["curve"]]
    for index, step in enumerate(steps):
        means = (summaries[task][name]["curve"][index]["accuracy"]["mean"] for task, name, _ in columns)
        print(f"{step:6}" + "".join(f"{mean:>{len(label) + 2}.3f}" for mean, (_, _, label) in zip(means, columns)))

    print("\nWinner per seed (higher final held-out token accuracy):")
    print(f"{'task':14}{'seed':>5}{'Llama':>8}{'Feedback':>10}  winner")
    for task, runs in per_seed.items():
        for run, name in zip(runs, summaries[task]["winners"]):
            print(f"{task:14}{run['seed']:5}{run['llama']['accuracy']:8.3f}{run['feedback']['accuracy']:10.3f}  "
                  f"{LABELS.get(name, name)}")  # fmt: skip
    for task, summary in summaries.items():
        print(f"{task}: Feedback beat Llama in {summary['feedback_wins']} of {seeds}")

    print("\nFeedback layer weights softmax(w) (embedding, layer 1, ...), mean (low–high) over seeds:")
    for task, summary in summaries.items():
        weights = "  ".join(format_across_seeds(weight) for weight in summary["feedback"]["layer_weights"])
        print(f"  {task:14}{weights}")


def main(argv=None):
    args = parse_arguments(argv)
    report.start(args)
    print(f"{args.num_layers} layers, hidden {args.hidden_size}, {args.num_heads} heads, MLP {args.intermediate_size}; "
          f"{args.steps} steps of {args.batch_size}, learning rate {args.learning_rate}; "
          f"seeds {' '.join(map(str, args.seeds))}")  # fmt: skip
    per_seed = {task: [] for task in args.tasks}
    for seed in args.seeds:
        for task in args.tasks:
            per_seed[task].append(run_task(task, args, seed))
    summaries = {task: summarize(runs) for task, runs in per_seed.items()}
    print_tables(summaries, per_seed, args)
    if args.plot:
        plot(summaries, args.plot)
        print(f"plot: {args.plot}")
    results = {"seeds": args.seeds, "per_seed": per_seed, "summary": summaries}
    report.finish({"settings": report.own_settings(args), "paper": PAPER, **results}, args)
    return results


if __name__ == "__main__":
    main()
