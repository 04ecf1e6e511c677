"""Start execd in a workspace, talk to it, and tear everything down again.

Theory of operation
-------------------
:func:`serve` launches one execd through a :class:`~harnessd.runtime.Runtime`:

1. *Prepare.* A fresh token and a fresh 128-bit marker are made. A private
   working directory is created in the workspace (mode 0700; by default a new
   ``/tmp/execd-<random>``), and the token is written into it as a new 0600
   file. The token never appears in argv or in an environment. execd's state
   directory (the session ledgers) is ``state-<tag>`` in it unless
   ``extra_args`` names one.
2. *Start.* execd is started in the background under a tiny ``/bin/sh``
   supervisor, both writing to one log file in the working directory. execd
   reads and deletes the token file, then prints ``{"event": "listening",
   ...}``; when it ends it prints ``{"event": "exited", ...}``. The supervisor
   adds its own ``exited`` line with the exit status once execd is gone, so a
   worker that dies without a word -- a crash before Python starts, a bad
   command, SIGKILL -- is noticed too. No PID is needed or trusted for this.
   (A runtime whose ``start_background`` supervises by itself -- a workspace
   without a shell -- gets execd's argv without the ``/bin/sh`` around it.)
   With ``cwd`` the supervisor enters that directory first (the runtime's
   own is handed ``cwd``), so execd and every command that does not name a
   directory of its own run there.
3. *Wait.* The log is polled through the runtime (20 ms, backing off to
   250 ms). An ``exited`` line is looked for *before* the ``listening`` line,
   and after ``listening`` is seen the log is read once more after a short
   settle: a worker that announced and then died fails the launch with its log
   tail instead of handing back a dead port. The deadline is ``start_timeout``.
4. *Connect.* The client connects to the announced port and authenticates;
   the :class:`Session` holds the client.

:meth:`Session.close` runs at most once (later calls return the first
result): the ``session.close`` RPC with ``shutdown=True`` kills every process
carrying the marker and makes execd exit. When the RPC fails (execd killed,
hung, unreachable), ``execd cleanup --marker ...`` runs through the runtime
instead. Then the log is watched for execd's exit, the token file is removed
if still there, the state directory the launcher chose is removed, and the log
is removed (with the working directory :func:`serve` created) unless the close
was not clean: then it alone is kept to tell what went wrong (``keep_log=True``
always keeps it, ``keep_log=False`` never does).

Every launched execd has a lease (:data:`DEFAULT_LEASE` unless ``serve``
is told otherwise): execd cleans up by its marker and exits once no frame has
come from an authenticated client for that long. The client's keepalive pings
hold the lease while this process lives, so a harness that is SIGKILLed, or
whose machine vanishes, leaves nothing behind for longer than the lease.
``lease=None`` turns it off (execd then lives until closed).

A lost connection (reset, or no answer to keepalives for three intervals)
is replaced by itself (:class:`~harnessd.reattach.Reconnector`): for
``reattach_within`` seconds the session dials the same execd again in the
background, and the new client becomes ``session.client``. Calls that were in
flight go on over it (reattached by request id); calls made on the old client
meanwhile were not sent, wait for the new connection and are sent there, or
fail with :class:`~harnessd.errors.NotSent` when none came in time.
:meth:`Session.reconnect` replaces the connection on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import posixpath
import secrets
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import InitVar, dataclass, replace
from typing import Any

from harnessd import keepalive as keepalive_group
from harnessd import reattach
from harnessd.api import ExecdClient, connect
from harnessd.errors import ConnectionLost, HarnessError, LaunchFailed
from harnessd.execd_log import (
    MAX_LOG_READ,
    POLL_FIRST,
    POLL_MAX,
    await_exit,
    describe_exit,
    log_tail,
    parse_event,
    scan,
)
from harnessd.opening import Opening
from harnessd.runtime import (
    LocalRuntime,
    Runtime,
    SupervisingRuntime,
    WorkspaceError,
    remove_workdir,
)
from harnessd.token import new_token
from protocol import limits
from protocol.rpc.core import CloseReport
from protocol.values import DEFAULT_MARKER_VAR, new_marker, validate_marker, validate_marker_var

log = logging.getLogger("harnessd.launcher")

DEFAULT_LEASE = 30.0
"""Seconds a launched execd outlives the last frame from its harness (see :func:`serve`)."""

LEASE_PINGS = 3
"""Keepalive pings per lease at least: a late ping or two never costs the lease."""

_SH = "/bin/sh"
_SETTLE = 0.05
_LATE_ANNOUNCE = 5.0

# Runs as: sh -c SCRIPT execd-supervisor EXECD_ARGV...  Reports how execd ended
# even when execd itself could not (crash, SIGKILL, command not found).
_SUPERVISOR = (
    '"$@"; status=$?; '
    """printf '{"event": "exited", "code": %d, "source": "supervisor"}\\n' "$status"; """
    'exit "$status"'
)
# Put before the supervisor when execd runs in a given directory:
# sh -c SCRIPT execd-supervisor CWD EXECD_ARGV...  A directory that cannot be
# entered ends the launch with the supervisor's exited line (status 126).
_ENTER = (
    'cd -- "$1" || { '
    "printf '%s\\n' "
    """'{"event": "exited", "code": 126, "source": "supervisor", """
    """"error": "cannot enter the directory given as cwd"}'; """
    "exit 126; }; shift; "
)


