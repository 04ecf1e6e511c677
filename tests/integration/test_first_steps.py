"""What a new user meets first: execd run by hand, versions, -e, --cwd, limits, messages.

Every command runs for real, as docs/cli.md shows it: execd started by hand
with a token file, ``harnessd exec`` against it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from execd.__main__ import _parser as execd_parser
from execd.app import StartupError
from execd.marker import _cli_parser as cleanup_parser
from harnessd.__main__ import _parser as harnessd_parser
from harnessd.demo import free_port
from tests.support import cli
from tests.support.worker_env import WorkerPython, worker_python_or_skip

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534
AS_NOBODY = [
    shutil.which("setpriv") or "setpriv",
    f"--reuid={NOBODY}",
    f"--regid={NOBODY}",
    "--clear-groups",
]


@contextmanager
def execd_by_hand(argv: list[str], env: dict[str, str], cwd: str) -> Iterator[int]:
    """``argv`` (an execd command line) started as a user would; its port while it runs."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("event") != "listening":
            proc.kill()
            _, err = proc.communicate(timeout=30)
            raise AssertionError(f"execd did not start: {line}{err}")
        yield int(event["port"])
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _execd(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "execd", "--state-dir", str(tmp_path / "state"), *args]


def _exec(
    port: int, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return cli.run("harnessd", "exec", "--port", str(port), *args, env=env)


# -- execd run by hand -------------------------------------------------------------


def test_a_token_file_execd_removed_is_explained(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    with execd_by_hand(_execd(tmp_path, "--token-file", str(token)), dict(os.environ), "/") as port:
        assert not token.exists()  # execd read it and removed it
        done = _exec(port, "--token-file", str(token), "--", "true")
    assert done.returncode == 2
    line = cli.one_line(done.stderr, "harnessd exec")
    assert str(token) in line and "execd removes its token file" in line
    assert "--keep-token-file" in line
    # execd started again with the same file says why it is gone, too.
    again = cli.run("execd", *_execd(tmp_path, "--token-file", str(token))[3:])
    assert again.returncode == 2
    assert "--keep-token-file" in cli.one_line(again.stderr, "execd")


def test_with_keep_token_file_clients_use_the_same_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    argv = _execd(tmp_path, "--token-file", str(token), "--keep-token-file")
    with execd_by_hand(argv, dict(os.environ), "/") as port:
        done = _exec(port, "--token-file", str(token), "--", "echo", "hello")
    assert (done.returncode, done.stdout) == (0, "hello\n"), done.stderr


# -- what the command lines say ------------------------------------------------------


@pytest.mark.parametrize("command", ["execd", "harnessd"])
def test_both_command_lines_tell_their_version(command: str) -> None:
    done = cli.run(command, "--version")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(rf"{command} \d+\.\d+\S* \(protocol \d+\)\n", done.stdout), done.stdout


def _parsers() -> Iterator[argparse.ArgumentParser]:
    pending = [execd_parser(), cleanup_parser(), harnessd_parser()]
    while pending:
        parser = pending.pop()
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())


def _refuses(kind: object, text: str) -> bool:
    try:
        kind(text)  # type: ignore[operator]
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return True
    return False


def _typed_options() -> list[tuple[str, str]]:
    """Every option of both command lines whose type refuses ``bogus!``."""
    found = []
    for parser in _parsers():
        for action in parser._actions:
            if action.option_strings and action.type and _refuses(action.type, "bogus!"):
                found.append((parser.prog, action.option_strings[-1]))
    return found


_TOP = {"execd": execd_parser, "execd cleanup": cleanup_parser, "harnessd": harnessd_parser}


@pytest.mark.parametrize(("prog", "option"), _typed_options())
def test_a_bad_value_is_explained_in_words_not_internal_names(
    prog: str, option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    top = "execd cleanup" if prog == "execd cleanup" else prog.split()[0]
    args = [*prog.split()[1:], option, "bogus!"] if top == "harnessd" else [option, "bogus!"]
    with pytest.raises((SystemExit, StartupError)) as caught:
        _TOP[top]().parse_args(args)
    said = str(caught.value) if isinstance(caught.value, StartupError) else capsys.readouterr().err
    line = next((x for x in said.splitlines() if "bogus!" in x), said)
    assert option in line, said
    assert not re.search(r"invalid \w+ value", line), line


# -- harnessd exec ---------------------------------------------------------------------


@pytest.fixture
def port(tmp_path: Path) -> Iterator[int]:
    """An execd started by hand for the test, its token in $EXECD_TOKEN."""
    env = {**os.environ, "EXECD_TOKEN": "t" * 64}
    with execd_by_hand(_execd(tmp_path), env, "/") as number:
        yield number


def test_env_options_set_variables_of_the_command(port: int) -> None:
    token = {"EXECD_TOKEN": "t" * 64}
    script = 'printf "%s|%s|%s" "$GREETING" "$EMPTY" "$FROM_HERE"'
    done = _exec(
        port,
        "-e",
        "GREETING=hello world",
        "--env",
        "EMPTY=",
        "-e",
        "FROM_HERE",
        "--",
        "sh",
        "-c",
        script,
        env={**token, "FROM_HERE": "local value"},
    )
    assert (done.returncode, done.stdout) == (0, "hello world||local value"), done.stderr
    for bad, why in [
        ("UNSET_HERE_4711", "is not set here"),
        ("=x", "is not NAME=VALUE"),
        ("EXECD_TOKEN", "never passed on"),
    ]:
        refused = _exec(port, "-e", bad, "--", "true", env=token)
        assert refused.returncode == 2
        assert why in cli.one_line(refused.stderr, "harnessd exec")


def test_a_cwd_that_is_a_file_is_named_as_the_directory(port: int, tmp_path: Path) -> None:
    a_file = tmp_path / "a file"
    a_file.write_text("")
    done = _exec(port, "--cwd", str(a_file), "--", "echo", "hi", env={"EXECD_TOKEN": "t" * 64})
    assert done.returncode == 126
    line = cli.one_line(done.stderr, "harnessd exec")
    assert line == f"harnessd exec: the working directory is not a directory: {a_file}"


@pytest.fixture
def worker() -> Iterator[WorkerPython]:
    """An interpreter the user ``nobody`` can run execd with."""
    yield from worker_python_or_skip(AS_NOBODY)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run execd as an unprivileged user")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is missing")
def test_a_memory_limit_kept_by_an_rlimit_is_named_when_the_command_fails(
    worker: WorkerPython, tmp_path: Path
) -> None:
    # An unprivileged execd has no cgroup of its own: memory is an address-space rlimit.
    scratch = Path("/tmp") / f"sx-rlimit-{os.getpid()}-{secrets.token_hex(4)}"
    scratch.mkdir(mode=0o1777)
    scratch.chmod(0o1777)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(scratch),
        "EXECD_TOKEN": "t" * 64,
        **worker.environment(),
    }
    argv = [
        *AS_NOBODY,
        "env",
        "-i",
        *(f"{k}={v}" for k, v in env.items()),
        *worker.execd_command(),
        "--state-dir",
        str(scratch / "state"),
    ]
    try:
        with execd_by_hand(argv, {}, "/") as port:
            token = {"EXECD_TOKEN": "t" * 64}
            hungry = [worker.python, "-c", "bytearray(1 << 30)"]
            failed = _exec(port, "--limit-memory", "64M", "--", *hungry, env=token)
            fine = _exec(port, "--limit-memory", "64M", "--", worker.python, "-c", "", env=token)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert failed.returncode == 1
    assert "MemoryError" in failed.stderr
    note = failed.stderr.strip().splitlines()[-1]
    assert note.startswith("harnessd exec: the command ran under a memory limit of 64 MiB")
    assert (fine.returncode, fine.stderr) == (0, "")


def test_the_run_execd_yourself_block_of_the_docs_runs_as_written(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    found = re.search(r"## Running execd yourself\n.*?```sh\n(.*?)```", text, flags=re.DOTALL)
    assert found is not None
    script = found.group(1).replace("4464", str(free_port()))
    # The console scripts of this installation, as a user's PATH would have them.
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    done = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path},
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, "hello from the workspace\n"), done.stderr
    assert (tmp_path / "token").stat().st_mode & 0o077 == 0
