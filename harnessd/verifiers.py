"""execd as a verifiers runtime: ``ExecdRuntime(ExecdConfig())`` wherever verifiers takes a live box.

Needs the ``verifiers`` extra (in a checkout of splitexec: ``pip install -e
'.[verifiers]'``, or ``pip install '/path/to/checkout[verifiers]'`` when not
editable). Importing :mod:`harnessd` never imports this module (or
verifiers); import it by name.

Theory of operation
-------------------
``start()`` launches one execd through a harnessd runtime (:func:`~harnessd.launcher.serve`:
a local process by default, or any command prefix such as ``ssh host`` or
``ip netns exec ws ...``), connects, and makes a working directory in the
workspace. Every method of the verifiers contract then maps onto execd RPCs
on that one connection: ``run`` is ``shell.run`` (collected output),
``open_process`` is a streaming ``shell.run`` with stdin streamed, files go
through ``files.read``/``files.write`` (the read cap is enforced in execd:
it never sends more than the cap), and ``run_background`` is an execd service
whose log is the requested file. Relative paths and commands resolve against
the working directory, as verifiers' own subprocess runtime does.

Views (``with_env``/``with_user``) share the object's ``__dict__`` as verifiers'
base class arranges, so every view talks to the same execd through the same
:class:`_Box`. A user view exists only where execd runs as root and says so
(``server.info`` reports uid 0): its commands run under ``setpriv`` as that
user and its file I/O goes through commands as that user.

Teardown (``stop()`` -> :meth:`ExecdRuntime.teardown`) stops the background
services (SIGTERM, SIGKILL after a grace period), kills everything else that
carries the session marker (including daemons that double-forked and left
their process group), removes the working directory it made, and shuts execd
down. :meth:`ExecdRuntime.cleanup` is the synchronous backstop verifiers runs
at interpreter exit, with no event loop: it runs ``execd cleanup --marker``
through the harnessd runtime with plain blocking subprocesses, and execd
itself exits once its lease runs out without a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import secrets
import signal
import subprocess
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field
from pydantic_config import BaseConfig
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes.base import (
    BaseRuntimeInfo,
    ProgramResult,
    Runtime,
    RuntimeProcess,
    register,
)

from harnessd.api import ExecdClient, RunningCommand
from harnessd.errors import HarnessError, NotFound, SpawnFailed
from harnessd.launcher import Session, default_execd_command, serve
from harnessd.runtime import CommandPrefixRuntime, LocalRuntime
from harnessd.runtime import Runtime as WorkspaceRuntime
from protocol.rpc import shell

__all__ = [
    "ExecdConfig",
    "ExecdFileNotFound",
    "ExecdProcess",
    "ExecdRuntime",
    "ExecdRuntimeInfo",
    "ExecdSandboxError",
]

log = logging.getLogger("harnessd.verifiers")

_BLOCK = 1024 * 1024
# A service's stdout and stderr are two pipes; one descriptor keeps their order in the log.
_MERGED_OUTPUT = 'exec "$@" 2>&1'
_WRITE_AS_USER = 'mkdir -p -- "$(dirname -- "$1")" && cat >"$1"'


class ExecdSandboxError(SandboxError):  # type: ignore[misc]
    """A workspace operation failed in execd; ``cause`` is the harnessd error, when there is one."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class ExecdFileNotFound(ExecdSandboxError, FileNotFoundError):
    """The path or program does not exist in the workspace.

    Both a verifiers ``SandboxError`` and a ``FileNotFoundError``, so callers
    written against either verifiers' container runtimes or its subprocess
    runtime catch it.
    """


