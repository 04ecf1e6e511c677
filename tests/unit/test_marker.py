"""execd.marker with real processes: marking, finding, freezing and killing.

Scenarios that orphan processes run under a small reaper wrapper: a Python
process that makes itself a child subreaper, starts the scenario with the
marker in its environment, reaps every descendant and exits once none is left.
Its exit therefore proves that the whole tree is gone, and nothing is left as
a zombie of PID 1. The wrapper itself is not marked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from execd.errors import InvalidParams
from execd.marker import (
    ENVIRON_READ_CAP,
    CleanupReport,
    child_environment,
    cleanup,
    cleanup_async,
    cleanup_main,
    find_marked,
    scrub_own_environment,
)
from protocol.values import DEFAULT_MARKER_VAR, new_marker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc")

VAR = "EXECD_MARKER_TEST"
PY = sys.executable
SLEEP = shutil.which("sleep") or "/bin/sleep"

REAPER = r"""
import json, os, sys, time
from execd.marker import child_environment, set_child_subreaper

var, marker, mode = sys.argv[1:4]
argv = sys.argv[4:]
if not set_child_subreaper():
    sys.exit(3)
env = child_environment(os.environ, var, marker)
first = None
if mode == "run":
    first = os.posix_spawnp(argv[0], argv, env)
    print(json.dumps({"pid": first}), flush=True)
else:
    go = argv[0]
    print(json.dumps({"pid": os.getpid()}), flush=True)
    while os.path.exists(go):
        os.posix_spawnp("sleep", ["sleep", "300"], env)
        while True:
            try:
                done, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if done == 0:
                break
        time.sleep(0.001)
    print(json.dumps({"stopped": True}), flush=True)
status = None
while True:
    try:
        pid, raw = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if pid == first:
        status = os.waitstatus_to_exitcode(raw)
print(json.dumps({"exit": status}), flush=True)
"""

DOUBLE_FORK = r"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(300)
    os._exit(0)
os.wait()
"""


def _entry(var: str, marker: str) -> bytes:
    return f"{var}={marker}".encode()


def _sweep(entry: bytes, timeout: float = 10.0) -> None:
    """Stop, then kill, every process whose environment holds ``entry`` (test safety net).

    Deliberately independent of the module under test.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hits: list[int] = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as fh:
                    data = fh.read()
            except OSError:
                continue
            if entry in data.split(b"\0"):
                hits.append(int(name))
        if not hits:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in hits:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        time.sleep(0.05)


@dataclass
class Reaped:
    """A scenario running under the reaper wrapper."""

    proc: subprocess.Popen[str]
    pid: int

    def finish(self, timeout: float = 30.0) -> tuple[int | None, list[str]]:
        """Wait for the whole tree to be gone; the first child's exit code and all stdout lines."""
        out, _ = self.proc.communicate(timeout=timeout)
        lines = out.splitlines()
        assert self.proc.returncode == 0, lines
        status = json.loads(lines[-1])["exit"]
        return status, lines[:-1]


