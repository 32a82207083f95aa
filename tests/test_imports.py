"""Import structure: no import cycles, and nothing outside `retention/cli/` imports the CLI.

The scan reads every module of `retention/` and `protocol/` with `ast` and follows each import
statement wherever it stands: at module level and inside functions (a function-level import is a
cycle deferred to call time, still a cycle of the design). Imports under `if TYPE_CHECKING:` are
never executed and are skipped. `from a.b import c` is an edge to `a.b.c` when that is a module,
else to `a.b`. `importlib.import_module("a.b")` is an edge to `a.b`; `import_module(f"a.{x}")` (a
registry loading its modules by name) an edge to every module under `a.` (an over-approximation).
Importing a module also runs its packages' `__init__`; those implicit edges are not counted (every
module would otherwise sit in a cycle with its package's `__init__`).

Every cycle fails the test, wherever it is.

Imports stand at the top of their module (the standard: arrows only downward and visible). Inside a
function only in the CLI (`retention/cli/`, for start-up time), for an optional extra, or under a
`# deferred: <reason>` comment line (`test_function_level_imports_are_marked`).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("retention", "protocol")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the scanned packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _parse(path: Path) -> ast.Module:
    with warnings.catch_warnings():  # a module's own invalid escapes are not this test's business
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(path.read_text(), str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module")


def _dynamic_targets(arg: ast.expr, known: set[str]) -> set[str]:
    """Modules an `import_module(arg)` may load: a literal name exactly; an f-string by its literal
    prefix, as every module under that prefix (an over-approximation: a registry loop over a list of
    names); a name computed otherwise is not followed."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return {arg.value} & known
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
        return {m for m in known if m.startswith(prefix) and m != prefix.rstrip(".") and not m.endswith(".__main__")}
    return set()


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Modules of `known` that `module` imports anywhere in its body (see the module docstring)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def target(name: str) -> str | None:
        while name and name not in known:  # `a.b.Class` -> `a.b`
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                t = target(alias.name)
                if t:
                    found.add(t)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for alias in node.names:
                t = target(f"{src}.{alias.name}") if f"{src}.{alias.name}" in known else target(src)
                if t:
                    found.add(t)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            found.update(_dynamic_targets(node.args[0], known))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(_parse(p), m, p.name == "__init__.py", known) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[tuple[str, ...]] = []

    def strong(v: str) -> None:  # recursion depth is bounded by the module count (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def test_scan_sees_function_level_imports():
    """The scanner must catch a cycle closed only inside a function (the old configs <-> model one)."""
    src = "def f():\n    from retention.models.arch.model import ArchLM\n"
    tree = ast.parse(src)
    assert _imports(tree, "retention.models.arch.configs", False, {"retention.models.arch.model", "retention.models.arch.configs"}) == {
        "retention.models.arch.model"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [("a", "b", "c")]
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import retention.models.arch.model\n"
    assert _imports(ast.parse(guarded), "x", False, {"retention.models.arch.model"}) == set()


def test_graph_covers_the_packages():
    graph = import_graph()
    assert "retention.models.arch.model" in graph and "protocol.io" in graph
    assert "retention.models.arch.configs" in graph["retention.models.arch.model"]
    assert "retention.policy.scoring.h2o" in graph["retention.policy.registry"]


def test_dynamic_import_targets():
    known = {"pkg", "pkg.a", "pkg.b", "pkg.__main__", "other"}
    call = lambda src: ast.parse(src).body[0].value.args[0]  # noqa: E731
    assert _dynamic_targets(call('importlib.import_module("other")'), known) == {"other"}
    assert _dynamic_targets(call('importlib.import_module(f"pkg.{name}")'), known) == {"pkg.a", "pkg.b"}
    assert _dynamic_targets(call("importlib.import_module(name)"), known) == set()


def test_no_import_cycles_anywhere():
    """No cycle anywhere in `retention/` or `protocol/` (the scorer registry's was the last: the
    registry now names its modules in `BUILTINS` and no scorer module imports the package)."""
    assert cycles(import_graph()) == []


def _room(module: str) -> str:
    """The package a module of `retention/` lives in (`runtime`, `policy`, `runs`, ...): its second
    name, and under `runs/` its subpackage (`runs.engines`, `runs.scale`); a module of the root is its
    own room."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "runs" and (ROOT / "retention" / "runs" / parts[2]).is_dir():
        return f"runs.{parts[2]}"
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_arrow_back_up_between_packages():
    """Between the packages of `retention/` (and the subpackages of `runs/`: the engines below the runs,
    the scale-out launchers above them), arrows point one way:
    no two packages import each other, whatever modules carry the imports."""
    rooms: dict[str, set[str]] = {}
    for m, deps in import_graph().items():
        if m.startswith("retention."):
            rooms.setdefault(_room(m), set()).update(_room(d) for d in deps if d.startswith("retention.") and _room(d) != _room(m))
    both = sorted({tuple(sorted((a, b))) for a, out in rooms.items() for b in out if a in rooms.get(b, ())})
    assert both == []


def test_the_runtime_imports_nothing_above_it():
    """The engine, cache and generation code type against `retention.runtime.protocol.StepPolicy`: no
    module of `retention/runtime/` imports the mechanisms, the scorers' public face or the models."""
    above = ("retention.policy", "retention.scorers", "retention.models", "retention.runs")
    offenders = sorted((m, d) for m, deps in import_graph().items() if m.startswith("retention.runtime")
                       for d in deps if d.startswith(above))
    assert offenders == []


def test_nothing_outside_the_cli_imports_it():
    graph = import_graph()
    offenders = sorted(m for m, deps in graph.items()
                       if not (m == "retention.cli" or m.startswith("retention.cli."))
                       and any(d == "retention.cli" or d.startswith("retention.cli.") for d in deps))
    assert offenders == []


#: Optional third-party extras: imported where they are used, so that the rest runs without them.
OPTIONAL = frozenset({"vllm", "ray", "gguf", "math_verify", "matplotlib", "datasets"})
DEFERRED = "# deferred:"


def _function_level_imports(tree: ast.Module):
    """Every import statement inside a function body (at any depth), in source order."""
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return sorted(out, key=lambda n: n.lineno)


def _imported_roots(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name.split(".")[0] for a in node.names}
    return {"." if node.level else (node.module or "").split(".")[0]}


def _is_deferred(lines: list[str], node: ast.AST) -> bool:
    """Whether `node` sits under a `# deferred:` comment line: the line right above it, or above the
    run of import lines it belongs to (one comment covers imports written one after the other)."""
    i = node.lineno - 2  # the line above, 0-based
    while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
        i -= 1
    return i >= 0 and lines[i].strip().startswith(DEFERRED)


def function_level_offenders() -> list[str]:
    """`file:line: statement` of each function-level import outside the CLI that is neither of an
    optional extra nor marked `# deferred:` (an internal one never counts as optional)."""
    offenders = []
    for m, path in _modules().items():
        if m == "retention.cli" or m.startswith("retention.cli."):
            continue
        text = path.read_text()
        lines = text.splitlines()
        for node in _function_level_imports(_parse(path)):
            roots = _imported_roots(node)
            if roots <= OPTIONAL or _is_deferred(lines, node):
                continue
            offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return offenders


def test_function_level_imports_are_marked():
    """Outside `retention/cli/` an import inside a function is an optional extra's or says why it
    waits (`# deferred: <reason>` on the line above); every other one belongs at the top."""
    offenders = function_level_offenders()
    if offenders:
        pytest.fail(f"{len(offenders)} function-level imports to hoist or mark:\n" + "\n".join(offenders),
                    pytrace=False)


def test_function_level_scan():
    """Imports inside functions (methods and nested functions too) are found; one `# deferred:` line
    covers the run of import lines right below it, not an import after other code."""
    src = ("import os\n"
           "def f():\n"
           "    import json\n"
           "    # deferred: a reason\n"
           "    import torch\n"
           "    from retention.models import x\n"
           "    y = 1\n"
           "    import vllm\n"
           "    from retention import z\n"
           "    class C:\n"
           "        def g(self):\n"
           "            from protocol import io\n")
    lines = src.splitlines()
    nodes = _function_level_imports(ast.parse(src))
    assert [n.lineno for n in nodes] == [3, 5, 6, 8, 9, 12]
    assert [_is_deferred(lines, n) for n in nodes] == [False, True, True, False, False, False]
    assert [_imported_roots(n) <= OPTIONAL for n in nodes] == [False, False, False, True, False, False]


def test_protocol_never_imports_retention_at_module_level():
    """`protocol/` stays usable without the runtime (docs/architecture: arrows only downward)."""
    offenders = []
    for m, path in _modules().items():
        if not m.startswith("protocol"):
            continue
        for node in _parse(path).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "retention" or n.startswith("retention.") for n in names):
                offenders.append(m)
    assert offenders == []
