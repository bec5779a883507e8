"""`make gpu-check`: everything memlm checks and measures on a GPU, as one call on a machine with CUDA and no network.

    make gpu-wheels                                           # here, with the network: the wheels the machine lacks
    python3 devtools/gpu_check.py [--wheels build/gpu-wheels] [--out FOLDER]    # there (= make gpu-check)

FOLDER defaults to ``$OUT`` when set, else build/gpu-check. Without CUDA the check refuses in one line (exit code 2)
and runs nothing. With CUDA it runs four stages within :data:`BUDGET_SECONDS` (7.5 minutes, inside the machine's
8), each in its own process group with a time limit: its own budget (:data:`STAGES`) plus what the stages before it
left unused, never past the whole budget. A stage that runs out of time is stopped, recorded as ``timed_out``, and
the next one runs:

1. ``install``: checks the wheel folder against its manifest (devtools/gpu_wheels.py), installs its wheels and
   memlm, built from the working tree, without dependencies into a fresh folder put first on ``PYTHONPATH`` (the
   machine's torch and Triton stay), then records what the later stages import and any requirement left unmet;
2. ``tests``: pytest on the tests marked ``gpu`` (:data:`GPU_TEST_PATHS`), in parallel under pytest-xdist and each
   bounded by pytest-timeout where the machine has them; deprecation warnings are shown, not failures (the machine
   runs other torch and Triton releases than CI, and the check is about the GPU path);
3. ``kernel_speed`` and 4. ``model_speed``: benchmarks/gpu_speed.py.

The report, ``gpu_check.json`` (:func:`build_report`, :func:`report_problems` says what a well-formed one holds), and
``gpu_check.log`` (every stage's output) are written into FOLDER at the end, also when tests fail or a stage breaks.
The speed page's GPU section is written from a report kept as benchmarks/results/gpu_check.json
(``python benchmarks/gpu_speed.py --report benchmarks/results/gpu_check.json``).
"""

import argparse
import dataclasses
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: devtools/ from the repository's root
    sys.path.insert(0, str(ROOT))

SCHEMA = "memlm-gpu-check/1"
BUDGET_SECONDS = 450.0
# Each stage's own budget in seconds, in order; they add up to BUDGET_SECONDS.
STAGES = {"install": 60.0, "tests": 180.0, "kernel_speed": 90.0, "model_speed": 120.0}
# A stage given less than this is skipped: too short to start Python and torch.
SHORTEST_STAGE = 10.0
GPU_TEST_PATHS = ("tests/kernels", "tests/modeling")
# The speed stages start no measurement in the last SPEED_MARGIN seconds of their limit (one may take that long).
SPEED_PARTS = {"kernel_speed": "kernels", "model_speed": "models"}
SPEED_MARGIN = 30.0
TEST_TIMEOUT = 150  # seconds per test (pytest-timeout)
TEST_WORKERS = 8  # pytest-xdist processes sharing the GPU (16 CPU cores there), so that Triton compiles in parallel
STATUSES = ("passed", "failed", "timed_out", "skipped")
OUTCOMES = ("passed", "failed", "skipped", "error")
REPORT_NAME, LOG_NAME = "gpu_check.json", "gpu_check.log"


# --- Stages ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StageResult:
    """How a stage ended: ``status`` one of :data:`STATUSES`, its seconds and time limit, the last command's exit
    code (None when stopped or skipped) and a one-line message."""

    name: str
    status: str
    seconds: float
    limit_seconds: float
    returncode: int | None = None
    message: str = ""


def stage_limit(stage: str, elapsed: float, budgets: dict = STAGES, total: float = BUDGET_SECONDS) -> float:
    """Seconds ``stage`` may run when the check has run ``elapsed`` seconds: its own budget plus what the stages before
    it left unused (the budgets up to and including it, less the time spent), never past ``total``."""
    names = list(budgets)
    allowed = sum(budgets[name] for name in names[: names.index(stage) + 1]) - elapsed
    return max(0.0, min(allowed, total - elapsed))