def default_execd_command() -> list[str]:
    """``[sys.executable, "-m", "execd"]``: right wherever the workspace shares this install."""
    return [sys.executable, "-m", "execd"]


@dataclass(frozen=True, slots=True)
class CloseResult:
    """What :meth:`Session.close` did.

    ``killed``/``remaining``: processes killed by marker and marked processes
    still alive afterwards (from the RPC's report, or from the fallback's when
    it ran). ``fallback_ran``: ``execd cleanup`` ran through the runtime
    because the RPC did not clean up. ``worker_exited``/``exit_code``: the
    log showed execd's exit (``exit_code`` as the shell reports it, 128+N
    after signal N). ``rpc_error``, ``fallback_error``, ``housekeeping_error``
    describe failures of the corresponding step. ``log_kept``: execd's log
    was left at the session's ``log_path``.
    """

    killed: int
    remaining: tuple[int, ...]
    fallback_ran: bool
    worker_exited: bool
    exit_code: int | None = None
    rpc_error: str | None = None
    fallback_error: str | None = None
    housekeeping_error: str | None = None
    log_kept: bool = False

    @property
    def leftover(self) -> int:
        """How many marked processes were still alive."""
        return len(self.remaining)

    @property
    def clean(self) -> bool:
        """True when cleanup ran to completion and left no marked process."""
        return not self.remaining and self.fallback_error is None


@dataclass(frozen=True, slots=True)
class _Options:
    """How a session connects and cleans up; fixed at launch."""

    execd_command: tuple[str, ...]
    encrypt: bool | str
    keepalive: float | None
    connect_timeout: float
    cleanup_timeout: float
    token_path: str
    created_workdir: bool
    state_dir: str | None = None
    """execd's state directory when the launcher chose it (removed at close), else None."""
    reattach_within: float = reattach.DEFAULT_REATTACH_WITHIN

    async def dial(self, host: str, port: int, token: str, timeout: float | None) -> ExecdClient:
        return await connect(
            host,
            port,
            token,
            encrypt=self.encrypt,
            timeout=self.connect_timeout if timeout is None else timeout,
            keepalive=self.keepalive,
            reattach_within=self.reattach_within,
        )


