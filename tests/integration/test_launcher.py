"""The launcher and runtimes against real execd processes: serve, close, crash, loss, leaks."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import harnessd.token
from execd.marker import find_marked
from harnessd import launcher
from harnessd.errors import ConnectionLost, LaunchFailed, ProtocolViolation
from harnessd.launcher import Session, serve
from harnessd.runtime import (
    CommandPrefixRuntime,
    LocalRuntime,
    Runtime,
    WorkspaceError,
    remove_workdir,
)
from tests.conftest import eventually, one_loop
from tests.support.procs import alive, cmdline

pytestmark = [pytest.mark.anyio, one_loop, pytest.mark.timeout(60)]

MARKER_VAR = "EXECD_MARKER"

# Three ways to escape a process tree: double fork + setsid, nohup, a backgrounded child.
ESCAPEES = (
    "setsid sh -c 'sleep 301 </dev/null >/dev/null 2>&1 &' </dev/null >/dev/null 2>&1 & "
    "nohup sleep 302 </dev/null >/dev/null 2>&1 & "
    "sh -c 'sleep 303 </dev/null >/dev/null 2>&1 &'"
)


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every token the launcher makes during the test, so the test can look for leaks."""
    made: list[str] = []
    real = harnessd.token.new_token

    def recording() -> str:
        token = real()
        made.append(token)
        return token

    monkeypatch.setattr("harnessd.launcher.new_token", recording)
    yield made


def private(tmp_path: Path) -> dict[str, Any]:
    """serve() options keeping the workdir and execd's state under the test's tmp_path."""
    return {
        "workdir": str(tmp_path / "work"),
        "extra_args": ("--state-dir", str(tmp_path / "state")),
    }


def _escapees(marker: str) -> list[int]:
    return [
        pid
        for pid in find_marked(MARKER_VAR, marker)
        if any(f"sleep {n}" in cmdline(pid) for n in (301, 302, 303))
    ]


async def _start_escapees(session: Session) -> list[int]:
    result = await session.client.run(command=ESCAPEES, timeout=30)
    assert result.exit_code == 0, result

    def three() -> list[int]:
        found = _escapees(session.marker)
        return found if len(found) >= 3 else []

    return await eventually(three, what="three escapees")


# -- serve and close ---------------------------------------------------------------


async def test_serve_run_close_leaves_nothing(tmp_path: Path) -> None:
    session = await serve(extra_args=("--state-dir", str(tmp_path / "state")))
    try:
        assert session.workdir.startswith("/tmp/execd-")
        assert stat.S_IMODE(os.stat(session.workdir).st_mode) == 0o700
        assert len(session.marker) == 32
        result = await session.client.run(["sh", "-c", 'echo "hi $EXECD_MARKER"'])
        assert result.exit_code == 0
        assert result.stdout == f"hi {session.marker}\n".encode()
        info = await session.client.server_info()
        assert info.pid == session.pid
        assert info.marker == session.marker
        detached = await session.client.run_detached(["sleep", "300"])
        # Until the kernel has finished the exec, /proc shows an empty environment.
        await eventually(
            lambda: detached.pid in find_marked(MARKER_VAR, session.marker), what="marked"
        )
        assert os.listdir(session.workdir) == [os.path.basename(session.log_path)]
    finally:
        first = await session.close()
    assert first.clean
    assert first.remaining == ()
    assert not first.fallback_ran
    assert first.rpc_error is None
    assert not alive(detached.pid)
    assert first.worker_exited
    assert first.exit_code == 0
    assert find_marked(MARKER_VAR, session.marker) == []
    assert await session.close() is first
    assert session.closed
    # A clean close leaves no log behind, nor the directory serve() made for it.
    assert not first.log_kept
    assert not os.path.exists(session.workdir)
    # execd may say goodbye (an Abort) before the client closes its side.
    with pytest.raises((ConnectionLost, ProtocolViolation)):
        await session.client.noop()
    with pytest.raises(ConnectionLost):
        await session.reconnect()


