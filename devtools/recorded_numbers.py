"""Find the tests that compare with numbers recorded in a file, and refuse the comparisons that hold on one processor
only (issue 38).

    python devtools/recorded_numbers.py [tests/]            # the problems, one per line; exit 1 when there are some
    python devtools/recorded_numbers.py --list [tests/]     # the tests that compare with recorded numbers

Numbers written by one processor (old checkpoints' logits, the official code's reference data, any golden output)
are not the bits another processor computes: AMD and Intel, another SIMD width (`ATEN_CPU_CAPABILITY`), another
thread count or BLAS sum in another order. A comparison with such numbers must allow what the arithmetic can differ
by, and say why. This reads the test modules' syntax (nothing is imported or run) and, inside each module:

- a value is *recorded* when it comes from a loading call (`load_file`, `torch.load`, `safe_open`, `np.load`,
  `json.load`, ...), from a name assigned from one, from a module function that returns one, or from a fixture that
  does; anything computed from a recorded value is recorded too;
- a *comparison* is `torch.equal`, `Tensor.equal`, NumPy's `assert_array_equal` / `assert_equal`,
  `torch.testing.assert_close`, `torch.allclose` / `isclose`, NumPy's `assert_allclose` / `allclose`, or `x <= 0` /
  `x == 0` (an error bounded by zero), with a recorded value among its operands.

Problems: bit equality against a recorded value (`torch.equal`, `assert_array_equal`, an error `<= 0`); a tolerance
comparison without both tolerances given explicitly, or with both zero; a tolerance written as a number with no
comment on its lines or the line above saying why (a named constant carries its reason where it is defined).

`tests/conftest.py` marks the tests this finds `recorded`, and `make test` runs them a second time with
`ATEN_CPU_CAPABILITY=default`, which computes matrix products, softmax and norms with other bits, as another
processor does. Bit equality stays right between two computations made in the same process.
"""

import argparse
import ast
import io
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

# The last part of a call's name that reads numbers from a file.
LOADING_CALLS = frozenset({"load_file", "load", "loads", "safe_open", "get_tensor", "get_slice", "fromfile"})
# Calls that rearrange numbers without computing new ones worth another processor's bits (their result of recorded
# values is recorded too): tensor and array libraries, and Python's containers and numbers.
REARRANGING = frozenset({"torch", "np", "numpy", "math", "float", "int", "list", "tuple", "dict", "sum", "max", "min",
                         "abs", "sorted", "zip", "enumerate"})  # fmt: skip
BIT_EQUALITY = frozenset({"equal", "assert_array_equal", "assert_equal", "array_equal"})
WITH_TOLERANCE = frozenset({"assert_close", "allclose", "isclose", "assert_allclose"})
PRAGMAS = ("fmt:", "noqa", "type:", "pragma")


@dataclass
class Problem:
    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class Module:
    """What one test module's syntax says: its problems and the tests that compare with recorded numbers."""

    path: Path
    problems: list = field(default_factory=list)
    tests: set = field(default_factory=set)  # "test_name" or "Class::test_name"


def _called_name(call: ast.Call) -> str:
    function = call.func
    if isinstance(function, ast.Attribute):
        return function.attr
    if isinstance(function, ast.Name):
        return function.id
    return ""


