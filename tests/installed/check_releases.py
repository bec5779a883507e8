"""memlm under the newest and the oldest 🤗 releases it allows, not only under the tested set `make test` installs.

    python tests/installed/check_releases.py [--python python3] [--work ~/.cache/memlm/releases]

setup.cfg allows a range of releases of transformers, accelerate, datasets, tokenizers, huggingface_hub and
safetensors; users install the newest the range allows on the day they install. For each of these environments:

- `newest`: the newest releases on the registry right now (pip --upgrade, eager), whatever `constraints/tested.txt`
  says: a release that appeared since the last commit is caught here before users meet it;
- `oldest`: `constraints/oldest.txt`, the lower bounds of setup.cfg pinned (tests/test_compat.py checks that the two
  agree), so the declared minimum is a tested one;
- `prerelease`: the newest pre-release of transformers, only when the registry has one newer than its newest
  release. It is reported and does not fail the run: a pre-release may be broken itself, and the two above decide.

a fresh virtual environment is made with the torch of its kind, memlm is installed in it (editable, with the `dev`
extra) and the tests marked `huggingface` run (the model contract, generation, the caches, remote code, Trainer, PEFT,
lm-eval, serving and the CLI); in `newest`, also those marked `kernels` (every kernel test: the Triton interpreter,
FLA, the hub kernel variants a CUDA build resolves; the Triton kernels' own tests only when its Triton is not the
one `make test` ran them with). torch differs between the environments as between users:

- `newest` takes torch as `pip install memlm` gives it on a Linux machine today: the newest release, a CUDA build
  (multi-GB, NVIDIA's libraries included, with its Triton), which runs on a CPU too. Its pip ignores this machine's
  pip configuration (PIP_CONFIG_FILE=/dev/null), which caps torch at the releases on its disk;
- `oldest` takes setup.cfg's lower bound from constraints/oldest.txt (torch 2.11, a CUDA build with Triton 3.6: the
  torch of the GPU machines memlm is checked on), and NumPy below 2.4: Triton 3.6's interpreter, which runs the
  kernels on a CPU, converts one-element arrays to Python integers, which NumPy 2.4 refuses (Triton 3.8 fixed it).
  Its kernel tests are not run (CI's time), only the 🤗-facing ones, some of which run kernels in the interpreter;
- `prerelease` takes the local CPU build (torch==2.13.0, seconds to install).

In `newest` and `oldest`, the quantization tests run too, with 🤗's quantizers (torchao, bitsandbytes, optimum-quanto)
at their newest releases and at setup.cfg's lower bounds, one configuration of each package
(tests/installed/check_quantization.py, which installs them apart from the environment: see there why).

The newest environment also saves checkpoints under its release and loads them under the oldest one and back
(MEMLM_OTHER_RELEASE_PYTHON). The environments are kept for the next run (the oldest is rebuilt when its
constraints or setup.cfg change; the newest is upgraded every run). Prints the versions each one ran with; exits
non-zero when `newest` or `oldest` fails.
"""

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import check_quantization

ROOT = Path(__file__).resolve().parents[2]
# The local CPU build (what `make test` runs): the prerelease environment's torch.
LOCAL_TORCH = "torch==2.13.0"
# Triton 3.6's interpreter (torch 2.11's) fails with NumPy 2.4 and later (see above).
OLDEST_NUMPY = "numpy<2.4"
# What each environment runs: the 🤗-facing tests, and in `newest` the kernels' (whose results may depend on the
# torch build).
MARKERS = {"newest": "(huggingface or kernels) and not slow", "oldest": "huggingface and not slow"}
# The Triton kernels' own tests: the interpreter's numerics and the compiler's output ahead of time are Triton's. Under
# the Triton `make test` ran them with (constraints/tested.txt), `newest` leaves them out (CI's time): what torch's
# build adds there (its references' ops) the other kernel and model tests run here anyway.
TRITON_ONLY = (
    "tests/kernels/test_gpu_compile.py",
    "tests/kernels/test_triton_delta_rule_chunk.py",
    "tests/kernels/test_triton_delta_rule_recurrent.py",
    "tests/kernels/test_triton_expire_attention.py",
)
# The 🤗 packages whose range setup.cfg declares, as they are named on the registry.
HUGGING_FACE = ("transformers", "accelerate", "datasets", "tokenizers", "huggingface_hub", "safetensors")
SHOWN = (*HUGGING_FACE, "torch", "triton", "peft", "lm_eval", "kernels")


def run(command: list, *, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    print("$ " + " ".join(str(part) for part in command), flush=True)
    return subprocess.run([str(part) for part in command], cwd=ROOT, env=env, check=check, stdin=subprocess.DEVNULL)


def pip(python: Path, *arguments, public: bool = False) -> None:
    """pip install into `python`'s environment; `public`: from the public registry alone, ignoring this machine's pip
    configuration (which caps torch at the builds on its disk), as a user's machine installs."""
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull} if public else None
    command = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *arguments]
    check_quantization.pip_install(command, env, cwd=ROOT)


