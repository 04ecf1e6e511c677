"""Two hosts for real: harness and workspace in network namespaces, execd as its own user.

Root only. Each run builds two network namespaces joined by a veth pair, an
nftables ruleset in the workspace that rejects every new connection toward
the harness, and a fresh system user; everything is removed afterwards, also
when a test fails (see :mod:`tests.e2e.netns`).

The harness side runs in a child process inside the harness namespace
(:func:`harness_entry`): it launches execd through
:class:`~harnessd.runtime.CommandPrefixRuntime` as
``ip netns exec <workspace> setpriv --reuid U --regid G --clear-groups env -i ...``
(the ``env -i`` gives the worker a clean environment: the prefix would
otherwise hand the harness's own environment, model credentials included,
to the workspace), drives a scripted agent session plus watches, services,
sessions and the ledger across the namespaces, probes isolation and cleanup,
and prints its observations as one JSON line that the test asserts on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from execd.marker import child_environment, find_marked
from protocol.values import new_marker
from tests.conftest import eventually_blocking
from tests.e2e.netns import (
    HostsUnavailable,
    SystemUser,
    TwoHosts,
    is_alive,
    kill_pids,
    missing_tools,
    pids_of_uid,
    system_user,
    two_hosts,
)
from tests.support.procs import cmdline
from tests.support.worker_env import WorkerPython, worker_python_or_skip

T = TypeVar("T")

REPO_ROOT = str(Path(__file__).resolve().parents[2])
MARKER_VAR = "EXECD_MARKER"
SECRET_VAR = "OPENAI_API_KEY"
SLEEP = shutil.which("sleep") or "/bin/sleep"
ROOT_SLEEP_SECONDS = "3200"

pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux namespaces"),
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0,
        reason="needs root to create network namespaces, nftables rules and users",
    ),
    pytest.mark.skipif(
        bool(missing_tools()), reason=f"missing tools: {', '.join(missing_tools())}"
    ),
]

# Tries one TCP connection: prints "connected <reply>" and exits 0, or
# "failed <errno name>" and exits 3.
CONNECT = r"""
import errno, socket, sys
host, port, who = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    sock = socket.create_connection((host, port), timeout=5)
except OSError as exc:
    print("failed", errno.errorcode.get(exc.errno or 0, type(exc).__name__))
    sys.exit(3)
with sock:
    sock.sendall(who.encode())
    print("connected", sock.recv(100).decode())
"""

# Listens on argv[1] (port 0), prints the port, then answers every connection
# with "ack <what it sent>" and prints "peer <address> <what it sent>".
LISTEN = r"""
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(16)
print(server.getsockname()[1], flush=True)
while True:
    conn, peer = server.accept()
    with conn:
        data = conn.recv(100)
        conn.sendall(b"ack " + data)
        print("peer", peer[0], data.decode(), flush=True)
"""

# Double fork into a new session, then become "sleep 3104": a classic daemon.
DAEMONIZE = r"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        fd = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(fd, target)
        os.execvp("sleep", ["sleep", "3104"])
    os._exit(0)
os.wait()
"""

ESCAPE_TAGS = ("3101", "3102", "3103", "3104", "3105", "3106", "3107")


# -- fixtures ----------------------------------------------------------------------------


def available(make: Callable[[], contextlib.AbstractContextManager[T]], what: str) -> Iterator[T]:
    """A fixture body: what ``make()`` enters, for the module, or its tests skipped."""
    with contextlib.ExitStack() as stack:
        try:
            value = stack.enter_context(make())
        except HostsUnavailable as exc:
            pytest.skip(f"{what}: {exc}")
        yield value


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    yield from available(two_hosts, "cannot build the two namespaces")


@pytest.fixture(scope="module")
def worker_user() -> Iterator[SystemUser]:
    yield from available(system_user, "cannot create a workspace user")


def run_as(user: SystemUser) -> list[str]:
    """The prefix that drops to the workspace user."""
    return ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"]


@pytest.fixture(scope="module")
def worker_python(worker_user: SystemUser) -> Iterator[WorkerPython]:
    yield from worker_python_or_skip(run_as(worker_user))


