"""execd's error hierarchy: every failure a handler raises maps to one wire code.

A handler raises an :class:`ExecdError`; the dispatcher turns it into an Error
reply carrying ``code``, ``message`` and ``data``. Anything else a handler
raises is a bug: it becomes ``INTERNAL`` with a generic message (the details go
to the log, never to the peer), and the connection lives on.
"""

from __future__ import annotations

import errno
from typing import Any, ClassVar

from protocol.errors import ErrorCode


class ExecdError(Exception):
    """Base of every error execd reports to a client."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


class InvalidParams(ExecdError):
    code = ErrorCode.INVALID_PARAMS


class UnknownMethod(ExecdError):
    code = ErrorCode.UNKNOWN_METHOD


class Cancelled(ExecdError):
    code = ErrorCode.CANCELLED


class TooManyCalls(ExecdError):
    code = ErrorCode.TOO_MANY_CALLS


class LimitExceeded(ExecdError):
    code = ErrorCode.LIMIT_EXCEEDED


class OperationTimeout(ExecdError):
    code = ErrorCode.TIMEOUT


class NotSupported(ExecdError):
    code = ErrorCode.NOT_SUPPORTED


class ShuttingDown(ExecdError):
    code = ErrorCode.SHUTTING_DOWN


class StreamError(ExecdError):
    code = ErrorCode.STREAM_ERROR


# -- files --------------------------------------------------------------------


class FileError(ExecdError):
    code = ErrorCode.IO_ERROR


class NotFound(FileError):
    code = ErrorCode.NOT_FOUND


class IsADirectory(FileError):
    code = ErrorCode.IS_A_DIRECTORY


class NotADirectory(FileError):
    code = ErrorCode.NOT_A_DIRECTORY


class PermissionDenied(FileError):
    code = ErrorCode.PERMISSION_DENIED


class TooLarge(FileError):
    code = ErrorCode.TOO_LARGE


class NoSpace(FileError):
    code = ErrorCode.NO_SPACE


class AlreadyExists(FileError):
    code = ErrorCode.EXISTS


class NotEmpty(FileError):
    code = ErrorCode.NOT_EMPTY


class InvalidPath(FileError):
    code = ErrorCode.INVALID_PATH


class ReadOnly(FileError):
    code = ErrorCode.READ_ONLY


class CrossDevice(FileError):
    code = ErrorCode.CROSS_DEVICE


# -- processes ----------------------------------------------------------------


class SpawnFailed(ExecdError):
    code = ErrorCode.SPAWN_FAILED


class NoSuchProcess(ExecdError):
    code = ErrorCode.NO_SUCH_PROCESS


class ProcessLimit(ExecdError):
    code = ErrorCode.PROCESS_LIMIT


class AlreadyExited(ExecdError):
    code = ErrorCode.ALREADY_EXITED


class AlreadyAttached(ExecdError):
    code = ErrorCode.ALREADY_ATTACHED


# -- services -----------------------------------------------------------------


class ServiceExists(ExecdError):
    code = ErrorCode.SERVICE_EXISTS


class NoSuchService(ExecdError):
    code = ErrorCode.NO_SUCH_SERVICE


class ServiceFailed(ExecdError):
    code = ErrorCode.SERVICE_FAILED


class NotReady(ExecdError):
    code = ErrorCode.NOT_READY


# -- watches ------------------------------------------------------------------


class NoSuchWatch(ExecdError):
    code = ErrorCode.NO_SUCH_WATCH


class WatchLimit(ExecdError):
    code = ErrorCode.WATCH_LIMIT


# -- ledger -------------------------------------------------------------------


class LedgerConflict(ExecdError):
    """An append did not continue the ledger; ``data`` carries the current head."""

    code = ErrorCode.LEDGER_CONFLICT


class NoSuchLedger(ExecdError):
    code = ErrorCode.NO_SUCH_LEDGER


class LedgerCorrupt(ExecdError):
    code = ErrorCode.LEDGER_CORRUPT


class EntryTooLarge(ExecdError):
    code = ErrorCode.ENTRY_TOO_LARGE


# -- persistent shell sessions -------------------------------------------------


class NoSuchSession(ExecdError):
    code = ErrorCode.NO_SUCH_SESSION


class SessionExists(ExecdError):
    code = ErrorCode.SESSION_EXISTS


class SessionBusy(ExecdError):
    code = ErrorCode.SESSION_BUSY


class SessionDead(ExecdError):
    code = ErrorCode.SESSION_DEAD


_ERRNO_MAP: dict[int, type[FileError]] = {
    errno.ENOENT: NotFound,
    errno.EISDIR: IsADirectory,
    errno.ENOTDIR: NotADirectory,
    errno.EACCES: PermissionDenied,
    errno.EPERM: PermissionDenied,
    errno.ENOSPC: NoSpace,
    errno.EDQUOT: NoSpace,
    errno.EFBIG: TooLarge,
    errno.EEXIST: AlreadyExists,
    errno.ENOTEMPTY: NotEmpty,
    errno.ENAMETOOLONG: InvalidPath,
    errno.ELOOP: InvalidPath,
    errno.EINVAL: InvalidPath,
    errno.EROFS: ReadOnly,
    errno.EXDEV: CrossDevice,
}


def from_oserror(exc: OSError, path: str | None = None) -> FileError:
    """Translate an OSError into the matching typed :class:`FileError`.

    The message names the path and the condition; ``data`` carries the errno
    name so a client can tell, for example, EDQUOT from ENOSPC.
    """
    cls = _ERRNO_MAP.get(exc.errno or 0, FileError)
    name = errno.errorcode.get(exc.errno or 0, "EIO")
    where = path if path is not None else (exc.filename or "")
    reason = exc.strerror or name
    message = f"{reason}: {where}" if where else reason
    return cls(message, {"errno": name, "path": str(where)})
