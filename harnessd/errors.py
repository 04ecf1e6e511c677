"""harnessd's error hierarchy.

Everything the client library raises derives from :class:`HarnessError`.
Errors execd reports for a call arrive as a :class:`RemoteError` subclass
chosen by the stable wire code (:func:`remote_error`), so callers can write
``except NotFound:``; a code without its own class still arrives as a
RemoteError carrying ``code``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from protocol.errors import ErrorCode


class HarnessError(Exception):
    """Base of every harnessd error."""


class ConnectionLost(HarnessError):
    """The connection to execd is gone (closed, reset, or silent past the keepalive)."""


class ConnectFailed(HarnessError):
    """No connection could be made to execd."""


class HandshakeFailed(HarnessError):
    """The handshake did not complete; ``code`` is the wire code when known."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class AuthenticationFailed(HandshakeFailed):
    """One side could not prove knowledge of the token (wrong token)."""


class ProtocolViolation(HarnessError):
    """execd broke the protocol, or closed the connection with an Abort."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class LaunchFailed(HarnessError):
    """execd could not be started in the workspace; the message carries its log tail."""


class RemoteError(HarnessError):
    """A call failed in execd with a stable wire ``code``."""

    default_code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str, code: int | None = None, data: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else int(self.default_code)
        self.data = data


class UnknownMethod(RemoteError):
    default_code = ErrorCode.UNKNOWN_METHOD


class InvalidParams(RemoteError):
    default_code = ErrorCode.INVALID_PARAMS


class Cancelled(RemoteError):
    default_code = ErrorCode.CANCELLED


class TooManyCalls(RemoteError):
    default_code = ErrorCode.TOO_MANY_CALLS


class LimitExceeded(RemoteError):
    default_code = ErrorCode.LIMIT_EXCEEDED


class RemoteTimeout(RemoteError):
    default_code = ErrorCode.TIMEOUT


class InternalError(RemoteError):
    default_code = ErrorCode.INTERNAL


class FileError(RemoteError):
    default_code = ErrorCode.IO_ERROR


class NotFound(FileError):
    default_code = ErrorCode.NOT_FOUND


class IsADirectory(FileError):
    default_code = ErrorCode.IS_A_DIRECTORY


class NotADirectory(FileError):
    default_code = ErrorCode.NOT_A_DIRECTORY


class PermissionDenied(FileError):
    default_code = ErrorCode.PERMISSION_DENIED


class TooLarge(FileError):
    default_code = ErrorCode.TOO_LARGE


class NoSpace(FileError):
    default_code = ErrorCode.NO_SPACE


class AlreadyExists(FileError):
    default_code = ErrorCode.EXISTS


class NotEmpty(FileError):
    default_code = ErrorCode.NOT_EMPTY


class InvalidPath(FileError):
    default_code = ErrorCode.INVALID_PATH


class SpawnFailed(RemoteError):
    default_code = ErrorCode.SPAWN_FAILED


class NoSuchProcess(RemoteError):
    default_code = ErrorCode.NO_SUCH_PROCESS


class ProcessLimit(RemoteError):
    default_code = ErrorCode.PROCESS_LIMIT


class ServiceError(RemoteError):
    default_code = ErrorCode.SERVICE_FAILED


class ServiceFailed(ServiceError):
    """A service died before it became ready; ``data`` carries its log tail and exit status."""

    default_code = ErrorCode.SERVICE_FAILED


class NoSuchService(ServiceError):
    default_code = ErrorCode.NO_SUCH_SERVICE


class ServiceExists(ServiceError):
    default_code = ErrorCode.SERVICE_EXISTS


class NotReady(ServiceError):
    default_code = ErrorCode.NOT_READY


class WatchLimit(RemoteError):
    default_code = ErrorCode.WATCH_LIMIT


class NoSuchWatch(RemoteError):
    default_code = ErrorCode.NO_SUCH_WATCH


class LedgerConflict(RemoteError):
    """An append did not continue execd's ledger; ``data`` holds execd's head."""

    default_code = ErrorCode.LEDGER_CONFLICT


class LedgerCorrupt(RemoteError):
    default_code = ErrorCode.LEDGER_CORRUPT


class NoSuchSession(RemoteError):
    default_code = ErrorCode.NO_SUCH_SESSION


class SessionExists(RemoteError):
    default_code = ErrorCode.SESSION_EXISTS


class SessionBusy(RemoteError):
    default_code = ErrorCode.SESSION_BUSY


class SessionDead(RemoteError):
    default_code = ErrorCode.SESSION_DEAD


_BY_CODE: dict[int, type[RemoteError]] = {
    int(cls.default_code): cls
    for cls in (
        UnknownMethod,
        InvalidParams,
        Cancelled,
        TooManyCalls,
        LimitExceeded,
        RemoteTimeout,
        InternalError,
        FileError,
        NotFound,
        IsADirectory,
        NotADirectory,
        PermissionDenied,
        TooLarge,
        NoSpace,
        AlreadyExists,
        NotEmpty,
        InvalidPath,
        SpawnFailed,
        NoSuchProcess,
        ProcessLimit,
        ServiceFailed,
        NoSuchService,
        ServiceExists,
        NotReady,
        WatchLimit,
        NoSuchWatch,
        LedgerConflict,
        LedgerCorrupt,
        NoSuchSession,
        SessionExists,
        SessionBusy,
        SessionDead,
    )
}


def remote_error(code: int, message: str, data: Any = None) -> RemoteError:
    """The typed exception for an Error reply with ``code``."""
    cls = _BY_CODE.get(code, RemoteError)
    return cls(message, code, data)