class ExecdConfig(BaseConfig):  # type: ignore[misc]
    """Where and how :class:`ExecdRuntime` runs execd.

    ``runtime``: a harnessd workspace runtime object (any object with the four
    coroutines of :class:`harnessd.runtime.Runtime`). Else ``prefix`` builds a
    :class:`~harnessd.runtime.CommandPrefixRuntime` (``["ssh", "host"]`` with
    ``quote_for_remote_shell``, ``["ip", "netns", "exec", "ws"]``, ...); with
    neither, execd runs on this machine (:class:`~harnessd.runtime.LocalRuntime`).
    The built-in runtimes drop credential-like variables (and ``scrub``) from
    the environment execd starts with, so they never reach the workspace.

    ``execd_command``, ``bind_host``, ``connect_host``, ``encrypt``,
    ``lease``, ``start_timeout`` and ``cleanup_timeout`` are passed to
    :func:`~harnessd.launcher.serve`. ``lease`` also bounds how long execd outlives a
    harness that died without running any cleanup.

    ``workdir``: where commands run and relative paths resolve (created when
    missing, kept at teardown); by default a fresh directory under ``/tmp``
    that teardown removes. ``output_cap``: most bytes kept per output stream
    of ``run`` (head and tail; default execd's own cap). ``stop_grace``:
    seconds background services get between SIGTERM and SIGKILL at teardown.
    ``is_local``: whether programs in the workspace reach this machine's
    loopback (default: true only for a local execd).
    """

    type: Literal["execd"] = "execd"
    runtime: Any = Field(default=None, exclude=True)
    prefix: list[str] | None = None
    quote_for_remote_shell: bool = False
    scrub: list[str] = Field(default_factory=list)
    execd_command: list[str] | None = None
    bind_host: str = "127.0.0.1"
    connect_host: str | None = None
    encrypt: bool | str = False
    lease: float | None = 30.0
    start_timeout: float = 15.0
    cleanup_timeout: float = 10.0
    workdir: str | None = None
    output_cap: int | None = None
    stop_grace: float = 5.0
    is_local: bool | None = None


class ExecdRuntimeInfo(BaseRuntimeInfo):  # type: ignore[misc]
    """What a trace records about the execd a rollout ran in (``id`` is the session marker)."""

    type: Literal["execd"] = "execd"
    host: str | None = None
    port: int | None = None
    pid: int | None = None
    workdir: str | None = None
    log_path: str | None = None
    """execd's log in the workspace (removed by a clean stop, kept when teardown failed)."""
    prefix: list[str] | None = None


@dataclass
class _Box:
    """The physical resource every view of one ExecdRuntime shares."""

    workspace: WorkspaceRuntime
    execd_command: tuple[str, ...]
    session: Session | None = None
    workdir: str | None = None
    created_workdir: bool = False
    root: bool = False
    services: list[str] = field(default_factory=list)
    users: dict[str, tuple[int, int]] = field(default_factory=dict)
    cleaned: bool = False
    """The synchronous backstop ran: marked processes are gone, the runtime is unusable."""

    @property
    def running(self) -> bool:
        return self.session is not None and not self.session.closed and not self.cleaned


def _workspace_runtime(config: ExecdConfig) -> WorkspaceRuntime:
    if config.runtime is not None:
        if config.prefix is not None:
            raise ValueError("ExecdConfig: give either runtime or prefix, not both")
        if not isinstance(config.runtime, WorkspaceRuntime):
            raise TypeError("ExecdConfig.runtime must implement harnessd.runtime.Runtime")
        return config.runtime
    if config.prefix is not None:
        return CommandPrefixRuntime(
            config.prefix,
            quote_for_remote_shell=config.quote_for_remote_shell,
            scrub=config.scrub,
        )
    return LocalRuntime(scrub=config.scrub)


def _exit_code(result: shell.RunResult) -> int:
    """``Popen.returncode`` style: the exit status, or ``-N`` after signal ``N``."""
    if result.exit_code is not None:
        return result.exit_code
    return -(result.signal or 0)


def _sandbox_error(what: str, exc: HarnessError) -> ExecdSandboxError:
    message = f"{what}: {exc}"
    if isinstance(exc, NotFound):
        return ExecdFileNotFound(message, exc)
    if (
        isinstance(exc, SpawnFailed)
        and isinstance(exc.data, dict)
        and exc.data.get("errno") == "ENOENT"
    ):
        return ExecdFileNotFound(message, exc)
    return ExecdSandboxError(message, exc)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class ExecdProcess(RuntimeProcess):  # type: ignore[misc]
    """A live command in execd: stdout/stderr stream as bytes, stdin is fed from ``write``."""

    def __init__(self, client: ExecdClient, command: RunningCommand[shell.RunResult]) -> None:
        self._client = client
        self._command = command
        self._code: int | None = None
        self.stdout: AsyncIterator[bytes] = command.handle.stream(shell.STDOUT_STREAM)
        self.stderr: AsyncIterator[bytes] = command.handle.stream(shell.STDERR_STREAM)

    async def write(self, data: bytes) -> None:
        """Send ``data`` to the command's stdin."""
        try:
            await self._command.write_stdin(data)
        except HarnessError as exc:
            raise _sandbox_error("write to a process", exc) from exc

    async def close_stdin(self) -> None:
        """End the command's stdin (beyond verifiers' contract, for programs that read to EOF)."""
        with contextlib.suppress(HarnessError):
            await self._command.close_stdin()

    async def wait(self) -> int:
        """The exit status (``-N`` after signal ``N``), once the command has ended."""
        if self._code is None:
            try:
                result = await self._command.result()
            except HarnessError as exc:
                raise _sandbox_error("process", exc) from exc
            self._code = _exit_code(result)
        return self._code

    async def poll(self) -> int | None:
        """The exit status if the command has ended, else None, without waiting."""
        if self._code is None and self._command.handle.done:
            return await self.wait()
        return self._code

    async def terminate(self) -> None:
        """SIGTERM to the command's process group (nothing once it has ended)."""
        await self._signal(signal.SIGTERM)

    async def kill(self) -> None:
        """SIGKILL to the command's process group (nothing once it has ended)."""
        await self._signal(signal.SIGKILL)

    async def _signal(self, signum: int) -> None:
        if self._command.handle.done:
            return
        with contextlib.suppress(HarnessError):
            await self._command.signal(signum)


