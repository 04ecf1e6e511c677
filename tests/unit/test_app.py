"""execd.app: the dispatch table every capability contributes to."""

from __future__ import annotations

import itertools
import typing

import pytest

from execd.app import Execd
from execd.config import Config
from execd.context import Method
from protocol.rpc import all_rpcs


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Method]:
    """execd's dispatch table."""
    config = Config(marker="m", state_dir=str(tmp_path_factory.mktemp("state")))
    methods = Execd(config, b"t" * 32).methods
    methods.load_all()
    return methods


@pytest.fixture(scope="module")
def methods(table: dict[str, Method]) -> dict[str, str]:
    """Every RPC method execd serves, with the name of its handler."""
    return {name: method.handler.__name__ for name, method in table.items()}


def test_each_handler_is_annotated_with_its_declared_types(table: dict[str, Method]) -> None:
    """What mypy would check of a typed binding: params and result as declared."""
    for name, method in table.items():
        hints = typing.get_type_hints(method.handler)
        assert hints["params"] is method.rpc.params, name
        assert hints["return"] == method.rpc.result, name


def test_execd_serves_exactly_the_declared_rpcs(table: dict[str, Method]) -> None:
    """Each entry is bound from its declaration in protocol/rpc, and none is missing."""
    assert {name: method.rpc for name, method in table.items()} == {
        rpc.name: rpc for rpc in all_rpcs()
    }


NAMESPACES = [
    "files",
    "ledger",
    "request",
    "server",
    "services",
    "session",
    "sessions",
    "shell",
    "terminal",
    "watch",
]


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_handler_is_named_after_its_method(methods: dict[str, str], namespace: str) -> None:
    mine = {name: handler for name, handler in methods.items() if name.split(".")[0] == namespace}
    assert mine
    assert mine == {name: name.replace(".", "_") for name in mine}


def test_every_method_is_in_a_known_namespace(methods: dict[str, str]) -> None:
    by_namespace = itertools.groupby(sorted(methods), key=lambda name: name.split(".")[0])
    assert sorted(namespace for namespace, _ in by_namespace) == NAMESPACES


def test_capabilities_are_built_on_their_first_call(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    config = Config(marker="m", state_dir=str(tmp_path_factory.mktemp("state")))
    app = Execd(config, b"t" * 32)
    assert app.capabilities == []
    # request.attach is the request table's, which the server holds from the start.
    assert {name.split(".")[0] for name in app.methods} == {"server", "session", "request"}
    assert app.methods.get("files.stat") is not None
    assert [type(c).__name__ for c in app.capabilities] == ["FilesCapability"]
    # Unknown names stay unknown, in a known namespace or not, and build nothing more.
    assert app.methods.get("files.frobnicate") is None
    assert app.methods.get("nowhere.at_all") is None
    assert app.methods.get("shell") is None
    assert len(app.capabilities) == 1
    app.methods.load_all()
    assert len(app.capabilities) == 7
