"""Every example of the documentation runs: the code blocks of README.md and docs/**/*.md, and the `>>>` examples in
the docstrings of memlm's modules (what the API pages show). An example that a new 🤗 release breaks fails here, in
`make test` and, since these tests are marked `huggingface`, under the newest and the oldest releases allowed
(`make test-releases`).

- ```python blocks run in order, one namespace per page (a page's later block may use what an earlier one built),
  in an empty folder (what they save lands there), with no hub (HF_HUB_OFFLINE=1, set by tests/conftest.py).
- ```bash blocks are checked, not run (most train for minutes): each command's options are parsed by the command's
  own argument parser (`memlm ...`, `python SCRIPT ...`, `python -m MODULE ...`, `accelerate launch ...`,
  `transformers ...`; argparse's, or click's for 🤗's commands and `memlm serve`), `make`
  targets must exist in the Makefile and `pip install 'memlm[EXTRA]'` extras in setup.cfg; a command this file does
  not know how to check fails, so that nothing unchecked is shown as a command.
- ```json blocks must parse; ```text blocks (equations, layouts, output) are not code. Any other language fails.
- Docstrings: every `>>>` example of every module under memlm/ (sybil's doctest parser, with ELLIPSIS), bare as in
  the configs or inside ```python fences as in 🤗's docstrings; the module's names are in scope.

Sybil (https://sybil.readthedocs.io) finds the blocks and reports a failure with its file and line.
"""

import argparse
import configparser
import contextlib
import doctest
import importlib
import io
import json
import os
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch
from sybil import Sybil
from sybil.document import PythonDocStringDocument
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser
from sybil.parsers.rest import DocTestParser

pytestmark = pytest.mark.huggingface

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SOURCES = sorted((ROOT / "memlm").rglob("*.py"))
LANGUAGES = {"python", "bash", "json", "text"}
FENCE = re.compile(r"^([ \t]*)```(.*)$", re.MULTILINE)


# --- bash: the commands' own parsers read the options, nothing runs ----------------------------------------------


class _Parsed(BaseException):
    """Raised once a command's arguments are parsed: stops it before it does anything (BaseException, so that no
    `except Exception` of the command catches it)."""


@contextlib.contextmanager
def _parse_only():
    """argparse's parsers, and click's commands (🤗's `transformers` command, and `memlm serve`, which is 🤗's serve),
    stop once they have read their arguments."""
    import click

    original, original_invoke = argparse.ArgumentParser.parse_args, click.Command.invoke

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)  # a bad option: usage and SystemExit(2)
        raise _Parsed

    def invoke(self, context):
        if isinstance(self, click.Group):  # a group's own callback: its command reads its arguments next
            return None
        raise _Parsed  # the command has read its arguments (a bad option: usage and SystemExit(2))

    argparse.ArgumentParser.parse_args, click.Command.invoke = parse_args, invoke
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, click.Command.invoke = original, original_invoke


def _run_module(module: str) -> None:
    """`python -m MODULE` in this process, as a fresh interpreter would run it: a module that earlier tests imported is
    set aside while it runs (runpy warns about running a module found in `sys.modules`, which `python -m` never
    meets), and put back after."""
    imported = sys.modules.pop(module, None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        if imported is not None:
            sys.modules[module] = imported


def _parse(command: str, run, argv: list[str]) -> None:
    """Run `run()` with `sys.argv = argv` until it has parsed its arguments; fail on a usage error."""
    errors = io.StringIO()
    saved = sys.argv
    sys.argv = argv
    try:
        with _parse_only(), contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            run()
    except _Parsed:
        return
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise AssertionError(f"`{command}` is refused by its parser:\n{errors.getvalue()}") from None
    finally:
        sys.argv = saved


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.MULTILINE))


def _extras() -> set[str]:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    return set(setup["options.extras_require"])


