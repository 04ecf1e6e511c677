"""execd.app: the dispatch table every capability contributes to."""

from __future__ import annotations

import itertools

import pytest

from execd.app import Execd
from execd.config import Config


@pytest.fixture(scope="module")
def methods(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every RPC method execd serves, with the name of its handler."""
    config = Config(marker="m", state_dir=str(tmp_path_factory.mktemp("state")))
    app = Execd(config, b"t" * 32)
    return {name: method.handler.__name__ for name, method in app.methods.items()}


NAMESPACES = [
    "files",
    "ledger",
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