async def test_async_with_and_log_removal(tmp_path: Path) -> None:
    async with serve(extra_args=("--state-dir", str(tmp_path / "state"))) as session:
        await session.client.noop()
        workdir = session.workdir
    assert session.closed
    result = await session.close()
    assert result.clean and not result.log_kept and result.housekeeping_error is None
    assert not os.path.exists(workdir)

    # Kept on demand, though the close was clean.
    session = await serve(extra_args=("--state-dir", str(tmp_path / "state")))
    result = await session.close(keep_log=True)
    assert result.clean and result.log_kept and result.housekeeping_error is None
    assert os.listdir(session.workdir) == [os.path.basename(session.log_path)]
    shutil.rmtree(session.workdir)

    # A directory given to serve() stays; what execd wrote into it goes.
    given = tmp_path / "given"
    async with serve(
        workdir=str(given), extra_args=("--state-dir", str(tmp_path / "state"))
    ) as session:
        assert stat.S_IMODE(given.stat().st_mode) == 0o700
    assert list(given.iterdir()) == []


# Behaves like ssh: the arguments are joined with spaces and run by a shell.
REMOTE_SHELL = ["sh", "-c", 'exec /bin/sh -c "$*"', "sh"]


@pytest.mark.parametrize(
    "runtime",
    [
        pytest.param(CommandPrefixRuntime(["env", "FOO=bar"]), id="env"),
        pytest.param(
            CommandPrefixRuntime(["env", "FOO=bar", *REMOTE_SHELL], quote_for_remote_shell=True),
            id="remote-shell",
        ),
    ],
)
async def test_prefix_runtime_wraps_every_command(runtime: Runtime, tmp_path: Path) -> None:
    async with serve(
        runtime,
        workdir=str(tmp_path / "work dir 'quoted'"),
        extra_args=("--state-dir", str(tmp_path / "state")),
    ) as session:
        assert session.runtime is runtime
        result = await session.client.run(["sh", "-c", 'printf %s "$FOO"'])
        assert result.stdout == b"bar"
        await _start_escapees(session)
        os.kill(session.pid, signal.SIGKILL)
    assert session.closed
    closed = await session.close()
    assert closed.fallback_ran and closed.clean
    assert find_marked(MARKER_VAR, session.marker) == []


# -- the runtimes ------------------------------------------------------------------


RUNTIMES = [
    pytest.param(LocalRuntime(), id="local"),
    pytest.param(CommandPrefixRuntime(["sh", "-c", 'exec "$@"', "sh"]), id="prefix"),
    pytest.param(
        CommandPrefixRuntime(REMOTE_SHELL, quote_for_remote_shell=True), id="remote-shell"
    ),
]


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_runtime_operations(runtime: Runtime, tmp_path: Path) -> None:
    odd = tmp_path / 'it\'s a "dir" $(x)'
    target = odd / "sub" / "secret; rm -rf ~"
    await runtime.write_file(str(target), b"s3cret\n", make_parents=True)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(odd.stat().st_mode) == 0o700
    assert target.read_bytes() == b"s3cret\n"
    assert await runtime.read_file(str(target)) == b"s3cret\n"
    with pytest.raises(WorkspaceError):
        await runtime.read_file(str(target), max_bytes=3)
    with pytest.raises(WorkspaceError):
        await runtime.write_file(str(target), b"again")
    assert target.read_bytes() == b"s3cret\n"
    link = odd / "link"
    link.symlink_to(odd / "elsewhere")
    with pytest.raises(WorkspaceError):
        await runtime.write_file(str(link), b"x")
    assert not (odd / "elsewhere").exists()
    public = odd / "public"
    await runtime.write_file(str(public), b"", mode=0o644)
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    with pytest.raises(WorkspaceError):
        await runtime.read_file(str(odd / "missing"))

    echoed = await runtime.run(["cat"], stdin=b"x" * 300_000)
    assert echoed.exit_code == 0 and echoed.stdout == b"x" * 300_000
    failed = await runtime.run(["sh", "-c", "echo oops >&2; exit 7"])
    assert (failed.exit_code, failed.stderr) == (7, b"oops\n")
    started = time.monotonic()
    with pytest.raises(WorkspaceError, match="timed out"):
        await runtime.run(["sleep", "30"], timeout=0.3)
    assert time.monotonic() - started < 10

    log = odd / "bg.log"
    report = odd / "bg.report"
    script = (
        'echo "out $1"; echo err >&2; '
        "sid=$(cut -d' ' -f6 /proc/$$/stat); "
        'printf "%s %s" "$sid" "$(readlink /proc/$$/fd/0)" > "$0.tmp" && mv "$0.tmp" "$0"'
    )
    await runtime.start_background(["sh", "-c", script, str(report), "a b"], log_path=str(log))
    await eventually(report.exists)
    sid, stdin = report.read_text().split()
    assert int(sid) != os.getsid(0)
    assert stdin == "/dev/null"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    await eventually(lambda: log.read_bytes().count(b"\n") >= 2)
    assert sorted(log.read_bytes().splitlines()) == [b"err", b"out a b"]