def _script(command: str, path: str) -> Path:
    if Path(path).name == "run_onnx.py":  # the runner `memlm export onnx` copies into its folder
        return ROOT / "memlm" / "onnx_runner.py"
    script = ROOT / path
    assert script.is_file(), f"`{command}`: {path} does not exist"
    return script


def check_command(command: str) -> None:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VARIABLE=value before the command
        words = words[1:]
    program, arguments = words[0], words[1:]
    if program == "make":
        missing = [target for target in arguments if not target.startswith("-") and target not in _make_targets()]
        assert not missing, f"`{command}`: the Makefile has no target {missing}"
    elif program == "pip" and arguments[:1] == ["install"]:
        requirements = [word for word in arguments[1:] if not word.startswith("-")]
        for requirement in requirements:
            match = re.fullmatch(r"(memlm|\.)(?:\[([\w,-]+)\])?", requirement)
            assert match, f"`{command}`: only memlm and its extras are checked, not {requirement!r}"
            unknown = set(filter(None, (match.group(2) or "").split(","))) - _extras()
            assert not unknown, f"`{command}`: setup.cfg has no extra {sorted(unknown)}"
    elif program == "memlm":
        from memlm.cli import main

        _parse(command, lambda: main(arguments), ["memlm", *arguments])
    elif program == "transformers":  # 🤗's command, e.g. `transformers chat` against `memlm serve`
        from transformers.cli.transformers import app

        _parse(command, lambda: app(arguments, prog_name="transformers"), ["transformers", *arguments])
    elif program == "python" and arguments[:1] == ["-m"]:
        module = arguments[1]
        _parse(command, lambda: _run_module(module), [module, *arguments[2:]])
    elif program == "python":
        script = _script(command, arguments[0])
        _parse(command, lambda: runpy.run_path(str(script), run_name="__main__"), [str(script), *arguments[1:]])
    elif program == "accelerate" and arguments[:1] == ["launch"]:
        options = arguments[1:]
        while options and options[0].startswith("-"):
            option = options.pop(0)
            if option == "--config_file":
                assert (ROOT / options[0]).is_file(), f"`{command}`: {options[0]} does not exist"
            if "=" not in option and options and not options[0].startswith("-") and not options[0].endswith(".py"):
                options.pop(0)  # the option's value
        script = _script(command, options[0])
        _parse(command, lambda: runpy.run_path(str(script), run_name="__main__"), [str(script), *options[1:]])
    else:
        raise AssertionError(f"`{command}`: tests/docs/test_examples.py does not know how to check {program!r}")


