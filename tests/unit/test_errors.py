"""One source for errors: wire codes, execd's classes, the client's generated classes."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import harnessd
from execd import context as execd_context
from execd import errors as execd_errors
from harnessd import errors as client_errors
from protocol import errors as protocol_errors
from protocol.errors import ErrorCode

ROOT = Path(__file__).resolve().parents[2]
CALL_CODES = [code for code in ErrorCode if code >= 100]


def _declared(module: object, base: type, attribute: str) -> dict[int, list[type]]:
    """Code -> the classes of ``module`` derived from ``base`` that declare it themselves."""
    found: dict[int, list[type]] = {}
    for value in vars(module).values():
        if (
            isinstance(value, type)
            and issubclass(value, base)
            and value is not base
            and value.__module__ == getattr(module, "__name__", None)
            and attribute in vars(value)
        ):
            found.setdefault(int(vars(value)[attribute]), []).append(value)
    return found


@pytest.mark.parametrize("code", CALL_CODES, ids=lambda code: code.name)
def test_every_call_code_has_exactly_one_execd_class(code: ErrorCode) -> None:
    classes = _declared(execd_errors, execd_errors.ExecdError, "code").get(int(code), [])
    assert len(classes) == 1, (code, classes)


@pytest.mark.parametrize("code", CALL_CODES, ids=lambda code: code.name)
def test_every_call_code_arrives_as_its_own_named_class(code: ErrorCode) -> None:
    exc = client_errors.remote_error(int(code), "boom", {"k": 1})
    cls = type(exc)
    assert cls is not client_errors.RemoteError, f"{code.name} arrives as a bare RemoteError"
    assert vars(cls)["default_code"] == code
    assert (exc.code, exc.message, exc.data) == (int(code), "boom", {"k": 1})
    # Same name as execd's class, reachable as harnessd.<Name>.
    (source,) = _declared(execd_errors, execd_errors.ExecdError, "code")[int(code)]
    assert cls.__name__ == source.__name__
    assert getattr(harnessd, cls.__name__) is cls
    assert isinstance(exc, harnessd.HarnessError)


def test_client_classes_mirror_execd_nesting_and_docs() -> None:
    execd_classes = {
        name: value
        for name, value in vars(execd_errors).items()
        if isinstance(value, type)
        and issubclass(value, execd_errors.ExecdError)
        and value is not execd_errors.ExecdError
    }
    for name, source in execd_classes.items():
        mirror = getattr(client_errors, name)
        parent = source.__bases__[0]
        expected = (
            client_errors.RemoteError
            if parent is execd_errors.ExecdError
            else getattr(client_errors, parent.__name__)
        )
        assert mirror.__bases__ == (expected,), name
        assert inspect.getdoc(mirror) == inspect.getdoc(source), name
    # A file error is caught as a FileError and a service error as a ServiceError.
    assert isinstance(client_errors.remote_error(ErrorCode.NOT_FOUND, "x"), harnessd.FileError)
    assert isinstance(client_errors.remote_error(ErrorCode.NOT_READY, "x"), harnessd.ServiceError)


def test_generated_block_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "generate_errors.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_unknown_code_keeps_its_number() -> None:
    exc = client_errors.remote_error(999, "from a newer execd")
    assert type(exc) is client_errors.RemoteError and exc.code == 999


def test_one_connection_lost_class() -> None:
    lost = protocol_errors.ConnectionLost
    assert harnessd.ConnectionLost is lost
    assert client_errors.ConnectionLost is lost
    assert execd_context.ConnectionLost is lost
    assert issubclass(lost, harnessd.HarnessError)
    named = [
        value
        for module in (protocol_errors, execd_errors, client_errors, execd_context)
        for value in vars(module).values()
        if isinstance(value, type) and value.__name__ == "ConnectionLost"
    ]
    assert set(named) == {lost}


def test_protocol_error_is_the_common_base() -> None:
    assert issubclass(protocol_errors.LocalProtocolError, protocol_errors.ProtocolError)
    assert issubclass(protocol_errors.RemoteProtocolError, protocol_errors.ProtocolError)
    assert issubclass(protocol_errors.FlowControlBlocked, protocol_errors.LocalProtocolError)
    for value in vars(protocol_errors).values():
        if (
            isinstance(value, type)
            and issubclass(value, protocol_errors.ProtocolError)
            and value
            not in (
                protocol_errors.ProtocolError,
                protocol_errors.LocalProtocolError,
                protocol_errors.RemoteProtocolError,
                protocol_errors.FlowControlBlocked,
            )
        ):
            assert issubclass(value, protocol_errors.RemoteProtocolError), value
            assert vars(value)["code"] < 100, value
    assert not issubclass(protocol_errors.LocalProtocolError, protocol_errors.RemoteProtocolError)


def test_every_error_class_is_exported_from_harnessd() -> None:
    for name in client_errors.__all__:
        assert getattr(harnessd, name) is getattr(client_errors, name)
        assert name in harnessd.__all__
    readme = (ROOT / "README.md").read_text()
    for name in (
        "NotFound",
        "PermissionDenied",
        "LedgerConflict",
        "ConnectionLost",
        "LaunchFailed",
    ):
        assert f"`{name}`" in readme
        assert issubclass(getattr(harnessd, name), harnessd.HarnessError)