@dataclass(kw_only=True, eq=False, repr=False)
class Session:
    """One live execd in a workspace, with its authenticated client.

    Public fields: ``client`` (the current :class:`~harnessd.api.ExecdClient`),
    ``host``/``port`` (where the client connects), ``marker``/``marker_var``,
    ``pid`` (as announced by execd: informational only, nothing relies on it),
    ``workdir``, ``log_path`` and ``runtime``. The token stays private: it is
    needed for :meth:`reconnect` and never shown by ``repr()``.
    """

    client: ExecdClient
    host: str
    port: int
    marker: str
    marker_var: str
    pid: int
    workdir: str
    log_path: str
    runtime: Runtime
    token: InitVar[str]
    options: InitVar[_Options]

    def __post_init__(self, token: str, options: _Options) -> None:
        self._token = token
        self._options = options
        self._closing: asyncio.Future[CloseResult] | None = None
        self._reconnector = reattach.Reconnector.of(self, options.reattach_within)

    def __repr__(self) -> str:
        return (
            f"Session(host={self.host!r}, port={self.port}, marker={self.marker!r}, "
            f"pid={self.pid}, workdir={self.workdir!r}, runtime={self.runtime!r})"
        )

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closing is not None

    @property
    def created_workdir(self) -> bool:
        """True when the launch made ``workdir`` (so closing removes it unless the log is kept)."""
        return self._options.created_workdir

    async def reconnect(self, *, timeout: float | None = None) -> ExecdClient:
        """Connect again to the same execd and make the new client ``session.client``.

        Calls in flight on the old one go on over the new one (reattached by
        request id, :mod:`harnessd.calls`). While the session is reconnecting
        by itself, this waits for that and returns its client. Raises
        ConnectFailed, HandshakeFailed, or ConnectionLost when closed.
        """
        if self._closing is not None:
            raise ConnectionLost("the session is closed")
        return await self._reconnector.swap(timeout)

    async def close(self, *, keep_log: bool | None = None) -> CloseResult:
        """Kill every marked process, stop execd, and report what was left.

        Idempotent: a second call (or a concurrent one) returns the first
        call's result, and its ``keep_log`` is ignored. Safe in ``finally``
        blocks and under cancellation: the cleanup is shielded and runs to its
        end (each step is bounded by a timeout) before CancelledError
        propagates. execd's log is removed, with the working directory when
        :func:`serve` created it, unless the close was not clean (an RPC or
        cleanup failure, a marked process left, execd not seen exiting with
        status 0): then it stays at ``log_path`` (``CloseResult.log_kept``).
        ``keep_log=True`` always keeps it, ``keep_log=False`` never does.
        """
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._shutdown(keep_log))
        task = self._closing
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([task])
            raise

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals -------------------------------------------------------------

    async def dial(self, timeout: float | None) -> ExecdClient:
        """A new client of this session's execd (:meth:`reconnect` adopts it)."""
        return await self._options.dial(self.host, self.port, self._token, timeout)

    async def _close_call(self, client: ExecdClient) -> CloseReport:
        budget = self._options.cleanup_timeout
        async with asyncio.timeout(budget + 10.0):
            return await client.shutdown(timeout=budget)

    async def _close_remote(self) -> CloseReport:
        try:
            return await self._close_call(self.client)
        except ConnectionLost:
            log.info("connection to execd lost; reconnecting to close the session")
        client = await self.dial(None)
        old, self.client = self.client, client
        await old.close()
        return await self._close_call(client)

    async def _shutdown(self, keep_log: bool | None) -> CloseResult:
        report: CloseReport | None = None
        rpc_error: str | None = None
        await self._reconnector.stop()
        try:
            report = await self._close_remote()
        except Exception as exc:
            rpc_error = f"{type(exc).__name__}: {exc}"
            log.warning("session.close failed (%s); falling back to execd cleanup", rpc_error)
        with contextlib.suppress(Exception):
            await self.client.close()
        killed = report.killed if report is not None else 0
        remaining: tuple[int, ...] = tuple(report.remaining) if report is not None else ()
        fallback_ran = report is None or bool(report.remaining)
        fallback_error: str | None = None
        if fallback_ran:
            try:
                more, remaining = await self._fallback_cleanup()
                killed += more
            except Exception as exc:
                fallback_error = f"{type(exc).__name__}: {exc}"
                log.error("execd cleanup failed: %s", exc)
        exit_code = await await_exit(
            self.runtime, self.log_path, 10.0 if report is not None else 2.0
        )
        result = CloseResult(
            killed=killed,
            remaining=remaining,
            fallback_ran=fallback_ran,
            worker_exited=exit_code is not None,
            exit_code=exit_code,
            rpc_error=rpc_error,
            fallback_error=fallback_error,
        )
        if keep_log is None:
            # The log tells what went wrong; after a clean close nobody needs it.
            keep_log = not (result.clean and rpc_error is None and exit_code == 0)
        housekeeping_error = await self._housekeeping(keep_log)
        result = replace(result, housekeeping_error=housekeeping_error, log_kept=keep_log)
        if result.remaining:
            log.error("session %s: marked processes survived cleanup: %s", self.marker, remaining)
        return result

    async def _fallback_cleanup(self) -> tuple[int, tuple[int, ...]]:
        budget = self._options.cleanup_timeout
        argv = [
            *self._options.execd_command,
            "cleanup",
            "--marker",
            self.marker,
            "--marker-var",
            self.marker_var,
            "--timeout",
            str(budget),
        ]
        result = await self.runtime.run(argv, timeout=budget + 30.0)
        for line in reversed(result.stdout.splitlines()):
            event = parse_event(line)
            if event is not None and event.get("event") == "cleanup":
                killed = event.get("killed")
                left = event.get("remaining")
                if isinstance(killed, int) and isinstance(left, list):
                    return killed, tuple(pid for pid in left if isinstance(pid, int))
        detail = result.stderr.decode("utf-8", "replace").strip()[-2000:]
        raise WorkspaceError(
            f"execd cleanup gave no report (status {result.exit_code}): {detail or 'no output'}"
        )

    async def _housekeeping(self, keep_log: bool) -> str | None:
        opts = self._options
        try:
            if not keep_log and opts.created_workdir:
                await remove_workdir(self.runtime, self.workdir)
                return None
            doomed = [opts.token_path] if keep_log else [opts.token_path, self.log_path]
            if opts.state_dir is not None:
                doomed.append(opts.state_dir)
            result = await self.runtime.run(["rm", "-rf", "--", *doomed], timeout=30.0)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        if result.exit_code != 0:
            return f"rm failed: {result.stderr.decode('utf-8', 'replace').strip()[:500]}"
        return None


