"""The protocol package stays sans-I/O: only its bridge and the fuzz kit's live module do I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import protocol

FORBIDDEN = frozenset({"asyncio", "anyio", "socket", "selectors", "trio", "subprocess"})
#: The asyncio glue, and the fuzz kit's sockets and launched servers.
ALLOWED_TO_DO_IO = frozenset({"bridge.py", "fuzz/live.py"})
PACKAGE = Path(protocol.__file__).parent


def imported_roots(source: str, filename: str = "<source>") -> set[str]:
    """Top-level module names a source file imports, wherever the import statement is.

    Covers ``import x``, ``import x.y as z``, ``from x import y``, and calls to
    ``__import__("x")`` or ``importlib.import_module("x")`` with a literal name.
    """
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            first = node.args[0]
            if (
                name in {"__import__", "import_module"}
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                roots.add(first.value.split(".")[0])
    return roots


def protocol_modules() -> list[Path]:
    """Every module of protocol/ and its subpackages that must stay free of I/O."""
    files = sorted(PACKAGE.rglob("*.py"))
    pure = [f for f in files if f.relative_to(PACKAGE).as_posix() not in ALLOWED_TO_DO_IO]
    assert len(pure) > 5, f"protocol sources not found under {PACKAGE}"
    assert len(files) - len(pure) == len(ALLOWED_TO_DO_IO)
    return pure


@pytest.mark.parametrize("path", protocol_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_does_no_io_imports(path: Path) -> None:
    bad = imported_roots(path.read_text(encoding="utf-8"), str(path)) & FORBIDDEN
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {sorted(bad)}"


def test_the_bridge_is_where_asyncio_lives() -> None:
    source = (PACKAGE / "bridge.py").read_text(encoding="utf-8")
    assert "asyncio" in imported_roots(source)


@pytest.mark.parametrize(
    "source",
    [
        "import asyncio",
        "import socket as s",
        "from anyio import create_task_group",
        "from selectors import DefaultSelector",
        "import trio.lowlevel",
        "def f():\n    import subprocess\n",
        "try:\n    import uvloop\nexcept ImportError:\n    import asyncio\n",
        "if TYPE_CHECKING:\n    from asyncio import Transport\n",
        "m = __import__('socket')",
        "import importlib\nm = importlib.import_module('asyncio.streams')",
    ],
)
def test_checker_sees_every_form_of_import(source: str) -> None:
    assert imported_roots(source) & FORBIDDEN


@pytest.mark.parametrize(
    "source",
    [
        "import struct, hashlib",
        "from . import limits",
        "from .aead import FrameSealer",
        "from protocol.socketry import x",
        "text = 'import asyncio'",
    ],
)
def test_checker_ignores_harmless_imports(source: str) -> None:
    assert not imported_roots(source) & FORBIDDEN
