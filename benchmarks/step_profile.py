"""Where a training step's time goes: DeltaNet and the Feedback Transformer next to 🤗 Llama, by kind of work.

Runs `torch.profiler` over training steps (forward + backward of the LM loss) of the models the speed scripts
compare: DeltaNet and Llama of `delta_rule.py`'s model table (T = 2048, batch 4) and the Feedback Transformer and
Llama of `feedback.py` (B = 32, T = 256). For each model it prints the step's self CPU time split by region (memlm's
operations and their backward: the chunkwise delta rule, the DPFP feature map, the Feedback step loop; Llama's
attention) and, inside each region, matrix products (mm/addmm/bmm/baddbmm) against everything else, with the minor
page faults of an unprofiled step (fresh pages the kernel maps and zeroes; glibc returns allocations of 32 MiB and more
to the system when freed, so each one faults again).

    python benchmarks/step_profile.py [--steps 2] [--models deltanet llama feedback feedback_llama]
    python benchmarks/step_profile.py --decode [--models feedback feedback_llama]   # 64 greedy tokens after 2048

With `--decode` a "step" is `feedback.py`'s decoding: 64 greedy tokens at batch 1 after a prefill of 2048 tokens.

    python benchmarks/step_profile.py --generate-ops [--context 128]

With `--generate-ops` it counts instead the operations of one token of greedy `generate()` at batch 1 after the
context, for the seven models of `paper_layouts.py`'s generate() table (both layouts of each family and 🤗 Llama): the
operations no other operation ran, by name. On a CPU a decoding step of these sizes is bound by its number of
operations more than by their arithmetic, and unlike a time the count does not move from run to run.

    python benchmarks/step_profile.py --instructions [--context 128]

With `--instructions` it counts the CPU instructions of such a token instead, for the same seven models, under
valgrind's callgrind (which must be installed; the script runs itself under it, on one thread: a thread pool's idle
threads spin, which callgrind would count): the instructions of a `generate()` call for `--tokens` new tokens less
those of a call for one, over `--tokens` − 1. Like the operations, the count is the same on every run of a machine
and release, where a time on a shared machine moves by several percent; unlike them it weighs each operation by its
work, Python's included. It is not a time: memory stalls, branch misses and the thread pool's waits are not in it.

The shares are what the speed page's text refers to; the times themselves are inflated by the profiler.
"""

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from torch.profiler import profile

try:  # run as a script (python benchmarks/step_profile.py) or imported as benchmarks.step_profile
    import delta_rule
    import feedback
    import paper_layouts
    import report
except ImportError:
    from benchmarks import delta_rule, feedback, paper_layouts, report

# Ops whose time (and their children's) belongs to a region, by the name the profiler gives them.
REGIONS = {
    "DeltaRuleChunkFunction": "delta rule",
    "DeltaRuleChunkFunctionBackward": "delta rule",
    "DPFPFunction": "DPFP",
    "DPFPFunctionBackward": "DPFP",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention (SDPA)",
    "_ThroughTime": "step loop",
    "_ThroughTimeBackward": "step loop",
}
PRODUCTS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::baddbmm_"}
MODELS = ("deltanet", "llama", "feedback", "feedback_llama")


def build(name: str, decode: bool = False, context: int = 2048):
    """The model `name` and its training step, or its decoding of 64 tokens after `context` (a function of no
    arguments)."""
    if decode:
        models = delta_rule.comparison_models() if name in ("deltanet", "llama") else feedback.build_models()
        return report.Decoding(models["llama" if name.endswith("llama") else name], context, 64)
    if name in ("deltanet", "llama"):
        args = delta_rule.parse_arguments([])
        model = delta_rule.comparison_models()[name]
        return delta_rule.training_step(model, 2048, args)
    model = feedback.build_models()["feedback" if name == "feedback" else "llama"]
    return feedback.training_step(model, 32, 256)


def region_of(event) -> str:
    while event is not None:
        if event.name in REGIONS:
            return REGIONS[event.name]
        event = event.cpu_parent
    return "rest of the model"


