"""What the worker tests build, cached between runs: the worker, a static test program, root filesystems.

Building the worker (``tools/build_worker.py``, about a minute) and a Debian
root filesystem (``debootstrap``, a minute or two) is too slow for every run
of the suite, so both happen only when :data:`FLAG` is ``1`` (``./check`` sets
it when it runs as root) and are kept in :func:`cache_dir` under a key of
what they are made from: the worker under a digest of its sources, the test
program under a digest of its C source, the Debian tree under its suite and
variant. A second run of the same tree builds nothing.

Every failure to build raises :class:`Unavailable`, which tests turn into a
skip with the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAG = "SPLITEXEC_WORKER_TESTS"
"""Set to 1 to let tests build the worker and root filesystems (slow the first time)."""
CACHE_VAR = "SPLITEXEC_TEST_CACHE"
TESTBIN_SOURCE = Path(__file__).with_name("testbin.c")
TESTBIN_PATH = "/usr/local/bin/testbin"
"""Where the test program sits in the images made here."""
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SUITE = "bullseye"
"""Debian 11: its Python is 3.9, older than execd needs."""


class Unavailable(Exception):
    """Something the test needs cannot be built or run here (the reason)."""


def enabled() -> bool:
    """Whether the slow builds are allowed (:data:`FLAG`)."""
    return os.environ.get(FLAG) == "1"


def require_enabled() -> None:
    """Raise Unavailable unless :data:`FLAG` allows the builds."""
    if not enabled():
        raise Unavailable(
            f"set {FLAG}=1 to build the self-contained worker and the test images "
            "(./check does as root; the first build takes a few minutes, later runs reuse it)"
        )


def cache_dir() -> Path:
    """Where builds are kept: ``$SPLITEXEC_TEST_CACHE``, else ``~/.cache/splitexec-tests``."""
    base = os.environ.get(CACHE_VAR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "splitexec-tests"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _exclusive(name: str) -> Iterator[None]:
    """Hold a lock on ``name`` in the cache: test processes running at once build a thing once."""
    with open(cache_dir() / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _run(argv: list[str], what: str, timeout: float) -> str:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{what}: {exc}") from None
    if result.returncode != 0:
        raise Unavailable(f"{what} failed: {(result.stderr or result.stdout).strip()[-1500:]}")
    return result.stdout


def worker() -> Path:
    """The self-contained worker built from this tree (built now unless cached)."""
    require_enabled()
    with _exclusive("worker"):
        out = _run(
            [
                sys.executable,
                str(ROOT / "tools" / "build_worker.py"),
                "--cache-dir",
                str(cache_dir() / "worker"),
            ],
            "building the worker",
            timeout=1200,
        )
    return Path(out.split("\t")[0])


def testbin() -> Path:
    """The static test program (``gcc -static``), built unless cached."""
    source = TESTBIN_SOURCE.read_bytes()
    path = cache_dir() / f"testbin-{hashlib.sha256(source).hexdigest()[:16]}"
    if path.exists():
        return path
    compiler = shutil.which("gcc")
    if compiler is None:
        raise Unavailable("gcc is not installed (it builds the static test program)")
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    _run(
        [compiler, "-static", "-O2", "-o", str(staged), str(TESTBIN_SOURCE)],
        "gcc -static",
        timeout=120,
    )
    os.replace(staged, path)
    return path


def _add_dir(archive: tarfile.TarFile, name: str, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    archive.addfile(info)


def bare_rootfs() -> Path:
    """A tarball of a root with nothing but ``/tmp`` and the test program (no shell, no libc)."""
    program = testbin()
    path = cache_dir() / f"bare-{program.name}.tar"
    if path.exists():
        return path
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    with tarfile.open(staged, "w") as archive:
        _add_dir(archive, "tmp", 0o1777)
        for part in ("usr", "usr/local", "usr/local/bin"):
            _add_dir(archive, part, 0o755)
        archive.add(program, arcname=TESTBIN_PATH.lstrip("/"), recursive=False)
    os.replace(staged, path)
    return path


def debian_rootfs() -> Path:
    """A tarball of Debian :data:`DEBIAN_SUITE` (minbase and python3, so its only Python is 3.9)."""
    require_enabled()
    path = cache_dir() / f"debian-{DEBIAN_SUITE}-minbase-python3.tar"
    with _exclusive(path.name):
        if not path.exists():
            _debootstrap(path)
    return path


def _debootstrap(path: Path) -> None:
    if os.geteuid() != 0:
        raise Unavailable("debootstrap needs root")
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise Unavailable("debootstrap is not installed (apt-get install debootstrap)")
    tree = path.with_name(f".{path.stem}.{os.getpid()}")
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        _run(
            [
                debootstrap,
                "--variant=minbase",
                "--include=python3",
                DEBIAN_SUITE,
                str(tree),
                DEBIAN_MIRROR,
            ],
            "debootstrap",
            timeout=1200,
        )
        _run(
            ["tar", "--numeric-owner", "-C", str(tree), "-cf", str(staged), "."],
            "packing the Debian tree",
            timeout=600,
        )
        os.replace(staged, path)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
        staged.unlink(missing_ok=True)