def _root_name(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else ""


def _target_names(target: ast.AST) -> set:
    return {node.id for node in ast.walk(target) if isinstance(node, ast.Name)}


class _Scope:
    """The names of one function (or of the module) that hold committed paths or recorded values, and the module's
    loading functions."""

    def __init__(self, loaders: set, recorded: set, committed: set):
        self.loaders = loaders  # module functions (and fixtures) that return recorded values
        self.recorded = set(recorded)
        self.committed = set(committed)  # paths inside the repository or beside it (derived from __file__)

    def is_committed(self, node: ast.AST | None) -> bool:
        """Whether `node` names a path inside the repository or beside it (keyword arguments aside: the result of
        `subprocess.run(..., cwd=ROOT)` is not a path)."""
        if isinstance(node, ast.Name):
            return node.id == "__file__" or node.id in self.committed
        if node is None or isinstance(node, ast.keyword):
            return False
        return any(self.is_committed(child) for child in ast.iter_child_nodes(node))

    def is_recorded(self, node: ast.AST | None) -> bool:
        """Whether `node` holds numbers read from a committed file, as they were read or rearranged (indexed,
        stacked, subtracted): a file written by the test itself was computed by this processor, and so is what a
        model or any other function computes from recorded inputs."""
        if node is None or isinstance(node, ast.keyword):
            return False
        if isinstance(node, ast.Name):
            return node.id in self.recorded
        if isinstance(node, ast.Lambda | ast.FunctionDef):
            return False
        if isinstance(node, ast.Call):
            name = _called_name(node)
            if isinstance(node.func, ast.Name) and name in self.loaders:
                return True
            if name in LOADING_CALLS and any(self.is_committed(part) for part in [*node.args, *node.keywords]):
                return True
            if isinstance(node.func, ast.Attribute) and self.is_recorded(node.func.value):
                return True  # recorded.abs(), tensors.get(name), ...
            if _root_name(node.func) in REARRANGING:
                return any(self.is_recorded(argument) for argument in node.args)
            return False  # a model, a converter, any other function: computed here
        return any(self.is_recorded(child) for child in ast.iter_child_nodes(node))

    def learn(self, statements: list) -> None:
        """Add the names assigned from committed paths and recorded values, until nothing changes (loops may assign
        late)."""
        while True:
            before = len(self.recorded), len(self.committed)
            for statement in statements:
                for node in ast.walk(statement):
                    pairs = []
                    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        pairs = [(target, node.value) for target in targets]
                    elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                        pairs = [(node.target, node.iter)]
                    elif isinstance(node, ast.With | ast.AsyncWith):
                        pairs = [(item.optional_vars, item.context_expr) for item in node.items if item.optional_vars]
                    for target, value in pairs:
                        if self.is_recorded(value):
                            self.recorded |= _target_names(target)
                        elif self.is_committed(value):
                            self.committed |= _target_names(target)
            if (len(self.recorded), len(self.committed)) == before:
                return


def _functions(tree: ast.Module):
    """(qualified name, function) for the module's functions and its classes' methods."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}::{item.name}", item


def _is_fixture(function: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(decorator) for decorator in function.decorator_list)


def _returns_recorded(function: ast.FunctionDef, scope: _Scope) -> bool:
    return any(
        isinstance(node, ast.Return | ast.Yield | ast.YieldFrom) and scope.is_recorded(node.value)
        for node in ast.walk(function)
    )


def _parameters(function: ast.FunctionDef) -> list:
    return [argument.arg for argument in function.args.posonlyargs + function.args.args + function.args.kwonlyargs]


def _function_scope(function: ast.FunctionDef, module_scope: _Scope, recorded_parameters: set) -> _Scope:
    """`recorded_parameters`: fixtures that return recorded values, and the parameters a call passes them to."""
    parameters = set(_parameters(function))
    hidden = parameters - recorded_parameters  # a parameter hides a module name of the same spelling
    scope = _Scope(
        module_scope.loaders,
        (module_scope.recorded - hidden) | (parameters & recorded_parameters),
        module_scope.committed - hidden,
    )
    scope.learn(function.body)
    return scope


def _commented_lines(source: str) -> set:
    """The lines (1-based) with a `#` comment that says something (not a `fmt:`, `noqa` or `type:` pragma)."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        text = token.string.lstrip("#").strip()
        if token.type == tokenize.COMMENT and text and not text.startswith(PRAGMAS):
            lines.add(token.start[0])
    return lines


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 0


def _comparisons(function: ast.FunctionDef, scope: _Scope, commented: set):
    """(line, problem or None) for each comparison with a recorded value in `function`."""
    statement_of = {}
    for statement in ast.walk(function):
        if isinstance(statement, ast.stmt):
            for node in ast.walk(statement):
                statement_of[id(node)] = statement  # the innermost wins: ast.walk reaches it last
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            name = _called_name(node)
            operands = list(node.args)
            if isinstance(node.func, ast.Attribute) and name in BIT_EQUALITY | WITH_TOLERANCE:
                operands.append(node.func.value)  # tensor.equal(other)
            if not any(scope.is_recorded(operand) for operand in operands):
                continue
            if name in BIT_EQUALITY:
                yield node.lineno, f"{name}() against numbers recorded in a file: compare with a tolerance"
            elif name in WITH_TOLERANCE:
                yield node.lineno, _tolerance_problem(node, statement_of.get(id(node), node), commented)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = node.left, node.comparators[0]
            bounded_by_zero = isinstance(node.ops[0], ast.LtE | ast.Eq) and _is_zero(right)
            if bounded_by_zero and scope.is_recorded(left):
                yield node.lineno, "an error bounded by 0 against numbers recorded in a file: bound it by a tolerance"
            elif isinstance(node.ops[0], ast.Lt | ast.LtE | ast.Gt | ast.GtE) and (
                scope.is_recorded(left) or scope.is_recorded(right)
            ):
                yield node.lineno, None  # an error bounded by a tolerance: fine, and the test is listed


def _tolerance_problem(call: ast.Call, statement: ast.AST, commented: set) -> str | None:
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    if None in keywords:  # **TOLERANCE: a named set of tolerances, which says why where it is defined
        return None
    if "rtol" not in keywords or "atol" not in keywords:
        return (
            f"{_called_name(call)}() against numbers recorded in a file without rtol= and atol=: give both, chosen "
            f"from what the arithmetic can differ by on another processor, with a comment saying why"
        )
    if _is_zero(keywords["rtol"]) and _is_zero(keywords["atol"]):
        return f"{_called_name(call)}() with zero tolerance against numbers recorded in a file"
    literal = any(
        isinstance(value, ast.Constant) and not _is_zero(value) for value in (keywords["rtol"], keywords["atol"])
    )
    if literal and not commented & set(range(statement.lineno - 1, statement.end_lineno + 1)):
        return "a tolerance against numbers recorded in a file with no comment saying why (on its lines or above)"
    return None


def _fixtures(tree: ast.Module, scope: _Scope) -> set:
    return {
        name
        for name, function in _functions(tree)
        if "::" not in name and _is_fixture(function) and _returns_recorded(function, scope)
    }


def read_module(path: Path, shared_fixtures: frozenset = frozenset()) -> Module:
    """The problems and the recorded-number tests of one test module; `shared_fixtures`: conftest fixtures that
    return recorded values."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    module_statements = [node for node in tree.body if not isinstance(node, ast.FunctionDef | ast.ClassDef)]
    scope = _Scope(set(), set(), set())
    functions = dict(_functions(tree))
    received = {name: set() for name in functions}  # the parameters that calls pass recorded values to

    def function_scope(name: str) -> _Scope:
        return _function_scope(functions[name], scope, fixtures | received[name])

    fixtures = set(shared_fixtures)
    while True:  # the module's names, loading functions, fixtures and helpers' parameters, until nothing changes
        known = (
            len(scope.recorded),
            len(scope.committed),
            len(scope.loaders),
            len(fixtures),
            sum(map(len, received.values())),
        )
        scope.learn(module_statements)
        fixtures |= _fixtures(tree, scope)
        for name, function in functions.items():
            inside = function_scope(name)
            if "::" not in name and _returns_recorded(function, inside):
                scope.loaders.add(name)
            for call in ast.walk(function):
                callee = call.func.id if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) else None
                if callee not in functions:
                    continue
                parameters = _parameters(functions[callee])
                for position, argument in enumerate(call.args[: len(parameters)]):
                    if inside.is_recorded(argument):
                        received[callee].add(parameters[position])
                for keyword in call.keywords:
                    if keyword.arg in parameters and inside.is_recorded(keyword.value):
                        received[callee].add(keyword.arg)
        if (
            len(scope.recorded),
            len(scope.committed),
            len(scope.loaders),
            len(fixtures),
            sum(map(len, received.values())),
        ) == known:
            break
    commented = _commented_lines(source)
    module = Module(path)
    comparing = set()  # module functions that compare with recorded values (helpers included)
    for name, function in functions.items():
        found = list(_comparisons(function, function_scope(name), commented))
        module.problems += [Problem(path, line, message) for line, message in found if message]
        if found:
            comparing.add(name)
    while True:  # a test that calls a comparing helper compares too
        before = len(comparing)
        for name, function in functions.items():
            calls = {_called_name(node) for node in ast.walk(function) if isinstance(node, ast.Call)}
            if calls & {helper for helper in comparing if "::" not in helper}:
                comparing.add(name)
        if len(comparing) == before:
            break
    module.tests = {name for name in comparing if name.rsplit("::", 1)[-1].startswith("test")}
    module.problems.sort(key=lambda problem: problem.line)
    return module


def conftest_fixtures(folder: Path) -> frozenset:
    """The fixtures of the conftest.py files under `folder` that return recorded values."""
    shared = set()
    for conftest in sorted(folder.rglob("conftest.py")):
        tree = ast.parse(conftest.read_text())
        scope = _Scope(set(), set(), set())
        scope.learn([node for node in tree.body if not isinstance(node, ast.FunctionDef | ast.ClassDef)])
        shared |= _fixtures(tree, scope)
    return frozenset(shared)


def read_tests(folder: Path) -> list:
    """Every test module under `folder` (test_*.py)."""
    shared = conftest_fixtures(folder)
    return [read_module(path, shared) for path in sorted(folder.rglob("test_*.py"))]


def main(arguments: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=Path(__file__).resolve().parents[1] / "tests")
    parser.add_argument("--list", action="store_true", help="print the tests that compare with recorded numbers")
    options = parser.parse_args(arguments)
    modules = read_tests(options.folder)
    if options.list:
        for module in modules:
            for test in sorted(module.tests):
                print(f"{module.path}::{test}")
        return 0
    problems = [problem for module in modules for problem in module.problems]
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