def profile_step(step, steps: int) -> tuple[dict, float, int]:
    """{(region, "products" | "other"): self seconds} per step, the seconds of an unprofiled step and its minor page
    faults."""
    step()
    step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    with profile() as profiler:
        for _ in range(steps):
            step()
    totals = {}
    for event in profiler.events():
        kind = "products" if event.name in PRODUCTS else "other"
        key = (region_of(event), kind)
        totals[key] = totals.get(key, 0.0) + event.self_cpu_time_total / 1e6 / steps
    return totals, seconds, faults


def print_profile(name: str, totals: dict, seconds: float, faults: int) -> None:
    profiled = sum(totals.values())
    print(f"\n{name}: {seconds:.3f} s per step unprofiled ({profiled:.3f} s profiled), {faults} minor page faults")
    print(f"  {'region':20}{'kind':10}{'share':>8}{'ms':>10}")
    for (region, kind), time_spent in sorted(totals.items(), key=lambda item: -item[1]):
        if time_spent / profiled >= 0.005:
            print(f"  {region:20}{kind:10}{time_spent / profiled:8.1%}{time_spent * 1e3:10.1f}")


def top_level_operations(function) -> dict[str, int]:
    """{name: calls} of the operations `function()` runs that no other operation ran (an op's own inner ops, such
    as linear's addmm, are not counted again)."""
    with profile() as profiler:
        function()
    counts = {}
    for event in profiler.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def operations_per_token(model, context: int, tokens: int) -> dict[str, float]:
    """{name: calls per token} of greedy `generate()` at batch 1 after `context` random tokens (seed 0): the top-level
    operations of a call for `tokens` new tokens less those of a call for one, over `tokens` − 1 (the prompt's forward
    and the first token cancel out). The model must have no end-of-text token (all `tokens` are made)."""
    import torch

    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    model.generate(prompt, max_new_tokens=tokens, do_sample=False)  # (warm: first calls take other paths)
    one = top_level_operations(lambda: model.generate(prompt, max_new_tokens=1, do_sample=False))
    many = top_level_operations(lambda: model.generate(prompt, max_new_tokens=tokens, do_sample=False))
    per_token = {name: (count - one.get(name, 0)) / (tokens - 1) for name, count in many.items()}
    return {name: count for name, count in per_token.items() if count}


def count_instructions_here(args) -> None:
    """`--instructions`'s worker, run under callgrind with collection off: for each model, one warm-up call, then
    calls for one and for `args.tokens` new tokens, each counted alone (callgrind_control zeroes the counts before it
    and dumps them after it, under the model's name and the call's tokens)."""
    import torch

    torch.set_num_threads(1)
    process = str(os.getpid())

    def control(*options):
        subprocess.run(["callgrind_control", *options, process], check=True, capture_output=True)

    models = paper_layouts.generation_models(args.quick)
    prompt = torch.randint(0, paper_layouts.BYTE_VOCABULARY, (1, args.context),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    with torch.no_grad():
        for name, model in models.items():
            model.generate(prompt, max_new_tokens=args.tokens, do_sample=False)  # (warm: first calls take other paths)
            control("--instr=on")
            for tokens in (1, args.tokens):
                control("--zero")
                model.generate(prompt, max_new_tokens=tokens, do_sample=False)
                control(f"--dump={name} {tokens}")
            control("--instr=off")


def instructions_per_token(args) -> dict[str, float]:
    """{model: instructions per token} of `--instructions`: this script run again under callgrind
    (`count_instructions_here`), its dumps read back."""
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"--instructions runs under valgrind's callgrind; not found: {', '.join(missing)}")
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "callgrind.out")
        worker = [sys.executable, os.path.abspath(__file__), "--count-instructions-here", "--context",
                  str(args.context), "--tokens", str(args.tokens)] + (["--quick"] if args.quick else [])  # fmt: skip
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={output}", *worker]
        environment = os.environ | {"PYTHONHASHSEED": "0"}  # (a set's order, and so its work, the same every run)
        finished = subprocess.run(command, capture_output=True, text=True, env=environment)
        if finished.returncode != 0:
            raise SystemExit(f"the run under callgrind failed:\n{finished.stderr[-3000:]}")
        counts = {}  # {(model, tokens): instructions}, in the order the worker dumped them
        dumps = sorted((name for name in os.listdir(folder) if name.rsplit(".", 1)[-1].isdigit()),
                       key=lambda name: int(name.rsplit(".", 1)[-1]))  # fmt: skip
        for name in dumps:
            label = total = None
            with open(os.path.join(folder, name)) as dump:
                for line in dump:
                    if line.startswith("desc: Trigger: dump "):  # (callgrind_control --dump=LABEL)
                        label = line.removeprefix("desc: Trigger: dump ").strip()
                    elif line.startswith("totals:"):
                        total = int(line.split()[1])
            if label is not None and total is not None:
                model, tokens = label.rsplit(" ", 1)
                counts[model, int(tokens)] = total
    models = dict.fromkeys(model for model, _ in counts)
    return {model: (counts[model, args.tokens] - counts[model, 1]) / (args.tokens - 1) for model in models}


