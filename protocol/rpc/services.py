"""Parameter and result shapes of the ``services.*`` methods.

A *service* is a named long-lived background process (a web server, a
database, a file watcher) that execd supervises for the rest of the session.
Like every command it leads its own session and process group and carries
the daemon's marker, so it dies when the execd session closes.

Methods
-------

``services.start`` (:class:`StartParams` -> :class:`ServiceInfo`)
    Spawns ``argv`` (or ``command`` through ``/bin/sh -c``) with stdin on
    ``/dev/null`` and stdout and stderr appended to the service's log file
    (default ``<state_dir>/services/<name>.log``), then waits for the
    readiness ``probe``. It replies once the service is ready; without a
    probe, once it is spawned. Failures:

    * ``SERVICE_FAILED`` (402): the service exited before it became ready;
      ``data`` is ``{"name", "log_tail", "exit_code", "signal"}``, the log
      tail holding what this start wrote to the log (its last lines);
    * ``NOT_READY`` (403): the probe did not succeed within its timeout; the
      service has been stopped; ``data`` is ``{"name", "log_tail",
      "timeout"}``;
    * ``SERVICE_EXISTS`` (400): a service of that name is starting, running
      or waiting to restart (a finished one is replaced);
    * ``LIMIT_EXCEEDED`` (104): the daemon's service limit is reached and
      every remembered service is still alive.

``services.status`` (:class:`StatusParams` -> :class:`ServiceInfo`)
    The state of one service: ``starting``, ``running``, ``backoff``
    (waiting to be restarted), ``exited`` (ended by itself and not to be
    restarted) or ``stopped`` (by a client, or after a failed probe).

``services.logs`` (:class:`LogsParams` -> :class:`LogsResult`)
    Without ``follow``: the last ``lines`` lines, or the last ``nbytes``
    bytes, or (with ``offset``) the bytes from that offset on, in the result
    (at most :data:`MAX_LOG_READ` bytes; default the last
    :data:`DEFAULT_LOG_LINES` lines). With ``follow``: the bytes stream live
    on stream :data:`LOG_STREAM`, starting at ``offset`` (or at the start of
    the requested tail, or at the current end of the log), until the client
    cancels the call or the service has ended for good and its output is
    drained; then the stream ends and the result carries the final offset.
    Offsets are byte offsets in the log file, which is appended to across
    restarts, so a client can resume a follow where it left off.

``services.stop`` (:class:`StopParams` -> :class:`ServiceInfo`)
    Sends ``signal`` (default SIGTERM, followed by SIGCONT) to the service's
    process group, waits up to ``grace`` seconds for the group to die, then
    SIGKILLs what is left. Descendants that left the group (``setsid``,
    double forks) but still carry the service's sub-marker are killed too.
    A stopped service is never restarted. Stopping a finished service only
    sweeps its leftovers and returns its final state.

``services.restart`` (:class:`RestartParams` -> :class:`ServiceInfo`)
    Stops the service (as ``services.stop`` with its defaults) and starts it
    again with the same parameters, probe included; fails like
    ``services.start``. The restart counter starts again from zero.

``services.list`` (:class:`ListParams` -> :class:`ListResult`)
    Every service execd remembers, in start order.

Restart policy
--------------

With ``policy="on-failure"``, a service that became ready and then exits
with a non-zero status or by a signal is started again after a backoff
delay of ``backoff_initial * 2 ** restarts`` seconds (at most
``backoff_max``), up to ``max_restarts`` times; ``restarts`` in
:class:`ServiceInfo` counts them. A service that dies before it is ready is
reported by ``services.start`` instead of being restarted. Restarted
instances are not probed again.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from protocol.rpc import Rpc, Schema
from protocol.rpc.resources import Limits, ProcessEnd
from protocol.rpc.types import (
    MAX_SECONDS,
    Argv,
    Command,
    Env,
    Offset,
    PathStr,
    Seconds,
    Unset,
)

LOG_STREAM: Final = "log"
"""The stream a following ``services.logs`` sends the log's bytes on."""

NAME_PATTERN: Final = r"^[A-Za-z0-9_.-]{1,64}$"
"""What a service name looks like."""

MAX_HOST: Final = 255
MAX_PATTERN: Final = 4096
"""Longest readiness regular expression, in characters."""

MAX_RESTARTS: Final = 1_000_000
MAX_LOG_READ: Final = 4 * 1024 * 1024
"""Most log bytes one non-following ``services.logs`` returns."""

MAX_LOG_LINES: Final = 1_000_000
#: Lines of log ``services.logs`` returns when none are asked for.
DEFAULT_LOG_LINES: Final = 100
DEFAULT_PROBE_TIMEOUT: Final = 30.0
DEFAULT_PROBE_INTERVAL: Final = 0.1
DEFAULT_COMMAND_INTERVAL: Final = 0.2

Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
Interval = Annotated[float, msgspec.Meta(ge=0.001, le=MAX_SECONDS)]
Signal = Annotated[int, msgspec.Meta(ge=1, le=64)]
ServiceState = Literal["starting", "running", "backoff", "exited", "stopped"]


# -- readiness probes -------------------------------------------------------------


class _Probe(Schema, kw_only=True, tag_field="type"):
    """Common shape of the probes: the ``type`` tag and an overall timeout."""

    timeout: Seconds = DEFAULT_PROBE_TIMEOUT


