"""Refuse, in one line, a Python older than what constraints/tested.txt needs, before `make` builds `.venv` with it
(pip would otherwise stop deep in the install with "ResolutionImpossible").

    python3 devtools/check_python.py    # exit 0, or 1 with what to do

It reads only the standard library: it runs on the interpreter `make` was given, before anything is installed."""

import sys

# The newest Requires-Python among constraints/tested.txt's pins (pymdown-extensions 13.1: >= 3.11.5; 🤗 Transformers
# 5 and NumPy 2.4: >= 3.11). tests/test_compat.py checks it against the installed distributions.
MINIMUM = (3, 11, 5)


def problem(version: tuple = tuple(sys.version_info[:3])) -> str | None:
    if tuple(version) >= MINIMUM:
        return None
    found, needed = ".".join(map(str, version)), ".".join(map(str, MINIMUM))
    return (
        f"make: Python {found} is too old for the tested set of versions (constraints/tested.txt needs {needed} or "
        f"newer); run make with PYTHON= a newer interpreter, e.g. make PYTHON=python3.12 main"
    )


if __name__ == "__main__":
    message = problem()
    if message:
        print(message, file=sys.stderr)
        raise SystemExit(1)