def print_instructions(counts: dict[str, float], context: int) -> None:
    print(f"\nInstructions per token of generate() at batch 1 after {context} tokens (callgrind, one thread)")
    for name, per_token in counts.items():
        print(f"  {name:22}{per_token / 1e6:8.3f} M{per_token / counts['llama']:8.2f}× Llama's")


def print_operations(counts: dict[str, dict[str, float]], context: int) -> None:
    print(f"\nOperations per token of generate() at batch 1 after {context} tokens")
    llama = sum(counts["llama"].values())
    for name, per_token in counts.items():
        most = sorted(per_token.items(), key=lambda item: -item[1])[:5]
        listed = ", ".join(f"{operation.removeprefix('aten::')} {count:.1f}" for operation, count in most)
        total = sum(per_token.values())
        print(f"  {name:22}{total:8.1f}{total / llama:8.2f}× Llama's   ({listed}, …)")


def main(argv=None):
    parser = report.arguments(__doc__)
    parser.add_argument("--steps", type=int, default=2, help="profiled training steps per model")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None, help="default: all four (training), "
                        "feedback and feedback_llama (--decode)")  # fmt: skip
    parser.add_argument("--decode", action="store_true", help="profile decoding instead of a training step")
    parser.add_argument("--generate-ops", action="store_true",
                        help="count the operations of a generate() token instead (paper_layouts.py's models)")  # fmt: skip
    parser.add_argument("--instructions", action="store_true", help="count the CPU instructions of a generate() token "
                        "instead, under valgrind's callgrind (paper_layouts.py's models)")  # fmt: skip
    parser.add_argument("--count-instructions-here", action="store_true", help=argparse.SUPPRESS)  # (the worker)
    parser.add_argument("--context", type=int, default=None, help="--generate-ops, --instructions: the prompt's "
                        "tokens (default 128, 16 with --quick)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=None, help="--generate-ops, --instructions: new tokens of the "
                        "counted call (default 33, 3 with --quick)")  # fmt: skip
    args = report.parse(parser, argv, quick={"steps": 1}, unset={"context": (128, 16), "tokens": (33, 3)})
    if args.count_instructions_here:
        return count_instructions_here(args)
    if (args.instructions or args.generate_ops) and (args.tokens < 2 or args.context < 1):
        parser.error(f"--tokens must be at least 2 and --context positive, got {args.tokens} and {args.context}")
    if args.instructions:
        report.start(args)
        counts = instructions_per_token(args)
        print_instructions(counts, args.context)
        return report.finish({"settings": report.own_settings(args), "instructions_per_token": counts}, args)
    if args.generate_ops:
        report.start(args)
        counts = {name: operations_per_token(model, args.context, args.tokens)
                  for name, model in paper_layouts.generation_models(args.quick).items()}  # fmt: skip
        print_operations(counts, args.context)
        return report.finish({"settings": report.own_settings(args), "operations_per_token": counts}, args)
    models = args.models or (["feedback", "feedback_llama"] if args.decode else list(MODELS))
    report.start(args)
    profiles = {}
    for name in models:
        profiles[name] = profile_step(build(name, args.decode), args.steps)
        print_profile(name, *profiles[name])
    saved = {}
    for name, (regions, step, faults) in profiles.items():
        shares = {f"{region}, {kind}": seconds for (region, kind), seconds in regions.items()}
        saved[name] = {"seconds_by_region": shares, "step_seconds": step, "minor_page_faults": faults}
    report.finish({"settings": report.own_settings(args), "profiles": saved}, args)


if __name__ == "__main__":
    main()
