"""``harnessd bench`` without its baseline packages: one line naming them, with the right pip command.

Each case runs harnessd in a fresh interpreter that sees only the project and
its runtime dependencies (``python -S`` with a hand-made path), so the
baseline packages really are missing, and a ``splitexec`` distribution record
that says how it was installed: editable from a source tree, or from a wheel.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import msgspec
import uvloop

REPO = Path(__file__).resolve().parents[2]


def _site(tmp_path: Path, direct_url: dict[str, object] | None) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    for module in (msgspec, uvloop):
        assert module.__file__ is not None
        (site / module.__name__).symlink_to(Path(module.__file__).parent)
    for package in ("protocol", "execd", "harnessd", "bench"):
        (site / package).symlink_to(REPO / package)
    record = site / "splitexec-0.1.0.dist-info"
    record.mkdir()
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: splitexec\nVersion: 0.1.0\n")
    if direct_url is not None:
        (record / "direct_url.json").write_text(json.dumps(direct_url))
    return site


def _bench(site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-S", "-m", "harnessd", "bench", "--quick"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(site)},
        timeout=60,
        check=False,
        cwd=str(site),
    )


def _line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert line.startswith("harnessd bench: ")
    for name in ("fastapi", "uvicorn", "httpx", "grpcio"):
        assert name in line
    return line


PIP = f"{shlex.quote(sys.executable)} -m pip install"


def test_an_install_that_recorded_no_origin_is_told_to_use_its_checkout(tmp_path: Path) -> None:
    # splitexec is not on the package index: 'splitexec[bench]' alone would never install.
    line = _line(_bench(_site(tmp_path, None)))
    assert line.endswith(f"{PIP} '/path/to/splitexec[bench]' (your checkout of splitexec)")


def test_a_wheel_install_is_told_to_install_that_wheel_with_the_extra(tmp_path: Path) -> None:
    wheel = tmp_path / "dist" / "splitexec-0.1.0-py3-none-any.whl"
    url: dict[str, object] = {"url": wheel.as_uri(), "archive_info": {}}
    line = _line(_bench(_site(tmp_path, url)))
    assert line.endswith(f"{PIP} {shlex.quote(f'{wheel}[bench]')}")
    remote = "https://example.invalid/splitexec-0.1.0-py3-none-any.whl"
    (tmp_path / "b").mkdir()
    line = _line(_bench(_site(tmp_path / "b", {"url": remote, "archive_info": {}})))
    assert line.endswith(f"{PIP} 'splitexec[bench] @ {remote}'")


def test_a_checkout_installed_as_is_is_told_to_install_it_again_with_the_extra(
    tmp_path: Path,
) -> None:
    source = tmp_path / "checkout"
    line = _line(_bench(_site(tmp_path, {"url": source.as_uri(), "dir_info": {}})))
    assert line.endswith(f"{PIP} {shlex.quote(f'{source}[bench]')}")


def test_bench_help_gives_install_commands_that_work_from_a_checkout() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "harnessd", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    text = " ".join(done.stdout.split())
    assert "pip install -e '.[bench]'" in text
    assert "'splitexec[" not in text


def test_an_editable_install_is_told_to_reinstall_its_source_tree_with_the_extra(
    tmp_path: Path,
) -> None:
    source = tmp_path / "my checkout"
    url: dict[str, object] = {"url": source.as_uri(), "dir_info": {"editable": True}}
    line = _line(_bench(_site(tmp_path, url)))
    expected = shlex.quote(f"{source}[bench]")
    assert line.endswith(f"{shlex.quote(sys.executable)} -m pip install -e {expected}")
