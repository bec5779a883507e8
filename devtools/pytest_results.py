"""A pytest plugin writing one JSON line per finished test, and per module that failed to collect, to the file named by
``$MEMLM_TEST_RESULTS``, as each finishes: a run stopped by its time limit still leaves what it did. `make gpu-check`
loads it with ``-p devtools.pytest_results``. Under pytest-xdist only the controlling process writes (the workers
send it their reports).

Each line: ``{"test": node id, "outcome": "passed" | "failed" | "skipped" | "error", "when": "collect" | "setup" |
"call" | "teardown", "seconds": float, "message": str}`` (the message: the end of the failure, or the skip reason).
"""

import json
import os

ENVIRONMENT_VARIABLE = "MEMLM_TEST_RESULTS"
MESSAGE_CHARACTERS = 3000
_writes = {"enabled": True}


def pytest_configure(config):
    _writes["enabled"] = not hasattr(config, "workerinput")  # an xdist worker: its controller writes


def _write(record: dict) -> None:
    path = os.environ.get(ENVIRONMENT_VARIABLE)
    if not path or not _writes["enabled"]:
        return
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])  # (file, line, reason)
    return report.longreprtext[-MESSAGE_CHARACTERS:] if report.longrepr else ""


def pytest_runtest_logreport(report):
    # The call's outcome, or a setup / teardown that did not pass (then the call did not run or its result stands).
    if (
        report.when == "call"
        or (report.when == "setup" and not report.passed)
        or (report.when == "teardown" and report.failed)
    ):
        outcome = "error" if report.when != "call" and report.failed else report.outcome
        _write({"test": report.nodeid, "outcome": outcome, "when": report.when, "seconds": round(report.duration, 3),
                "message": _message(report)})  # fmt: skip


def pytest_collectreport(report):
    if report.failed:
        _write(
            {"test": report.nodeid, "outcome": "error", "when": "collect", "seconds": 0.0, "message": _message(report)}
        )
