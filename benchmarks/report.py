"""The benchmarks' one harness: what every script shares, so that each script holds only what it measures.

- the arguments (`arguments` → `parse`): `--repeats`, `--threads`, `--quick` (also spelled `--smoke`: small sizes, a
  run that checks the script), `--json`, and for a script with a section of the speed page `--write-docs` and
  `--report RESULTS_JSON`;
- the start of a run (`start`: torch's threads, the machine line) and its end (`finish`: the JSON, the docs);
- timing: `median_seconds` for one function, `interleaved_times` (and `interleaved_median_times`) for several
  timed in turns, `paired_speedup` for the ratio of two of them round by round, `Decoding` for
  greedy decoding after a prefill, `generation_step_seconds` for a token of `generate()`, and `cache_bytes` for
  what a cache holds;
- the tables: `print_table` for the terminal, `markdown_table` for the docs.

A script with a section of `docs/performance/speed.md` (a `Section`) keeps it between two markers and rewrites it
from the results of one run: `--write-docs` right after measuring, or `--report RESULTS_JSON` from a saved run (the
JSON the documentation quotes is kept under `benchmarks/results/`). Nothing between the markers is written by hand.
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEED_PAGE = os.path.join(ROOT, "docs", "performance", "speed.md")
RESULTS_FOLDER = os.path.join(ROOT, "benchmarks", "results")


@dataclasses.dataclass(frozen=True)
class Section:
    """A script's section of the speed page: the markers' `name`, the `command` that writes it from the saved run,
    and `write`, which turns a run's results into the section's Markdown."""

    name: str
    command: str
    write: Callable[[dict], str]


def arguments(description: str, *, repeats: int | None = None, threads: int | None = None,
              section: Section | None = None, quick: str = "small sizes, few repeats: a run that checks the script"):  # fmt: skip
    """An `argparse.ArgumentParser` with the arguments every script takes (its own are added after): `--repeats`
    (default `repeats`; none when None), `--threads` (default `threads`; None: torch's choice), `--quick` / `--smoke`,
    `--json`, and with a `section` `--write-docs` and `--report`."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats, help="timed runs per measurement (their median)")
    parser.add_argument("--threads", type=int, default=threads, help="torch threads (default: %(default)s)")
    parser.add_argument("--quick", "--smoke", dest="quick", action="store_true", help=quick)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    if section is not None:
        parser.add_argument("--write-docs", action="store_true", help="rewrite the script's section of the speed page")
        parser.add_argument("--report", default=None, metavar="RESULTS_JSON",
                            help="measure nothing: rewrite the section from a saved run's JSON")  # fmt: skip
        parser.add_argument("--report-page", default=SPEED_PAGE, help=argparse.SUPPRESS)
    return parser


def parse(parser: argparse.ArgumentParser, argv=None, quick: dict | None = None, unset: dict | None = None,
          positive: tuple = ()) -> argparse.Namespace:  # fmt: skip
    """The parsed arguments: with `--quick`, those named in `quick` take its values; those left None take their
    (full, quick) value from `unset`; those named in `positive` must be integers ≥ 1 (else the parser's error)."""
    args = parser.parse_args(argv)
    for name, value in (quick or {}).items() if args.quick else ():
        setattr(args, name, value)
    for name, (full, small) in (unset or {}).items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    return args


def own_settings(args: argparse.Namespace) -> dict:
    """The run's arguments, for its results' settings: all but where the results go (`--json`, the docs)."""
    return {
        key: value for key, value in vars(args).items() if key not in ("json", "write_docs", "report", "report_page")
    }


def start(args: argparse.Namespace) -> dict:
    """Before measuring: torch's threads as asked, the machine's line printed; returns `machine()`, for the results'
    settings."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    measured = machine()
    print(f"torch {measured['torch']}, {measured['threads']} threads, {measured['processor']}", flush=True)
    return measured


def saved_run(args: argparse.Namespace, section: Section) -> dict | None:
    """`--report RESULTS_JSON`: the section rewritten from a saved run, whose results are returned; else None."""
    if not args.report:
        return None
    with open(args.report) as file:
        results = json.load(file)
    if results.get("settings", {}).get("quick"):
        raise SystemExit(f"the docs quote a full run; {args.report} holds a --quick one")
    rewrite_section(args.report_page, section.name, section.command, section.write(results))
    print(f"wrote the {section.name} section of {args.report_page}")
    return results


def finish(results: dict, args: argparse.Namespace, section: Section | None = None, write_docs: bool = True) -> dict:
    """After a run: `--json` writes its results, `--write-docs` the script's section of the speed page (from a full
    run only, and not when `write_docs` is False). Returns the results."""
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2, default=str)
    if section is not None and args.write_docs and write_docs:
        if args.quick:
            raise SystemExit("the docs quote a full run, not --quick")
        rewrite_section(args.report_page, section.name, section.command, section.write(results))
        print(f"wrote the {section.name} section of {args.report_page}")
    return results


def median_seconds(function, warmup: int, repeats: int, device=None) -> float:
    """Median seconds of `function()` over `repeats` runs after `warmup` untimed ones: wall-clock time, or on a CUDA
    `device` the time between two CUDA events around each run."""
    if device is None or device.type != "cuda":
        return interleaved_median_times({"function": function}, warmup, repeats)["function"]
    import torch

    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


class Decoding:
    """Greedy decoding for timing: a prefill of `context` random tokens (seed 0) at batch `batch_size`, then each call
    runs `steps` greedy steps of one token per row through the model's forward with its cache (under the keyword the
    installed 🤗 gives it: `cache`, before 5.24 `past_key_values`, `cache_params` for 🤗 Mamba), carrying the tokens
    and the cache on to the next call; `cache` is the latest. The prompt is drawn on the CPU and moved to `device`;
    with `prefill_chunk` it is read that many tokens at a time."""

    def __init__(self, model, context: int, steps: int, batch_size: int = 1, device=None,
                 prefill_chunk: int | None = None):  # fmt: skip
        import torch

        from memlm.compat import cache_keyword, output_cache

        self.model, self.steps, self.output_cache = model.eval(), steps, output_cache
        self.keyword = cache_keyword(model)
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (batch_size, context), generator=generator).to(device)
        self.cache = None
        # The prompt in pieces of `prefill_chunk` tokens, carrying the cache (bounds a long prompt's memory).
        with torch.no_grad():
            for start in range(0, context, prefill_chunk or context):
                piece = prompt[:, start : start + (prefill_chunk or context)]
                cached = {} if self.cache is None else {self.keyword: self.cache}
                self.cache = output_cache(model(piece, use_cache=True, logits_to_keep=1, **cached))
        self.token = prompt[:, -1:]

    def __call__(self):
        import torch

        with torch.no_grad():
            for _ in range(self.steps):
                output = self.model(self.token, use_cache=True, logits_to_keep=1, **{self.keyword: self.cache})
                self.cache, self.token = self.output_cache(output), output.logits[:, -1:].argmax(-1)


def cache_bytes(cache) -> int:
    """Bytes of every distinct tensor storage reachable from a cache object (memlm's memories, a Transformer's keys
    and values, whatever the class keeps them in; a preallocated buffer counts whole)."""
    import torch

    seen, total, stack, visited = set(), 0, [cache], set()
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif hasattr(value, "__dict__") and id(value) not in visited:
            visited.add(id(value))
            stack.extend(vars(value).values())
    return total


def machine() -> dict:
    """What the run was measured on: date (UTC), processor, logical CPUs, torch and its threads."""
    import torch

    processor = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as file:
            names = [line.split(":", 1)[1].strip() for line in file if line.startswith("model name")]
        processor = names[0] if names else processor
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "processor": processor,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def measured_on(settings: dict) -> str:
    """One sentence naming the machine and the date of a run (its `settings`, holding what `machine()` gave)."""
    return (
        f"Measured on {settings['date']} on {settings['cpus']} logical CPUs ({settings['processor']}), torch "
        f"{settings['torch']} with {settings['threads']} threads, in one run of the script."
    )


def cell(value, pattern: str) -> str:
    return "—" if value is None else format(value, pattern)


def against(ratio: float, goal: float) -> str:
    """`ratio` printed for a comparison with `goal`: two decimals, or as many more (up to six) as it takes for the
    printed number to sit on the same side of the goal as the ratio (0.4996 does not show as a missed 0.50)."""
    for decimals in range(2, 7):
        text = f"{ratio:.{decimals}f}"
        if (float(text) >= goal) == (ratio >= goal):
            break
    return text


def judged(ratio: float, goal: float, where: str = "") -> str:
    """A ratio against its goal, as in "1.28×{where} (goal ≥ 1.25×: met)" (the ratio printed by `against`)."""
    return f"{against(ratio, goal)}×{where} (goal ≥ {goal}×: {'met' if ratio >= goal else 'missed'})"


def print_table(title: str, columns: list[tuple[str, str, str]], rows: list[dict]) -> None:
    """Print `rows` under `title` as right-aligned text columns; `columns` are (header, row key, format) triples."""
    lines = [[header for header, _, _ in columns]]
    lines += [[cell(row.get(key), pattern) for _, key, pattern in columns] for row in rows]
    widths = [max(len(text) for text in column) for column in zip(*lines)]
    print(f"\n{title}")
    for line in lines:
        print("  ".join(text.rjust(width) for text, width in zip(line, widths)))


def markdown_table(columns: list[tuple[str, str, str]], rows: list[dict]) -> str:
    """A Markdown table of `rows`; `columns` are (header, row key, format) triples; numbers are right-aligned."""
    lines = ["| " + " | ".join(header for header, _, _ in columns) + " |"]
    lines.append("| " + " | ".join("---" if pattern == "s" else "---:" for _, _, pattern in columns) + " |")
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(key), pattern) for _, key, pattern in columns) + " |")
    return "\n".join(lines)


def markers(name: str, command: str) -> tuple[str, str]:
    begin = f"<!-- {name}: begin; written by `{command}`, do not edit -->"
    return begin, f"<!-- {name}: end -->"


def section_text(page: str, name: str) -> str | None:
    """The text between `name`'s markers in `page` (without them), or None when the page has no such section."""
    with open(page) as file:
        text = file.read()
    start = text.find(f"<!-- {name}: begin;")
    end = text.find(f"<!-- {name}: end -->")
    if start < 0 or end < 0:
        return None
    return text[text.index("\n", start) + 1 : end].rstrip("\n")