class Session:
    """One marker plus everything started with it; ``close`` kills and reaps it all."""

    def __init__(self, tmp_path: Path, var: str = VAR) -> None:
        self.tmp = tmp_path
        self.var = var
        self.marker = new_marker()
        self.procs: list[subprocess.Popen[Any]] = []
        self._files: list[IO[bytes]] = []

    @property
    def entry(self) -> bytes:
        return _entry(self.var, self.marker)

    def env(self) -> dict[str, str]:
        return child_environment(os.environ, self.var, self.marker)

    def popen(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A direct child of the test process; marked unless ``env`` says otherwise."""
        proc = subprocess.Popen(
            argv,
            env=self.env() if env is None else env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.tmp,
        )
        self.procs.append(proc)
        return proc

    def reaped(self, *argv: str, mode: str = "run") -> Reaped:
        """Run ``argv`` (marked) under an unmarked subreaper wrapper."""
        errors = open(self.tmp / f"reaper-{len(self.procs)}.err", "wb")  # noqa: SIM115
        self._files.append(errors)
        proc = subprocess.Popen(
            [PY, "-c", REAPER, self.var, self.marker, mode, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            cwd=self.tmp,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first, "reaper wrapper failed to start"
        return Reaped(proc, json.loads(first)["pid"])

    def wait_marked(self, count: int, timeout: float = 20.0) -> list[int]:
        """Wait until at least ``count`` marked processes exist; return them."""
        deadline = time.monotonic() + timeout
        while True:
            found = find_marked(self.var, self.marker)
            if len(found) >= count:
                return found
            assert time.monotonic() < deadline, f"only {len(found)} marked processes appeared"
            time.sleep(0.02)

    def close(self) -> None:
        try:
            _sweep(self.entry)
        finally:
            for proc in self.procs:
                if proc.returncode is not None:
                    continue
                if proc.poll() is None:
                    proc.kill()
                proc.communicate(timeout=10)
            for fh in self._files:
                fh.close()


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    sess = Session(tmp_path)
    try:
        yield sess
    finally:
        sess.close()


def _dead(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    return proc.wait(timeout=timeout)


# -- markers and environments ---------------------------------------------------------


def test_child_environment_layering() -> None:
    base = {"KEEP": "1", "EXECD_TOKEN": "tok", "GONE": "x", "SHADOW": "base", "EXECD_MARKER": "old"}
    env = child_environment(
        base,
        "EXECD_MARKER",
        "m1",
        extra={"EXTRA": "e", "SHADOW": "extra"},
        overrides={"SHADOW": "override", "NEW": "n"},
        unset=["GONE", "NEVER_THERE"],
    )
    assert env == {
        "EXECD_MARKER": "m1",
        "KEEP": "1",
        "SHADOW": "override",
        "EXTRA": "e",
        "NEW": "n",
    }
    assert next(iter(env)) == "EXECD_MARKER", "the marker leads the environment block"
    assert base["EXECD_MARKER"] == "old" and "EXECD_TOKEN" in base, "base is not modified"


def test_child_environment_unset_beats_override_and_extra() -> None:
    env = child_environment({}, VAR, "m", extra={"A": "1"}, overrides={"A": "2"}, unset=("A",))
    assert env == {VAR: "m"}


def test_child_environment_custom_secret_vars() -> None:
    base = {"MY_SECRET": "s", "EXECD_TOKEN": "t", "PATH": "/bin"}
    env = child_environment(base, VAR, "m", secret_vars=["MY_SECRET"])
    assert env == {VAR: "m", "EXECD_TOKEN": "t", "PATH": "/bin"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"overrides": {VAR: "other"}},
        {"extra": {VAR: "other"}},
        {"unset": [VAR]},
    ],
)
def test_child_environment_refuses_to_touch_marker(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidParams, match="marker"):
        child_environment({"PATH": "/bin"}, VAR, "m", **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"overrides": {"": "x"}},
        {"overrides": {"A=B": "x"}},
        {"overrides": {"A\0B": "x"}},
        {"overrides": {"A": "x\0y"}},
        {"extra": {"A=": "x"}},
        {"unset": ["A=B"]},
        {"unset": [""]},
    ],
)
def test_child_environment_rejects_malformed_entries(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidParams):
        child_environment({}, VAR, "m", **kwargs)


def test_child_environment_error_does_not_echo_values() -> None:
    with pytest.raises(InvalidParams) as info:
        child_environment({}, VAR, "m", overrides={"A": "hunter2\0"})
    assert "hunter2" not in info.value.message


def test_child_environment_validates_marker_config() -> None:
    with pytest.raises(ValueError):
        child_environment({}, "BAD-NAME", "m")
    with pytest.raises(ValueError):
        child_environment({}, VAR, "not a marker")


def test_scrub_own_environment_runtime_variable() -> None:
    name = "EXECD_TEST_RUNTIME_SECRET"
    os.environ[name] = "value"
    try:
        assert scrub_own_environment([name, name + "_ABSENT"]) == [name]
        assert name not in os.environ
        assert scrub_own_environment([name]) == []
    finally:
        os.environ.pop(name, None)


def test_scrub_own_environment_wipes_exec_block() -> None:
    script = r"""
import json, os, subprocess, sys
from execd.marker import scrub_own_environment
os.environ["RUNTIME_ONLY"] = "r-value"
removed = scrub_own_environment(["EXECD_TOKEN", "SECOND_SECRET", "RUNTIME_ONLY", "ABSENT"])
with open("/proc/self/environ", "rb") as fh:
    block = fh.read()
child = subprocess.run(["env"], capture_output=True, text=True, check=True).stdout
print(json.dumps({
    "removed": removed,
    "in_block": [v for v in ("tok-value-1", "sec-value-2") if v.encode() in block],
    "in_os_environ": [k for k in ("EXECD_TOKEN", "SECOND_SECRET", "RUNTIME_ONLY") if k in os.environ],
    "in_child": [k for k in ("EXECD_TOKEN", "SECOND_SECRET", "RUNTIME_ONLY") if k in child],
    "kept": os.environ.get("KEEP_ME"),
}))
"""
    env = dict(os.environ, EXECD_TOKEN="tok-value-1", SECOND_SECRET="sec-value-2", KEEP_ME="yes")
    out = subprocess.run([PY, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {
        "removed": ["EXECD_TOKEN", "SECOND_SECRET", "RUNTIME_ONLY"],
        "in_block": [],
        "in_os_environ": [],
        "in_child": [],
        "kept": "yes",
    }


# -- finding ---------------------------------------------------------------------------


def test_find_marked_matches_whole_entry_only(session: Session) -> None:
    plain = {k: v for k, v in os.environ.items() if k != VAR}
    m = session.marker
    marked = session.popen([SLEEP, "300"])
    unmarked = session.popen([SLEEP, "300"], env=plain)
    longer = session.popen([SLEEP, "300"], env={**plain, VAR: m + "x"})
    shorter = session.popen([SLEEP, "300"], env={**plain, VAR: m[:-1]})
    prefixed = session.popen([SLEEP, "300"], env={**plain, "X" + VAR: m})
    embedded = session.popen([SLEEP, "300"], env={**plain, "OTHER": f"{VAR}={m}"})
    session.wait_marked(1)
    time.sleep(0.2)
    assert find_marked(VAR, m) == [marked.pid]
    for proc in (unmarked, longer, shorter, prefixed, embedded):
        assert proc.poll() is None
    assert find_marked("X" + VAR, m) == [prefixed.pid]
    assert find_marked(VAR, m + "x") == [longer.pid]
    assert find_marked(VAR, m, uid=os.geteuid() + 4242) == []
    assert os.getpid() not in find_marked(VAR, m)


def test_find_marked_validates_arguments() -> None:
    with pytest.raises(ValueError):
        find_marked("BAD-VAR", "m")
    with pytest.raises(ValueError):
        find_marked(VAR, "")


def _padded_env(var_entry: str, pad_total: int) -> dict[str, str]:
    """Environment whose block is ``pad_total`` bytes of padding, then ``var_entry``."""
    env: dict[str, str] = {}
    index = 0
    left = pad_total
    while left:
        size = min(left, 100_000)
        if 0 < left - size < 16:
            size -= 16
        name = f"PAD{index:03d}"
        env[name] = "p" * (size - len(name) - 2)
        left -= size
        index += 1
    block = sum(len(k) + len(v) + 2 for k, v in env.items())
    assert block == pad_total
    name, _, value = var_entry.partition("=")
    env[name] = value
    return env


def test_find_marked_environ_read_is_bounded(session: Session) -> None:
    m = session.marker
    whole = f"{VAR}={m}"
    # A different marker whose first bytes are ours, cut by the cap right after them:
    # the partial entry must not pass for ours.
    cut = session.popen(
        [SLEEP, "300"], env=_padded_env(whole + "tail", ENVIRON_READ_CAP - len(whole))
    )
    # Our entry ends (with its NUL) inside the cap: found.
    inside = session.popen(
        [SLEEP, "300"], env=_padded_env(whole, ENVIRON_READ_CAP - len(whole) - 1)
    )
    # Our entry beyond the cap: out of reach, by design.
    beyond = session.popen([SLEEP, "300"], env=_padded_env(whole, ENVIRON_READ_CAP + 10))
    # child_environment puts the marker first, so a giant environment cannot hide it.
    big = {f"BIG{i}": "b" * 100_000 for i in range(14)}
    first = session.popen([SLEEP, "300"], env=child_environment(big, VAR, m))
    session.wait_marked(2)
    time.sleep(0.2)
    assert find_marked(VAR, m) == sorted([inside.pid, first.pid])
    assert cut.poll() is None and beyond.poll() is None


def test_find_marked_tolerates_churn(session: Session) -> None:
    marked = session.popen([SLEEP, "300"])
    session.wait_marked(1)
    stop = threading.Event()
    true = shutil.which("true") or "/bin/true"

    def churn() -> None:
        while not stop.is_set():
            subprocess.run([true], env=session.env(), check=False)

    workers = [threading.Thread(target=churn) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        for _ in range(30):
            assert marked.pid in find_marked(VAR, session.marker)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)


# -- cleanup ---------------------------------------------------------------------------


def _assert_clean(report: CleanupReport, session: Session, at_least: int) -> None:
    assert isinstance(report, CleanupReport)
    assert report.remaining == []
    assert report.killed >= at_least
    assert report.rounds >= 1
    assert report.elapsed >= 0
    assert find_marked(session.var, session.marker) == []


def test_cleanup_plain_child(session: Session) -> None:
    proc = session.popen([SLEEP, "300"])
    session.wait_marked(1)
    report = cleanup(VAR, session.marker, timeout=20)
    _assert_clean(report, session, 1)
    assert report.killed == 1
    assert _dead(proc) == -signal.SIGKILL


def test_cleanup_ignores_sigterm(session: Session) -> None:
    proc = session.popen(["sh", "-c", f"trap '' TERM; exec {SLEEP} 300"])
    session.wait_marked(1)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{proc.pid}/comm").read_text().strip() != "sleep":  # trap is set
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.terminate()
    time.sleep(0.2)
    assert proc.poll() is None, "the process should ignore SIGTERM"
    _assert_clean(cleanup(VAR, session.marker, timeout=20), session, 1)
    assert _dead(proc) == -signal.SIGKILL


def test_cleanup_nohup(session: Session) -> None:
    proc = session.popen(["nohup", SLEEP, "300"])
    session.wait_marked(1)
    _assert_clean(cleanup(VAR, session.marker, timeout=20), session, 1)
    assert _dead(proc) == -signal.SIGKILL


def test_cleanup_double_forked_setsid_grandchild(session: Session) -> None:
    run = session.reaped(PY, "-c", DOUBLE_FORK)
    found = session.wait_marked(1)
    deadline = time.monotonic() + 20
    while run.pid in found or len(found) != 1:  # until only the grandchild is left
        assert time.monotonic() < deadline, found
        time.sleep(0.02)
        found = find_marked(VAR, session.marker)
    with open(f"/proc/{found[0]}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    assert int(fields[1]) == run.proc.pid, "the orphan was adopted by the wrapper"
    assert int(fields[3]) not in (os.getsid(0), run.pid), "it lives in a session of its own"
    _assert_clean(cleanup(VAR, session.marker, timeout=20), session, 1)
    status, _ = run.finish()
    assert status == 0


def test_cleanup_shell_setsid_background(session: Session) -> None:
    setsid = shutil.which("setsid")
    if setsid is None:
        pytest.skip("setsid(1) is not installed")
    run = session.reaped("sh", "-c", f'{setsid} sh -c "{SLEEP} 300 & {SLEEP} 300" & wait')
    session.wait_marked(3)
    _assert_clean(cleanup(VAR, session.marker, timeout=20), session, 2)
    run.finish()


@pytest.mark.parametrize(
    ("loop", "seen", "killed"),
    [
        # Of the marked processes one scan sees, at most one is transient (the
        # current "sleep 0.01", which may exit before the cleanup's scan).
        (f"while :; do {SLEEP} 100 & {SLEEP} 0.01; done", 21, 20),
        (f"while :; do {SLEEP} 100 & done", 50, 50),
    ],
    ids=["respawning", "unthrottled"],
)
def test_cleanup_fork_loop(session: Session, loop: str, seen: int, killed: int) -> None:
    run = session.reaped("sh", "-c", loop)
    session.wait_marked(seen)
    report = cleanup(VAR, session.marker, timeout=30)
    _assert_clean(report, session, killed)
    status, _ = run.finish()
    assert status == -signal.SIGKILL


def test_cleanup_nothing_to_do(session: Session) -> None:
    report = cleanup(VAR, session.marker, timeout=0)
    assert report == CleanupReport(killed=0, remaining=[], rounds=0, elapsed=report.elapsed)


def test_cleanup_rejects_bad_timeout(session: Session) -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            cleanup(VAR, session.marker, timeout=bad)


def test_cleanup_spares_other_markers_and_unmarked(session: Session) -> None:
    other = new_marker()
    bystander = session.popen([SLEEP, "300"], env=child_environment(os.environ, VAR, other))
    unmarked = session.popen([SLEEP, "300"], env={k: v for k, v in os.environ.items() if k != VAR})
    target = session.popen([SLEEP, "300"])
    session.wait_marked(1)
    _assert_clean(cleanup(VAR, session.marker, timeout=20), session, 1)
    assert _dead(target) == -signal.SIGKILL
    assert bystander.poll() is None and unmarked.poll() is None
    assert find_marked(VAR, other) == [bystander.pid]
    _sweep(_entry(VAR, other))


def test_cleanup_spares_self_and_ancestors(session: Session) -> None:
    """A marked cleaner never kills itself nor the marked shell that started it."""
    script = r"""
import json, os, subprocess, sys
from execd.marker import cleanup, find_marked
var, marker = sys.argv[1:3]
sibling = subprocess.Popen(["sleep", "300"])
found = []
for _ in range(500):
    found = find_marked(var, marker)
    if sibling.pid in found and len(found) >= 2:
        break
report = cleanup(var, marker, timeout=20)
sibling.wait(timeout=20)
print(json.dumps({"me": os.getpid(), "parent": os.getppid(), "found": found,
                  "sibling": sibling.pid, "sibling_rc": sibling.returncode,
                  "killed": report.killed, "remaining": report.remaining}), flush=True)
"""
    shell = f'{SLEEP} 300 & "$0" -c "$1" "$2" "$3"; echo shell-survived'
    run = session.reaped("sh", "-c", shell, PY, script, VAR, session.marker)
    status, lines = run.finish(timeout=60)
    assert status == 0
    assert lines[-1] == "shell-survived"
    got = json.loads(lines[-2])
    assert got["parent"] == run.pid
    assert got["me"] not in got["found"] and got["parent"] not in got["found"]
    assert got["sibling"] in got["found"]
    assert len(got["found"]) == 2, "the shell's background sleep and the python sibling"
    assert got["sibling_rc"] == -signal.SIGKILL
    assert got["killed"] == 2
    assert got["remaining"] == []


@pytest.mark.anyio
async def test_cleanup_async_does_not_block_loop(session: Session) -> None:
    proc = session.popen([SLEEP, "300"])
    session.wait_marked(1)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    try:
        report = await cleanup_async(VAR, session.marker, timeout=20)
    finally:
        task.cancel()
    _assert_clean(report, session, 1)
    assert ticks >= 1
    assert _dead(proc) == -signal.SIGKILL


def test_set_child_subreaper_adopts_orphans() -> None:
    script = r"""
import os, time
from execd.marker import set_child_subreaper
ok = set_child_subreaper()
r, w = os.pipe()
middle = os.fork()
if middle == 0:
    me = os.getpid()
    if os.fork() == 0:
        deadline = time.monotonic() + 20
        while os.getppid() == me and time.monotonic() < deadline:
            time.sleep(0.01)
        os.write(w, str(os.getppid()).encode())
        os._exit(0)
    os._exit(0)
os.waitpid(middle, 0)
os.close(w)
adopter = int(os.read(r, 64))
os.wait()
print(ok, adopter == os.getpid())
"""
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


# -- command line ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--marker", "bad marker"],
        ["--marker", ""],
        ["--marker", "ok", "--marker-var", "1BAD"],
        ["--marker", "ok", "--timeout", "-1"],
        ["--marker", "ok", "--timeout", "nan"],
        ["--marker", "ok", "--timeout", "soon"],
        ["--marker", "ok", "--timeout", "1e9"],
        ["--marker", "ok", "--bogus"],
    ],
)
def test_cleanup_main_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cleanup_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "execd cleanup" in captured.err and "error" in captured.err


def test_cleanup_main_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert cleanup_main(["--marker", new_marker(), "--timeout", "0"]) == 0
    line = json.loads(capsys.readouterr().out)
    # Stale cgroups of dead execds go too; how many depends on what else ran here.
    assert isinstance(line.pop("stale_cgroups_removed"), int)
    assert line == {"event": "cleanup", "killed": 0, "remaining": [], "rounds": 0}


def test_cleanup_main_kills(session: Session, capsys: pytest.CaptureFixture[str]) -> None:
    proc = session.popen([SLEEP, "300"])
    session.wait_marked(1)
    rc = cleanup_main(["--marker", session.marker, "--marker-var", VAR, "--timeout", "20"])
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    line = json.loads(out)
    assert rc == 0
    assert line["event"] == "cleanup"
    assert line["killed"] == 1 and line["remaining"] == [] and line["rounds"] >= 1
    assert _dead(proc) == -signal.SIGKILL


def test_cleanup_main_default_var_as_command(tmp_path: Path) -> None:
    sess = Session(tmp_path, var=DEFAULT_MARKER_VAR)
    try:
        proc = sess.popen([SLEEP, "300"])
        sess.wait_marked(1)
        code = "import sys; from execd.marker import cleanup_main; sys.exit(cleanup_main())"
        env = {k: v for k, v in os.environ.items() if k != DEFAULT_MARKER_VAR}
        out = subprocess.run(
            [PY, "-c", code, "--marker", sess.marker, "--timeout", "20"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        line = json.loads(out.stdout)
        assert isinstance(line.pop("stale_cgroups_removed"), int)
        assert line == {"event": "cleanup", "killed": 1, "remaining": [], "rounds": 1}
        assert _dead(proc) == -signal.SIGKILL
    finally:
        sess.close()


# Runs execd cleanup with few descriptors: one round may then hold (and kill)
# only 16 processes through pidfds (``_fd_budget``), whoever runs it.
FEW_FDS_CLEANUP = r"""
import resource, sys
from execd.marker import cleanup_main
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(40, hard), hard))
sys.exit(cleanup_main(sys.argv[1:]))
"""
CROWD = 24


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux 5.3)")
def test_cleanup_main_reports_leftovers(session: Session) -> None:
    """More marked processes than one round may hold, and no time for another: exit 1."""
    bystander = session.popen([SLEEP, "300"], env={k: v for k, v in os.environ.items() if k != VAR})
    crowd = [session.popen([SLEEP, "300"]) for _ in range(CROWD)]
    session.wait_marked(CROWD)
    out = subprocess.run(
        [PY, "-c", FEW_FDS_CLEANUP, "--marker", session.marker, "--marker-var", VAR, "--timeout=0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out
    line = json.loads(out.stdout)
    assert line["event"] == "cleanup" and line["rounds"] == 1
    assert 1 <= line["killed"] < CROWD
    left = line["remaining"]
    assert line["killed"] + len(left) == CROWD
    assert sorted(left) == sorted(p.pid for p in crowd if p.poll() is None)
    # A cleanup with time for more rounds finishes the job; the unmarked one is spared.
    assert cleanup(VAR, session.marker, timeout=30).remaining == []
    assert all(_dead(p) == -signal.SIGKILL for p in crowd)
    assert bystander.poll() is None
