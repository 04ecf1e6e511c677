"""Parameter and result shapes of the ``files.*`` methods.

Paths are UTF-8 strings of 1 to :data:`~protocol.rpc.types.MAX_PATH`
characters (:data:`~protocol.rpc.types.PathStr`); a relative path is resolved
against the daemon's working directory. Every integer and
byte string a client sends is bounded here so that decoding rejects absurd
values before a handler runs.

Streams: ``files.read`` sends file content on the stream named
:data:`DATA_STREAM` when the caller asks for it or when the content does not
fit in one reply; ``files.write`` with ``stream=True`` reads the client's bytes
from the same stream name.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from protocol.rpc import Rpc, Schema
from protocol.rpc.types import Offset, PathStr

MAX_INLINE_DATA: Final = 16 * 1024 * 1024
"""Largest ``data`` payload a ``files.write`` call may carry inline."""

MAX_LIST_LIMIT: Final = 10_000_000
"""Schema bound of ``files.list``'s ``limit``; the daemon clamps it further."""

DATA_STREAM: Final = "data"
"""Name of the stream that carries file content in both directions."""


Mode = Annotated[int, msgspec.Meta(ge=0, le=0o7777)]
Size = Offset
"""A byte count in a file: the bound of an offset."""
InlineData = Annotated[bytes, msgspec.Meta(max_length=MAX_INLINE_DATA)]
Digest = Annotated[str, msgspec.Meta(min_length=64, max_length=64, pattern="^[0-9a-f]{64}$")]
FileType = Literal["file", "dir", "symlink", "other"]


# -- files.read ------------------------------------------------------------------


class ReadParams(Schema):
    """Read ``length`` bytes (``None``: up to end of file) from ``offset``.

    ``max_bytes`` guards the caller: when the requested range holds more bytes
    the call fails with TOO_LARGE and ``data = {"size": ...}``. ``stream``
    forces the content onto the ``data`` stream even when it would fit inline;
    ``inline_max`` sends content of more bytes than that on the stream (a
    client that reads the stream keeps small content in one reply frame and
    large content off it, where chunks cost no copy).
    ``checksum`` asks for the SHA-256 of the bytes sent (it costs a pass over
    them on both sides, so it is off by default: TCP and the optional AEAD
    already protect the transfer).
    """

    path: PathStr
    offset: Size = 0
    length: Size | None = None
    max_bytes: Size | None = None
    stream: bool = False
    checksum: bool = False
    inline_max: Size | None = None


class ReadResult(Schema):
    """Outcome of ``files.read``.

    ``size`` is the file's size when it was opened; ``bytes_sent`` and
    ``sha256`` (present when ``checksum`` was asked) describe exactly the bytes delivered, inline in ``data`` or on
    the ``data`` stream (``streamed``). ``eof`` tells whether the read reached
    the end of the file.
    """

    size: Size
    bytes_sent: Size
    sha256: Digest | None = None
    data: bytes | None = None
    streamed: bool = False
    eof: bool = False


# -- files.write -----------------------------------------------------------------


class WriteParams(Schema):
    """Write ``data`` (or the client's ``data`` stream when ``stream``) to ``path``.

    ``atomic`` writes a temporary file beside the target and renames it over
    the target, so readers see the old or the new content, never a mix;
    ``append`` requires ``atomic=False``. An atomic write fsyncs the temporary
    before the rename, so after a crash the target holds the old content or the
    new, never a part; ``durable`` also fsyncs the directory after the rename
    (in plain mode: the file before the call returns), so that the new content
    survives a crash once the call has returned. ``mode`` sets the exact permission
    bits; without it an existing target keeps its mode. ``expected_size``
    makes the call fail unless exactly that many bytes arrive.
    """

    path: PathStr
    data: InlineData | None = None
    stream: bool = False
    create_parents: bool = False
    mode: Mode | None = None
    atomic: bool = True
    durable: bool = False
    append: bool = False
    expected_size: Size | None = None
    checksum: bool = False


class WriteResult(Schema):
    """How many bytes were written, and their SHA-256 (hex) when ``checksum`` was asked."""

    size: Size
    sha256: Digest | None = None


# -- files.stat ------------------------------------------------------------------


class StatParams(Schema):
    """Describe ``path``; with ``follow_symlinks=False`` a link describes itself."""

    path: PathStr
    follow_symlinks: bool = True