def rewrite_section(page: str, name: str, command: str, section: str) -> None:
    """Replace `name`'s section of `page` (markers included) by `section`; the page must already have the markers."""
    with open(page) as file:
        text = file.read()
    begin, end = markers(name, command)
    start, stop = text.find(f"<!-- {name}: begin;"), text.find(end)
    if start < 0 or stop < 0:
        raise SystemExit(f"{page} has no section {name!r}: add the two lines\n{begin}\n{end}\nwhere it belongs.")
    text = text[:start] + f"{begin}\n{section}\n" + text[stop:]
    with open(page, "w") as file:
        file.write(text)


def interleaved_times(functions: dict, warmup: int, repeats: int, timed_inside: bool = False) -> dict:
    """Seconds of each of `functions` (name → callable) per round, timed in turns: one run of each per round, so
    that a change in the machine's load (other jobs) weighs on all of them alike, in an order shuffled every round
    (seeded), so that none always runs after the same one (a Transformer over a long context leaves the caches cold
    for whatever runs next). With `timed_inside`, each call returns the seconds it measured itself (a part of its
    work, as `generation_step_seconds`). {name: [seconds of round 1, round 2, …]}."""
    for _ in range(warmup):
        for function in functions.values():
            function()
    times = {name: [] for name in functions}
    order, names = random.Random(0), list(functions)
    for _ in range(repeats):
        order.shuffle(names)
        for name in names:
            function = functions[name]
            start = time.perf_counter()
            seconds = function()
            times[name].append(seconds if timed_inside else time.perf_counter() - start)
    return times


