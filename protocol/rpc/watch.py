"""Parameter, result and pushed-event shapes of the ``watch.*`` methods.

``watch.subscribe`` returns a ``watch_id``; from then on the daemon pushes
events on that connection with ``topic = watch_id``, ``name`` = the event kind
and ``data`` = a :class:`WatchEvent`. Events can arrive before the subscribe
reply has been read: clients key them by topic.

Change kinds (selectable with ``events``; default all):

* ``created``, ``deleted``: an entry appeared or went away;
* ``modified``: a file's content was written;
* ``closed_write``: a file opened for writing was closed;
* ``attrib``: metadata changed (mode, owner, times, link count);
* ``moved``: a rename, paired by the kernel's cookie into one event with
  ``from_path`` and ``to_path``. A rename with only one side inside the watch
  is still ``moved``, with the other side absent: ``to_path`` missing means
  the entry moved out of the watch, ``from_path`` missing means it moved in.
  ``path`` is ``to_path`` when present, else ``from_path``. A move out of
  the watch is only known to be unpaired after a short grace period (tens of
  milliseconds), so it can be reported after events that followed it.

Control kinds (always delivered, whatever ``events`` says):

* ``root_deleted``: the watched path itself was deleted, moved away or
  unmounted (``reason``); ``ended`` follows;
* ``ended``: the last event of a subscription (``reason``: ``root_deleted``,
  ``unsubscribed`` or ``shutdown``);
* ``overflow``: events were lost. ``source = "queue"``: this subscriber's
  bounded queue was full and ``dropped`` events were discarded;
  ``source = "kernel"``: the daemon's inotify queue overflowed (count
  unknown) and every subscription got this event. Rescan after either;
* ``watch_limit``: a directory that appeared under a recursive watch could
  not be watched because the inotify watch limit is reached (``path``);
* ``watch_failed``: the same for another reason (``reason`` is the errno name,
  for example ``EACCES``).

A watch on a single file follows that file's inode: deleting it, or saving
over it by renaming another file onto its name (as many editors do), ends the
watch with ``root_deleted``; watch the directory to follow such files.

Paths in events are absolute, built from the subscribed path as given (made
absolute against the daemon's working directory and normalised), not resolved
through symlinks.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, get_args

import msgspec

from protocol import limits
from protocol.rpc import Rpc, Schema
from protocol.rpc.types import PathStr

MAX_DEBOUNCE: Final = 3600.0
"""Longest debounce window, in seconds."""

MAX_WAIT: Final = 7 * 24 * 3600.0
"""Longest ``watch.wait_for_path`` timeout, in seconds."""

MAX_UNWATCHED_REPORTED: Final = 64
"""At most this many unwatchable paths are listed in a subscribe result."""


ChangeKind = Literal["created", "modified", "closed_write", "deleted", "moved", "attrib"]
ControlKind = Literal["root_deleted", "ended", "overflow", "watch_limit", "watch_failed"]
Condition = Literal["exists", "absent", "file", "dir", "nonempty"]

CHANGE_KINDS: Final[tuple[str, ...]] = get_args(ChangeKind)

WatchId = Annotated[int, msgspec.Meta(ge=1, le=limits.MAX_U63)]


# -- watch.subscribe ------------------------------------------------------------------


class SubscribeParams(Schema):
    """Watch ``path`` (a directory, or a single file or symlink).

    ``recursive``: also watch every directory below, including directories
    created or moved in later (their existing entries are reported as
    ``created``). Symlinks below the root are never descended.
    ``events``: the change kinds wanted (``None``: all).
    ``debounce``: seconds; when positive, repeats of the same kind for the same
    path within the window are delivered once, ``debounce`` seconds after the
    first, with ``count`` telling how many were merged (a ``created``,
    ``deleted`` or ``moved`` for the path ends the merging, so the order of
    structural changes is kept).
    ``follow``: when ``path`` is a symlink, watch its target (``True``) or the
    link itself (``False``).
    """

    path: PathStr
    recursive: bool = False
    events: Annotated[list[ChangeKind], msgspec.Meta(min_length=1, max_length=16)] | None = None
    debounce: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DEBOUNCE)] = 0.0
    follow: bool = True


class SubscribeResult(Schema):
    """The new subscription.

    ``watched`` counts the inotify watches it holds (1 unless recursive).
    ``unwatched`` lists (up to :data:`MAX_UNWATCHED_REPORTED`) directories of a
    recursive watch that could not be watched (for example, unreadable);
    ``unwatched_count`` counts them all.
    """

    watch_id: WatchId
    watched: int
    unwatched: list[str] = msgspec.field(default_factory=list)
    unwatched_count: int = 0


# -- watch.unsubscribe ---------------------------------------------------------------


class UnsubscribeParams(Schema):
    """End subscription ``watch_id`` (of this connection).

    Events still queued are discarded; an ``ended`` event (``reason =
    "unsubscribed"``) is pushed before the reply and nothing after it. An id
    that is unknown, belongs to another connection or has already ended fails
    with NO_SUCH_WATCH.
    """

    watch_id: WatchId


class UnsubscribeResult(Schema):
    """The subscription that ended."""

    watch_id: WatchId


# -- watch.wait_for_path ---------------------------------------------------------------


class WaitForPathParams(Schema):
    """Wait until ``condition`` holds for ``path``, at most ``timeout`` seconds.

    Conditions follow symlinks, like ``test -e/-f/-d``: ``exists``; ``absent``;
    ``file`` (a regular file); ``dir``; ``nonempty`` (a regular file of size > 0
    or a directory with at least one entry). Neither the path nor its parents
    need to exist yet. ``timeout = 0`` checks once. Fails with TIMEOUT.
    """

    path: PathStr
    condition: Condition = "exists"
    timeout: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_WAIT)] = 30.0


class WaitForPathResult(Schema):
    """The condition held after ``waited`` seconds."""

    met: bool
    waited: float


# -- pushed events ------------------------------------------------------------------------


class WatchEvent(Schema):
    """The ``data`` of every event pushed for a subscription.

    ``path``: what the event is about (for control events, the watched root).
    ``is_dir``: whether that entry is a directory. ``from_path``/``to_path``:
    the sides of a ``moved`` event. ``count``: raw events merged by debounce.
    ``dropped`` and ``source``: see ``overflow``. ``reason``: see
    ``root_deleted``, ``ended`` and ``watch_failed``.
    """

    path: str
    is_dir: bool = False
    from_path: str | None = None
    to_path: str | None = None
    count: int = 1
    dropped: int = 0
    source: str = ""
    reason: str = ""


# -- the methods --------------------------------------------------------------
SUBSCRIBE: Final = Rpc("watch.subscribe", SubscribeParams, SubscribeResult)
UNSUBSCRIBE: Final = Rpc("watch.unsubscribe", UnsubscribeParams, UnsubscribeResult)
WAIT_FOR_PATH: Final = Rpc("watch.wait_for_path", WaitForPathParams, WaitForPathResult)

RPCS: Final = (SUBSCRIBE, UNSUBSCRIBE, WAIT_FOR_PATH)
