"""The quantization tests (tests/clients/test_quantization.py and the quantization guide's examples), with 🤗's
quantizers installed for them alone.

    python tests/installed/check_quantization.py [--python python3] [--versions tested|oldest|newest] [--work DIR]

torchao, bitsandbytes and optimum-quanto are the `quantization` extra, not part of `dev`: importing transformers
imports torchao when it is installed, and torchao 0.18 then logs to the stderr of every process (on a CPU build of
torch its CUDA extensions do not load; torch 2.13 deprecates a call it makes), which the tests of memlm's commands
read as their output. So the three are installed, without their dependencies (`python`'s environment holds them:
torch, NumPy, safetensors, huggingface_hub), into a folder put before that environment's packages (PYTHONPATH) for
the quantization tests only:

- `tested`: the versions constraints/quantization.txt pins (what `make test` runs);
- `oldest`: constraints/oldest.txt's pins, setup.cfg's lower bounds (`make test-releases`, with the oldest 🤗 releases);
- `newest`: the newest releases on the registry (`make test-releases`, with the newest 🤗 releases and torch).

A pinned folder is kept for the next run; `newest` is installed again every run. The tests must run, not skip: the
packages are imported before pytest starts, and the test module imports them without `importorskip` here
(MEMLM_QUANTIZATION_REQUIRED). Exits with pytest's status.
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("torchao", "bitsandbytes", "optimum-quanto")
# The tests, the examples of the quantization guide, and the script of its table.
TESTS = ("tests/clients/test_quantization.py",
         "tests/docs/test_examples.py::test_every_code_block_of_the_page_runs[docs/guides/quantization.md]",
         "tests/benchmarks/test_quantization_table.py")  # fmt: skip
# --some: torchao-int8, bitsandbytes-4bit and quanto-int8 (pytest -k matches parts of the test ids), without the
# benchmark script's smoke run (two minutes: `make test` runs it).
SOME = "not dynamic and not int4 and not float8 and not 8bit and not quantization_table"


def pins(constraints: Path) -> list[str]:
    """The lines of `constraints` that pin one of PACKAGES."""
    lines = [line.strip() for line in constraints.read_text().splitlines()]
    found = [line for line in lines if line.split("==")[0].lower() in PACKAGES]
    if len(found) != len(PACKAGES):
        raise SystemExit(f"{constraints} must pin each of {', '.join(PACKAGES)}; it pins {found}")
    return found


def install(python: str, requirements: list[str], folder: Path, public: bool) -> None:
    """`requirements` into `folder` (pip's --target), without their dependencies; again only when they change."""
    stamp = folder / ".memlm-stamp"
    marker = hashlib.sha256("\n".join([python, *requirements]).encode()).hexdigest()
    if not public and stamp.exists() and stamp.read_text() == marker:
        return
    shutil.rmtree(folder, ignore_errors=True)
    command = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target",
               str(folder), *requirements]  # fmt: skip
    # `public`: the registry alone, as a user's machine sees it (this machine's pip configuration caps some packages).
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull} if public else None
    pip_install(command, env)
    stamp.write_text(marker)


def pip_install(
    command: list, env: dict | None, cwd: Path | None = None, attempts: int = 3, pause: float = 30
) -> None:
    """Run the pip install `command`, again from scratch when it fails, up to `attempts` times: a download the network
    cuts short is resumed by pip (PIP_RESUME_RETRIES, which the Makefile sets), and when resuming fails too (CI once
    resumed Triton's wheel five times from the same byte) only a new download gets past it."""
    for attempt in range(1, attempts + 1):
        print("$ " + " ".join(str(part) for part in command), flush=True)
        if subprocess.run([str(part) for part in command], cwd=cwd, env=env, stdin=subprocess.DEVNULL).returncode == 0:
            return
        if attempt == attempts:
            raise SystemExit(f"pip install failed {attempts} times: {' '.join(str(part) for part in command)}")
        print(f"pip install failed (attempt {attempt} of {attempts}); again in {pause:.0f} s", flush=True)
        time.sleep(pause)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the environment's interpreter (memlm[dev] in it)")
    parser.add_argument("--versions", choices=("tested", "oldest", "newest"), default="tested")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "memlm" / "quantization")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--some", action="store_true",
                        help="one configuration of each package (torchao int8, bitsandbytes 4-bit, quanto int8), "
                             "not all nine: what `make test-releases` runs beside the whole of `make test`")  # fmt: skip
    arguments = parser.parse_args(argv)
    if arguments.versions == "newest":
        requirements = list(PACKAGES)
    else:
        requirements = pins(
            ROOT / "constraints" / ("quantization.txt" if arguments.versions == "tested" else "oldest.txt")
        )
    folder = arguments.work / f"{arguments.versions}-{hashlib.sha256(arguments.python.encode()).hexdigest()[:12]}"
    install(arguments.python, requirements, folder, public=arguments.versions == "newest")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])),
           "MEMLM_QUANTIZATION_REQUIRED": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    shown = "from importlib.metadata import version; print(', '.join(f'{name} {version(name)}' for name in %r))"
    subprocess.run([arguments.python, "-c", shown % (PACKAGES,)], check=True, env=env, cwd=ROOT)
    command = [arguments.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(arguments.workers), *TESTS]
    if arguments.some:
        command += ["-k", SOME]
    command += ["--durations=10"]  # (where CI's time goes)
    print("$ " + " ".join(command), flush=True)
    return subprocess.run(command, env=env, cwd=ROOT, stdin=subprocess.DEVNULL).returncode


if __name__ == "__main__":
    raise SystemExit(main())