class TcpProbe(_Probe, tag="tcp"):
    """Ready once a TCP connection to ``host:port`` succeeds (retried every ``interval``)."""

    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST)] = "127.0.0.1"
    interval: Interval = DEFAULT_PROBE_INTERVAL


class LogProbe(_Probe, tag="log"):
    """Ready once a line of the log matches ``pattern`` (a Python regular expression).

    Every line this start wrote counts, including lines written before the
    probe began to look; the unterminated last line is matched too.
    """

    pattern: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATTERN)]


class CommandProbe(_Probe, tag="command"):
    """Ready once a check command exits with status 0.

    Exactly one of ``argv`` and ``command`` (``/bin/sh -c``). It runs with the
    service's environment and working directory, its output discarded, at
    most ``attempt_timeout`` seconds per attempt, every ``interval`` seconds.
    """

    argv: Argv | None = None
    command: Command | None = None
    interval: Interval = DEFAULT_COMMAND_INTERVAL
    attempt_timeout: Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)] = 10.0


Probe = TcpProbe | LogProbe | CommandProbe


class RestartPolicy(Schema):
    """When and how often a service that exits on its own is started again."""

    policy: Literal["never", "on-failure"] = "never"
    max_restarts: Annotated[int, msgspec.Meta(ge=0, le=MAX_RESTARTS)] = 5
    backoff_initial: Seconds = 0.5
    backoff_max: Seconds = 30.0


# -- services.start / restart ---------------------------------------------------------


class StartParams(Schema):
    """Start a service; exactly one of ``argv`` and ``command`` is required.

    ``env`` overrides and ``unset`` removes variables of the daemon's base
    environment (the marker variables can be neither). ``log`` is the log
    file (appended to; relative paths are resolved against ``cwd``, else the
    daemon's working directory; missing parent directories are created).
    """

    name: Name
    argv: Argv | None = None
    command: Command | None = None
    cwd: PathStr | None = None
    env: Env | None = None
    unset: Unset | None = None
    log: PathStr | None = None
    probe: Probe | None = None
    restart: RestartPolicy | None = None
    #: Resource limits of every instance (``protocol.rpc.resources``).
    limits: Limits | None = None


class RestartParams(Schema):
    """``services.restart``: stop then start a service with its parameters."""

    name: Name


class ServiceInfo(ProcessEnd):
    """What is known about one service.

    ``pid`` is the current (or last) instance's; ``started`` its Unix start
    time and ``uptime`` the seconds it has been running (while it runs).
    ``exit_code``, ``signal`` and ``limit_exceeded`` describe the last
    instance's end, once it has ended. ``ready`` says the readiness probe
    succeeded for this start. ``log_size`` is the log file's size in bytes.
    ``error`` explains a restart that could not be spawned.
    """

    name: str
    state: ServiceState
    title: str
    log_path: str
    pid: int | None = None
    started: float | None = None
    uptime: float | None = None
    finished: float | None = None
    restarts: int = 0
    ready: bool = False
    log_size: int = 0
    error: str | None = None


# -- status / list / stop -----------------------------------------------------------------


class StatusParams(Schema):
    """``services.status``: one service's state."""

    name: Name


class ListParams(Schema):
    """``services.list`` takes no parameters."""


class ListResult(Schema):
    """Every remembered service, in start order."""

    services: list[ServiceInfo]
    #: Set when more remained than fit one reply frame to the client (the first are listed).
    truncated: bool = False


class StopParams(Schema):
    """``services.stop``: ``signal`` the group, wait ``grace`` (daemon default), SIGKILL."""

    name: Name
    signal: Signal = 15
    grace: Seconds | None = None


# -- logs -----------------------------------------------------------------------------------


class LogsParams(Schema):
    """``services.logs``: a tail or a range of the log, or a live follow.

    ``lines`` and ``nbytes`` select a tail (both: the last ``lines`` lines,
    but no more than ``nbytes`` bytes); ``offset`` selects the bytes from
    that offset on and excludes ``lines``. ``nbytes`` also bounds an
    ``offset`` read. With ``follow`` the bytes go to :data:`LOG_STREAM`.
    """

    name: Name
    lines: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOG_LINES)] | None = None
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOG_READ)] | None = None
    offset: Offset | None = None
    follow: bool = False


class LogsResult(Schema):
    """The bytes read (empty when following) and where they sit in the log.

    ``start`` is the offset of the first byte read or sent; ``end`` the
    offset after the last one (resume there); ``size`` the log's size when
    the call finished.
    """

    start: int
    end: int
    size: int
    data: bytes = b""


# -- the methods --------------------------------------------------------------
START: Final = Rpc("services.start", StartParams, ServiceInfo)
STATUS: Final = Rpc("services.status", StatusParams, ServiceInfo)
LOGS: Final = Rpc("services.logs", LogsParams, LogsResult)
STOP: Final = Rpc("services.stop", StopParams, ServiceInfo)
RESTART: Final = Rpc("services.restart", RestartParams, ServiceInfo)
LIST: Final = Rpc("services.list", ListParams, ListResult)

RPCS: Final = (START, STATUS, LOGS, STOP, RESTART, LIST)
