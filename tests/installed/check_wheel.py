"""memlm as users install it: the wheel, CPU torch and nothing else, used from an empty folder.

    python tests/installed/check_wheel.py [--python python3] [--work build/wheel-check]

1. Builds the wheel from a clean copy of the source tree (the tracked and the new, not ignored, files).
2. Installs it into two fresh virtual environments, torch==2.13.0 first (an unpinned torch pulls a multi-GB CUDA
   build): `core` holds only memlm's required dependencies (no Triton, no extras); `train` adds the `train` extra
   (accelerate, datasets, matplotlib) on top of `core`'s packages, which it sees through a .pth file, so torch is
   installed once. Both are kept for the next run while setup.cfg, pyproject.toml and the interpreter are unchanged
   (then only the wheel is reinstalled).
3. From an empty folder, with no hub (HF_HUB_OFFLINE=1): `core` imports every module of the installed package (the
   Triton kernels may only refuse with their message), runs `memlm --help`, the README's Usage snippet (read from
   README.md), loads its checkpoint as remote code without memlm, and `memlm info` / `memlm generate` on it; `train`
   runs `memlm train` for the three tiny presets, `memlm info` and `memlm generate` on each run, and the synthetic-task
   commands of docs/guides/tasks.md (make_dataset.py for every task, train_task.py for every memlm model,
   plot-memory).

The core checks, the presets and the task commands run side by side, two processes at a time (each process is
short and mostly single-threaded). pip compiles the packages' bytecode as it installs them, as it does for users
(with PYTHONDONTWRITEBYTECODE set, as on CI, a process would otherwise compile torch's Python sources again each time
it starts). Every step checks exit codes and outputs; the first failure stops the run with what went wrong.
"""

import argparse
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
PRESETS = {
    "tiny-deltanet": ("memlm_deltanet", "modeling_deltanet.py"),
    "tiny-expire-span": ("memlm_expire_span", "modeling_expire_span.py"),
    "tiny-feedback": ("memlm_feedback_transformer", "modeling_feedback_transformer.py"),
}
# Small runs: enough steps to exercise warm-up, a checkpoint, evaluation and the final save. Evaluation reads one
# stream token after token for the Feedback Transformer, so it is kept short.
TRAIN_OPTIONS = ["--steps", "20", "--warmup-steps", "2", "--eval-every", "20", "--save-every", "10",
                 "--eval-tokens", "256", "--batch-size", "4", "--length", "32", "--max-bytes", "200000"]  # fmt: skip
# The optional packages of the kernel backends: their modules may refuse to import without them.
OPTIONAL_KERNEL_PACKAGES = ("triton", "fla")
# Not of the wheel's required dependencies: none may be installed in `core`.
FORBIDDEN_IN_CORE = ("triton", "accelerate", "datasets", "matplotlib", "pytest", "ruff", "flash-linear-attention")


class CheckFailed(Exception):
    pass


PASSED = [0]  # checks passed so far, for the closing line
COUNTING = threading.Lock()  # the checks run in two threads


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)
    with COUNTING:
        PASSED[0] += 1


def run(command: list, *, cwd: Path, env: dict, timeout: int = 900, succeed: bool = True) -> str:
    """Run `command`; return stdout + stderr. Fail unless its exit code is 0 (or, with succeed=False, non-zero)."""
    started = time.monotonic()
    shown = " ".join(shlex.quote(str(part)) for part in command)
    result = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    # One print for the command and its exit: the checks run in two threads.
    print(f"$ {shown}\n  exit {result.returncode} after {time.monotonic() - started:.1f} s", flush=True)
    if (result.returncode == 0) != succeed:
        expected = "to succeed" if succeed else "to fail"
        raise CheckFailed(f"expected {shown} {expected}, it exited {result.returncode}:\n{output[-4000:]}")
    return output


def requirements_stamp(python: str) -> str:
    """What the environments depend on: the packaging files, the torch pin and the interpreter."""
    digest = hashlib.sha256(TORCH.encode() + b" bytecode compiled")
    for name in ("setup.cfg", "pyproject.toml"):
        digest.update((ROOT / name).read_bytes())
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True)
    digest.update(version.stdout.encode() + str(Path(python).resolve()).encode())
    return digest.hexdigest()