def run_commands(name: str, commands: list[list[str]], limit: float, log, environment: dict,
                 shortest: float = SHORTEST_STAGE) -> StageResult:  # fmt: skip
    """Run ``commands`` one after the other (stopping at the first that fails) in the repository's root within
    ``limit`` seconds, their output appended to the open file ``log``; skip them when ``limit`` is under ``shortest``.
    Each runs in its own process group, which is killed (with whatever it started) when the time is out."""
    began = time.monotonic()
    if limit < shortest:
        return StageResult(name, "skipped", 0.0, limit, message=f"skipped: {limit:.0f} s left, under {shortest:.0f} s")
    returncode = None
    for command in commands:
        log.write(f"\n===== {name}: {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            returncode = process.wait(timeout=max(0.1, limit - (time.monotonic() - began)))
        except subprocess.TimeoutExpired:
            _kill_group(process)
            seconds = time.monotonic() - began
            log.write(f"\n===== {name}: stopped after {seconds:.0f} s (its limit was {limit:.0f} s)\n")
            return StageResult(name, "timed_out", seconds, limit, message=f"stopped at its limit of {limit:.0f} s")
        if returncode != 0:
            message = f"{os.path.basename(command[0])} {' '.join(command[1:3])} exited with {returncode}"
            return StageResult(name, "failed", time.monotonic() - began, limit, returncode, message)
    return StageResult(name, "passed", time.monotonic() - began, limit, returncode)


def _kill_group(process: subprocess.Popen) -> None:
    """Stop a stage's process group: SIGTERM, then SIGKILL after 5 seconds."""
    for kill, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, kill)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_lines(path: Path) -> list[dict]:
    """The JSON lines of a results file (none if it was never written; a line cut by a kill is left out)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


# --- The machine, the installation --------------------------------------------------------------------------------


def machine_description() -> dict:
    """The GPU, its software and the date, read in this process (the machine's torch and Triton)."""
    import torch

    properties = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    driver = None
    if shutil.which("nvidia-smi"):
        found = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)  # fmt: skip
        driver = found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout.strip() else None
    return {
        "gpu": torch.cuda.get_device_name(0),
        "capability": "{}.{}".format(*torch.cuda.get_device_capability(0)),
        "memory_gib": properties.total_memory / 2**30,
        "multiprocessors": properties.multi_processor_count,
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def sources_digest(root: Path = ROOT) -> str:
    """sha256 over the paths and contents of memlm's Python files: which sources the check ran."""
    digest = hashlib.sha256()
    for path in sorted((root / "memlm").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def git_commit(root: Path = ROOT) -> str | None:
    """The commit checked out, with ``+changes`` when the tree differs from it; None without git or its folder."""
    if not shutil.which("git") or not (root / ".git").exists():
        return None
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:
        return None
    changed = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+changes" if changed else "")


# Writes what the stages import, with their versions and unmet requirements, as JSON into the file argv[1] (run where
# the installed folder comes first on the path).
INSTALLED_SCRIPT = (
    "import json, sys; from devtools.gpu_wheels import installed_versions; "
    "json.dump(installed_versions(), open(sys.argv[1], 'w'))"
)


def install_commands(python: str, wheels: Path, site: Path) -> list[list[str]]:
    """The wheels of the folder, then memlm from the working tree (no dependencies, no build isolation: the machine's
    setuptools builds it), into ``site``."""
    pip = [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--upgrade", "--target", str(site)]  # fmt: skip
    wheel_files = sorted(str(path) for path in wheels.glob("*.whl"))
    return ([pip + wheel_files] if wheel_files else []) + [pip + ["--no-build-isolation", str(ROOT)]]


def install(python: str, wheels: Path, site: Path, limit: float, log, environment: dict) -> tuple[StageResult, dict]:
    """The install stage, and what the later stages will import (:func:`devtools.gpu_wheels.installed_versions`,
    recorded also when an install command failed: memlm still imports from the working tree). The stage fails when the
    wheel folder is unfit, a command fails, or a requirement is left unmet."""
    from devtools.gpu_wheels import folder_problems

    problems = folder_problems(wheels)
    log.write("wheel folder: " + (" ".join(problems) if problems else "fit to carry") + "\n")
    began = time.monotonic()
    stage = run_commands("install", install_commands(python, wheels, site), limit, log, environment)
    record = site.parent / "installed.json"
    if stage.status != "timed_out":
        recording = run_commands("install", [[python, "-c", INSTALLED_SCRIPT, str(record)]],
                                 limit - (time.monotonic() - began), log, environment, shortest=0.0)  # fmt: skip
        if stage.status == "passed":
            stage = recording
    installed = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else {}
    unmet = problems + installed.get("unmet", [])
    if unmet and stage.status == "passed":
        stage.status = "failed"
    stage.seconds = time.monotonic() - began
    stage.limit_seconds = limit
    stage.message = "; ".join(part for part in [stage.message, *unmet] if part)
    return stage, installed


def wheel_summary(wheels: Path) -> dict | None:
    """The wheel folder as the report names it: where, and the packages its manifest lists (None without one)."""
    from devtools.gpu_wheels import MANIFEST

    if not (wheels / MANIFEST).is_file():
        return None
    listing = json.loads((wheels / MANIFEST).read_text(encoding="utf-8"))
    return {"folder": str(wheels), "wheels": [f"{wheel['name']}=={wheel['version']}" for wheel in listing["wheels"]]}


def stage_environment(site: Path) -> dict:
    """The stages' environment: the installed folder, then the repository, first on the path; no hub; no forced
    kernel backend or interpreter."""
    environment = {
        name: value for name, value in os.environ.items() if name not in ("MEMLM_KERNELS", "TRITON_INTERPRET")
    }
    path = [str(site), str(ROOT)] + ([environment["PYTHONPATH"]] if environment.get("PYTHONPATH") else [])
    environment.update(PYTHONPATH=os.pathsep.join(path), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                       PYTHONUNBUFFERED="1")  # fmt: skip
    return environment


def test_command(python: str) -> list[str]:
    """pytest on the tests marked gpu, with the result plugin; parallel and per-test timeouts where available."""
    command = [python, "-m", "pytest", "-m", "gpu", "-p", "devtools.pytest_results", "-p", "no:cacheprovider", "-q",
               "-rfEs", "--continue-on-collection-errors", "-W", "default::DeprecationWarning", "-W",
               "default::PendingDeprecationWarning", "-W", "default::FutureWarning"]  # fmt: skip
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(TEST_WORKERS)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += [f"--timeout={TEST_TIMEOUT}"]
    return command + list(GPU_TEST_PATHS)


# --- The report -----------------------------------------------------------------------------------------------------


def summarize_tests(records: list[dict]) -> dict:
    """Counts per outcome and one case per test: a test's worst outcome (error > failed > skipped > passed) with its
    seconds and message."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    cases: dict[str, dict] = {}
    for record in records:
        case = cases.setdefault(record["test"], {"test": record["test"], "outcome": record["outcome"], "seconds": 0.0,
                                                 "message": ""})  # fmt: skip
        case["seconds"] += record["seconds"]
        if rank[record["outcome"]] >= rank[case["outcome"]]:
            case["outcome"] = record["outcome"]
            case["message"] = record["message"] or case["message"]
    counts = {outcome: sum(case["outcome"] == outcome for case in cases.values()) for outcome in OUTCOMES}
    return {"counts": counts, "cases": list(cases.values())}


def build_report(*, started: str, seconds: float, machine: dict, sources: dict, wheels: dict | None,
                 installed: dict, stages: list[StageResult], test_records: list[dict], kernels: list[dict],
                 models: list[dict], error: str | None = None) -> dict:  # fmt: skip
    """The check's report (schema :data:`SCHEMA`) from what its stages left."""
    return {
        "schema": SCHEMA,
        "started": started,
        "seconds": round(seconds, 1),
        "budget_seconds": BUDGET_SECONDS,
        "machine": machine,
        "sources": sources,
        "wheels": wheels,
        "installed": installed,
        "stages": [dataclasses.asdict(stage) for stage in stages],
        "tests": summarize_tests(test_records),
        "kernels": kernels,
        "models": models,
        "error": error,
    }


NUMBER = (int, float)
OPTIONAL_NUMBER = (int, float, type(None))
OPTIONAL_TEXT = (str, type(None))
# The fields of each part of a report and their types.
REPORT_FIELDS = {
    "schema": str, "started": str, "seconds": NUMBER, "budget_seconds": NUMBER, "machine": dict, "sources": dict,
    "wheels": (dict, type(None)), "installed": dict, "stages": list, "tests": dict, "kernels": list, "models": list,
    "error": OPTIONAL_TEXT,
}  # fmt: skip
MACHINE_FIELDS = {"gpu": str, "capability": str, "memory_gib": NUMBER, "torch": str, "cuda": OPTIONAL_TEXT,
                  "triton": OPTIONAL_TEXT, "python": str}  # fmt: skip
STAGE_FIELDS = {"name": str, "status": str, "seconds": NUMBER, "limit_seconds": NUMBER, "returncode": (int, type(None)),
                "message": str}  # fmt: skip
CASE_FIELDS = {"test": str, "outcome": str, "seconds": NUMBER, "message": str}
KERNEL_FIELDS = {"operation": str, "implementation": str, "pass": OPTIONAL_TEXT, "batch_size": int, "tokens": int,
                 "heads": int, "head_dim": int, "dtype": str, "error": OPTIONAL_TEXT}  # fmt: skip
MODEL_FIELDS = {"family": str, "model": str, "backend": str, "compiled": bool, "measure": str, "batch_size": int,
                "tokens": int, "new_tokens": (int, type(None)), "dtype": str, "hidden_size": int,
                "num_hidden_layers": int, "num_attention_heads": int, "vocab_size": int, "error": OPTIONAL_TEXT}  # fmt: skip


def _field_problems(where: str, item, fields: dict) -> list[str]:
    if not isinstance(item, dict):
        return [f"{where} is not an object."]
    problems = [f"{where} lacks {name}." for name in fields if name not in item]
    return problems + [
        f"{where}.{name} is {type(item[name]).__name__}, not {getattr(kind, '__name__', kind)}."
        for name, kind in fields.items()
        if name in item and (not isinstance(item[name], kind) or (kind is int and isinstance(item[name], bool)))
    ]


def report_problems(report: dict) -> list[str]:
    """What keeps ``report`` from being a well-formed gpu-check report, one sentence each (empty: none)."""
    problems = _field_problems("the report", report, REPORT_FIELDS)
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"the report's schema is {report['schema']!r}, not {SCHEMA!r}.")
    problems += _field_problems("machine", report["machine"], MACHINE_FIELDS)
    for index, stage in enumerate(report["stages"]):
        problems += _field_problems(f"stages[{index}]", stage, STAGE_FIELDS)
        if isinstance(stage, dict) and stage.get("status") not in STATUSES:
            problems.append(f"stages[{index}].status is {stage.get('status')!r}, not one of {', '.join(STATUSES)}.")
    if [stage.get("name") for stage in report["stages"] if isinstance(stage, dict)] != list(STAGES)[
        : len(report["stages"])
    ]:
        problems.append(f"the stages are not {', '.join(STAGES)}, in order.")
    tests = report["tests"]
    test_problems = _field_problems("tests", tests, {"counts": dict, "cases": list})
    problems += test_problems
    if not test_problems:
        for index, case in enumerate(tests["cases"]):
            problems += _field_problems(f"tests.cases[{index}]", case, CASE_FIELDS)
        counted = {outcome: sum(case.get("outcome") == outcome for case in tests["cases"]) for outcome in OUTCOMES}
        if tests["counts"] != counted:
            problems.append(f"tests.counts {tests['counts']} are not the cases' {counted}.")
    for part, fields, measured in (("kernels", KERNEL_FIELDS, ("milliseconds", "first_call_seconds")),
                                   ("models", MODEL_FIELDS, ("tokens_per_second", "parameters"))):  # fmt: skip
        for index, record in enumerate(report[part]):
            problems += _field_problems(f"{part}[{index}]", record, fields)
            if isinstance(record, dict) and record.get("error") is None:
                problems += _field_problems(f"{part}[{index}]", record, dict.fromkeys(measured, NUMBER))
    return problems


# --- The check ------------------------------------------------------------------------------------------------------


def refusal() -> str | None:
    """Why this machine cannot run the check (one line), or None when torch sees a CUDA device."""
    try:
        import torch
    except ImportError as error:
        return f"gpu-check: refused, torch does not import ({error}); nothing was run."
    if not torch.cuda.is_available():
        return f"gpu-check: refused, torch {torch.__version__} sees no CUDA device; run it on a GPU machine (nothing was run)."
    return None


def default_out() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "build" / "gpu-check"


def run_check(wheels: Path, out: Path, python: str = sys.executable) -> dict:
    """Run the stages and write the report and the log into ``out``; returns the report."""
    began = time.monotonic()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="memlm-gpu-check-"))
    site = work / "site"
    results = {name: work / f"{name}.jsonl" for name in ("tests", "kernels", "models")}
    stages: list[StageResult] = []
    machine, installed, error = {}, {}, None
    with open(out / LOG_NAME, "w", encoding="utf-8") as log:
        try:
            machine = machine_description()
            print(f"gpu-check: {machine['gpu']}, torch {machine['torch']}, Triton {machine['triton']}", flush=True)
            environment = stage_environment(site)
            stage, installed = install(python, wheels, site, stage_limit("install", 0.0), log, environment)
            stages.append(stage)
            _progress(stage)
            for name in ("tests", "kernel_speed", "model_speed"):
                limit = stage_limit(name, time.monotonic() - began)
                if name == "tests":
                    command = test_command(python)
                    stage_variables = {**environment, "MEMLM_TEST_RESULTS": str(results["tests"])}
                else:
                    part = SPEED_PARTS[name]
                    command = [python, str(ROOT / "benchmarks" / "gpu_speed.py"), part, "--results", str(results[part]),
                               "--seconds", f"{max(0.0, limit - SPEED_MARGIN):.0f}"]  # fmt: skip
                    stage_variables = environment
                stages.append(run_commands(name, [command], limit, log, stage_variables))
                _progress(stages[-1])
        except Exception:  # the report still says what ran, and why the check stopped
            error = traceback.format_exc()[-4000:]
            log.write(f"\n===== the check stopped:\n{error}\n")
    report = build_report(
        started=started,
        seconds=time.monotonic() - began,
        machine=machine,
        sources={"memlm_sha256": sources_digest(), "git": git_commit()},
        wheels=wheel_summary(wheels),
        installed=installed,
        stages=stages,
        test_records=read_lines(results["tests"]),
        kernels=read_lines(results["kernels"]),
        models=read_lines(results["models"]),
        error=error,
    )
    (out / REPORT_NAME).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    shutil.rmtree(work, ignore_errors=True)
    return report