async def test_remove_workdir_refuses_dangerous_paths(tmp_path: Path) -> None:
    runtime = LocalRuntime()
    for bad in ("/", "relative/dir", "/tmp/../", "//"):
        with pytest.raises(ValueError):
            await remove_workdir(runtime, bad)
    victim = tmp_path / "w"
    (victim / "deep").mkdir(parents=True)
    (victim / "deep" / "f").write_text("x")
    await remove_workdir(runtime, str(victim))
    assert not victim.exists()


# -- failed launches ---------------------------------------------------------------


async def test_crash_at_start_fails_fast_with_log_tail(tmp_path: Path, tokens: list[str]) -> None:
    crash = [
        sys.executable,
        "-c",
        "import sys; print('boom', file=sys.stderr); sys.exit(3)",
    ]
    workdir = tmp_path / "w"
    started = time.monotonic()
    with pytest.raises(LaunchFailed) as caught:
        await serve(execd_command=crash, workdir=str(workdir))
    elapsed = time.monotonic() - started
    assert elapsed < 10, elapsed
    message = str(caught.value)
    assert "boom" in message
    assert "status 3" in message
    assert tokens and tokens[0] not in message
    assert [p.name for p in workdir.iterdir() if p.name.startswith("token")] == []


FAKE_WORKER = """\
import json, os, socket, sys, time
args = sys.argv[1:]
marker = args[args.index("--marker") + 1]
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
print(json.dumps({"event": "listening", "host": "127.0.0.1", "port": sock.getsockname()[1],
                  "pid": os.getpid(), "marker": marker, "protocol": 1}), flush=True)
if sys.argv[1] == "loud":
    print(json.dumps({"event": "exited", "code": 1, "error": "fell over"}), flush=True)
    sys.exit(1)
time.sleep(0.01)
os._exit(5)
"""


