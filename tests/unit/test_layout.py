"""The layout's rules, checked from the source with ``ast`` (nothing is imported or run):

- the programs (``exchange``, ``supplier``, ``buyer_cli``, ``edge``) stand side by side on the
  shared home: none imports another;
- the shared home (``bourse``) imports no program, nor ``ops`` or ``loadtest``;
- ``ops`` and ``loadtest`` use the supplier only through its public top-level API;
- no two modules import each other, directly or round a loop, at import time or under
  ``if TYPE_CHECKING:`` (a loop the type checker sees is a loop in the design).

Every failure names the file, the line and the import that breaks the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ("exchange", "supplier", "buyer_cli", "edge")
SHARED = "bourse"
TOOLS = ("ops", "loadtest")
PACKAGES = (SHARED, *PROGRAMS, *TOOLS)


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to the module it names."""

    source: str  # the importing module, e.g. "supplier.host"
    path: Path  # its file, relative to the repository root
    line: int
    target: str  # the module imported, e.g. "supplier.config"
    text: str  # the statement as written, for the failure message
    top_level: bool  # runs when the module is imported (not in a function, not TYPE_CHECKING)
    typing: bool = False  # at module level under ``if TYPE_CHECKING:`` (the type checker's)

    def __str__(self) -> str:
        text = self.text if len(self.text) <= 100 else self.text[:97] + "..."
        return f"{self.path}:{self.line}: {text}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the six packages, by dotted name."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


# When a statement runs: at import time, for the type checker only (module level under
# ``if TYPE_CHECKING:``), or when a function is called.
IMPORT, TYPING, CALL = "import", "typing", "call"


def _statements(body: list[ast.stmt], when: str = IMPORT) -> Iterator[tuple[ast.stmt, str]]:
    """Every statement, with when it runs. Function bodies run when called; an
    ``if TYPE_CHECKING:`` block at module level, for the type checker; class bodies,
    ``try`` and other ``if`` when the block around them does."""
    for stmt in body:
        yield stmt, when
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _statements(stmt.body, CALL)
        elif isinstance(stmt, ast.If):
            typing = when == IMPORT and _is_type_checking(stmt.test)
            yield from _statements(stmt.body, TYPING if typing else when)
            yield from _statements(stmt.orelse, when)
        elif isinstance(stmt, ast.ClassDef | ast.With | ast.AsyncWith | ast.For | ast.While):
            yield from _statements(stmt.body, when)
            yield from _statements(getattr(stmt, "orelse", []), when)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            for block in (stmt.body, stmt.orelse, stmt.finalbody):
                yield from _statements(block, when)
            for handler in stmt.handlers:
                yield from _statements(handler.body, when)


def _base(source: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, node.module] if node.module else package)


@cache
def imports_of(source: str) -> tuple[Import, ...]:
    """Every import in module ``source`` (functions and TYPE_CHECKING blocks included,
    marked as not top-level), each target resolved to a module name."""
    path = modules()[source]
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT)
    found: list[Import] = []
    for stmt, when in _statements(tree.body):
        text = ast.unparse(stmt) if isinstance(stmt, ast.Import | ast.ImportFrom) else ""
        at = (when == IMPORT, when == TYPING)
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                found.append(Import(source, rel, stmt.lineno, alias.name, text, *at))
        elif isinstance(stmt, ast.ImportFrom):
            base = _base(source, path, stmt)
            for alias in stmt.names:
                # `from pkg import sub` imports the submodule pkg.sub; else a name of pkg
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules() else base
                found.append(Import(source, rel, stmt.lineno, target, text, *at))
    return tuple(found)


def _package(module: str) -> str:
    return module.split(".", 1)[0]


def all_imports(packages: tuple[str, ...] = PACKAGES) -> list[Import]:
    return [i for m in modules() if _package(m) in packages for i in imports_of(m)]


def _report(rule: str, bad: list[Import]) -> str:
    lines = dict.fromkeys(f"  {i}  (imports {i.target})" for i in bad)  # one per statement
    return f"{rule}:\n" + "\n".join(lines)


def test_the_packages_are_found() -> None:
    """A guard on the guards: a rule over no files would pass for nothing."""
    names = modules()
    assert {"bourse.wire.messages", "exchange.service", "supplier.host", "buyer_cli.cli"} <= set(
        names
    )
    assert any(i.target == "bourse.wire.messages" for i in imports_of("exchange.orders"))


def test_no_program_imports_another_program() -> None:
    bad = [
        i
        for i in all_imports(PROGRAMS)
        if _package(i.target) in PROGRAMS and _package(i.target) != _package(i.source)
    ]
    assert not bad, _report("a program imports another program", bad)


def test_the_shared_home_imports_no_program_nor_ops_nor_loadtest() -> None:
    bad = [i for i in all_imports((SHARED,)) if _package(i.target) in (*PROGRAMS, *TOOLS)]
    assert not bad, _report(f"{SHARED}/ imports a program, ops or loadtest", bad)


def supplier_internals_used_by_tools() -> list[Import]:
    """Imports from ops/ and loadtest/ of anything below the supplier's top level."""
    return [i for i in all_imports(TOOLS) if i.target.startswith("supplier.")]


def test_ops_and_loadtest_use_only_the_suppliers_public_api() -> None:
    bad = supplier_internals_used_by_tools()
    assert not bad, _report(
        "ops/loadtest reach inside supplier (use `from supplier import X`)", bad
    )


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components with more than one module, or one
    module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def _in_graph(i: Import) -> bool:
    """An import the module's design depends on: run at import time or for the type checker
    (a cycle hidden under TYPE_CHECKING is still two modules that need each other)."""
    return i.top_level or i.typing


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the six packages it imports when it is imported or type
    checked."""
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for i in all_imports():
        if _in_graph(i) and i.target in graph:
            graph[i.source].add(i.target)
    return graph


def test_type_checking_imports_are_seen_and_function_imports_are_not() -> None:
    """A guard on the cycle rule: it reads the imports under ``if TYPE_CHECKING:`` (also
    written ``typing.TYPE_CHECKING``) and leaves those in functions out."""
    tree = ast.parse(
        "import typing\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import a\n"
        "if typing.TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
        "def f() -> None:\n    import d\n"
        "    if TYPE_CHECKING:\n        import e\n"
    )
    when = {
        alias.name: w
        for stmt, w in _statements(tree.body)
        if isinstance(stmt, ast.Import)
        for alias in stmt.names
    }
    assert when == {
        "typing": IMPORT,
        "a": TYPING,
        "b": TYPING,
        "c": IMPORT,
        "d": CALL,
        "e": CALL,
    }


def test_cycle_finder_finds_a_loop_and_no_false_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["e"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = strongly_connected(graph)
    lines = []
    for component in cycles:
        members = set(component)
        edges = [
            str(i) for m in component for i in imports_of(m) if _in_graph(i) and i.target in members
        ]
        lines.append(" <-> ".join(component) + "\n    " + "\n    ".join(edges))
    assert not cycles, "import cycles (top-level and TYPE_CHECKING imports):\n  " + "\n  ".join(
        lines
    )