def _progress(stage: StageResult) -> None:
    message = f" ({stage.message})" if stage.message else ""
    print(
        f"gpu-check: {stage.name} {stage.status} in {stage.seconds:.0f} s of {stage.limit_seconds:.0f}{message}",
        flush=True,
    )


def summary(report: dict) -> str:
    """What the check found, for the end of its output: the tests that did not pass (the speed tables follow, printed
    by `benchmarks/gpu_speed.py --show`, see `main`)."""
    counts = report["tests"]["counts"]
    lines = [f"gpu-check: tests {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
             f"{counts['skipped']} skipped; {report['seconds']:.0f} s"]  # fmt: skip
    for case in report["tests"]["cases"]:
        if case["outcome"] in ("failed", "error"):
            last = (case["message"].strip().splitlines() or [""])[-1]
            lines.append(f"  {case['outcome']}: {case['test']}: {last[:300]}")
    if report["error"]:
        lines.append("gpu-check: the check stopped: " + report["error"].strip().splitlines()[-1])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, default=ROOT / "build" / "gpu-wheels",
                        help="the folder make gpu-wheels filled (default %(default)s)")  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None, help="where the report and the log go (default: $OUT, else build/gpu-check)"
    )
    arguments = parser.parse_args(argv)
    reason = refusal()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    out = arguments.out or default_out()
    report = run_check(arguments.wheels.resolve(), out.resolve())
    print(summary(report), flush=True)
    if not report_problems(report):  # the speed tables, as the speed page will show them
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_speed.py"), "--show", str(out / REPORT_NAME)])
    print(f"gpu-check: wrote {out / REPORT_NAME} and {out / LOG_NAME}")
    passed = all(stage["status"] == "passed" for stage in report["stages"]) and len(report["stages"]) == len(STAGES)
    return 0 if passed and not report["error"] else 1


if __name__ == "__main__":
    sys.exit(main())