def source_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def build_wheel(work: Path, env: dict) -> Path:
    """Build from a copy, so no build/ left over from an earlier build can add a file the tree no longer has."""
    source, dist = work / "source", work / "dist"
    for folder in (source, dist):
        shutil.rmtree(folder, ignore_errors=True)
    for name in source_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", dist, source], cwd=work, env=env)
    wheels = list(dist.glob("memlm-*.whl"))
    check(len(wheels) == 1, f"expected one memlm wheel in {dist}, found {wheels}")
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    sources = {name for name in source_files() if name.startswith("memlm/") and name.endswith(".py")}
    missing = sorted(sources - names)
    check(not missing, f"the wheel lacks these modules of the tree: {missing}")
    cards = {f"memlm/hub_cards/{path.name}" for path in (ROOT / "hub_cards").glob("*.md")}
    presets = {f"memlm/training/presets/{path.name}" for path in (ROOT / "memlm/training/presets").glob("*.json")}
    check(cards | presets <= names, f"the wheel lacks data files: {sorted((cards | presets) - names)}")
    stray = sorted(name for name in names if name.split("/")[0] in ("tests", "training", "benchmarks", "hub_cards"))
    check(not stray, f"the wheel carries files that are not memlm's: {stray[:5]}")
    return wheels[0]


def site_packages(venv: Path) -> Path:
    found = list(venv.glob("lib/python3*/site-packages"))
    check(len(found) == 1, f"expected one site-packages in {venv}, found {found}")
    return found[0]


def pip(venv: Path) -> list:
    """This interpreter's pip, installing into `venv` (made without pip of its own)."""
    return [sys.executable, "-m", "pip", "--python", venv / "bin/python"]


def prepare_environments(python: str, work: Path, wheel: Path, env: dict) -> tuple[Path, Path]:
    core, train = work / "core", work / "train"
    stamp = work / "environments.stamp"
    wanted = requirements_stamp(python)
    fresh = not (stamp.is_file() and stamp.read_text() == wanted and (core / "bin/memlm").exists())
    fresh = fresh or not (train / "bin/memlm").exists()
    if fresh:
        stamp.unlink(missing_ok=True)
        for venv in (core, train):
            shutil.rmtree(venv, ignore_errors=True)
            run([python, "-m", "venv", "--without-pip", venv], cwd=work, env=env)
        run([*pip(core), "install", "--quiet", TORCH], cwd=work, env=env)
        run([*pip(core), "install", "--quiet", wheel], cwd=work, env=env)
        # `train` sees core's packages (torch among them) after its own, so pip adds only what the extra needs.
        (site_packages(train) / "memlm_core.pth").write_text(f"{site_packages(core)}\n")
        run([*pip(train), "install", "--quiet", "--no-deps", "--force-reinstall", wheel], cwd=work, env=env)
        run([*pip(train), "install", "--quiet", f"memlm[train] @ {wheel.as_uri()}"],
            cwd=work, env=env)  # fmt: skip
        stamp.write_text(wanted)
    else:  # same requirements: only memlm itself changed
        for venv in (core, train):
            run([*pip(venv), "install", "--quiet", "--no-deps", "--force-reinstall", wheel],
                cwd=work, env=env)  # fmt: skip
    check(not list(site_packages(train).glob("torch")), "the train environment installed its own torch")
    return core, train


MARK = "RESULT "  # the line a helper script prints its result on, as JSON

