"""Resource limits of one command: the ``limits`` of every call that starts one.

Every way to start a command (``shell.run`` collected, streaming or detached,
``services.start``, ``sessions.open``, ``terminal.open``) takes ``limits``, a
:class:`Limits` map. They apply before the command's first instruction and
to everything it starts. execd may have defaults of its own (command-line
flags); a call may lower them, never raise them (``INVALID_PARAMS`` with the
limit named in ``data``).

How each limit is enforced (:data:`Mechanism`, reported in ``server.info``
and in every result that carries a verdict):

* ``memory``: ``memory.max`` in a cgroup v2 of the command's own where execd
  has a delegated v2 subtree with the memory controller (``"cgroup-v2"``),
  else the v1 ``memory`` controller's ``memory.limit_in_bytes`` when execd
  may create a cgroup there (``"cgroup-v1"``), else ``RLIMIT_AS`` (address
  space: allocations fail, the program decides what happens next);
* ``processes``: ``pids.max`` of the v2 or else the v1 ``pids`` controller,
  else ``RLIMIT_NPROC`` (which counts every process of execd's user, and does
  not bind root: as root without a writable pids controller the limit is
  refused with ``NOT_SUPPORTED`` rather than silently not enforced);
* ``cpu``: a total over the command and everything it starts where execd
  can read its cgroup's CPU time (v2 ``cpu.stat``, which needs no
  controller: ``"cgroup-v2"``; else a writable v1 ``cpuacct``:
  ``"cgroup-v1"``): execd watches it and kills the whole cgroup once it
  passes the limit. Else ``RLIMIT_CPU`` (seconds, rounded up; per process),
  SIGXCPU at the limit and SIGKILL one second later. For a session the
  budget is per command (counted from each ``sessions.run``);
* ``file_size``: ``RLIMIT_FSIZE`` (bytes, rounded down to 512), SIGXFSZ;
* ``open_files``: ``RLIMIT_NOFILE``.

``limit_exceeded`` in a result names the limit that ended (or, for
``processes``, stopped a fork of) the command where it can be told: SIGXCPU
(or a shell's exit status 152) or the CPU watch's kill is ``cpu``, SIGXFSZ
(153) is ``file_size``, a cgroup OOM kill is ``memory``, a refused fork in a
pids cgroup is ``processes``. It cannot be told for ``RLIMIT_AS`` (an allocation merely
fails), ``RLIMIT_NPROC`` (a fork merely fails) or ``open_files`` (an open
merely fails): the command then ends as the program decides and the field
stays empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Final, Literal

import msgspec

from protocol.rpc import Schema

LimitName = Literal["memory", "cpu", "processes", "file_size", "open_files"]
"""The resource limits a command can be given."""
LIMIT_NAMES: Final[tuple[LimitName, ...]] = (
    "memory",
    "cpu",
    "processes",
    "file_size",
    "open_files",
)
Mechanism = Literal["cgroup-v2", "cgroup-v1", "rlimit", "unavailable"]
"""How execd enforces one limit."""

MAX_BYTES: Final = 2**62
MAX_CPU: Final = 30 * 24 * 3600.0
MAX_COUNT: Final = 2**22


class Limits(Schema, kw_only=True, forbid_unknown_fields=True):
    """Bounds on one command and everything it starts; None: no bound from this call.

    ``memory`` and ``file_size`` in bytes, ``cpu`` in CPU seconds,
    ``processes`` and ``open_files`` as counts. Unknown names are refused
    (a limit the daemon does not know must not be silently ignored).
    """

    memory: Annotated[int, msgspec.Meta(ge=1 << 20, le=MAX_BYTES)] | None = None
    cpu: Annotated[float, msgspec.Meta(gt=0, le=MAX_CPU)] | None = None
    processes: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)] | None = None
    file_size: Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)] | None = None
    open_files: Annotated[int, msgspec.Meta(ge=3, le=MAX_COUNT)] | None = None

    def is_empty(self) -> bool:
        """Whether no limit is set."""
        return all(getattr(self, name) is None for name in LIMIT_NAMES)


class LimitsInfo(Schema, kw_only=True):
    """``server.info``: the daemon's default limits and how each limit is enforced."""

    mechanisms: dict[LimitName, Mechanism]
    defaults: Limits | None = None


class ProcessEnd(Schema, kw_only=True):
    """How the process an info result describes ended, once it has (base of those results).

    At most one of ``exit_code`` and ``signal`` is set. ``limit_exceeded`` is
    the limit that ended it, where that can be told; ``limits`` says how each
    of its limits is enforced. As a base class's keyword-only fields they come
    last in the encoded map, which decoders read by key.
    """

    exit_code: int | None = None
    signal: int | None = None
    limit_exceeded: LimitName | None = None
    limits: dict[LimitName, Mechanism] | None = None


def as_limits(value: Limits | Mapping[str, float] | None) -> Limits | None:
    """``value`` as :class:`Limits` (a mapping such as ``{"memory": 256 << 20}`` is converted).

    Raises ``msgspec.ValidationError`` for unknown names or values out of range.
    """
    if value is None or isinstance(value, Limits):
        return value
    return msgspec.convert(dict(value), Limits)
