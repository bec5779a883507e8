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

Prints one table (held-out token and sequence accuracy; seconds of training, evaluations included) and the
Feedback models' learned layer weights softmax(w) (Eq. 1: how much the embedding and each layer contribute to the
memory); `--plot` writes the held-out accuracy against the training step per model and task.

    python benchmarks/paper_feedback.py [--smoke] [--json results.json] [--plot benchmarks/paper_feedback.png]
    python benchmarks/paper_feedback.py --tasks algorithmic3 --steps 500 --plot benchmarks/paper_feedback_programs.png

The default run is the random walk for 1500 steps (the Feedback model learns its step-by-step recurrence slowly:
at 500 steps it is still behind Llama). A Feedback step on the programs (up to 67 tokens) costs about 2.5 times one
on the walk, so the programs run as a second command with fewer steps.
"""

import argparse
import json
import platform
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memlm import FeedbackTransformerConfig, FeedbackTransformerForCausalLM
from memlm.training.tasks.algorithmic import algorithmic_dataset, algorithmic_symbols
from memlm.training.tasks.common import evaluate_accuracy, train_on_task
from memlm.training.tasks.random_walk import random_walk_dataset, random_walk_symbols

DEFAULT_PLOT = "benchmarks/paper_feedback.png"
TASKS = ("random_walk", "algorithmic3", "algorithmic5")
MODELS = ("llama", "feedback")
# Table 1 of the paper: token accuracy (%) of the standard Transformer and the Feedback Transformer.
PAPER = {"random_walk": (68.0, 100.0), "algorithmic3": (33.7, 99.1), "algorithmic5": (37.5, 92.6)}
SMOKE = {"steps": 2, "eval_every": 1, "train_examples": 16, "eval_examples": 8, "batch_size": 4, "hidden_size": 16,
         "intermediate_size": 32, "num_layers": 1, "num_heads": 2, "episode_length": 6, "num_statements": 4,
         "warmup_steps": 0}  # fmt: skip


def task_data(task: str, args) -> tuple[object, object, int]:
    """Training and held-out datasets of `task` (different seeds) and the vocabulary size."""
    if task == "random_walk":

        def build(count, seed):
            return random_walk_dataset(count, args.grid_size, args.episode_length, seed=seed)

        vocabulary = len(random_walk_symbols(args.grid_size)) + 1
    else:
        variables = int(task.removeprefix("algorithmic"))

        def build(count, seed):
            return algorithmic_dataset(count, variables, args.num_statements, seed=seed)

        vocabulary = len(algorithmic_symbols()) + 1
    return build(args.train_examples, args.seed), build(args.eval_examples, args.seed + 1), vocabulary


def build_model(name: str, vocabulary: int, longest: int, args):
    """A Feedback Transformer or a Llama of the sizes in `args`, initialised from `args.seed`."""
    sizes = {"vocab_size": vocabulary, "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
             "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_heads, "pad_token_id": 0}  # fmt: skip
    torch.manual_seed(args.seed)
    if name == "feedback":
        span = args.memory_span or longest
        return FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**sizes, memory_span=span))
    return LlamaForCausalLM(LlamaConfig(**sizes, max_position_embeddings=max(longest, 64)))


def run_task(task: str, args) -> dict:
    train, held_out, vocabulary = task_data(task, args)
    longest = max(max(len(ids) for ids in train["input_ids"]), max(len(ids) for ids in held_out["input_ids"]))
    results = {"sequence_length": longest, "vocabulary": vocabulary}
    for name in MODELS:
        model = build_model(name, vocabulary, longest, args)
        curve = [{"step": 0, **evaluate_accuracy(model, held_out)}]

        def evaluate_every(step: int, loss: float, model=model, curve=curve, name=name) -> None:
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                curve.append({"step": step + 1, "train_loss": loss, **evaluate_accuracy(model, held_out)})
                print(f"  {task:13} {name:9} step {step + 1:5}  loss {loss:.3f}  "
                      f"held-out accuracy {curve[-1]['accuracy']:.3f}", flush=True)  # fmt: skip

        start = time.perf_counter()
        train_on_task(model, train, args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                      warmup_steps=args.warmup_steps, seed=args.seed, callback=evaluate_every)  # fmt: skip
        results[name] = {"seconds": time.perf_counter() - start, "curve": curve, **curve[-1]}
        results[name]["parameters"] = sum(parameter.numel() for parameter in model.parameters())
        if name == "feedback":
            results[name]["memory_span"] = model.config.memory_span
            results[name]["layer_weights"] = torch.softmax(model.model.layer_weights.detach(), 0).tolist()
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.6), squeeze=False)
    labels = {"llama": "Transformer (Llama)", "feedback": "Feedback Transformer"}
    for axis, (task, result) in zip(axes[0], results.items()):
        for name in MODELS:
            curve = result[name]["curve"]
            axis.plot([point["step"] for point in curve], [point["accuracy"] for point in curve], marker="o",
                      markersize=3, label=labels[name])  # fmt: skip
        for name, value in zip(MODELS, PAPER[task]):
            axis.axhline(value / 100, linestyle=":", linewidth=1, color="C0" if name == "llama" else "C1")
        axis.set_title(f"{task} (T = {result['sequence_length']})")
        axis.set_xlabel("training step")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out token accuracy")
    axes[0][0].legend(loc="lower right", fontsize=8, title="dotted: paper, Table 1", title_fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a few seconds: tiny models, data and steps (CI)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help=f"PNG path (default {DEFAULT_PLOT}; none with --smoke)")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    elif args.plot is None:
        args.plot = DEFAULT_PLOT
    args.tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    for task in args.tasks:
        if task not in TASKS:
            parser.error(f"--tasks: unknown task {task!r}; choose from {TASKS}")
    for name in ("steps", "eval_every", "train_examples", "eval_examples", "batch_size", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def main(argv=None):
    args = parse_arguments(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; "
          f"{args.num_layers} layers, hidden {args.hidden_size}, {args.num_heads} heads, MLP {args.intermediate_size}; "
          f"{args.steps} steps of {args.batch_size}, learning rate {args.learning_rate}")  # fmt: skip
    results = {task: run_task(task, args) for task in args.tasks}

    print(f"\n{'task':14}{'T':>5}{'Llama acc':>11}{'Feedback acc':>14}{'Llama seq':>11}{'Feedback seq':>14}"
          f"{'paper (T / F)':>16}{'Llama s':>9}{'Feedback s':>12}")  # fmt: skip
    for task, result in results.items():
        llama, feedback = result["llama"], result["feedback"]
        paper = "{:.1f} / {:.1f}".format(*PAPER[task])
        print(f"{task:14}{result['sequence_length']:5}{llama['accuracy']:11.3f}{feedback['accuracy']:14.3f}"
              f"{llama['sequence_accuracy']:11.3f}{feedback['sequence_accuracy']:14.3f}{paper:>16}"
              f"{llama['seconds']:9.1f}{feedback['seconds']:12.1f}")  # fmt: skip
    print("\nFeedback layer weights softmax(w) (embedding, layer 1, ...):")
    for task, result in results.items():
        print(f"  {task:14}" + " ".join(f"{weight:.3f}" for weight in result["feedback"]["layer_weights"]))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"settings": vars(args), "paper": PAPER, "results": results}, file, indent=2)
    return results


if __name__ == "__main__":
    main()