IMPORT_SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.metadata, importlib.util, json, pkgutil, sys
    import torch
    import memlm
    triton_modules = sorted(name for name in sys.modules if name.startswith("memlm.") and "triton" in name)
    imported, refused = [], {}
    for module in pkgutil.walk_packages(memlm.__path__, "memlm."):
        try:
            importlib.import_module(module.name)
            imported.append(module.name)
        except ImportError as error:  # the package that is missing: the error's, or its cause's
            cause = error if error.name else error.__cause__
            refused[module.name] = [getattr(cause, "name", None), str(error)]
    packages = sorted({distribution.metadata["Name"].lower() for distribution in importlib.metadata.distributions()})
    print("RESULT " + json.dumps({"file": memlm.__file__, "imported": imported, "refused": refused,
                                  "triton_after_import": triton_modules, "torch": torch.__version__,
                                  "cuda": torch.version.cuda, "packages": packages,
                                  "triton": importlib.util.find_spec("triton") is not None}))
    """
)

# Appended to the README's Usage snippet: the logits of the model it loaded back, for the remote-code check.
USAGE_LOGITS = textwrap.dedent(
    """
    import json as _json
    with torch.no_grad():
        _logits = model.eval()(torch.tensor([[70, 97, 115, 116]])).logits[0, -1, :6].tolist()
    print("RESULT " + _json.dumps(_logits))
    """
)

REMOTE_CODE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["memlm"] = None  # a machine without memlm
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    assert not type(model).__module__.startswith("memlm."), type(model).__module__
    with torch.no_grad():
        print("RESULT " + json.dumps(model.eval()(torch.tensor([[70, 97, 115, 116]])).logits[0, -1, :6].tolist()))
    """
)

# Every task through the installed commands in one process: its generator and solver (each task's error, if any,
# is reported), and two models on the first task that worked.
TASKS_SCRIPT = textwrap.dedent(
    """
    import json, sys, traceback
    from memlm.training.tasks import TASKS
    from memlm.training.tasks.commands import make_dataset, train_task
    folder = sys.argv[1]
    errors = {}
    for task in TASKS:
        try:
            make_dataset([task, "--output-dir", f"{folder}/data/{task}", "--train", "64", "--validation", "16",
                          "--test", "16"])
            errors[task] = None
        except Exception as error:
            traceback.print_exc()
            errors[task] = f"{type(error).__name__}: {error}"
    working = next(task for task, error in errors.items() if error is None)
    for model in ("deltanet", "feedback"):
        train_task(["--data", f"{folder}/data/{working}", "--model", model, "--output-dir",
                    f"{folder}/runs/task-{model}", "--steps", "5", "--batch-size", "8"])
    print("RESULT " + json.dumps(errors))
    """
)


def result(output: str):
    lines = [line for line in output.splitlines() if line.startswith(MARK)]
    check(len(lines) == 1, f"expected one {MARK.strip()} line in:\n{output[-3000:]}")
    return json.loads(lines[0][len(MARK) :])


def module_names_in_tree() -> set[str]:
    names = set()
    for path in (ROOT / "memlm").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts != ("memlm",):
            names.add(".".join(parts))
    return names


def readme_block(heading: str, language: str, page: str = "README.md") -> str:
    """The first ```language block under `## heading` of README.md (or another page of the repository): what users
    copy is what is run."""
    readme = (ROOT / page).read_text(encoding="utf-8")
    section = readme.split(f"\n## {heading}\n", 1)
    check(len(section) == 2, f"{page} has no '## {heading}' section")
    block = re.search(rf"```{language}\n(.*?)```", section[1].split("\n## ", 1)[0], flags=re.DOTALL)
    check(block is not None, f"{page}'s '## {heading}' section has no ```{language} block")
    return block.group(1)