class ExecdRuntime(Runtime):  # type: ignore[misc]
    """A verifiers runtime whose commands, files and services live behind one execd.

    Construct it with an :class:`ExecdConfig` (``ExecdRuntime(ExecdConfig())``
    for a local execd), ``await start()``, pass it to ``Agent.run(task,
    runtime=...)`` or any hook, and ``await stop()`` when done. See the module
    docstring for how each method maps onto execd.
    """

    def __init__(self, config: ExecdConfig | None = None, name: str | None = None) -> None:
        super().__init__(name)
        self.config = config if config is not None else ExecdConfig()
        workspace = _workspace_runtime(self.config)
        command = self.config.execd_command or default_execd_command()
        self._box = _Box(workspace=workspace, execd_command=tuple(command))
        self.is_local = (
            self.config.is_local
            if self.config.is_local is not None
            else isinstance(workspace, LocalRuntime)
        )
        self.info = ExecdRuntimeInfo(prefix=self.config.prefix)

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Launch and connect to execd, make the working directory; register for exit cleanup."""
        box = self._box
        if box.session is not None:
            raise ExecdSandboxError(f"runtime {self.name!r} was already started")
        config = self.config
        box.session = await serve(
            box.workspace,
            execd_command=box.execd_command,
            bind_host=config.bind_host,
            connect_host=config.connect_host,
            lease=config.lease,
            encrypt=config.encrypt,
            start_timeout=config.start_timeout,
            cleanup_timeout=config.cleanup_timeout,
        )
        register(self)
        client = box.session.client
        try:
            box.root = (await client.server_info()).uid == 0
            if config.workdir is not None:
                await client.mkdir(config.workdir, parents=True, exist_ok=True)
                box.workdir = config.workdir
            else:
                # 0755 like a container's workdir, so a user view can enter it.
                path = f"/tmp/{self.name}-{secrets.token_hex(4)}"  # noqa: S108
                await client.mkdir(path, parents=False, exist_ok=False, mode=0o755)
                box.workdir, box.created_workdir = path, True
        except HarnessError as exc:
            raise _sandbox_error("preparing the working directory", exc) from exc
        self.info.id = box.session.marker
        self.info.host = box.session.host
        self.info.port = box.session.port
        self.info.pid = box.session.pid
        self.info.workdir = box.workdir
        self.info.log_path = box.session.log_path

    async def teardown(self) -> None:
        """Stop services, kill every marked process, remove the workdir made at start, stop execd.

        Idempotent and best-effort (verifiers' ``stop()`` shields it from
        cancellation). Nothing :meth:`cleanup` needs is dropped before the
        end, so the exit backstop still works if this is cut short.
        """
        box = self._box
        session = box.session
        if session is None or session.closed:
            return
        client = session.client
        grace = self.config.stop_grace
        with contextlib.suppress(HarnessError):
            await asyncio.gather(
                *(client.stop_service(name, grace=grace) for name in box.services),
                return_exceptions=True,
            )
        # Other users' marked processes first: closing the session closes the shell capability.
        for uid, _ in box.users.values():
            with contextlib.suppress(HarnessError):
                await client.run(self._cleanup_argv(uid), timeout=self.config.cleanup_timeout + 30)
        with contextlib.suppress(HarnessError):
            await client.cleanup(timeout=self.config.cleanup_timeout)
        if box.created_workdir and box.workdir is not None:
            with contextlib.suppress(HarnessError):
                await client.remove(box.workdir, recursive=True, missing_ok=True)
        report = await session.close(keep_log=False)
        if not report.clean:
            log.warning("runtime %s: marked processes survived teardown: %s", self.name, report)

    def cleanup(self) -> None:
        """Synchronously kill every marked process and remove the workdir; no event loop needed.

        verifiers runs this at interpreter exit for every runtime still live.
        It runs ``execd cleanup --marker`` (and ``rm -rf`` of the workdir and of
        the launch directory made at start) through the harnessd runtime with
        blocking subprocesses; execd itself exits when its lease runs out
        without a connection. Idempotent.
        """
        box = self._box
        if not box.running:
            return
        box.cleaned = True
        budget = self.config.cleanup_timeout + 30
        commands = [self._cleanup_argv(None)]
        commands += [self._cleanup_argv(uid) for uid, _ in box.users.values()]
        if box.created_workdir and box.workdir is not None:
            commands.append(["rm", "-rf", "--", box.workdir])
        session = box.session
        if session is not None and session.created_workdir:
            # The launch's own directory (token, execd's log), as stop() removes it.
            commands.append(["rm", "-rf", "--", session.workdir])
        for argv in commands:
            try:
                _run_blocking(box.workspace, argv, budget)
            except Exception as exc:
                log.warning("runtime %s: %s failed: %s", self.name, argv[0], exc)

    def _cleanup_argv(self, uid: int | None) -> list[str]:
        box = self._box
        assert box.session is not None
        argv = [
            *box.execd_command,
            "cleanup",
            "--marker",
            box.session.marker,
            "--marker-var",
            box.session.marker_var,
            "--timeout",
            str(self.config.cleanup_timeout),
        ]
        return argv if uid is None else [*argv, "--uid", str(uid)]

    # -- views -----------------------------------------------------------------------

    @property
    def supports_user(self) -> bool:
        """True once started against an execd that runs as root (``server.info`` uid 0)."""
        return self._box.root

    # -- commands --------------------------------------------------------------------

    def _client(self) -> ExecdClient:
        box = self._box
        if box.session is None or not box.running:
            raise ExecdSandboxError(f"runtime {self.name!r} is not running")
        return box.session.client

    def _path(self, path: str) -> str:
        assert self._box.workdir is not None
        return posixpath.join(self._box.workdir, path)

    async def _argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as this view's user: under ``setpriv`` with the user's ids and groups."""
        if self.user is None:
            return list(argv)
        ids = self._box.users.get(self.user)
        if ids is None:
            ids = await self._lookup_user(self.user)
            self._box.users[self.user] = ids
        uid, gid = ids
        return [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={gid}",
            "--init-groups",
            "--",
            *argv,
        ]

    async def _lookup_user(self, user: str) -> tuple[int, int]:
        client = self._client()
        found = await client.run(["sh", "-c", 'id -u -- "$1" && id -g -- "$1"', "sh", user])
        numbers = found.stdout.split()
        if _exit_code(found) != 0 or len(numbers) != 2:
            detail = found.stderr.decode("utf-8", "replace").strip()
            raise ExecdSandboxError(f"no user {user!r} in the workspace: {detail}")
        return int(numbers[0]), int(numbers[1])

    async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        """Run ``argv`` to completion; a non-zero exit is returned, never raised.

        Cancelling the awaiting task cancels the call: execd kills the
        command's process group.
        """
        client = self._client()
        try:
            result = await client.run(
                await self._argv(argv),
                cwd=self._box.workdir,
                env=self.process_env(env),
                output_cap=self.config.output_cap,
            )
        except HarnessError as exc:
            raise _sandbox_error(f"run {argv[:1]!r}", exc) from exc
        return ProgramResult(
            exit_code=_exit_code(result),
            stdout=result.stdout.decode(errors="replace"),
            stderr=result.stderr.decode(errors="replace"),
        )

    async def open_process(self, argv: list[str], env: dict[str, str]) -> RuntimeProcess:
        """Start ``argv`` with live stdio over one streaming ``shell.run`` call."""
        client = self._client()
        command = client.run_streaming(
            await self._argv(argv),
            cwd=self._box.workdir,
            env=self.process_env(env),
            stdin_stream=True,
        )
        return ExecdProcess(client, command)

    async def run_background(self, argv: list[str], env: dict[str, str], log: str) -> None:
        """Start ``argv`` as an execd service, stdout and stderr to ``log`` (truncated first).

        It runs until teardown, which stops it (SIGTERM, SIGKILL after
        ``stop_grace``) and kills whatever it left behind, in or out of its
        process group.
        """
        client = self._client()
        box = self._box
        path = self._path(log)
        name = f"vf-{len(box.services)}-{secrets.token_hex(4)}"
        try:
            await client.write_file(path, b"", atomic=False)
            await client.start_service(
                name,
                await self._argv(["/bin/sh", "-c", _MERGED_OUTPUT, "sh", *argv]),
                cwd=box.workdir,
                env=self.process_env(env),
                log=path,
            )
        except HarnessError as exc:
            raise _sandbox_error(f"run_background {argv[:1]!r}", exc) from exc
        finally:
            # Even a failed start is remembered: stopping a finished service sweeps its leftovers.
            box.services.append(name)

    # -- files -----------------------------------------------------------------------

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        """At most ``max_bytes`` bytes of ``path`` (whole file when None); execd sends no more."""
        target = self._path(path)
        if self.user is not None:
            reader = ["cat"] if max_bytes is None else ["head", "-c", str(max_bytes)]
            return await self._read_as_user(path, [*reader, "--", target])
        try:
            return await self._client().read_file(target, length=max_bytes)
        except HarnessError as exc:
            raise _sandbox_error(f"read {path!r}", exc) from exc

    async def write(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (atomically), creating missing parent directories."""
        target = self._path(path)
        if self.user is not None:
            await self._write_as_user(path, target, data)
            return
        try:
            await self._client().write_file(target, data, create_parents=True)
        except HarnessError as exc:
            raise _sandbox_error(f"write {path!r}", exc) from exc

    async def _read_as_user(self, path: str, reader: list[str]) -> bytes:
        command = self._client().run_streaming(
            await self._argv(reader), cwd=self._box.workdir, env=self.process_env({})
        )
        out: list[bytes] = []
        err: list[bytes] = []
        try:
            async for name, data in command.output():
                (out if name == shell.STDOUT_STREAM else err).append(data)
            code = _exit_code(await command.result())
        except HarnessError as exc:
            raise _sandbox_error(f"read {path!r}", exc) from exc
        if code != 0:
            detail = b"".join(err).decode(errors="replace").strip()[-500:]
            cls = ExecdFileNotFound if "No such file" in detail else ExecdSandboxError
            raise cls(f"read {path!r}: {detail}")
        return b"".join(out)

    async def _write_as_user(self, path: str, target: str, data: bytes) -> None:
        argv = await self._argv(["sh", "-c", _WRITE_AS_USER, "sh", target])
        command = self._client().run_streaming(
            argv, cwd=self._box.workdir, env=self.process_env({}), stdin_stream=True
        )
        try:
            for start in range(0, len(data), _BLOCK):
                await command.write_stdin(data[start : start + _BLOCK])
            await command.close_stdin()
            result = await command.result()
        except HarnessError as exc:
            command.cancel()
            raise _sandbox_error(f"write {path!r}", exc) from exc
        if _exit_code(result) != 0:
            detail = result.stderr.decode(errors="replace").strip()[-500:]
            raise ExecdSandboxError(f"write {path!r}: {detail}")

    # -- network -----------------------------------------------------------------------

    async def expose(self, port: int) -> str:
        """The URL of ``port`` in the workspace as seen from here: execd's own address."""
        session = self._box.session
        host = session.host if session is not None else "127.0.0.1"
        return f"http://{_url_host(host)}:{port}"


def _run_blocking(workspace: WorkspaceRuntime, argv: list[str], timeout: float) -> None:
    """Run ``argv`` in the workspace without an event loop (exit-time cleanup).

    The built-in runtimes become one plain subprocess with their scrubbed
    environment; any other runtime's ``run`` coroutine gets a private event
    loop, in a thread when this thread already runs one.
    """
    command: list[str] | None = None
    if isinstance(workspace, LocalRuntime):
        command, env = argv, workspace.env
    elif isinstance(workspace, CommandPrefixRuntime):
        command, env = workspace.wrap(argv), workspace.env
    if command is not None:
        subprocess.run(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
            start_new_session=True,
            check=False,
        )
        return

    def drive() -> None:
        asyncio.run(workspace.run(argv, timeout=timeout))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        drive()
        return
    worker = threading.Thread(target=drive, name="execd-cleanup", daemon=True)
    worker.start()
    worker.join(timeout + 5)
