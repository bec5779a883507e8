"""The house reads top-down (STYLE.md): no memlm module imports, directly or through others, a module that imports
it back, at the top of the file or inside a function (including `importlib.import_module("memlm....")`)."""

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "memlm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The memlm modules `path` imports anywhere in it. A module's own parent packages are left out: Python runs them
    before the module anyway, so importing a name from one (`from . import __version__`) is no edge back."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                if node.level
                else node.module
            )
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                targets = [node.args[0].value]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and not (name == target or name.startswith(target + ".")):
                found.add(target)
    return found


def test_no_module_of_memlm_imports_itself_back():
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    graph = {_module_name(path): _imports(path, modules) for path in paths}
    circles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            module, route = stack.pop()
            for target in sorted(graph[module]):
                if target == start:
                    circles.append(" → ".join([*route, start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*route, target]))
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles), key=len)[:20])


def test_the_tooling_below_imports_nothing_from_above():
    """The layers outside the package read top-down too: `benchmarks/` and the scripts sit above `devtools/` and
    `memlm/`, so neither imports from `benchmarks/` or `training/` (devtools runs a benchmark as a command)."""
    above = {"benchmarks", "training"}
    upward = []
    for folder in ("devtools", "memlm"):
        for path in sorted((ROOT.parent / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                upward += [f"{path.relative_to(ROOT.parent)}: {name}" for name in names if name.split(".")[0] in above]
    assert not upward, "imports from above:\n" + "\n".join(upward)