def check_core(core: Path, folder: Path, env: dict) -> None:
    python, memlm = core / "bin/python", core / "bin/memlm"
    state = result(run([python, "-c", IMPORT_SCRIPT], cwd=folder, env=env))
    check(state["torch"].startswith("2.13.0") and state["cuda"] is None, f"core has torch {state['torch']}")
    present = sorted(set(FORBIDDEN_IN_CORE) & set(state["packages"]))
    check(not present and not state["triton"], f"core holds packages memlm does not require: {present}")
    check(state["file"].startswith(str(site_packages(core))), f"memlm was imported from {state['file']}")
    check(not state["triton_after_import"], f"import memlm imported {state['triton_after_import']}")
    expected = module_names_in_tree()
    # Only a kernel backend's module may refuse, and only for want of its optional package (Triton, FLA).
    for name, (missing_package, message) in state["refused"].items():
        check(name.startswith("memlm.kernels.") and missing_package in OPTIONAL_KERNEL_PACKAGES,
              f"{name} does not import from the wheel: {message}")  # fmt: skip
    check("memlm.kernels.delta_rule.triton_chunk" in state["refused"], "the Triton kernels imported without Triton")
    missing = sorted(expected - set(state["refused"]) - set(state["imported"]))
    check(not missing, f"modules of the tree not imported from the wheel: {missing}")

    output = run([memlm, "--help"], cwd=folder, env=env)
    for command in ("memlm train", "memlm finetune", "memlm generate", "memlm info", "memlm plot-memory"):
        check(command in output, f"memlm --help does not mention {command!r}:\n{output}")
    output = run([memlm, "train", "--preset", "tiny-deltanet", "--output-dir", "runs/no-extra"], cwd=folder, env=env,
                 succeed=False)  # fmt: skip
    check(
        "memlm: error: memlm train needs the train extra, and 'accelerate' is not installed: pip install "
        "'memlm[train]'."
        in output
        and "Traceback" not in output,
        f"memlm train without the train extra does not say so in one line:\n{output[-2000:]}",
    )

    (folder / "usage.py").write_text(readme_block("Usage", "python") + USAGE_LOGITS, encoding="utf-8")
    with_memlm = result(run([python, "usage.py"], cwd=folder, env=env))
    checkpoint = folder / "my-deltanet"
    written = {path.name for path in checkpoint.iterdir()}
    needed = {"model.safetensors", "config.json", "modeling_deltanet.py", "configuration_deltanet.py",
              "memlm_delta_rule_triton_chunk.py", "README.md", "tokenizer.json", "tokenizer_config.json"}  # fmt: skip
    check(needed <= written, f"the README's checkpoint lacks {sorted(needed - written)}")
    remote = result(run([python, "-c", REMOTE_CODE_SCRIPT, checkpoint], cwd=folder, env=env))
    check(with_memlm == remote, f"remote code without memlm gives {remote}, memlm gives {with_memlm}")

    info = run([memlm, "info", checkpoint], cwd=folder, env=env)
    for line in ("DeltaNetConfig (model_type memlm_deltanet)", "parameters:", "kernels: torch backend on cpu",
                 "tokenizer: saved beside the model"):  # fmt: skip
        check(line in info, f"memlm info does not say {line!r}:\n{info}")
    output = run([memlm, "generate", checkpoint, "--prompt", "Fast weights", "--max-new-tokens", "8", "--greedy"],
                 cwd=folder, env=env)  # fmt: skip
    check(output.startswith("Fast weights"), f"memlm generate printed:\n{output[-2000:]}")
    check("custom code" not in output, f"memlm generate asked about custom code:\n{output[-2000:]}")
    output = run([memlm, "export", "onnx", checkpoint, folder / "onnx"], cwd=folder, env=env, succeed=False)
    check(
        output.strip().splitlines()[-1:] == ["memlm: error: Exporting to ONNX needs onnx and onnxscript, not installed: "
                                             'pip install "memlm[onnx]".'] and "Traceback" not in output,
        f"memlm export onnx without the onnx extra does not say so in one line:\n{output[-2000:]}",
    )  # fmt: skip


def check_presets(train: Path, folder: Path, env: dict) -> None:
    memlm = train / "bin/memlm"
    for preset, (model_type, modeling_file) in PRESETS.items():
        output_dir = folder / "runs" / preset
        run([memlm, "train", "--preset", preset, "--output-dir", output_dir, *TRAIN_OPTIONS], cwd=folder, env=env)
        written = {path.name for path in output_dir.iterdir()}
        needed = {"model.safetensors", "config.json", modeling_file, "README.md", "metrics.json", "loss.png",
                  "tokenizer.json"}  # fmt: skip
        check(needed <= written, f"memlm train --preset {preset} did not write {sorted(needed - written)}")
        config = json.loads((output_dir / "config.json").read_text())
        check(config["model_type"] == model_type, f"{preset} saved model_type {config['model_type']}")
        metrics = json.loads((output_dir / "metrics.json").read_text())
        check(metrics.get("steps") == 20, f"{preset}: metrics.json says {metrics.get('steps')} steps, not 20")
        bits = metrics["eval_after"]["bits_per_byte"]
        check(0 < bits < metrics["eval_before"]["bits_per_byte"], f"{preset}: bits per byte {bits} did not fall")
        info = run([memlm, "info", output_dir], cwd=folder, env=env)
        check(f"held-out bits per byte: {bits:.3f} after 20 steps" in info, f"memlm info:\n{info}")
        output = run([memlm, "generate", output_dir, "--prompt", "def ", "--max-new-tokens", "8"], cwd=folder, env=env)
        check(output.startswith("def "), f"memlm generate printed:\n{output[-2000:]}")