class StatResult(Schema):
    """Metadata of one path.

    ``mode`` holds the permission bits only (``st_mode & 0o7777``). ``target``
    is the link's content whenever ``path`` itself is a symbolic link.
    """

    type: FileType
    size: Size
    mode: Mode
    mtime: float
    mtime_ns: int
    uid: int
    gid: int
    target: str | None = None


# -- files.list ------------------------------------------------------------------


class ListParams(Schema):
    """List a directory; ``recursive`` descends without following symlinks.

    ``limit`` (default and ceiling: the daemon's ``max_list_entries``) caps
    the number of entries returned.
    """

    path: PathStr
    recursive: bool = False
    limit: Annotated[int, msgspec.Meta(ge=0, le=MAX_LIST_LIMIT)] | None = None
    include_hidden: bool = True


class ListEntry(Schema):
    """One entry, ``path`` relative to the listed directory with ``/`` separators."""

    path: str
    type: FileType
    size: Size
    mtime: float
    mode: Mode


class ListResult(Schema):
    """The entries in depth-first, name-sorted order.

    ``truncated`` is set when more entries exist than were returned (the limit
    was hit, or the reply would not fit in one frame). ``unreadable`` names
    subdirectories that could not be opened (at most a bounded few), and
    ``skipped`` counts entries left out because their names are not UTF-8.
    """

    entries: list[ListEntry]
    truncated: bool = False
    unreadable: list[str] = msgspec.field(default_factory=list)
    skipped: int = 0


# -- files.mkdir -----------------------------------------------------------------


class MkdirParams(Schema):
    """Create a directory (and its parents when ``parents``).

    ``mode`` sets the new directory's exact permission bits; without it the
    usual ``0o777`` filtered by the daemon's umask applies.
    """

    path: PathStr
    parents: bool = True
    exist_ok: bool = True
    mode: Mode | None = None


class MkdirResult(Schema):
    """``created`` is false when the directory already existed."""

    created: bool


# -- files.remove ----------------------------------------------------------------


class RemoveParams(Schema):
    """Remove a file, symlink or directory (non-empty ones need ``recursive``)."""

    path: PathStr
    recursive: bool = False
    missing_ok: bool = False


class RemoveResult(Schema):
    """``removed`` is false when the path did not exist (and ``missing_ok``)."""

    removed: bool


# -- files.move ------------------------------------------------------------------


class MoveParams(Schema):
    """Rename ``src`` to ``dst`` (``dst`` is the new name, never a parent to move into).

    Across filesystems the content is copied beside ``dst``, renamed into
    place and ``src`` removed afterwards.
    """

    src: PathStr
    dst: PathStr
    overwrite: bool = True


class MoveResult(Schema):
    """``copied`` is set when the move crossed filesystems and copied data."""

    copied: bool = False


# -- files.chmod -----------------------------------------------------------------


class ChmodParams(Schema):
    """Set the permission bits of ``path`` (symlinks are followed)."""

    path: PathStr
    mode: Mode


class ChmodResult(Schema):
    """The permission bits after the change."""

    mode: Mode


# -- files.sha256 ----------------------------------------------------------------


class Sha256Params(Schema):
    """Hash the content of a regular file."""

    path: PathStr


class Sha256Result(Schema):
    """Hex SHA-256 of the content and the number of bytes hashed."""

    sha256: Digest
    size: Size


# -- the methods --------------------------------------------------------------
READ: Final = Rpc("files.read", ReadParams, ReadResult)
WRITE: Final = Rpc("files.write", WriteParams, WriteResult)
STAT: Final = Rpc("files.stat", StatParams, StatResult)
LIST: Final = Rpc("files.list", ListParams, ListResult)
MKDIR: Final = Rpc("files.mkdir", MkdirParams, MkdirResult)
REMOVE: Final = Rpc("files.remove", RemoveParams, RemoveResult)
MOVE: Final = Rpc("files.move", MoveParams, MoveResult)
CHMOD: Final = Rpc("files.chmod", ChmodParams, ChmodResult)
SHA256: Final = Rpc("files.sha256", Sha256Params, Sha256Result)

RPCS: Final = (READ, WRITE, STAT, LIST, MKDIR, REMOVE, MOVE, CHMOD, SHA256)
