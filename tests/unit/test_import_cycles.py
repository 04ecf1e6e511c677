"""No import loop in harnessd/ or protocol/: each module's imports lead away from it.

An import loop makes a module's meaning depend on which of the two was
imported first, and hides an E402 import at some module's bottom or inside a
function. The imports are read from the sources (ast), wherever they stand:
at module level, at a module's bottom, inside a function. Two kinds do not
count: imports under ``if TYPE_CHECKING:`` (types only, never run), and a
package's own ``__init__`` reaching into its submodules from inside a
function (``protocol.rpc.all_rpcs`` lists the modules that build on the
package's base classes; it runs after they are all defined).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import harnessd
import protocol

PACKAGES = (Path(harnessd.__file__).parent, Path(protocol.__file__).parent)


def module_sources(package: Path) -> dict[str, tuple[str, bool]]:
    """Every module of ``package`` and below: dotted name -> (source, is a package's __init__)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path.read_text(encoding="utf-8"), is_package)
    return modules


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(node: ast.Import | ast.ImportFrom, package: str, known: Iterable[str]) -> set[str]:
    """The known modules one import statement loads (``from p import m`` loads p.m if a module)."""
    names = set(known)
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in names}
    if node.level:
        parts = package.split(".")
        base = ".".join(
            parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])
        )
    else:
        base = node.module or ""
    found = set()
    for alias in node.names:
        child = f"{base}.{alias.name}"
        if child in names:
            found.add(child)
        elif base in names:
            found.add(base)
    return found


def imports_of(name: str, source: str, is_package: bool, known: Iterable[str]) -> set[str]:
    """The modules among ``known`` that module ``name`` imports at run time (see the docstring)."""
    package = name if is_package else name.rpartition(".")[0]
    known = set(known)
    found: set[str] = set()

    def visit(nodes: list[ast.stmt], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _type_checking(node.test):
                visit(node.orelse, in_function)
                continue
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported(node, package, known):
                    own_part = is_package and target.startswith(f"{name}.")
                    if not (in_function and own_part):
                        found.add(target)
                continue
            inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child], inner)
                elif isinstance(child, ast.ExceptHandler | ast.match_case):
                    visit(child.body, inner)

    visit(ast.parse(source, filename=name).body, False)
    found.discard(name)
    return found


def loops(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The import loops of ``graph``: each a path that comes back to its first module."""
    found: list[list[str]] = []
    state: dict[str, str] = {}  # "open" while on the path, "done" once all it reaches is seen
    path: list[str] = []

    def walk(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module)
    return found


def import_graph(packages: Iterable[Path]) -> dict[str, set[str]]:
    sources: dict[str, tuple[str, bool]] = {}
    for package in packages:
        sources |= module_sources(package)
    return {
        name: imports_of(name, source, is_package, sources)
        for name, (source, is_package) in sources.items()
    }


def test_harnessd_and_protocol_have_no_import_loop() -> None:
    graph = import_graph(PACKAGES)
    assert len(graph) > 60, sorted(graph)
    assert "harnessd.tools_terminal" in graph["harnessd.tools"]  # the walk sees imports
    assert loops(graph) == []


def _graph_of(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph([tmp_path / "pkg"])


@pytest.mark.parametrize(
    ("a_imports", "loop"),
    [
        ("from pkg.b import thing\n", True),
        ("import pkg.b\n", True),
        ("from pkg import b\n", True),
        ("from . import b\n", True),
        ("def later():\n    from pkg.b import thing\n", True),
        ("try:\n    import pkg.b\nexcept ImportError:\n    pass\n", True),
        ("VALUE = 1\n\nfrom pkg.b import thing  # noqa: E402\n", True),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import thing\n",
            False,
        ),
        ("import pkg.c\n", False),
    ],
)
def test_the_walk_finds_a_loop_wherever_the_import_stands(
    tmp_path: Path, a_imports: str, loop: bool
) -> None:
    graph = _graph_of(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": a_imports,
            "pkg/b.py": "from pkg.a import other\nthing = 1\n",
            "pkg/c.py": "",
        },
    )
    assert bool(loops(graph)) is loop, graph
    if loop:
        assert loops(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_a_package_may_list_its_own_modules_from_inside_a_function(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "class Base: ...\n\ndef parts():\n    from pkg import a\n    return a\n",
        "pkg/a.py": "from pkg import Base\n",
    }
    assert loops(_graph_of(tmp_path, files)) == []
    files["pkg/__init__.py"] = "class Base: ...\n\nfrom pkg import a  # noqa: E402\n"
    assert loops(_graph_of(tmp_path, files)) == [["pkg", "pkg.a", "pkg"]]
