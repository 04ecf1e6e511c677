"""What the README and docs/ show is what the code does.

Every Python program they show is a file in examples/ that the suite runs
(most in tests/integration/test_examples.py), every option a command line in them
names is one the program accepts, the README's "Running execd yourself" block
runs as written, and every link goes to a file that exists.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import wait_until_none_mention

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = ROOT / "examples"
TWO_COMMANDS = """\
# Set up and run the demo: a local execd on loopback driven by a scripted model.
python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/harnessd demo

# Set up and run the whole test suite (lint, formatting, strict typing, tests).
./check
"""


def fenced(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.DOTALL | re.M)


def test_programs_shown_are_the_examples() -> None:
    examples = {path.name: path.read_text() for path in EXAMPLES.glob("*.py")}
    shown_in: dict[Path, set[str]] = {}
    for page in PAGES:
        for block in fenced(page, "python"):
            matches = {name for name, text in examples.items() if text == block}
            assert matches, f"a program in {page.name} is not a file in examples/:\n{block[:300]}"
            shown_in.setdefault(page, set()).update(matches)
    # The programs every reader of the README meets: the quickstart and the agent loop.
    assert shown_in[README] == {"quickstart.py", "agent.py"}


def test_every_example_is_named_in_the_docs_and_run_by_the_suite() -> None:
    text = "\n".join(page.read_text() for page in PAGES)
    # Most run in test_examples.py; one that needs a daemon of its own runs beside its fixture.
    runners = "\n".join(path.read_text() for path in (ROOT / "tests").rglob("test_*.py"))
    for path in EXAMPLES.glob("*.py"):
        assert f"examples/{path.name}" in text, f"no page names examples/{path.name}"
        assert f'"{path.name}"' in runners, f"no test runs {path.name}"


def test_the_two_commands_are_as_they_were() -> None:
    assert TWO_COMMANDS in fenced(README, "sh")


def test_the_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 300


def test_links_go_to_files_that_exist() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path = (page.parent / target).resolve()
            assert path.exists(), f"{page.name} links to {target}"


# -- command lines ---------------------------------------------------------------------

# How each program the pages name prints its help: a command line starting with the
# key (after a path such as .venv/bin/) is checked against that help.
PROGRAMS = {
    "execd cleanup": ["-m", "execd", "cleanup"],
    "execd": ["-m", "execd"],
    **{
        f"harnessd {command}": ["-m", "harnessd", command]
        for command in ("exec", "demo", "run", "bench", "gc")
    },
    **{
        f"python -m bench{module}": ["-m", f"bench{module}"]
        for module in ("", ".scale", ".agents", ".soak", ".cores", ".instructions", ".ray_pool")
    },
    # The examples that take options (asking the others for --help would run them).
    **{
        f"python examples/{path.name}": [str(path)]
        for path in EXAMPLES.glob("*.py")
        if "argparse" in path.read_text()
    },
}


@functools.cache
def options_of(program: str) -> frozenset[str]:
    done = subprocess.run(
        [sys.executable, *PROGRAMS[program], "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", done.stdout))


def command_lines(page: Path) -> Iterator[str]:
    """Every line of a sh block, and every inline code span.

    A line of a sh block that starts with blanks goes on the line before it, as
    the continued synopses do.
    """
    text = page.read_text()
    for block in fenced(page, "sh"):
        yield from re.split(r"\n(?![ \t])", block.replace("\\\n", " "))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.M)
    for span in re.findall(r"`([^`]+)`", prose):
        yield span.replace("\n", " ")


def commands(line: str) -> Iterator[list[str]]:
    """The words of each command of a line, split at ``&&``, ``;``, ``|`` and ``&``."""
    lexer = shlex.shlex(
        line.replace("[", " ").replace("]", " "), posix=True, punctuation_chars=True
    )
    lexer.commenters = "#"
    try:
        words = list(lexer)
    except ValueError:
        return  # not shell: an unbalanced quote in prose
    command: list[str] = []
    for word in [*words, ";"]:
        if word and set(word) <= set(";&|()<>"):
            if command:
                yield command
            command = []
        else:
            command.append(word)


def named_program(words: list[str]) -> tuple[str, list[str]] | None:
    """The program a command runs (longest known name first) and its words after it."""
    words = list(words)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)  # VAR=value before the command
    if not words:
        return None
    if words[0].endswith(("/execd", "/harnessd")):
        words[0] = words[0].rsplit("/", 1)[-1]
    if words[0] == "python3":
        words[0] = "python"
    for size in (3, 2, 1):
        name = " ".join(words[:size])
        if name in PROGRAMS:
            return name, words[size:]
    return None


def named_options(words: list[str]) -> list[str]:
    options = []
    for word in words:
        if word == "--":
            break  # what follows is the remote command's
        if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", word):
            options.append(word.split("=", 1)[0])
    return options


def test_every_option_the_pages_name_exists() -> None:
    checked = 0
    for page in PAGES:
        for line in command_lines(page):
            for command in commands(line):
                found = named_program(command)
                if found is None:
                    continue
                program, words = found
                for option in named_options(words):
                    assert option in options_of(program), (
                        f"{page.name}: `{program}` has no {option}"
                    )
                    checked += 1
    assert checked > 50, f"only {checked} options found: is the parser of command lines broken?"


def test_the_option_check_catches_a_wrong_option() -> None:
    (command,) = commands("harnessd exec --port 1 --token-fil t -- ls --long")
    found = named_program(command)
    assert found is not None
    program, words = found
    assert named_options(words) == ["--port", "--token-fil"]
    assert "--token-fil" not in options_of(program)


# -- running execd yourself ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.timeout(90)
def test_running_execd_yourself_as_the_readme_says(tmp_path: Path) -> None:
    section = README.read_text().split("## Running execd yourself", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, flags=re.DOTALL)
    assert block is not None
    script = block.group(1).replace("7001", str(free_port()))
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", HOME=str(tmp_path))
    env.pop("EXECD_TOKEN", None)
    # The block's last line stops execd (SIGTERM) and waits for it.
    assert script.rstrip().endswith("kill $! && wait"), script
    done = subprocess.run(
        ["sh", "-ec", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    marker, kernel = done.stdout.split()
    assert re.fullmatch(r"[0-9a-f]{32}", marker) and kernel == os.uname().sysname
    assert (tmp_path / "token").stat().st_mode & 0o077 == 0
    assert (tmp_path / "token").exists(), "--keep-token-file keeps it for harnessd exec"
    assert wait_until_none_mention(marker, 10.0) == []
