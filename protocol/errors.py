"""Wire error codes and the protocol error hierarchy.

This module is the one home of every numeric error code that crosses the wire.
Codes are stable: a code, once published in PROTOCOL.md, never changes meaning.
Ranges:

* 1-99: connection-level protocol violations (the connection is closed);
* 100-199: call-level failures (the call fails, the connection lives on);
* 200-299: files and paths;
* 300-399: processes and commands;
* 400-499: services;
* 500-599: path watches;
* 600-699: the session ledger;
* 700-799: persistent shell sessions.

The exception classes here are the root of every hierarchy in the project
(h11's shape)::

    SplitexecError
    +-- ConnectionLost                 the connection is gone (both ends)
    +-- ProtocolError                  a protocol violation, with its ``code``
    |   +-- LocalProtocolError         this side asked for something forbidden
    |   +-- RemoteProtocolError        the peer broke the protocol (Abort, close)
    +-- execd.errors.ExecdError        a failed call, one class per code >= 100
    +-- harnessd.errors.RemoteError    the same classes as the client sees them,
                                       generated from execd's (tools/generate_errors.py)
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Every stable numeric error code of the protocol."""

    # -- connection level: the sender closes the connection after an Abort --
    PROTOCOL_ERROR = 1
    FRAME_TOO_LARGE = 2
    MALFORMED_MESSAGE = 3
    UNKNOWN_MESSAGE_TYPE = 4
    INVALID_MESSAGE = 5
    UNEXPECTED_MESSAGE = 6
    AUTH_FAILED = 7
    VERSION_MISMATCH = 8
    DECRYPT_FAILED = 9
    FLOW_CONTROL_VIOLATION = 10
    HANDSHAKE_TIMEOUT = 11
    DUPLICATE_CALL_ID = 12
    UNSUPPORTED_CIPHER = 13
    CONNECTION_LIMIT = 14
    GOING_AWAY = 15

    # -- call level: an Error reply, the connection survives --
    UNKNOWN_METHOD = 100
    INVALID_PARAMS = 101
    CANCELLED = 102
    TOO_MANY_CALLS = 103
    LIMIT_EXCEEDED = 104
    TIMEOUT = 105
    INTERNAL = 106
    NOT_SUPPORTED = 107
    SHUTTING_DOWN = 108
    STREAM_ERROR = 109

    # -- files and paths --
    NOT_FOUND = 200
    IS_A_DIRECTORY = 201
    NOT_A_DIRECTORY = 202
    PERMISSION_DENIED = 203
    TOO_LARGE = 204
    NO_SPACE = 205
    EXISTS = 206
    NOT_EMPTY = 207
    INVALID_PATH = 208
    IO_ERROR = 209
    READ_ONLY = 210
    CROSS_DEVICE = 211

    # -- processes and commands --
    SPAWN_FAILED = 300
    NO_SUCH_PROCESS = 301
    PROCESS_LIMIT = 302
    ALREADY_EXITED = 303
    ALREADY_ATTACHED = 304

    # -- services --
    SERVICE_EXISTS = 400
    NO_SUCH_SERVICE = 401
    SERVICE_FAILED = 402
    NOT_READY = 403

    # -- path watches --
    NO_SUCH_WATCH = 500
    WATCH_LIMIT = 501

    # -- session ledger --
    LEDGER_CONFLICT = 600
    LEDGER_CORRUPT = 602
    ENTRY_TOO_LARGE = 603

    # -- persistent shell sessions --
    NO_SUCH_SESSION = 700
    SESSION_EXISTS = 701
    SESSION_BUSY = 702
    SESSION_DEAD = 703

    # -- request ids (calls that outlive their connection) --
    REQUEST_NOT_KNOWN = 800


class SplitexecError(Exception):
    """Base of every exception the splitexec packages define.

    ``harnessd.HarnessError`` is this class under the client's name; execd's
    ``execd.errors.ExecdError``, the protocol errors below and
    :class:`ConnectionLost` all derive from it.
    """


class ConnectionLost(SplitexecError):
    """The connection is gone (closed, reset, or silent past the keepalive).

    The one class for this condition at both ends: calls in flight on the
    client fail with it, and execd's handlers get it when they send on a
    connection that has closed. The glue raises it at its one edge
    (:meth:`protocol.bridge.FramedProtocol.send` and the stream reads).
    """


class ProtocolError(SplitexecError):
    """Base of protocol violations, by either side.

    :class:`RemoteProtocolError`: the peer broke the protocol, and the
    connection must be closed. :class:`LocalProtocolError`: this side asked
    for something the protocol forbids (a caller bug); nothing was sent.
    ``code`` is the wire code that names the violation. Messages never contain
    secrets.
    """

    code: ErrorCode = ErrorCode.PROTOCOL_ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class LocalProtocolError(ProtocolError):
    """This side tried to do something the protocol forbids (a caller bug).

    Raised by the state machines when asked to send a message that is not
    allowed in the current state or beyond the stream credit. The connection
    is left untouched.
    """


class FlowControlBlocked(LocalProtocolError):
    """A chunk is larger than the credit the peer has granted for its stream."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; the connection must be closed.

    ``code`` is the wire code sent in the Abort message before closing.
    """


class FrameTooLarge(RemoteProtocolError):
    """A frame header declared a body longer than the receiver's cap."""

    code = ErrorCode.FRAME_TOO_LARGE


class MalformedMessage(RemoteProtocolError):
    """A frame body is not valid msgpack."""

    code = ErrorCode.MALFORMED_MESSAGE


class UnknownMessageType(RemoteProtocolError):
    """A frame body carries a tag this implementation does not know."""

    code = ErrorCode.UNKNOWN_MESSAGE_TYPE


class InvalidMessage(RemoteProtocolError):
    """A known message has a missing or wrongly typed field."""

    code = ErrorCode.INVALID_MESSAGE


class UnexpectedMessage(RemoteProtocolError):
    """A valid message arrived in a state where it is not allowed."""

    code = ErrorCode.UNEXPECTED_MESSAGE


class AuthenticationFailed(RemoteProtocolError):
    """The peer did not prove knowledge of the shared token."""

    code = ErrorCode.AUTH_FAILED


class VersionMismatch(RemoteProtocolError):
    """The two sides share no protocol version."""

    code = ErrorCode.VERSION_MISMATCH


class UnsupportedCipher(RemoteProtocolError):
    """The two sides share no acceptable frame protection."""

    code = ErrorCode.UNSUPPORTED_CIPHER


class DecryptionFailed(RemoteProtocolError):
    """An encrypted frame failed authentication (tampered, replayed or reordered)."""

    code = ErrorCode.DECRYPT_FAILED


class FlowControlViolation(RemoteProtocolError):
    """The peer sent more stream bytes than it had credit for."""

    code = ErrorCode.FLOW_CONTROL_VIOLATION


class DuplicateCallId(RemoteProtocolError):
    """The peer reused the id of a call that is still in flight."""

    code = ErrorCode.DUPLICATE_CALL_ID