def check_tasks(train: Path, folder: Path, env: dict) -> None:
    python, memlm = train / "bin/python", train / "bin/memlm"
    # The synthetic-task commands of the tasks guide, with fewer examples and steps.
    commands = readme_block("From the command line", "bash", "docs/guides/tasks.md").replace("\\\n", " ")
    commands = [shlex.split(line) for line in commands.splitlines() if line.strip()]
    check([command[:2] for command in commands] == [["python", "training/tasks/make_dataset.py"],
          ["python", "training/tasks/train_task.py"], ["memlm", "plot-memory"]], f"the tasks guide's commands: {commands}")  # fmt: skip
    make, train_task, plot = commands
    sizes = ["--train", "64", "--validation", "16", "--test", "16"]
    output = run([python, ROOT / make[1], *make[2:], *sizes], cwd=folder, env=env)
    check("the brute-force solver gets 100% of every split" in output, f"make_dataset.py printed:\n{output[-2000:]}")
    train_task = [python, ROOT / train_task[1], *train_task[2:]]
    train_task[train_task.index("--steps") + 1] = "10"
    output = run([*train_task, "--batch-size", "8"], cwd=folder, env=env)
    check("accuracy" in output, f"train_task.py printed no accuracy:\n{output[-2000:]}")
    output = run([memlm, *plot[1:]], cwd=folder, env=env)
    picture = folder / plot[plot.index("--output") + 1]
    check("layer 1: mean span" in output and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", output[-2000:])

    # Every task's generator and solver, and two more models on one task.
    errors = result(run([python, "-c", TASKS_SCRIPT, folder], cwd=folder, env=env))
    check(len(errors) >= 5, f"memlm.training.tasks.TASKS holds {sorted(errors)}")
    for task, error in errors.items():
        check(error is None, f"make_dataset {task} failed: {error}")
        data = folder / "data" / task
        check((data / "task.json").is_file() and (data / "tokenizer").is_dir(), f"{task}: no task.json or tokenizer")
    for model in ("deltanet", "feedback"):
        check((folder / "runs" / f"task-{model}" / "model.safetensors").is_file(), f"train_task --model {model}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=getattr(sys, "_base_executable", sys.executable),
                        help="the interpreter the environments are made from (default: the one below this one)")  # fmt: skip
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "memlm" / "wheel-check",
                        help="where the wheel and the environments are kept between runs (outside the checkout, so "
                        "a fresh clone on the same machine reuses them)")  # fmt: skip
    arguments = parser.parse_args()
    started = time.monotonic()
    work = arguments.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    lock = (work / "lock").open("w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # one run at a time per folder
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "VIRTUAL_ENV", "MEMLM_KERNELS", "TRITON_INTERPRET", "PYTHONHOME")}  # fmt: skip
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        wheel = build_wheel(work, env)
        core, train = prepare_environments(arguments.python, work, wheel, env)
        with tempfile.TemporaryDirectory(prefix="memlm-wheel-") as empty:
            env["HF_HOME"] = str(Path(empty) / "huggingface")
            core_env = {**env, "PATH": f"{core / 'bin'}{os.pathsep}{env['PATH']}"}
            train_env = {**env, "PATH": f"{train / 'bin'}{os.pathsep}{env['PATH']}"}
            with ThreadPoolExecutor(2) as pool:  # each writes its own files in the folder
                checks = [pool.submit(check_presets, train, Path(empty), train_env),
                          pool.submit(check_core, core, Path(empty), core_env),
                          pool.submit(check_tasks, train, Path(empty), train_env)]  # fmt: skip
                for done in checks:
                    done.result()  # the first failure, raised here
    except CheckFailed as failure:
        print(f"wheel check FAILED: {failure}", flush=True)
        print(f"wheel: {PASSED[0]} passed, 1 failed", flush=True)
        raise SystemExit(1) from None
    print(f"wheel check done in {time.monotonic() - started:.0f} s", flush=True)
    print(f"wheel: {PASSED[0]} passed, 0 failed", flush=True)


if __name__ == "__main__":
    main()