@pytest.fixture
def workspace_root(worker_user: SystemUser) -> Iterator[Path]:
    """A private directory owned by the workspace user (its HOME, execd's cwd)."""
    root = Path(tempfile.mkdtemp(prefix="sx-ws-"))
    try:
        os.chown(root, worker_user.uid, worker_user.gid)
        os.chmod(root, 0o700)
        yield root
    finally:
        kill_pids(pids_of_uid(worker_user.uid))
        shutil.rmtree(root, ignore_errors=True)


# -- helpers -------------------------------------------------------------------------------


def root_python(argv: list[str]) -> list[str]:
    return [sys.executable, "-c", *argv]


def start_listener(hosts: TwoHosts, in_harness: bool) -> tuple[subprocess.Popen[str], int]:
    addr = hosts.harness_addr if in_harness else hosts.workspace_addr
    wrap = hosts.in_harness if in_harness else hosts.in_workspace
    proc = subprocess.Popen(
        wrap(root_python([LISTEN, addr])),
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"listener did not start: {line!r}"
    return proc, int(line)


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out or ""


def try_connect(prefix: list[str], host: str, port: int, who: str) -> tuple[int, str]:
    result = subprocess.run(
        [*prefix, *root_python([CONNECT, host, str(port), who])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.returncode, result.stdout.strip()


def wait_for_comm(pid: int, comm: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} never became {comm!r}")


# -- the tests -----------------------------------------------------------------------------


def test_only_the_harness_can_open_connections(hosts: TwoHosts) -> None:
    """Root processes in each namespace: harness -> workspace works, the reverse is rejected."""
    harness_listener, harness_port = start_listener(hosts, in_harness=True)
    workspace_listener, workspace_port = start_listener(hosts, in_harness=False)
    try:
        from_workspace = try_connect(
            hosts.in_workspace([]), hosts.harness_addr, harness_port, "workspace"
        )
        from_harness = try_connect(
            hosts.in_harness([]), hosts.harness_addr, harness_port, "harness"
        )
        to_workspace = try_connect(
            hosts.in_harness([]), hosts.workspace_addr, workspace_port, "harness"
        )
    finally:
        harness_seen = stop(harness_listener)
        workspace_seen = stop(workspace_listener)
    assert from_workspace == (3, "failed ECONNREFUSED"), from_workspace
    assert from_harness == (0, "connected ack harness"), from_harness
    # The workspace's answers flow back over a connection the harness opened.
    assert to_workspace == (0, "connected ack harness"), to_workspace
    assert harness_seen.splitlines() == [f"peer {hosts.harness_addr} harness"]
    assert workspace_seen.splitlines() == [f"peer {hosts.harness_addr} harness"]


def test_agent_session_across_namespaces(
    hosts: TwoHosts,
    worker_user: SystemUser,
    worker_python: WorkerPython,
    workspace_root: Path,
) -> None:
    marker = new_marker()
    secret = f"sk-fake-{secrets.token_hex(16)}"
    plain = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    root_owned = subprocess.Popen(
        hosts.in_workspace([SLEEP, ROOT_SLEEP_SECONDS]),
        env=child_environment(plain, MARKER_VAR, marker),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_comm(root_owned.pid, "sleep")
        assert find_marked(MARKER_VAR, marker, uid=0) == [root_owned.pid]
        config = HarnessConfig(
            workspace_ns=hosts.workspace_ns,
            harness_addr=hosts.harness_addr,
            workspace_addr=hosts.workspace_addr,
            uid=worker_user.uid,
            gid=worker_user.gid,
            user=worker_user.name,
            python=worker_python.python,
            pythonpath=worker_python.path,
            root=str(workspace_root),
            marker=marker,
            root_pid=root_owned.pid,
        )
        child = subprocess.run(
            hosts.in_harness([sys.executable, "-c", HARNESS_BOOT, REPO_ROOT]),
            input=msgspec.json.encode(config),
            capture_output=True,
            env={**os.environ, SECRET_VAR: secret},
            cwd=str(workspace_root),
            timeout=240,
            check=False,
        )
        stderr = child.stderr.decode(errors="replace")
        assert child.returncode == 0, f"harness side failed:\n{stderr[-6000:]}"
        facts: dict[str, Any] = json.loads(child.stdout.decode().strip().splitlines()[-1])
        print(json.dumps({k: v for k, v in facts.items() if k != "workspace_env"}, indent=1))

        # The harness reached execd on the workspace address it announced, encrypted.
        announced = facts["announced"]
        assert announced["host"] == hosts.workspace_addr
        assert announced["port"] == announced["log_port"] > 0
        assert announced["uid"] == worker_user.uid
        assert announced["cipher"] != "none"

        # The workspace cannot open a connection to the harness; the harness can.
        assert facts["workspace_connect"] == {"exit_code": 3, "out": "failed ECONNREFUSED"}
        assert facts["harness_connect"] == "connected ack harness"
        assert facts["listener_peers"] == [hosts.harness_addr]

        # No model credential anywhere in the workspace.
        assert SECRET_VAR not in facts["workspace_env"]
        assert secret not in facts["workspace_env"]
        assert f"{MARKER_VAR}={marker}" in facts["workspace_env"]
        escaped = facts["escaped"]
        scan = facts["environ_scan"]
        assert announced["pid"] in scan["scanned"], scan
        assert set(escaped.values()) <= set(scan["scanned"]), scan
        assert scan["with_secret"] == [] and scan["unreadable"] == [], scan
        assert secret not in stderr

        # The scripted agent session ran every tool across the namespaces.
        agent = facts["agent"]
        assert agent["stop_reason"] == "finished", agent
        assert agent["tool_errors"] == 0, agent
        assert agent["tool_calls"] == 13, agent
        texts = "\n".join(agent["texts"])
        for expected in ("hello two-hosts", "hi from app", "GET /out.txt"):
            assert expected in texts, (expected, agent["texts"])
        assert agent["verified"] == agent["ledger_seq"] >= 20
        assert agent["remote_head"] == agent["ledger_seq"]
        assert facts["watch"] == ["created", "closed_write"]

        # The worker cannot signal another user's process.
        kill = facts["kill_root"]
        assert kill["exit_code"] != 0 and "not permitted" in kill["stderr"].lower(), kill
        assert facts["root_marked_before_close"] == [root_owned.pid]

        # Close killed every marked process of the worker, however it had escaped.
        assert sorted(escaped) == sorted(ESCAPE_TAGS), escaped
        close = facts["close"]
        assert close["clean"] and close["remaining"] == [], close
        assert close["worker_exited"] and not close["fallback_ran"], close
        assert close["killed"] >= 4, close
        assert facts["alive_after_close"] == [], facts["alive_after_close"]
        assert facts["marked_after_close"] == []
        assert facts["children_left"] == 0

        # ... and spared the root-owned process that carries a copy of the marker.
        assert root_owned.poll() is None
        assert is_alive(root_owned.pid)
        assert find_marked(MARKER_VAR, marker, uid=0) == [root_owned.pid]
        for pid in escaped.values():
            assert not is_alive(pid)
        assert pids_of_uid(worker_user.uid) == []
    finally:
        root_owned.kill()
        root_owned.wait(timeout=30)
    assert root_owned.returncode == -signal.SIGKILL


class CredentialLeak(AssertionError):
    """The model's credential showed up in the workspace."""


def test_readme_prefix_keeps_model_credentials_out(
    hosts: TwoHosts, worker_user: SystemUser, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harnessd.runtime import CommandPrefixRuntime

    secret = f"sk-fake-{secrets.token_hex(16)}"
    monkeypatch.setenv(SECRET_VAR, secret)
    runtime = CommandPrefixRuntime(hosts.in_workspace(run_as(worker_user)))
    result = asyncio.run(runtime.run(["env"], timeout=60))
    assert result.exit_code == 0, result
    assert b"PATH=" in result.stdout
    if secret.encode() in result.stdout:
        raise CredentialLeak(f"{SECRET_VAR} reached the workspace through the prefix")


def test_workspace_example_across_namespaces(
    hosts: TwoHosts,
    worker_user: SystemUser,
    worker_python: WorkerPython,
    workspace_root: Path,
) -> None:
    """examples/workspace.py as docs/runtime.md runs it for a network namespace."""
    clean_env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(workspace_root),
        **worker_python.environment(),
    }
    via = hosts.in_workspace(
        [*run_as(worker_user), "env", "-i", *(f"{k}={v}" for k, v in clean_env.items())]
    )
    probe = (
        f'id -u; grep -c "{hosts.workspace_if}:" /proc/net/dev; '
        'test -n "$EXECD_MARKER" && echo marked; pwd'
    )
    example = [
        *(sys.executable, str(Path(REPO_ROOT) / "examples" / "workspace.py")),
        *("--via", shlex.join(via), "--execd", shlex.join(worker_python.execd_command())),
        *("--bind-host", "0.0.0.0", "--connect-host", hosts.workspace_addr, "--encrypt"),
        *("--cwd", str(workspace_root), "--", "sh", "-c", probe),
    ]
    done = subprocess.run(
        hosts.in_harness(example),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == [str(worker_user.uid), "1", "marked", str(workspace_root)]
    # Closing the session ended execd and everything of the worker's (the last of
    # them may still be on its way out when the example returns).
    eventually_blocking(lambda: pids_of_uid(worker_user.uid) == [], what="no worker process")


# -- the harness side (runs in a child process inside the harness namespace) ---------------

HARNESS_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from tests.e2e.test_two_hosts import harness_entry; harness_entry()"
)


class HarnessConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What the harness child needs to know (sent on its stdin as JSON)."""

    workspace_ns: str
    harness_addr: str
    workspace_addr: str
    uid: int
    gid: int
    user: str
    python: str
    pythonpath: str
    root: str
    marker: str
    root_pid: int


def workspace_prefix(cfg: HarnessConfig) -> list[str]:
    """Into the workspace namespace, as the worker, with a clean environment."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": cfg.root,
        "USER": cfg.user,
        "LOGNAME": cfg.user,
        "LANG": "C.UTF-8",
        "PYTHONPATH": cfg.pythonpath,
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return [
        "ip",
        "netns",
        "exec",
        cfg.workspace_ns,
        "setpriv",
        f"--reuid={cfg.uid}",
        f"--regid={cfg.gid}",
        "--clear-groups",
        "env",
        "-i",
        *(f"{name}={value}" for name, value in env.items()),
    ]


def agent_script() -> list[dict[str, Any]]:
    """Thirteen tool calls over seven turns: every tool, across the namespaces."""
    fetch = (
        'python3 -c "import urllib.request; print(urllib.request.urlopen('
        "'http://127.0.0.1:8765/out.txt', timeout=10).read().decode())\""
    )
    return [
        {
            "content": "write a script and run it",
            "tool_calls": [
                {
                    "name": "write_file",
                    "arguments": {
                        "path": "app/greet.py",
                        "content": "import sys\nprint('hello', sys.argv[1])\n",
                    },
                },
                {"name": "shell", "arguments": {"command": "mkdir -p app && echo ready"}},
            ],
        },
        {
            "tool_calls": [
                {
                    "name": "shell",
                    "arguments": {"command": "python3 app/greet.py two-hosts > out.txt"},
                },
                {
                    "name": "session_run",
                    "arguments": {"session": "dev", "command": "cd app && export GREETING=hi"},
                },
            ]
        },
        {
            "tool_calls": [
                {"name": "read_file", "arguments": {"path": "out.txt"}},
                {"name": "list_files", "arguments": {"path": ".", "recursive": True}},
                {
                    "name": "session_run",
                    "arguments": {
                        "session": "dev",
                        "command": "echo $GREETING from $(basename $PWD)",
                    },
                },
            ]
        },
        {
            "tool_calls": [
                {
                    "name": "start_service",
                    "arguments": {
                        "name": "web",
                        "command": "python3 -m http.server 8765 --bind 127.0.0.1",
                        "probe": {"type": "tcp", "port": 8765, "timeout": 30},
                    },
                }
            ]
        },
        {
            "tool_calls": [
                {"name": "shell", "arguments": {"command": fetch}},
                {"name": "shell", "arguments": {"command": "sleep 0.3 && touch done.flag"}},
                {"name": "wait_for_path", "arguments": {"path": "done.flag", "timeout": 20}},
            ]
        },
        {
            "tool_calls": [
                {"name": "service_logs", "arguments": {"name": "web"}},
                {"name": "stop_service", "arguments": {"name": "web"}},
            ]
        },
        {"content": "done: greeted, served and cleaned up"},
    ]


def harness_entry() -> None:
    """Entry point of the harness child: config JSON on stdin, facts JSON on stdout."""
    _become_subreaper()
    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=HarnessConfig)
    try:
        facts = asyncio.run(_harness_side(cfg))
    except BaseException:
        traceback.print_exc()
        _reap_children(10.0)
        sys.exit(1)
    facts["children_left"] = _reap_children(15.0)
    print(json.dumps(facts), flush=True)


def _become_subreaper() -> None:
    """Orphans of the workspace side (execd's supervisor) become our children to reap."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _children() -> list[int]:
    pids: list[int] = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with contextlib.suppress(OSError):
            text = Path(f"/proc/{os.getpid()}/task/{task}/children").read_text()
            pids.extend(int(word) for word in text.split())
    return pids


def _reap_children(timeout: float) -> int:
    """Reap every child until none is left or ``timeout``; return how many were left."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return 0
        left = _children()
        if not left or time.monotonic() > deadline:
            return len(left)
        time.sleep(0.05)


def _scan_environs(uid: int, secret: str) -> dict[str, list[int]]:
    """Read /proc/*/environ of every process of ``uid`` (as root) looking for ``secret``."""
    scanned: list[int] = []
    with_secret: list[int] = []
    unreadable: list[int] = []
    for pid in pids_of_uid(uid):
        try:
            data = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError as exc:
            if exc.errno != errno.ESRCH and is_alive(pid):
                unreadable.append(pid)
            continue
        scanned.append(pid)
        if secret.encode() in data or f"{SECRET_VAR}=".encode() in data:
            with_secret.append(pid)
    return {"scanned": scanned, "with_secret": with_secret, "unreadable": unreadable}


async def _harness_side(cfg: HarnessConfig) -> dict[str, Any]:
    from harnessd.agent import AgentLimits, AgentSession
    from harnessd.launcher import serve
    from harnessd.runtime import CommandPrefixRuntime
    from harnessd.scripted_model import ScriptedModel
    from harnessd.toolbox import ToolConfig

    secret = os.environ[SECRET_VAR]
    facts: dict[str, Any] = {}
    peers: list[str] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[0])
        data = await reader.read(100)
        writer.write(b"ack " + data)
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(answer, cfg.harness_addr, 0)
    listen_port = listener.sockets[0].getsockname()[1]
    runtime = CommandPrefixRuntime(workspace_prefix(cfg))
    session = await serve(
        runtime,
        execd_command=[cfg.python, "-m", "execd"],
        bind_host=cfg.workspace_addr,
        connect_host=cfg.workspace_addr,
        marker=cfg.marker,
        encrypt=True,
        lease=120.0,
        workdir=f"{cfg.root}/execd",
        extra_args=("--state-dir", f"{cfg.root}/state"),
        start_timeout=60.0,
        cleanup_timeout=20.0,
    )
    escaped: dict[str, int] = {}
    try:
        client = session.client
        info = await client.server_info()
        log = (await runtime.read_file(session.log_path)).decode()
        listening = next(json.loads(line) for line in log.splitlines() if '"listening"' in line)
        facts["announced"] = {
            "host": session.host,
            "port": session.port,
            "log_port": listening["port"],
            "pid": info.pid,
            "uid": info.uid,
            "cipher": client.cipher,
        }

        probe = await client.run(
            [cfg.python, "-c", CONNECT, cfg.harness_addr, str(listen_port), "workspace"],
            timeout=30,
        )
        facts["workspace_connect"] = {
            "exit_code": probe.exit_code,
            "out": probe.stdout.decode().strip(),
        }
        facts["harness_connect"] = await _connect_here(cfg.harness_addr, listen_port)
        facts["listener_peers"] = list(peers)

        facts["workspace_env"] = (await client.run(["env"])).stdout.decode()
        facts["environ_scan"] = _scan_environs(cfg.uid, secret)

        project = f"{cfg.root}/project"
        await client.mkdir(project)
        agent = AgentSession(
            ScriptedModel(agent_script()),
            lambda: session.client,
            tools=ToolConfig(root=project, shell_timeout=60.0, probe_timeout=30.0),
            limits=AgentLimits(max_turns=10, turn_timeout=120.0, session_timeout=200.0),
            reconnect=session.reconnect,
        )
        result = await agent.run("greet, serve and clean up across two hosts")
        verified = await agent.sync.verify_remote(session.client)
        facts["agent"] = {
            "stop_reason": result.stop_reason,
            "tool_calls": result.tool_calls,
            "tool_errors": result.tool_errors,
            "texts": [tool.text for turn in result.turns for tool in turn.results],
            "ledger_seq": agent.ledger.seq,
            "verified": verified,
            "remote_head": (await session.client.ledger_head(agent.session_id)).seq,
        }

        facts["watch"] = await _watch_once(session.client, project)

        kill = await session.client.run(["sh", "-c", f"kill -0 {cfg.root_pid}"])
        facts["kill_root"] = {"exit_code": kill.exit_code, "stderr": kill.stderr.decode()}
        facts["root_marked_before_close"] = find_marked(MARKER_VAR, cfg.marker, uid=0)

        escaped = await _escape(session.client, cfg)
        facts["escaped"] = escaped
        # Again, now that services, shells and escaped daemons of the worker run too.
        for key, pids in _scan_environs(cfg.uid, secret).items():
            facts["environ_scan"][key] = sorted(set(facts["environ_scan"][key]) | set(pids))
    finally:
        closed = await session.close()
        listener.close()
        await listener.wait_closed()
    facts["close"] = {
        "clean": closed.clean,
        "killed": closed.killed,
        "remaining": list(closed.remaining),
        "worker_exited": closed.worker_exited,
        "fallback_ran": closed.fallback_ran,
        "rpc_error": closed.rpc_error,
    }
    facts["alive_after_close"] = [pid for pid in escaped.values() if is_alive(pid)]
    facts["marked_after_close"] = find_marked(MARKER_VAR, cfg.marker, uid=cfg.uid)
    return facts


async def _connect_here(host: str, port: int) -> str:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"harness")
    await writer.drain()
    reply = await reader.read(100)
    writer.close()
    return f"connected {reply.decode()}"


async def _watch_once(client: Any, project: str) -> list[str]:
    watch = await client.watch(project, recursive=True)
    target = f"{project}/watched.txt"
    await client.write_file(target, b"seen across namespaces\n", atomic=False)
    kinds: list[str] = []
    while "closed_write" not in kinds:
        kind, event = await watch.next(timeout=20)
        if event.path == target and kind in ("created", "closed_write") and kind not in kinds:
            kinds.append(kind)
    await watch.close()
    return kinds


async def _escape(client: Any, cfg: HarnessConfig) -> dict[str, int]:
    """Start processes that leave execd's supervision in every usual way; their PIDs by tag."""
    quiet = "</dev/null >/dev/null 2>&1"
    await client.run(["sh", "-c", f"(sleep 3101 {quiet} &); exit 0"])
    await client.run(["sh", "-c", f"setsid sleep 3102 {quiet} & exit 0"])
    await client.run(["sh", "-c", f"nohup sleep 3103 {quiet} & exit 0"])
    await client.run([cfg.python, "-c", DAEMONIZE])
    await client.run_detached(["sleep", "3105"])
    await client.start_service("idle", ["sleep", "3106"])
    await client.open_session("bg")
    await client.session_run("bg", f"sleep 3107 {quiet} &")
    found: dict[str, int] = {}
    deadline = time.monotonic() + 20.0
    while len(found) < len(ESCAPE_TAGS) and time.monotonic() < deadline:
        for pid in find_marked(MARKER_VAR, cfg.marker, uid=cfg.uid):
            line = cmdline(pid)
            for tag in ESCAPE_TAGS:
                if line == f"sleep {tag}":
                    found[tag] = pid
        await asyncio.sleep(0.05)
    return found
