"""execd's error hierarchy: every failure a handler raises maps to one wire code.

A handler raises an :class:`ExecdError`; the dispatcher turns it into an Error
reply carrying ``code``, ``message`` and ``data``. Anything else a handler
raises is a bug: it becomes ``INTERNAL`` with a generic message (the details go
to the log, never to the peer), and the connection lives on.

These classes are the one source of the call-level errors: every wire code from
100 up has exactly one class here that declares it, and the client's classes
(``harnessd.errors``) are generated from them by ``tools/generate_errors.py``,
names, nesting and docstrings included. A docstring therefore says what the
condition is, from either end.
"""

from __future__ import annotations

import errno
from typing import Any, ClassVar

from protocol.errors import ErrorCode, SplitexecError


class ExecdError(SplitexecError):
    """Base of every error execd reports to a client."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


class UnknownMethod(ExecdError):
    """No method of that name."""

    code = ErrorCode.UNKNOWN_METHOD


class InvalidParams(ExecdError):
    """The params do not match the method's schema, or are inconsistent."""

    code = ErrorCode.INVALID_PARAMS


class Cancelled(ExecdError):
    """The call was cancelled (by the client, or by execd shutting down its work)."""

    code = ErrorCode.CANCELLED


class TooManyCalls(ExecdError):
    """More calls in flight on this connection than execd allows."""

    code = ErrorCode.TOO_MANY_CALLS


class LimitExceeded(ExecdError):
    """A configured limit of execd was reached."""

    code = ErrorCode.LIMIT_EXCEEDED


class OperationTimeout(ExecdError):
    """The operation's time limit passed."""

    code = ErrorCode.TIMEOUT


class InternalError(ExecdError):
    """An unexpected failure in execd (the details are only in its log)."""

    code = ErrorCode.INTERNAL


class NotSupported(ExecdError):
    """The operation is not supported here."""

    code = ErrorCode.NOT_SUPPORTED


class ShuttingDown(ExecdError):
    """execd is shutting down and takes no new work."""

    code = ErrorCode.SHUTTING_DOWN


class StreamError(ExecdError):
    """A stream of the call broke or did not match what the call announced."""

    code = ErrorCode.STREAM_ERROR


# -- files --------------------------------------------------------------------


class FileError(ExecdError):
    """Any other file-system error; ``data`` carries the errno name and the path."""

    code = ErrorCode.IO_ERROR


class NotFound(FileError):
    """No such file or directory (ENOENT)."""

    code = ErrorCode.NOT_FOUND


class IsADirectory(FileError):
    """The path is a directory (EISDIR)."""

    code = ErrorCode.IS_A_DIRECTORY


class NotADirectory(FileError):
    """A path component is not a directory (ENOTDIR)."""

    code = ErrorCode.NOT_A_DIRECTORY


class PermissionDenied(FileError):
    """Permission denied (EACCES, EPERM)."""

    code = ErrorCode.PERMISSION_DENIED


class TooLarge(FileError):
    """Content larger than allowed (EFBIG, a caller's bound, a frame)."""

    code = ErrorCode.TOO_LARGE


class NoSpace(FileError):
    """No space or quota left (ENOSPC, EDQUOT)."""

    code = ErrorCode.NO_SPACE


class AlreadyExists(FileError):
    """The path already exists (EEXIST)."""

    code = ErrorCode.EXISTS


class NotEmpty(FileError):
    """The directory is not empty (ENOTEMPTY)."""

    code = ErrorCode.NOT_EMPTY


class InvalidPath(FileError):
    """An unusable path (ENAMETOOLONG, ELOOP, EINVAL)."""

    code = ErrorCode.INVALID_PATH


class ReadOnly(FileError):
    """Read-only file system (EROFS)."""

    code = ErrorCode.READ_ONLY


class CrossDevice(FileError):
    """The operation cannot cross file systems (EXDEV)."""

    code = ErrorCode.CROSS_DEVICE


# -- processes ----------------------------------------------------------------


class SpawnFailed(ExecdError):
    """The command could not be started; ``data`` says what failed (errno, what)."""

    code = ErrorCode.SPAWN_FAILED


class NoSuchProcess(ExecdError):
    """No such command or process."""

    code = ErrorCode.NO_SUCH_PROCESS


class ProcessLimit(ExecdError):
    """Too many commands or processes."""

    code = ErrorCode.PROCESS_LIMIT


class AlreadyExited(ExecdError):
    """The command has already exited."""

    code = ErrorCode.ALREADY_EXITED


class AlreadyAttached(ExecdError):
    """Another client is attached to the command."""

    code = ErrorCode.ALREADY_ATTACHED


# -- services -----------------------------------------------------------------


class ServiceError(ExecdError):
    """Base of the background service errors (a category: it declares no code)."""


class ServiceFailed(ServiceError):
    """A service died before it became ready; ``data`` carries its log tail and exit status."""

    code = ErrorCode.SERVICE_FAILED


class ServiceExists(ServiceError):
    """A service of that name exists."""

    code = ErrorCode.SERVICE_EXISTS


class NoSuchService(ServiceError):
    """No service of that name."""

    code = ErrorCode.NO_SUCH_SERVICE


class NotReady(ServiceError):
    """The service or resource is not ready."""

    code = ErrorCode.NOT_READY


# -- watches ------------------------------------------------------------------


class NoSuchWatch(ExecdError):
    """No such watch on this connection."""

    code = ErrorCode.NO_SUCH_WATCH


class WatchLimit(ExecdError):
    """The watch limit is reached."""

    code = ErrorCode.WATCH_LIMIT


# -- ledger -------------------------------------------------------------------


class LedgerConflict(ExecdError):
    """The append does not continue the ledger's head; ``data`` is the current head."""

    code = ErrorCode.LEDGER_CONFLICT


class LedgerCorrupt(ExecdError):
    """The stored ledger failed verification."""

    code = ErrorCode.LEDGER_CORRUPT


class EntryTooLarge(ExecdError):
    """A ledger entry exceeds its announced or maximal size."""

    code = ErrorCode.ENTRY_TOO_LARGE


# -- persistent shell sessions -------------------------------------------------


class NoSuchSession(ExecdError):
    """No such persistent shell session."""

    code = ErrorCode.NO_SUCH_SESSION


class SessionExists(ExecdError):
    """A persistent shell session of that name exists."""

    code = ErrorCode.SESSION_EXISTS


class SessionBusy(ExecdError):
    """The persistent shell session is running something."""

    code = ErrorCode.SESSION_BUSY


class SessionDead(ExecdError):
    """The persistent shell session has exited."""

    code = ErrorCode.SESSION_DEAD


# -- request ids ----------------------------------------------------------------


class RequestNotKnown(ExecdError):
    """execd does not know the request id: never seen (or execd restarted), or evicted.

    ``data`` says which (``{"reason": "unknown" | "evicted", "rid": <hex>}``);
    either way the call it names will not run again.
    """

    code = ErrorCode.REQUEST_NOT_KNOWN


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