def newest_prerelease(python: Path, package: str) -> str | None:
    """The newest pre-release of `package` on the registry when it is newer than its newest release, else None."""
    listing = subprocess.run(
        [str(python), "-m", "pip", "index", "versions", "--pre", package, "--disable-pip-version-check"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    match = re.search(rf"^{re.escape(package)} \(([^)]+)\)", listing, re.MULTILINE)
    newest = match.group(1) if match else ""
    return newest if re.search(r"(a|b|rc|dev)\d*$", newest) else None


def fingerprint(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def environment(
    name: str,
    work: Path,
    base_python: str,
    torch: list[str],
    requirements: list[str],
    marker: str,
    public: bool = False,
) -> Path:
    """The virtual environment `name` with `torch` installed first, then memlm[dev] and `requirements`; rebuilt when
    `marker` changes."""  # fmt: skip
    folder = work / name
    python = folder / "bin" / "python"
    stamp = folder / ".memlm-stamp"
    if not (python.exists() and stamp.exists() and stamp.read_text() == marker):
        shutil.rmtree(folder, ignore_errors=True)
        run([base_python, "-m", "venv", folder])
        pip(python, "--upgrade", "pip", public=public)
    pip(python, *torch, public=public)
    pip(python, "-e", f"{ROOT}[dev]", *requirements, public=public)
    stamp.write_text(marker)
    return python


def versions(python: Path) -> str:
    script = (
        "from importlib.metadata import version, PackageNotFoundError\n"
        "def shown(name):\n"
        "    try:\n        return f'{name} {version(name)}'\n"
        "    except PackageNotFoundError:\n        return f'{name} -'\n"
        f"print(', '.join(shown(name) for name in {SHOWN!r}))"
    )
    return subprocess.run([str(python), "-c", script], capture_output=True, text=True, check=True).stdout.strip()


def installed_version(python: Path, package: str) -> str | None:
    script = (
        f"from importlib.metadata import version\ntry:\n    print(version({package!r}))\nexcept Exception:\n    pass"
    )
    return (
        subprocess.run([str(python), "-c", script], capture_output=True, text=True, check=True).stdout.strip() or None
    )


def tested_version(package: str) -> str | None:
    """`package`'s pin in constraints/tested.txt (what `make test` installs), or None."""
    for line in (ROOT / "constraints" / "tested.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if name.strip().lower() == package:
            return version.strip()
    return None


def tests(python: Path, markers: str, other_python: Path | None, workers: int, ignored=()) -> bool:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if other_python is not None:
        env["MEMLM_OTHER_RELEASE_PYTHON"] = str(other_python)
    command = [python, "-m", "pytest", "-q", "-m", markers, "-p", "no:cacheprovider", "-n", str(workers)]
    command += [f"--ignore={path}" for path in ignored]
    command += ["--durations=10"]  # (where CI's time goes)
    return run(command, env=env, check=False).returncode == 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter the environments are made from")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "memlm" / "releases")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (memlm[dev] installs it)")
    arguments = parser.parse_args(argv)
    arguments.work.mkdir(parents=True, exist_ok=True)
    oldest_constraints = ROOT / "constraints" / "oldest.txt"
    started = time.monotonic()

    marker = fingerprint(oldest_constraints, ROOT / "setup.cfg", ROOT / "pyproject.toml")
    oldest = ["-c", str(oldest_constraints)]
    pythons = {"oldest": environment("oldest", arguments.work, arguments.python, [*oldest, "torch"],
                                     [*oldest, OLDEST_NUMPY], marker)}  # fmt: skip
    upgrade = ["--upgrade", "--upgrade-strategy", "eager", *HUGGING_FACE, "torch"]
    pythons["newest"] = environment("newest", arguments.work, arguments.python, ["--upgrade", "torch"], upgrade,
                                    "newest", public=True)  # fmt: skip
    prerelease = newest_prerelease(pythons["newest"], "transformers")
    if prerelease is None:
        print("prerelease: the registry has no transformers pre-release newer than its newest release.")
    else:
        try:
            pythons["prerelease"] = environment("prerelease", arguments.work, arguments.python, [LOCAL_TORCH],
                                                [f"transformers=={prerelease}", LOCAL_TORCH], prerelease)  # fmt: skip
        except subprocess.CalledProcessError:
            print(f"prerelease: transformers {prerelease} does not install with memlm (outside setup.cfg's range?); "
                  "reported, not fatal.")  # fmt: skip

    results = {}
    for name, python in pythons.items():
        other = pythons.get("oldest") if name == "newest" else None
        print(f"\n=== {name}: {versions(python)}", flush=True)
        ignored = ()
        if name == "newest" and installed_version(python, "triton") == tested_version("triton"):
            ignored = TRITON_ONLY
            print(f"(Triton {tested_version('triton')} is the tested one: its own kernel tests ran in make test)")
        results[name] = tests(python, MARKERS.get(name, MARKERS["oldest"]), other, arguments.workers, ignored)
        if name in ("newest", "oldest"):  # 🤗's quantizers, at their newest and their oldest releases allowed
            quantization = [f"--python={python}", f"--versions={name}", "--some", "--workers=0"]
            results[name] = check_quantization.main(quantization) == 0 and results[name]
    print(f"\nReleases checked in {time.monotonic() - started:.0f} s:")
    for name, passed in results.items():
        verdict = "passed" if passed else ("FAILED" if name != "prerelease" else "failed (reported, not fatal)")
        print(f"- {name}: {verdict} ({versions(pythons[name])})")
    return 0 if all(passed for name, passed in results.items() if name != "prerelease") else 1


if __name__ == "__main__":
    raise SystemExit(main())