def interleaved_median_times(functions: dict, warmup: int, repeats: int, timed_inside: bool = False) -> dict:
    """Median seconds of each of `functions`, timed in turns (`interleaved_times`)."""
    times = interleaved_times(functions, warmup, repeats, timed_inside)
    return {name: statistics.median(values) for name, values in times.items()}


def paired_speedup(times: dict, name: str, reference: str) -> float:
    """How many times faster `name` ran than `reference` in `interleaved_times`'s `times`: the median over the rounds
    of the round's ratio (reference's seconds / name's). Runs of one round are seconds apart, so a slower phase of
    the machine, which lasts longer, weighs on both sides of each ratio; a ratio of the two medians, taken from
    different rounds, moves with it."""
    return statistics.median(before / after for before, after in zip(times[reference], times[name]))


def generation_step_seconds(model, prompt, new_tokens: int, **options) -> float:
    """Seconds per token of greedy `model.generate(prompt, **options)` after its first new token: the time from that
    token to the last of `new_tokens` (≥ 2), read at each token by a stopping criterion that stops nothing, over the
    steps between. So the prompt's forward is left out, and each step counts generate's own work around the model's.
    `options`: more of generate's arguments (`compile_config`, a cache's)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps = []

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       stopping_criteria=StoppingCriteriaList([Clock()]), **options)  # fmt: skip
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)