def commands(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, quotes that close on a later line followed, comments
    and blank lines dropped."""
    found, pending = [], ""
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote that closes on a later line
            continue
        pending = ""
        if words:
            found.append(shlex.join(words))
    assert not pending, f"a quote is not closed in the bash block:\n{block}"
    return found


def check_bash(example) -> None:
    for command in commands(example.parsed):
        check_command(command)


def check_json(example) -> None:
    json.loads(example.parsed)


MARKDOWN = Sybil(
    parsers=[
        PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS),
        CodeBlockParser(language="bash", evaluator=check_bash),
        CodeBlockParser(language="json", evaluator=check_json),
    ]
)


class DocstringDocument(PythonDocStringDocument):
    """The docstrings of a module, with 🤗's fences around `>>>` examples (a line of ```python or ```) read as blank
    lines, so that the closing fence is not taken for the example's expected output."""

    @staticmethod
    def extract_docstrings(python_source_code: str):
        for start, end, text in PythonDocStringDocument.extract_docstrings(python_source_code):
            yield start, end, re.sub(r"(?m)^[ \t]*```\w*[ \t]*$", lambda fence: " " * len(fence.group(0)), text)


DOCSTRINGS = Sybil(
    parsers=[DocTestParser(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)],
    document_types={".py": DocstringDocument},
)


def _examples(sybil: Sybil, path: Path) -> list:
    return list(sybil.parse(path))


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


SOURCES_WITH_EXAMPLES = [path for path in SOURCES if ">>>" in path.read_text(encoding="utf-8")]


# The pages whose examples need packages `make test`'s environment leaves out (the `quantization` extra): they run where
# tests/installed/check_quantization.py installs them (MEMLM_QUANTIZATION_REQUIRED set), and are skipped elsewhere.
NEEDS = {"docs/guides/quantization.md": ("torchao", "bitsandbytes", "optimum.quanto")}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_code_block_of_the_page_runs(page, tmp_path, monkeypatch):
    if _name(page) == "docs/guides/onnx.md":
        from memlm.onnx_export import MINIMUM_TORCH

        if tuple(int(part) for part in torch.__version__.split(".")[:2]) < MINIMUM_TORCH:
            pytest.skip(f"memlm export onnx needs torch {MINIMUM_TORCH} or newer")
    for package in NEEDS.get(_name(page), ()):
        if os.environ.get("MEMLM_QUANTIZATION_REQUIRED"):
            importlib.import_module(package)
        else:
            pytest.importorskip(package, reason="the quantization extra: tests/installed/check_quantization.py")
    monkeypatch.chdir(tmp_path)
    examples = _examples(MARKDOWN, page)
    for example in examples:
        example.evaluate()


@pytest.mark.parametrize("source", SOURCES_WITH_EXAMPLES, ids=_name)
def test_every_docstring_example_of_the_module_runs(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    examples = _examples(DOCSTRINGS, source)
    assert examples, f"{_name(source)} has '>>>' outside a docstring example sybil can read"
    for example in examples:
        example.evaluate()


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_code_block_has_a_language_the_tests_know(page):
    """A block of another language (or none) would be neither run nor checked."""
    text = page.read_text(encoding="utf-8")
    fences = FENCE.findall(text)
    assert len(fences) % 2 == 0, f"{_name(page)} has an unclosed code block"
    openings = fences[::2]
    indented = [language for indent, language in openings if indent]
    assert not indented, f"{_name(page)}: a code block inside a list or a note is not found by the tests: {indented}"
    unknown = sorted({language for _, language in openings} - LANGUAGES)
    assert not unknown, f"{_name(page)}: code blocks in {unknown}; use one of {sorted(LANGUAGES)}"


def test_the_command_checks_catch_a_wrong_option_a_missing_target_and_an_unknown_extra():
    with pytest.raises(AssertionError, match="refused by its parser"):
        check_command("memlm train --preset tiny-deltanet --output-dir runs/x --no-such-option 3")
    with pytest.raises(AssertionError, match="refused by its parser"):
        check_command("python training/tasks/make_dataset.py no-such-task --output-dir data/x")
    with pytest.raises(AssertionError, match="refused by its parser"):
        check_command("memlm serve runs/x --port 8000 --no-such-option")
    with pytest.raises(AssertionError, match="refused by its parser"):
        check_command("transformers chat runs/x http://localhost:8000/v1 --no-such-option")
    with pytest.raises(AssertionError, match="has no target"):
        check_command("make no-such-target")
    with pytest.raises(AssertionError, match="has no extra"):
        check_command("pip install 'memlm[no-such-extra]'")
    with pytest.raises(AssertionError, match="does not exist"):
        check_command("python training/no_such_script.py --help")
    with pytest.raises(AssertionError, match="does not know how to check"):
        check_command("curl https://example.com")
    check_command("ACCELERATE_USE_CPU=1 accelerate launch --config_file training/accelerate/cpu.yaml "
                  "training/train.py --preset tiny-deltanet --output-dir runs/x")  # fmt: skip
    assert commands('make main   # a comment\n\npython a.py --x 1 \\\n    --y 2 --z \'{"a": 1,\n "b": 2}\'\n') == [
        "make main",
        'python a.py --x 1 --y 2 --z \'{"a": 1,\n "b": 2}\'',
    ]
