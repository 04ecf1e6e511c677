"""Each RPC is declared once (protocol/rpc), and PROTOCOL.md lists exactly those."""

from __future__ import annotations

import ast
import importlib
import re
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Annotated, NamedTuple

import msgspec
import pytest

import harnessd
import protocol
from protocol.rpc import Schema, all_rpcs, files, watch
from protocol.rpc import types as rpc_types

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


#: Fields that name a path in the workspace, whatever the method.
PATH_FIELDS = frozenset({"path", "src", "dst", "cwd", "log"})


def test_every_path_field_has_the_one_path_bound() -> None:
    checked = 0
    for rpc in all_rpcs():
        if not isinstance(rpc.params, type) or not issubclass(rpc.params, Schema):
            continue
        hints = typing.get_type_hints(rpc.params, include_extras=True)
        for name in PATH_FIELDS & set(hints):
            hint = hints[name]
            if typing.get_origin(hint) in (typing.Union, types.UnionType):
                (hint,) = [kind for kind in typing.get_args(hint) if kind is not type(None)]
            assert hint == rpc_types.PathStr, (rpc.name, name, hints[name])
            checked += 1
    assert checked >= 15


@pytest.mark.parametrize("path", ["", "x" * (rpc_types.MAX_PATH + 1)])
def test_a_path_out_of_bounds_does_not_decode(path: str) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"path": path}, files.StatParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"path": path}, watch.SubscribeParams)


def _plain(kind: object) -> object:
    """``kind`` without ``Annotated`` bounds, unions as sets: the type a caller may pass."""
    origin = typing.get_origin(kind)
    arguments = typing.get_args(kind)
    if origin is typing.Annotated:
        return _plain(arguments[0])
    if origin in (typing.Union, types.UnionType):
        return frozenset(_plain(argument) for argument in arguments)
    if origin is not None and arguments:
        return (origin, tuple(_plain(argument) for argument in arguments))
    return kind


def _required(kind: object) -> object:
    """A plain optional type without its None: a method may insist on a value the wire lets be nil."""
    if not isinstance(kind, frozenset) or type(None) not in kind:
        return kind
    rest = kind - {type(None)}
    return next(iter(rest)) if len(rest) == 1 else rest


def _resolve(node: ast.expr, namespace: object) -> object:
    """What a name or dotted name in a module's source refers to (None if it names nothing there)."""
    if isinstance(node, ast.Name):
        return getattr(namespace, node.id, None)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, namespace)
        return None if owner is None else getattr(owner, node.attr, None)
    return None


def _annotation(function: Callable[..., object], name: str) -> object:
    """The type annotated on ``function``'s argument ``name``, evaluated where it was written.

    One at a time: ``typing.get_type_hints`` would need every annotation of the
    function to resolve at run time, including names imported for type checking only.
    """
    text = function.__annotations__[name]
    # The annotation's own source text, from our own module, in that module's namespace.
    return eval(text, function.__globals__)  # noqa: S307


class Site(NamedTuple):
    """A client function that builds params: where, the function, its source and the builds."""

    where: str
    function: Callable[..., object]
    source: ast.FunctionDef | ast.AsyncFunctionDef
    builds: list[tuple[type[Schema], ast.Call]]


def _client_functions(
    module: ModuleType, tree: ast.Module
) -> Iterator[tuple[str, Callable[..., object], ast.FunctionDef | ast.AsyncFunctionDef]]:
    """The module-level functions and the methods of module-level classes, with their source."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, getattr(module, node.name), node
        elif isinstance(node, ast.ClassDef):
            owner = getattr(module, node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{item.name}", owner.__dict__[item.name], item


def params_sites() -> list[Site]:
    """Every function of harnessd that builds the params of an RPC (a Schema Struct)."""
    sites = []
    for path in sorted(Path(harnessd.__file__).parent.glob("*.py")):
        module = importlib.import_module(f"harnessd.{path.stem}")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name, function, source in _client_functions(module, tree):
            builds = []
            for call in ast.walk(source):
                if not isinstance(call, ast.Call):
                    continue
                kind = _resolve(call.func, module)
                if isinstance(kind, type) and issubclass(kind, Schema):
                    builds.append((kind, call))
            if builds:
                sites.append(Site(f"harnessd/{path.name}:{name}", function, source, builds))
    return sites


def test_an_argument_passed_to_a_params_field_has_the_fields_type() -> None:
    # A client method's keyword is its wire field's public face: the same type, bounds aside
    # (or without None, when the method always sends a value). mypy checks that each argument
    # fits its field; this holds the method to offering all that the field takes.
    compared = 0
    for site in params_sites():
        arguments = {name for name in site.function.__annotations__ if name != "return"}
        for kind, call in site.builds:
            fields = typing.get_type_hints(kind, include_extras=True)
            for keyword in call.keywords:
                value = keyword.value
                if not (isinstance(value, ast.Name) and value.id in arguments):
                    continue  # a computed value: mypy checks it against the field
                assert keyword.arg is not None, site.where
                client, field = _annotation(site.function, value.id), fields[keyword.arg]
                allowed = (_plain(field), _required(_plain(field)))
                assert _plain(client) in allowed, (site.where, value.id, client, field)
                compared += 1
    assert compared >= 60


def test_no_keyword_of_a_client_method_is_dropped() -> None:
    # A client method: one that passes its own arguments to params fields. Each of its
    # arguments goes somewhere; a keyword left out of the params would be ignored silently.
    checked = 0
    for site in params_sites():
        arguments = site.source.args
        names = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
        passed = {
            keyword.value.id
            for _, call in site.builds
            for keyword in call.keywords
            if isinstance(keyword.value, ast.Name)
        }
        if not passed & set(names):
            continue
        used = {
            node.id
            for node in ast.walk(site.source)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
        }
        unused = [name for name in names if name != "self" and name not in used]
        assert not unused, (site.where, unused)
        checked += 1
    assert checked >= 40


def test_the_field_comparison_sees_through_bounds_but_not_past_types() -> None:
    class Probe(Schema):
        path: Annotated[str, msgspec.Meta(max_length=8)]
        names: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta()] | None

    fields = typing.get_type_hints(Probe, include_extras=True)
    assert _plain(fields["path"]) == _plain(str)
    assert _plain(fields["names"]) == _plain(list[str] | None)
    assert _plain(fields["names"]) == _plain(typing.Optional[list[str]])  # noqa: UP045
    assert _plain(fields["names"]) != _plain(list[str])
    assert _plain(fields["names"]) != _plain(list[bytes] | None)
    assert _plain(fields["path"]) != _plain(typing.Literal["a"])
    assert _required(_plain(fields["names"])) == _plain(list[str])
    assert _required(_plain(fields["path"])) == _plain(str)
