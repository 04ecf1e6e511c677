"""The programs in examples/ run as written, here on this machine.

The network-namespace form of ``workspace.py`` runs as root in
``tests/e2e/test_two_hosts.py``; the ssh form runs through a local stand-in for
ssh's remote shell (ssh joins its arguments into one line for ``sh -c``).
``worker_workspace.py`` needs the built worker (:mod:`tests.support.worker_build`);
its ``--image`` form runs as root against a private dockerd in
``tests/e2e/test_worker_containers.py``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from execd.marker import find_marked
from tests.conftest import one_loop
from tests.support import worker_build
from tests.support.daemon import start_execd
from tests.support.procs import run_python, wait_until_none_mention

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
EXECD = shlex.join([sys.executable, "-m", "execd"])
# What sshd does with a command: one line, run by the remote user's shell.
FAKE_SSH = shlex.join(["sh", "-c", 'exec sh -c "$*"', "remote"])


def run_example(
    name: str, *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_python(str(EXAMPLES / name), *args, cwd=cwd, env=env)


def test_quickstart(tmp_path: Path) -> None:
    done = run_example("quickstart.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "typed error, wire code 200" in done.stdout
    assert done.stdout.endswith("quickstart: ok\n")
    assert list(tmp_path.iterdir()) == [], "the quick start leaves nothing in its directory"


def test_custom_tool(tmp_path: Path) -> None:
    done = run_example("custom_tool.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("write_file: wrote 21 bytes to "), lines
    assert lines[1].startswith("count_lines: 2 lines of ") and lines[1].endswith("'fox'"), lines
    assert lines[2:] == ["answer: Two lines mention a fox."]
    assert list(tmp_path.iterdir()) == [], "the example leaves nothing in its directory"


def test_fuzz_properties(tmp_path: Path) -> None:
    done = run_example("fuzz_properties.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Ran 1 test" in done.stderr and done.stderr.rstrip().endswith("OK"), done.stderr
    # hypothesis keeps its example database where it runs; nothing else is left.
    assert {p.name for p in tmp_path.iterdir()} <= {".hypothesis"}


@pytest.mark.anyio
@one_loop
async def test_mcp_server(tmp_path: Path) -> None:
    mcp = pytest.importorskip("mcp", reason="needs the mcp extra (./check installs it)")
    from mcp.client import Client

    from tests.support.mcp_peer import server_env, text_of

    root = tmp_path / "root"
    root.mkdir()
    params = mcp.StdioServerParameters(
        command=sys.executable,
        args=[str(EXAMPLES / "mcp_server.py"), str(root)],
        env=server_env(tmp_path),
        cwd=str(tmp_path),
    )
    with (tmp_path / "server.log").open("a") as errlog:
        async with Client(mcp.stdio_client(params, errlog=errlog), mode="legacy") as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            assert {"shell", "read_file", "write_file"} <= names, names
            wrote = await client.call_tool(
                "shell", {"command": "echo hi > note; echo $EXECD_MARKER"}
            )
            marker = text_of(wrote).split()[-1] if not wrote.is_error else ""
            assert marker, text_of(wrote)
            read = await client.call_tool("read_file", {"path": "note"})
            assert "hi" in text_of(read), text_of(read)
            outside = await client.call_tool("read_file", {"path": "/etc/passwd"})
            assert outside.is_error, "confined to its root"
    assert (root / "note").read_text() == "hi\n"
    assert wait_until_none_mention(marker, timeout=20) == []


def test_workspace_through_a_local_prefix(tmp_path: Path) -> None:
    script = 'echo out; echo err >&2; test -n "$EXECD_MARKER" && pwd; exit 3'
    done = run_example(
        "workspace.py",
        *("--via", "env", "--execd", EXECD, "--state-dir", str(tmp_path / "state")),
        *("--cwd", str(tmp_path), "--", "sh", "-c", script),
        cwd=tmp_path,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, f"out\n{tmp_path}\n", "err\n")


def test_workspace_through_an_ssh_like_prefix(tmp_path: Path) -> None:
    """Arguments survive the remote shell's word splitting with ``--remote-shell``."""
    tricky = ["a b", "it's", "$HOME", "*", ""]
    done = run_example(
        "workspace.py",
        *("--via", FAKE_SSH, "--remote-shell", "--execd", EXECD),
        *("--state-dir", str(tmp_path / "state state"), "--", "printf", "[%s]", *tricky),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(f"[{arg}]" for arg in tricky)
    assert (tmp_path / "state state").is_dir()


@pytest.mark.timeout(300)
def test_worker_workspace_through_a_local_prefix(tmp_path: Path) -> None:
    """docs/workspaces.md: the worker installed, kept, found again, removed; nothing left."""
    try:
        worker = worker_build.worker()
    except worker_build.Unavailable as exc:
        pytest.skip(str(exc))
    here = tmp_path / "work"
    here.mkdir()
    directory = tmp_path / "install"
    options = ("--via", "env", "--worker", str(worker), "--directory", str(directory))
    command = ("--cwd", str(here), "--", "sh", "-c", 'echo "$EXECD_MARKER"; pwd')
    markers = []
    for keep, how in ((True, "uploaded to"), (False, "in place at")):
        kept = ("--keep-worker",) if keep else ()
        done = run_example("worker_workspace.py", *options, *kept, *command, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        marker, cwd = done.stdout.split()
        assert cwd == str(here)
        markers.append(marker)
        assert done.stderr.startswith(f"worker: {how} {directory}/execd-worker-"), done.stderr
    # The second run removed the worker and execd's state; the directory was given, so it stays.
    assert list(directory.iterdir()) == []
    assert all(wait_until_none_mention(marker, 10.0) == [] for marker in markers)


def test_connect_to_a_running_execd(tmp_path: Path) -> None:
    with start_execd(tmp_path) as daemon:
        env = dict(os.environ, EXECD_TOKEN=f"{daemon.token}\n")
        args = (daemon.host, str(daemon.port), "--")
        done = run_example(
            "connect.py", *args, "sh", "-c", "echo $EXECD_MARKER", cwd=tmp_path, env=env
        )
        assert (done.returncode, done.stdout) == (0, f"{daemon.marker}\n"), done.stderr
        missing = run_example("connect.py", *args, "no-such-command-xyz", cwd=tmp_path, env=env)
        assert missing.returncode == 127 and "cannot start no-such-command-xyz" in missing.stderr
        env["EXECD_TOKEN"] = "wrong"
        refused = run_example("connect.py", *args, "true", cwd=tmp_path, env=env)
        assert refused.returncode == 2 and "authentication" in refused.stderr
        assert find_marked("EXECD_MARKER", daemon.marker) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_rollouts(tmp_path: Path) -> None:
    """The Ray example of docs/scale.md: a local Ray cluster, two actors, eight rollouts, nothing left."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    # Ray keeps its sockets under its temporary directory: the path must stay short.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        env = dict(os.environ, RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
        env.pop(
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None
        )  # the example keeps Ray on loopback itself
        done = run_python(str(EXAMPLES / "ray_rollouts.py"), cwd=tmp_path, env=env, timeout=280)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    *lines, totals = done.stdout.splitlines()
    assert len(lines) == 8, done.stdout
    assert all(": finished, answer 42, 2 tool calls, ledger seq 9, " in line for line in lines)
    assert totals.startswith("8 completed, 0 lost, 0 retried; tool calls p50 "), totals
    assert totals.endswith(" ms over 16 calls"), totals
    tags = {
        match.group(1) for match in re.finditer(r" on (rollouts-[0-9a-f]+)-a[01]:", done.stdout)
    }
    assert len(tags) == 1, done.stdout
    assert wait_until_none_mention(tags.pop(), 15.0) == []


@pytest.mark.timeout(120)
def test_verifiers_runtime(tmp_path: Path) -> None:
    """The example of docs/verifiers.md: files, a command, a background server, a capped read."""
    pytest.importorskip(
        "verifiers", reason="the verifiers extra is not installed (pip install -e '.[verifiers]')"
    )
    done = run_example("verifiers_runtime.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == (
        "capped read: read 'task/answer.txt': over the 1 byte limit\nverifiers runtime: ok\n"
    )
    # stop() took the background server with it.
    assert wait_until_none_mention("echo ready; sleep 600", 10.0) == []


def test_limits_and_terminals(tmp_path: Path) -> None:
    done = run_example("limits_and_terminals.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # SIGXCPU under RLIMIT_CPU, SIGKILL where execd watches a cgroup's CPU time.
    assert "stopped by its cpu limit (signal " in done.stdout
    assert done.stdout.endswith("limits and terminals: ok\n")


def test_custom_model(tmp_path: Path) -> None:
    """docs/model.md: a text policy adapted to the Model interface runs the agent loop."""
    done = run_example("custom_model.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == "finished after 2 turns: words.txt has 3 lines"
    synced = re.fullmatch(r"ledger: (\d+) of (\d+) entries synced to execd", second)
    assert synced is not None and synced.group(1) == synced.group(2), second


def test_custom_runtime(tmp_path: Path) -> None:
    """docs/runtime.md: execd launched, used and closed through a runtime written from scratch."""
    done = run_example("custom_runtime.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen, *journal = done.stdout.splitlines()
    found = re.fullmatch(r"HOME (\S+), variables (.*)", seen)
    assert found is not None, seen
    home, names = found.group(1), set(found.group(2).split())
    assert "EXECD_MARKER" in names and "EXECD_TOKEN" not in names
    # The workspace saw the runtime's clean environment, nothing of this process's.
    assert names & set(os.environ) <= {"PATH", "HOME", "LANG", "PWD", "SHLVL", "OLDPWD", "_"}
    assert not Path(home).exists(), "the scratch home goes with the example"
    steps = ["run mkdir -m 700", "write_file ", "start_background ", "read_file ", "run rm -rf"]
    assert [line for line in journal if not line.startswith(tuple(steps))] == []
    assert [next(s for s in steps if line.startswith(s)) for line in journal] == steps, journal
    assert re.search(r"/token-\w+ \(64 bytes, mode 600\)$", journal[1]), journal[1]


def test_agent(tmp_path: Path) -> None:
    """The README's agent loop: a model of a dozen lines, one tool call, an answer."""
    done = run_example("agent.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "finished: The workspace runs Linux. (1 tool call)\n"
