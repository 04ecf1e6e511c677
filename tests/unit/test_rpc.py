"""Each RPC is declared once (protocol/rpc), and PROTOCOL.md lists exactly those."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import msgspec
import pytest

import harnessd
import protocol
from protocol.rpc import Rpc, Schema, all_rpcs, files
from protocol.rpc.resources import parse_bytes

SPEC = Path(protocol.__file__).parent / "PROTOCOL.md"
WIRE_NAMES = {type(None): "nil", bytes: "bin"}


def spec_index() -> dict[str, tuple[str, str, str]]:
    """Section 17's table: method -> (schema module, params, result)."""
    text = SPEC.read_text()
    section = text[text.index("## 17.") : text.index("## 18.")]
    rows = re.findall(
        r"^\| `([a-z_]+\.[a-z0-9_]+)` \| `protocol/rpc/(\w+)\.py` \| `(\w+)` \| `?(\w+)`? \|$",
        section,
        re.M,
    )
    return {name: (module, params, result) for name, module, params, result in rows}


def declared() -> dict[str, tuple[str, str, str]]:
    return {
        rpc.name: (
            rpc.params.__module__.rsplit(".", 1)[1],
            rpc.params.__name__,
            WIRE_NAMES.get(rpc.result) or rpc.result.__name__,
        )
        for rpc in all_rpcs()
    }


def test_the_spec_index_is_the_declarations() -> None:
    assert spec_index() == declared()


def test_every_method_has_its_section() -> None:
    text = SPEC.read_text()
    for rpc in all_rpcs():
        assert f"**`{rpc.name}`**" in text, rpc.name


def test_names_are_unique_and_follow_the_module() -> None:
    names = [rpc.name for rpc in all_rpcs()]
    assert len(names) == len(set(names))
    for rpc in all_rpcs():
        module = rpc.params.__module__.rsplit(".", 1)[1]
        prefix = rpc.name.split(".")[0]
        assert module in ("core", prefix), rpc


def test_every_schema_has_the_one_configuration() -> None:
    for rpc in all_rpcs():
        for kind in (rpc.params, rpc.result):
            if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)):
                continue
            assert issubclass(kind, Schema), kind
            config = kind.__struct_config__
            assert config.omit_defaults and not config.forbid_unknown_fields


def test_params_from_takes_the_fields_among_the_arguments() -> None:
    def stat(path: str, *, follow_symlinks: bool = False, unrelated: int = 3) -> files.StatParams:
        return files.STAT.params_from(locals())

    assert stat("/w/a") == files.StatParams(path="/w/a", follow_symlinks=False)
    write = files.WRITE.params_from({"path": "/w/b", "data": b"x", "size": 9}, atomic=False)
    # Fields not among the arguments keep their defaults; given ones set or override.
    assert write == files.WriteParams(path="/w/b", data=b"x", atomic=False)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1048576", 1 << 20),
        ("512K", 512 << 10),
        ("256M", 256 << 20),
        ("2GiB", 2 << 30),
        ("1g", 1 << 30),
        ("64MB", 64 << 20),
        ("0", 0),
    ],
)
def test_limit_options_take_byte_counts_with_binary_suffixes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "M", "1.5G", "-1", "12X", "1KK", "0x10"])
def test_limit_options_refuse_what_is_not_a_byte_count(text: str) -> None:
    with pytest.raises(ValueError, match="not a byte count"):
        parse_bytes(text)


def _params_from_users() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, ast.Call]]:
    """Every client function that builds its params with ``params_from(locals(), ...)``."""
    found = []
    for path in sorted(Path(harnessd.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "params_from"
                ):
                    found.append((f"harnessd/{path.name}:{node.name}", node, call))
    return found


def test_every_argument_of_a_params_from_method_is_a_field_or_used() -> None:
    # params_from takes the fields by name from locals(): a keyword that names no field
    # and is not used otherwise would be dropped without a word.
    users = _params_from_users()
    assert len(users) >= 10
    for where, function, call in users:
        # The Rpc as the client module names it, e.g. "shell.RUN" or "watch_rpc.SUBSCRIBE".
        rpc: object = importlib.import_module(f"harnessd.{where.split('/')[1].split('.')[0]}")
        assert isinstance(call.func, ast.Attribute), where
        for part in ast.unparse(call.func.value).split("."):
            rpc = getattr(rpc, part)
        assert isinstance(rpc, Rpc), where
        fields = set(rpc.params.__struct_fields__)
        given = {keyword.arg for keyword in call.keywords}
        used = {
            node.id
            for node in ast.walk(function)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
        }
        arguments = function.args
        names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
        for name in names:
            if name == "self":
                continue
            assert name in fields or name in used, (where, name, sorted(fields))
            assert name not in given or name in used, (where, name)
