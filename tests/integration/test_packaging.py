"""What a user installs: license metadata, a wheel that builds cleanly, types a checker sees."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from bench.options import add_arguments
from tests.support.procs import run_python

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
import asyncio

import harnessd
from protocol.rpc.shell import RunResult


async def main() -> int:
    try:
        async with harnessd.connect("127.0.0.1", 9, "token") as client:
            result: RunResult = await client.run(["true"])
            return result.exit_code or 0
    except harnessd.NotFound as exc:
        code: int = exc.code
        return code
    except harnessd.ConnectionLost:
        return 1


asyncio.run(main())
"""

# If harnessd's types were not found, everything would be Any and this would pass.
BAD = """
import harnessd


async def main() -> None:
    async with harnessd.connect("127.0.0.1", 9, "token") as client:
        text: str = await client.echo(b"x")
"""


def test_license_matches_the_metadata() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_builds_without_warnings_and_carries_the_license(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    noise = [
        line
        for line in (built.stdout + built.stderr).splitlines()
        if "deprecat" in line.lower() or "BuildBackendWarning" in line
    ]
    assert noise == []
    (wheel,) = tmp_path.glob("splitexec-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        fields = archive.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in fields.splitlines()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "harnessd/py.typed" in names and "harnessd/errors.py" in names


def test_bench_output_defaults_under_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.chdir(tmp_path)
    out = parser.parse_args([]).out.resolve()
    assert out.is_relative_to(tmp_path), out
    assert "site-packages" not in out.parts


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_library_users_mypy_sees_harnessd_types(tmp_path: Path) -> None:
    """In the installed environment, from an unrelated directory, like any user."""
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    checked = run_python(
        *("-m", "mypy", "--strict", "--no-incremental", "--cache-dir", os.devnull),
        *("good.py", "bad.py"),
        cwd=tmp_path,
        env=env,
        timeout=280,
    )
    lines = [line for line in checked.stdout.splitlines() if ": error:" in line]
    assert [line.split(":")[0] for line in lines] == ["bad.py"], checked.stdout
    assert 'Incompatible types in assignment (expression has type "bytes"' in lines[0]
