"""What the speed scripts share: timing functions in turns, and writing their measured tables into the
documentation's speed page from a run's JSON.

Each script (`delta_rule.py`, `feedback.py`, `kernel_costs.py --static`) keeps its own section of
`docs/performance/speed.md` between two markers, and rewrites it from the results of one run:
`--write-docs` right after measuring, or `--report RESULTS_JSON` from a saved run (the JSON the documentation quotes
is kept under `benchmarks/results/`). Nothing between the markers is written by hand.
"""

import datetime
import json
import os
import platform
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEED_PAGE = os.path.join(ROOT, "docs", "performance", "speed.md")
RESULTS_FOLDER = os.path.join(ROOT, "benchmarks", "results")


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


def rewrite_from_saved_run(path: str, name: str, command: str, docs_section) -> dict:
    """`--report RESULTS_JSON`: rewrite `name`'s section of the speed page from a saved run; returns its results."""
    with open(path) as file:
        results = json.load(file)
    rewrite_section(SPEED_PAGE, name, command, docs_section(results))
    print(f"wrote the {name} section of {SPEED_PAGE}")
    return results


def keep_run(results: dict, json_path: str | None, write_docs: bool, name: str, command: str, docs_section) -> None:
    """After a run: `--json` writes its results, `--write-docs` its section of the speed page (a full run only)."""
    if json_path:
        with open(json_path, "w") as file:
            json.dump(results, file, indent=2)
    if write_docs:
        if results["settings"].get("quick"):
            raise SystemExit("the docs quote a full run, not --quick")
        rewrite_section(SPEED_PAGE, name, command, docs_section(results))
        print(f"wrote the {name} section of {SPEED_PAGE}")


def interleaved_median_times(functions: dict, warmup: int, repeats: int) -> dict:
    """Median seconds of each of `functions` (name → callable), timed in turns: one run of each per round, so
    that a change in the machine's load (other jobs) weighs on all of them alike."""
    for _ in range(warmup):
        for function in functions.values():
            function()
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}