@pytest.mark.parametrize("mode", ["loud", "silent"])
async def test_crash_right_after_announcing_fails(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    started = time.monotonic()
    with pytest.raises(LaunchFailed) as caught:
        await serve(execd_command=[sys.executable, str(script), mode], workdir=str(tmp_path / "w"))
    assert time.monotonic() - started < 10
    if mode == "loud":
        assert "fell over" in str(caught.value)


async def test_start_timeout_and_cancelled_launch_remove_the_token(tmp_path: Path) -> None:
    tag = f"hang-{os.getpid()}-{time.monotonic_ns()}"

    def hang(launch: str) -> list[str]:
        """A worker that never announces, tagged with ``launch``."""
        return [sys.executable, "-c", "import time; time.sleep(60)", f"{tag}-{launch}"]

    def hangers(launch: str = "") -> list[int]:
        return [
            int(entry)
            for entry in os.listdir("/proc")
            if entry.isdigit()
            and f"{tag}-{launch}" in cmdline(int(entry))
            and "sleep(60)" in cmdline(int(entry))
        ]

    def tokens(workdir: Path) -> list[str]:
        return [p.name for p in workdir.iterdir() if p.name.startswith("token")]

    try:
        first = tmp_path / "a"
        with pytest.raises(LaunchFailed, match="did not announce"):
            await serve(execd_command=hang("a"), workdir=str(first), start_timeout=0.5)
        assert tokens(first) == []

        second = tmp_path / "b"
        task = asyncio.ensure_future(serve(execd_command=hang("b"), workdir=str(second)))
        # Cancelled while it waits for the announcement: the token is out, the worker runs.
        await eventually(lambda: hangers("b"), what="the worker running")
        assert tokens(second) != []
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tokens(second) == []
    finally:
        for pid in hangers():
            os.kill(pid, signal.SIGKILL)


# -- cleanup -----------------------------------------------------------------------


async def test_close_kills_every_escapee(tmp_path: Path) -> None:
    async with serve(**private(tmp_path)) as session:
        escapees = await _start_escapees(session)
        result = await session.close()
    assert result.clean and not result.fallback_ran
    assert result.killed >= 3
    assert find_marked(MARKER_VAR, session.marker) == []
    assert not any(alive(pid) for pid in escapees)


async def test_cancelled_close_still_cleans_up(tmp_path: Path) -> None:
    session = await serve(**private(tmp_path))
    await _start_escapees(session)
    closing = asyncio.ensure_future(session.close())
    await asyncio.sleep(0)  # one turn of the loop: the close is under way
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert find_marked(MARKER_VAR, session.marker) == []
    result = await session.close()
    assert result.clean


async def test_fallback_cleanup_after_execd_is_killed(tmp_path: Path) -> None:
    session = await serve(**private(tmp_path))
    escapees = await _start_escapees(session)
    os.kill(session.pid, signal.SIGKILL)
    result = await session.close()
    assert result.fallback_ran
    assert result.rpc_error is not None
    assert result.fallback_error is None
    assert result.remaining == ()
    assert result.clean
    assert result.killed >= 3
    assert result.worker_exited and result.exit_code == 128 + signal.SIGKILL
    assert find_marked(MARKER_VAR, session.marker) == []
    assert not any(alive(pid) for pid in escapees)
    # The close was not clean (the RPC failed, execd died of a signal): the log stays.
    assert result.log_kept
    with open(session.log_path, "rb") as handle:
        assert b'"listening"' in handle.read()
    # Unless the caller says otherwise.
    again = await serve(**private(tmp_path))
    os.kill(again.pid, signal.SIGKILL)
    dropped = await again.close(keep_log=False)
    assert dropped.fallback_ran and not dropped.log_kept
    assert not os.path.exists(again.log_path)


# -- connection loss ---------------------------------------------------------------


async def test_connection_loss_is_detected_and_reconnect_works(tmp_path: Path) -> None:
    session = await serve(keepalive=0.5, **private(tmp_path))
    try:
        old = session.client
        await old.noop()
        os.kill(session.pid, signal.SIGSTOP)
        try:
            in_flight = asyncio.ensure_future(old.noop())
            started = time.monotonic()
            await eventually(lambda: old.closed, timeout=20, what="the loss detected")
            assert time.monotonic() - started < 10
        finally:
            os.kill(session.pid, signal.SIGCONT)
        # The call in flight was reattached on a new connection the session made by itself.
        await asyncio.wait_for(in_flight, 60)
        assert session.client is not old
        client = await session.reconnect()
        assert session.client is client is not old
        assert await client.echo(b"again") == b"again"
        with pytest.raises(ConnectionLost):
            await old.noop()
    finally:
        result = await session.close()
    assert result.clean and not result.fallback_ran


async def test_reconnect_replaces_a_live_client(tmp_path: Path) -> None:
    async with serve(**private(tmp_path)) as session:
        old = session.client
        await session.reconnect()
        await session.client.noop()
        with pytest.raises(ConnectionLost):
            await old.noop()


# -- the token ---------------------------------------------------------------------


def _processes_holding(needle: bytes) -> list[tuple[int, str]]:
    hits = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        for name in ("cmdline", "environ"):
            try:
                with open(f"/proc/{entry}/{name}", "rb") as handle:
                    if needle in handle.read():
                        hits.append((int(entry), name))
            except OSError:
                continue
    return hits


async def test_token_never_leaks(tmp_path: Path, tokens: list[str]) -> None:
    session = await serve(**private(tmp_path))
    try:
        token = tokens[-1].encode()
        child = await session.client.run_detached(["sleep", "300"])
        shown = await session.client.run(["sh", "-c", "env; cat /proc/$$/environ"])
        assert shown.exit_code == 0
        assert token not in shown.stdout
        assert _processes_holding(token) == []
        await eventually(
            lambda: child.pid in find_marked(MARKER_VAR, session.marker), what="marked"
        )
        assert token.decode() not in repr(session)
        assert [p for p in os.listdir(session.workdir) if p.startswith("token")] == []
    finally:
        assert (await session.close(keep_log=True)).log_kept
    with open(session.log_path, "rb") as handle:
        assert token not in handle.read()


# -- lease -------------------------------------------------------------------------

# Runs execd after writing its argv to ARGV_FILE (one item a line).
_RECORD_ARGV = 'printf "%s\\n" "$@" > "$ARGV_FILE"; exec "$PYTHON" -m execd "$@"'


async def test_every_launched_execd_has_a_lease_unless_it_is_turned_off(tmp_path: Path) -> None:
    record = tmp_path / "argv"
    command = [
        "env",
        f"ARGV_FILE={record}",
        f"PYTHON={sys.executable}",
        "sh",
        "-c",
        _RECORD_ARGV,
        "sh",
    ]

    async def launched_with(**options: Any) -> list[str]:
        async with serve(execd_command=command, **private(tmp_path), **options) as session:
            await session.client.noop()
        return record.read_text().splitlines()

    default = await launched_with()
    assert default[default.index("--lease") + 1] == repr(launcher.DEFAULT_LEASE)
    chosen = await launched_with(lease=7.5)
    assert chosen[chosen.index("--lease") + 1] == "7.5"
    assert "--lease" not in await launched_with(lease=None)


@pytest.mark.parametrize("lease", [0.0, -1.0, float("nan"), float("inf")])
def test_a_lease_must_be_a_positive_number_of_seconds(lease: float) -> None:
    with pytest.raises(ValueError, match="lease"):
        serve(lease=lease)


def test_a_lease_needs_keepalive_pings() -> None:
    with pytest.raises(ValueError, match="keepalive"):
        serve(lease=10.0, keepalive=None)
    serve(lease=None, keepalive=None)  # no lease, no pings: allowed


# Keeps a copy of the token file, then runs execd with the copy once the file $GATE
# exists: a worker that announces only after its launch was given up. Python and
# execd's modules load before the gate, so the announcement follows the gate at once
# (the launch waits a few seconds for a late worker; a Python start on a loaded
# machine could take longer).
_SLOW_START = """
kept=""
prev=""
for arg in "$@"; do
    if [ "$prev" = --token-file ]; then kept="$arg.kept"; cp "$arg" "$kept"; fi
    prev=$arg
done
exec "$PYTHON" -c '
import os, runpy, sys, time
import execd.__main__
while not os.path.exists(os.environ["GATE"]):
    time.sleep(0.01)
runpy.run_module("execd", run_name="__main__", alter_sys=True)
' "$@" --token-file "$kept"
"""


async def _cancelled_before_the_announcement(
    tmp_path: Path, find: Callable[[], Path | None], **options: Any
) -> Path:
    """A launch cancelled while its worker waits at the gate, the worker let go after; its workdir.

    ``find`` finds the launch's working directory once it exists.
    """
    gate = tmp_path / "gate"
    command = ["env", f"PYTHON={sys.executable}", f"GATE={gate}", "sh", "-c", _SLOW_START, "sh"]
    task = asyncio.ensure_future(serve(execd_command=command, **options))

    def tokens() -> list[str]:
        where = find()
        return (
            [] if where is None else [p.name for p in where.iterdir() if p.name.startswith("token")]
        )

    # The worker holds its copy of the token and waits at the gate: no announcement yet.
    await eventually(lambda: any(n.endswith(".kept") for n in tokens()), what="the worker waiting")
    made = find()
    assert made is not None
    task.cancel()
    # The launch has given up (its token is gone) before the worker may start.
    await eventually(lambda: all(n.endswith(".kept") for n in tokens()), what="the launch given up")
    gate.touch()
    with pytest.raises(asyncio.CancelledError):
        await task
    return made


async def test_a_launch_cancelled_before_the_announcement_still_closes_execd(
    tmp_path: Path,
) -> None:
    given = tmp_path / "work"
    workdir = await _cancelled_before_the_announcement(
        tmp_path,
        lambda: given if given.exists() else None,
        workdir=str(given),
        extra_args=("--state-dir", str(tmp_path / "s")),
    )
    log = next(workdir.glob("execd-*.log")).read_text()
    # By the time the cancelled launch returned, the late worker had announced and
    # been told to shut down: its own exit line and the supervisor's are both there.
    assert '"event": "listening"' in log
    listening = next(line for line in log.splitlines() if '"listening"' in line)
    pid = int(listening.split('"pid": ')[1].split(",")[0])
    await eventually(lambda: not alive(pid), timeout=15, what="the late worker's exit")
    # The supervisor writes its line once it has seen the worker exit: a moment later.
    await eventually(
        lambda: '"source": "supervisor"' in next(workdir.glob("execd-*.log")).read_text(),
        timeout=15,
        what="the supervisor's exit line",
    )


async def test_a_cancelled_launch_removes_the_directory_it_made_once_execd_closed(
    tmp_path: Path,
) -> None:
    marker = secrets.token_hex(16)

    def made() -> Path | None:
        logs = Path("/tmp").glob(f"execd-*/execd-{marker[:12]}.log")
        return next((log.parent for log in logs), None)

    workdir = await _cancelled_before_the_announcement(tmp_path, made, marker=marker)
    # Nothing went wrong that a log would tell: the launch was cancelled, execd closed cleanly.
    assert not workdir.exists()
