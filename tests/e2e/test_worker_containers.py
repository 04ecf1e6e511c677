"""The self-contained worker in real containers: a bare image and an old Debian, through docker.

A private dockerd (:mod:`tests.support.dockerd`) runs two images made here:

* *bare*: an empty root with only ``/tmp`` and a static test program -- no
  shell, no Python, no C library. harnessd installs the worker into it and
  runs commands, files, a watch, terminals, limits and the cleanup of a
  double-forked child there; a container it joins gets the worker once and
  reuses it the second time.
* *Debian 11* from the Debian archive (``debootstrap`` minbase with python3:
  its only Python is 3.9): the worker goes in through ``docker exec -i``'s
  stdin and the shell, files, services and sessions contract runs there.

Afterwards nothing is left: no process of the session in the container or on
the host, the container's filesystem as it was (``docker diff``), and the
daemon's teardown leaves nothing on the host either.

Needs root, Debian's ``docker.io`` and :data:`~tests.support.worker_build.FLAG`
(``./check`` sets it as root); skipped with the reason otherwise.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from execd.marker import find_marked
from harnessd.docker import DockerWorkspace
from harnessd.errors import SpawnFailed
from harnessd.launcher import Session
from protocol.values import DEFAULT_MARKER_VAR
from tests.conftest import eventually, one_loop
from tests.support import worker_build
from tests.support.dockerd import Dockerd, leftovers, private_dockerd
from tests.support.procs import run_python
from tests.support.worker_build import TESTBIN_PATH, Unavailable

pytestmark = [
    pytest.mark.anyio,
    one_loop,
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BARE = "splitexec-test/bare:1"
DEBIAN = f"splitexec-test/debian-{worker_build.DEBIAN_SUITE}:1"


@dataclass(frozen=True)
class Docker:
    daemon: Dockerd
    worker: Path

    def workspace(self, **options: object) -> DockerWorkspace:
        return DockerWorkspace(docker=self.daemon.docker, worker=str(self.worker), **options)  # type: ignore[arg-type]

    def run_container(self, image: str, *argv: str) -> str:
        return self.daemon.run("run", "-d", "--init", "--network", "host", image, *argv).strip()

    def processes(self, container: str) -> str:
        return self.daemon.run("top", container, "-o", "pid,args")


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    """The worker, the two images and a private dockerd; the daemon must leave nothing behind."""
    try:
        worker_build.require_enabled()
        worker = worker_build.worker()
        bare = worker_build.bare_rootfs()
        debian = worker_build.debian_rootfs()
        daemon_cm = private_dockerd()
        daemon = daemon_cm.__enter__()
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        daemon.import_tar(bare, BARE)
        daemon.import_tar(debian, DEBIAN)
        yield Docker(daemon, worker)
    finally:
        daemon_cm.__exit__(None, None, None)
    assert leftovers(daemon) == []


def _added_or_deleted(docker: Docker, container: str) -> list[str]:
    """``docker diff`` without ``C`` lines (a directory whose entries changed and changed back)."""
    lines = docker.daemon.run("diff", container).splitlines()
    return sorted(line for line in lines if not line.startswith("C "))


def _text(data: bytes) -> str:
    return data.decode(errors="replace").strip()


async def _no_marked_process(session: Session) -> None:
    await eventually(
        lambda: not find_marked(DEFAULT_MARKER_VAR, session.marker), what="no marked process"
    )


async def test_bare_image_runs_the_contract_and_leaves_nothing(docker: Docker) -> None:
    async with docker.workspace(image=BARE) as workspace:
        installed = workspace.installed
        assert installed is not None and installed.bare and not installed.uploaded
        # No shell to enter the directory given to serve: the worker's supervisor does.
        async with workspace.serve(cwd="/usr/local") as session:
            client = session.client
            echoed = await client.run([TESTBIN_PATH, "echo", "no", "shell"])
            assert (echoed.exit_code, _text(echoed.stdout)) == (0, "no shell")
            here = await client.run([TESTBIN_PATH, "pwd"])
            assert _text(here.stdout) == "/usr/local"
            moved = await client.run([TESTBIN_PATH, "pwd"], cwd="/tmp")
            assert _text(moved.stdout) == "/tmp"
            limited = await client.run([TESTBIN_PATH, "nofile"], limits={"open_files": 64})
            assert _text(limited.stdout) == "64", limited
            with pytest.raises(SpawnFailed):
                await client.run(command="echo needs a shell")

            await client.write_file("/tmp/area/note.txt", b"written", create_parents=True)
            assert await client.read_file("/tmp/area/note.txt") == b"written"
            watch = await client.watch("/tmp/area")
            await client.write_file("/tmp/area/seen.txt", b"x", atomic=False)
            kinds: set[str] = set()
            while "closed_write" not in kinds:
                kind, event = await watch.next(timeout=30)
                if event.path.endswith("seen.txt"):
                    kinds.add(kind)
            await watch.close()

            term = await client.open_terminal([TESTBIN_PATH, "tty"], cwd="/tmp")
            assert b"tty /dev/pts/" in await term.read(timeout=30, until=b"\n")
            async with await client.open_terminal(
                [TESTBIN_PATH, "cat"], limits={"open_files": 32}
            ) as echo:
                await echo.send(b"ping\n")
                assert b"ping" in await echo.read(timeout=30, until=b"ping")

            daemonized = await client.run([TESTBIN_PATH, "daemon", "/tmp/area/daemon.pid"])
            assert daemonized.exit_code == 0
            await client.wait_for_path("/tmp/area/daemon.pid", timeout=30)
            assert "testbin daemon" in docker.processes(workspace.container)
            closed = await session.close()
        assert closed.clean and closed.killed >= 1, closed
        assert "testbin" not in docker.processes(workspace.container)
        await _no_marked_process(session)
    assert workspace.container not in docker.daemon.run("ps", "-a", "--format", "{{.Names}}")


def test_the_example_runs_a_command_in_a_container_it_removes(
    docker: Docker, tmp_path: Path
) -> None:
    """examples/worker_workspace.py --image (docs/workspaces.md) with the bare image."""
    client = shlex.join(docker.daemon.docker)
    done = run_python(
        str(EXAMPLES / "worker_workspace.py"),
        *("--image", BARE, "--worker", str(docker.worker), "--docker", client),
        *("--cwd", "/usr/local", "--", TESTBIN_PATH, "pwd"),
        cwd=tmp_path,
        timeout=240,
    )
    assert (done.returncode, done.stdout) == (0, "/usr/local\n"), done.stderr
    placed, started = done.stderr.splitlines()
    assert placed.startswith("worker: in place at /tmp/splitexec-worker/execd-worker-"), placed
    container = started.removeprefix("container: ")
    assert container.startswith("splitexec-"), started
    assert container not in docker.daemon.run("ps", "-a", "--format", "{{.Names}}")


async def test_a_joined_bare_container_gets_the_worker_once(docker: Docker) -> None:
    container = docker.run_container(BARE, TESTBIN_PATH, "sleep", "100000")
    try:
        before = _added_or_deleted(docker, container)
        runs: list[bool] = []
        for keep in (True, False):
            async with docker.workspace(container=container, keep_worker=keep) as workspace:
                assert workspace.installed is not None and workspace.installed.bare
                runs.append(workspace.installed.uploaded)
                async with workspace.serve() as session:
                    echoed = await session.client.run([TESTBIN_PATH, "echo", "again"])
                    assert _text(echoed.stdout) == "again"
        assert runs == [True, False]
        assert _added_or_deleted(docker, container) == before
        assert "execd" not in docker.processes(container)
    finally:
        docker.daemon.run("rm", "-f", container)


async def test_debian_with_an_old_python_runs_the_contract(docker: Docker) -> None:
    container = docker.run_container(DEBIAN, "sleep", "infinity")
    try:
        version = docker.daemon.run(
            "exec", container, "python3", "-c", "import sys; print(sys.version_info[:2])"
        )
        assert version.strip() == "(3, 9)"
        before = _added_or_deleted(docker, container)
        async with docker.workspace(container=container) as workspace:
            assert workspace.installed is not None
            assert workspace.installed.uploaded and not workspace.installed.bare
            async with workspace.serve() as session:
                await _shell_files_services(session)
                closed = await session.close()
            assert closed.clean and closed.killed >= 1, closed
            await _no_marked_process(session)
        assert _added_or_deleted(docker, container) == before
        assert "execd" not in docker.processes(container)
    finally:
        docker.daemon.run("rm", "-f", container)


async def _shell_files_services(session: Session) -> None:
    client = session.client
    shell = await client.run(command="echo $((6 * 7)) $(uname -s)")
    assert _text(shell.stdout) == "42 Linux"
    fed = await client.run(["cat"], stdin=b"fed\n", cwd="/tmp", env={"X": "1"})
    assert shell.exit_code == 0 and fed.stdout == b"fed\n"
    # Nothing of the worker's packaging reaches the commands' environment.
    inherited = _text((await client.run(["env"])).stdout)
    for trace in ("LD_LIBRARY_PATH", "_PYI_", "STATICX", "_MEI"):
        assert trace not in inherited
    failed = await client.run(command="exit 3")
    assert failed.exit_code == 3
    limited = await client.run(command="ulimit -n", limits={"open_files": 64})
    assert _text(limited.stdout) == "64"
    await client.run(command="setsid sh -c 'sleep 301 </dev/null >/dev/null 2>&1 &'")

    await client.write_file("/tmp/contract/a.txt", b"alpha", create_parents=True)
    assert await client.read_file("/tmp/contract/a.txt") == b"alpha"
    listed = await client.list_dir("/tmp/contract")
    assert [entry.path for entry in listed.entries] == ["a.txt"]
    assert (await client.stat("/tmp/contract/a.txt")).size == 5

    await client.start_service("ticker", command="while :; do echo tick; sleep 0.2; done")
    assert [svc.name for svc in (await client.list_services()).services] == ["ticker"]
    stopped = await client.stop_service("ticker", grace=5)
    assert stopped.state != "running"

    await client.open_session("work", cwd="/tmp")
    ran = await client.session_run("work", "cd contract && pwd")
    assert _text(ran.stdout) == "/tmp/contract"
    await client.remove("/tmp/contract", recursive=True)