class Launch(Opening[Session]):
    """What :func:`serve` returns: await it for a Session, or use it with ``async with``.

    ``session = await serve(...)`` leaves closing to the caller;
    ``async with serve(...) as session:`` closes the session on exit.
    """

    def __init__(self, start: Callable[[], Awaitable[Session]]) -> None:
        super().__init__(start, Session.close)


def serve(
    runtime: Runtime | None = None,
    *,
    execd_command: Sequence[str] | None = None,
    bind_host: str = "127.0.0.1",
    connect_host: str | None = None,
    connect_port: int | None = None,
    port: int = 0,
    workdir: str | None = None,
    cwd: str | None = None,
    marker: str | None = None,
    marker_var: str = DEFAULT_MARKER_VAR,
    lease: float | None = DEFAULT_LEASE,
    encrypt: bool | str = False,
    start_timeout: float = 15.0,
    extra_args: Sequence[str] = (),
    keepalive: float | None = keepalive_group.DEFAULT_INTERVAL,
    connect_timeout: float = 10.0,
    cleanup_timeout: float = 10.0,
    reattach_within: float = reattach.DEFAULT_REATTACH_WITHIN,
) -> Launch:
    """Start execd in the workspace of ``runtime`` and return a connected :class:`Session`.

    ``runtime``: where execd runs (default :class:`~harnessd.runtime.LocalRuntime`).
    ``execd_command``: the argv that starts execd there (default
    :func:`default_execd_command`); the launcher appends ``--host``,
    ``--port``, ``--token-file``, ``--marker``, ``--marker-var``, ``--lease``
    and then ``extra_args``; ``execd_command + ["cleanup", ...]`` is the
    fallback cleanup. ``bind_host``/``port``: what execd binds (port 0: the
    kernel picks). ``connect_host``/``connect_port``: where to connect
    (default: the announced host and port; a wildcard address means the
    loopback of the same family); give them when the workspace is reached
    through a forwarded port. ``workdir``: a private directory in the
    workspace for the token file, the log and, unless ``extra_args`` has a
    ``--state-dir``, execd's state directory (the session ledgers) (default:
    a new ``/tmp/execd-<random>``, mode 0700; a given one is created with
    ``mkdir -p -m 700`` if missing). ``cwd``: the directory execd runs in,
    so the working directory of every command that does not name its own
    (an absolute path that must exist in the workspace). The default, None,
    is the directory the runtime starts commands in: with
    :class:`~harnessd.runtime.LocalRuntime` the current directory of this
    process, through ssh the remote home directory, in a container its
    working directory. Pass it whenever commands must not run where the
    harness happens to be. ``marker``: the session
    marker (default: 32 random hex digits). ``lease``: execd cleans up by the
    marker and exits once no authenticated client has sent it a frame for
    this many seconds (default :data:`DEFAULT_LEASE`), so after this process
    is SIGKILLed, its machine vanishes or the network drops, nothing is left
    for longer than that; ``lease=None`` is the explicit way to turn it off.
    ``encrypt``/``keepalive``/``connect_timeout``: passed to
    :func:`harnessd.api.connect`; the keepalive pings hold the lease, so with
    a lease ``keepalive`` must be set, and it is shortened to ``lease /
    LEASE_PINGS`` when longer. ``start_timeout``: how long execd may take to
    announce. ``cleanup_timeout``: the budget of marker cleanup at close.
    ``reattach_within``: how long calls in flight wait for a reconnect.
    Raises ValueError for a lease that is not a positive number of seconds,
    a relative ``workdir`` or ``cwd``, or a ``connect_port`` out of range.

    Raises :class:`~harnessd.errors.LaunchFailed` (message with execd's log
    tail, never the token) when execd cannot be started, dies during startup,
    or cannot be reached. After a failed (or cancelled) launch the token file
    is gone, a worker that announces within a few more seconds is closed
    again, and the log stays in the working directory for inspection. A
    worker that never announced cannot be stopped without a PID; it exits on
    its own if it had not yet read the (removed) token file, and ``lease``
    bounds its life otherwise.

    The result is awaitable (``session = await serve(...)``) and an async
    context manager (``async with serve(...) as session:`` closes on exit).
    """
    rt: Runtime = runtime if runtime is not None else LocalRuntime()
    command = tuple(execd_command) if execd_command is not None else tuple(default_execd_command())
    if not command:
        raise ValueError("execd_command must not be empty")
    value = validate_marker(marker if marker is not None else new_marker())
    validate_marker_var(marker_var)
    created = workdir is None
    directory = workdir if workdir is not None else f"/tmp/execd-{secrets.token_hex(8)}"  # noqa: S108
    if not posixpath.isabs(directory):
        raise ValueError("workdir must be an absolute path in the workspace")
    if cwd is not None and not posixpath.isabs(cwd):
        raise ValueError("cwd must be an absolute path in the workspace")
    if connect_port is not None and not 0 < connect_port < 65536:
        raise ValueError("connect_port must be a port number (1-65535)")
    if lease is not None:
        if not (math.isfinite(lease) and lease > 0):
            raise ValueError("lease must be a positive number of seconds (None: no lease)")
        if keepalive is None:
            raise ValueError("a lease needs keepalive pings to hold it: set keepalive")
        keepalive = min(keepalive, lease / LEASE_PINGS)
    tag = value[:12]
    chosen_state = not any(
        arg == "--state-dir" or arg.startswith("--state-dir=") for arg in extra_args
    )
    options = _Options(
        execd_command=command,
        encrypt=encrypt,
        keepalive=keepalive,
        connect_timeout=connect_timeout,
        cleanup_timeout=cleanup_timeout,
        token_path=posixpath.join(directory, f"token-{tag}"),
        created_workdir=created,
        state_dir=posixpath.join(directory, f"state-{tag}") if chosen_state else None,
        reattach_within=reattach_within,
    )
    plan = _Plan(
        runtime=rt,
        options=options,
        marker=value,
        marker_var=marker_var,
        workdir=directory,
        log_path=posixpath.join(directory, f"execd-{tag}.log"),
        bind_host=bind_host,
        connect_host=connect_host,
        connect_port=connect_port,
        port=port,
        cwd=cwd,
        lease=lease,
        start_timeout=start_timeout,
        extra_args=tuple(extra_args),
    )
    return Launch(plan.launch)


@dataclass(frozen=True, slots=True)
class _Announcement:
    host: str
    port: int
    pid: int


@dataclass(frozen=True, slots=True)
class _Plan:
    """One launch's parameters; :meth:`launch` carries it out."""

    runtime: Runtime
    options: _Options
    marker: str
    marker_var: str
    workdir: str
    log_path: str
    bind_host: str
    connect_host: str | None
    connect_port: int | None
    port: int
    cwd: str | None
    lease: float | None
    start_timeout: float
    extra_args: tuple[str, ...]

    def argv(self) -> list[str]:
        args = [
            *self.options.execd_command,
            "--host",
            self.bind_host,
            "--port",
            str(self.port),
            "--token-file",
            self.options.token_path,
            "--marker",
            self.marker,
            "--marker-var",
            self.marker_var,
        ]
        if self.lease is not None:
            args += ["--lease", repr(float(self.lease))]
        if self.options.state_dir is not None:
            args += ["--state-dir", self.options.state_dir]
        if self._supervisor() is not None:
            return [*args, *self.extra_args]
        if self.cwd is None:
            return [_SH, "-c", _SUPERVISOR, "execd-supervisor", *args, *self.extra_args]
        supervisor = _ENTER + _SUPERVISOR
        return [_SH, "-c", supervisor, "execd-supervisor", self.cwd, *args, *self.extra_args]

    def _supervisor(self) -> SupervisingRuntime | None:
        """The runtime, when it supervises execd itself (and enters ``cwd`` itself)."""
        runtime = self.runtime
        if isinstance(runtime, SupervisingRuntime) and runtime.supervises:
            return runtime
        return None

    async def start(self) -> None:
        """Start execd in the background: under the ``/bin/sh`` supervisor, or the runtime's."""
        supervisor = self._supervisor()
        if supervisor is not None and self.cwd is not None:
            await supervisor.start_background(self.argv(), log_path=self.log_path, cwd=self.cwd)
        else:
            await self.runtime.start_background(self.argv(), log_path=self.log_path)

    def address(self, announced: _Announcement) -> tuple[str, int]:
        """Where to connect to the execd that announced ``announced``."""
        host = self.connect_host or _connectable(announced.host)
        return host, self.connect_port or announced.port

    async def launch(self) -> Session:
        token = new_token()
        await self._prepare(token)
        try:
            await self.start()
        except BaseException as exc:
            await _bounded(self._discard_token())
            if isinstance(exc, WorkspaceError):
                raise LaunchFailed(f"cannot start execd: {exc}") from exc
            raise
        announced: _Announcement | None = None
        try:
            announced = await self._await_announcement(token)
            host, port = self.address(announced)
            client = await self.options.dial(host, port, token, None)
        except BaseException as exc:
            late = not isinstance(exc, LaunchFailed)
            interrupted = isinstance(exc, asyncio.CancelledError)
            await _bounded(self._abandon(token, announced, wait_late=late, tidy=interrupted))
            if isinstance(exc, LaunchFailed):
                raise
            if isinstance(exc, HarnessError):
                where = f"{host}:{port}" if announced is not None else "a port"
                raise LaunchFailed(
                    f"execd listens on {where} but connecting failed: {exc}"
                ) from exc
            raise
        log.info(
            "execd up at %s:%d (pid %d, marker %s, log %s)",
            host,
            port,
            announced.pid,
            self.marker,
            self.log_path,
        )
        return Session(
            client=client,
            host=host,
            port=port,
            marker=self.marker,
            marker_var=self.marker_var,
            pid=announced.pid,
            workdir=self.workdir,
            log_path=self.log_path,
            runtime=self.runtime,
            token=token,
            options=self.options,
        )

    async def _prepare(self, token: str) -> None:
        mkdir = ["mkdir", "-m", "700", "--", self.workdir]
        if not self.options.created_workdir:
            mkdir.insert(1, "-p")
        try:
            made = await self.runtime.run(mkdir, timeout=30.0)
            if made.exit_code != 0:
                detail = made.stderr.decode("utf-8", "replace").strip()[:500]
                raise LaunchFailed(f"cannot create the workdir {self.workdir}: {detail}")
            await self.runtime.write_file(self.options.token_path, token.encode(), mode=0o600)
        except WorkspaceError as exc:
            raise LaunchFailed(f"cannot prepare the workdir {self.workdir}: {exc}") from exc

    async def _await_announcement(self, token: str) -> _Announcement:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout
        delay = POLL_FIRST
        data = b""
        read_error: WorkspaceError | None = None
        while True:
            try:
                data = await self.runtime.read_file(self.log_path, max_bytes=MAX_LOG_READ)
                read_error = None
            except WorkspaceError as exc:
                read_error = exc
            exited, listening = scan(data)
            if exited is not None:
                raise self._failure(describe_exit(exited), data, token)
            if listening is not None:
                await asyncio.sleep(_SETTLE)
                with contextlib.suppress(WorkspaceError):
                    data = await self.runtime.read_file(self.log_path, max_bytes=MAX_LOG_READ)
                exited, _ = scan(data)
                if exited is not None:
                    raise self._failure(
                        f"announced a port, then {describe_exit(exited)}", data, token
                    )
                return self._check(listening, data, token)
            left = deadline - loop.time()
            if left <= 0:
                why = f"did not announce a port within {self.start_timeout:g} s"
                if read_error is not None:
                    why += f" (last log read failed: {read_error})"
                raise self._failure(why, data, token)
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 1.5, POLL_MAX)

    def _check(self, event: dict[str, Any], data: bytes, token: str) -> _Announcement:
        host, port, pid = event.get("host"), event.get("port"), event.get("pid")
        if not (
            isinstance(host, str)
            and isinstance(port, int)
            and 0 < port < 65536
            and isinstance(pid, int)
        ):
            raise self._failure("announced a malformed listening line", data, token)
        if event.get("marker") != self.marker:
            raise self._failure("announced a different marker than it was given", data, token)
        if event.get("protocol") != limits.PROTOCOL_VERSION:
            raise self._failure(
                f"speaks protocol {event.get('protocol')!r}, "
                f"this harness speaks {limits.PROTOCOL_VERSION}",
                data,
                token,
            )
        return _Announcement(host=host, port=port, pid=pid)

    def _failure(self, why: str, data: bytes, token: str) -> LaunchFailed:
        tail = log_tail(data, token)
        return LaunchFailed(f"execd {why}\n--- last lines of {self.log_path} ---\n{tail}")

    async def _discard_token(self) -> None:
        with contextlib.suppress(HarnessError):
            await self.runtime.run(["rm", "-f", "--", self.options.token_path], timeout=30.0)

    async def _abandon(
        self,
        token: str,
        announced: _Announcement | None,
        *,
        wait_late: bool = False,
        tidy: bool = False,
    ) -> None:
        """Undo a launch that failed after execd was started (best effort).

        With ``wait_late`` (the launch was interrupted, not timed out) a worker
        that has not announced yet is given a few seconds to do so and then
        closed like one that had. With ``tidy`` (the launch was cancelled: no
        failure to look into) the working directory the launch made goes too
        once execd closed cleanly; a failed launch keeps its log there.
        """
        await self._discard_token()
        if announced is None and wait_late:
            announced = await self._late_announcement(token)
        if announced is None:
            return
        data = b""
        with contextlib.suppress(WorkspaceError):
            data = await self.runtime.read_file(self.log_path, max_bytes=MAX_LOG_READ)
        if scan(data)[0] is not None:
            return
        host, port = self.address(announced)
        report: CloseReport | None = None
        with contextlib.suppress(HarnessError, TimeoutError, OSError):
            client = await connect(host, port, token, encrypt=self.options.encrypt, timeout=5.0)
            async with client:
                report = await client.shutdown(timeout=self.options.cleanup_timeout)
        if not (tidy and self.options.created_workdir and report is not None):
            return
        if not report.remaining and await await_exit(self.runtime, self.log_path, 10.0) == 0:
            with contextlib.suppress(HarnessError):
                await remove_workdir(self.runtime, self.workdir)

    async def _late_announcement(self, token: str) -> _Announcement | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.start_timeout, _LATE_ANNOUNCE)
        while True:
            data = b""
            with contextlib.suppress(WorkspaceError):
                data = await self.runtime.read_file(self.log_path, max_bytes=MAX_LOG_READ)
            exited, listening = scan(data)
            if exited is not None:
                return None
            if listening is not None:
                with contextlib.suppress(LaunchFailed):
                    return self._check(listening, data, token)
                return None
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(POLL_MAX)


async def _bounded(work: Awaitable[None], limit: float = 30.0) -> None:
    """Run cleanup ``work`` to its end (at most ``limit`` s) even if the caller is cancelled."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait_for(asyncio.shield(task), limit)
    except asyncio.CancelledError:
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(task, limit)
        raise
    except TimeoutError:
        task.cancel()


def _connectable(host: str) -> str:
    if host in ("0.0.0.0", ""):  # noqa: S104 - recognising the wildcard, not binding it
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host
