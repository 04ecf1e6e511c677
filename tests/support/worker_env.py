"""A Python interpreter an unprivileged workspace user can run execd with.

The tests' own interpreter may sit where other users cannot reach it (a venv
whose ``python`` links into a 0700 home directory). The workspace user gets
instead:

* a system interpreter of the same ``major.minor`` version, so the compiled
  extensions of the installed packages load (same ABI tag), and
* a world-readable directory (0755) holding copies of every package execd
  imports that is not part of the standard library -- ``execd`` and
  ``protocol`` themselves, ``msgspec``, ``uvloop``, ``cryptography`` with the
  cffi backend, ... -- found by importing execd's modules in a child of the
  tests' interpreter and reading where each module came from.

:func:`prepare` builds the directory and proves, by running an import as the
user, that the result works; it raises :class:`WorkerPythonUnavailable` with
the reason otherwise, which the tests turn into a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

#: Modules whose imports make up everything execd loads while serving.
EXECD_MODULES = (
    "execd.__main__",
    "execd.app",
    "execd.files",
    "execd.ledger",
    "execd.services",
    "execd.sessions",
    "execd.shell",
    "execd.watch",
    "uvloop",
    "cryptography.hazmat.primitives.ciphers.aead",
    "cryptography.hazmat.primitives.kdf.hkdf",
)

_SKIP_TOP_LEVEL = ("__main__", "_distutils_hack", "__editable__", "_virtualenv")

# Runs in a child of the tests' interpreter: import the modules named in argv,
# then print {top-level name: file or package directory} for every loaded
# module that is neither built in nor part of the standard library.
_FIND_SOURCES = r"""
import importlib, json, os, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
stdlib = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
found = {}
for name, module in list(sys.modules.items()):
    top = name.partition(".")[0]
    if top in stdlib or top in found:
        continue
    spec = getattr(sys.modules.get(top), "__spec__", None)
    if spec is None:
        continue
    if spec.submodule_search_locations:
        locations = list(spec.submodule_search_locations)
        if len(locations) == 1:
            found[top] = locations[0]
    elif spec.origin and os.path.isfile(spec.origin):
        found[top] = spec.origin
print(json.dumps(found))
"""

_PROBE = "import sys; [__import__(m) for m in sys.argv[1:]]; print(sys.version_info[:2])"


class WorkerPythonUnavailable(Exception):
    """No interpreter the workspace user can run execd with (the reason)."""


@dataclass(frozen=True, slots=True)
class WorkerPython:
    """An interpreter plus the package directory to put on its PYTHONPATH."""

    python: str
    path: str

    def environment(self) -> dict[str, str]:
        """Variables the worker's environment needs (besides PATH, HOME, ...)."""
        return {"PYTHONPATH": self.path, "PYTHONDONTWRITEBYTECODE": "1"}

    def execd_command(self) -> list[str]:
        """The argv that starts execd with this interpreter."""
        return [self.python, "-m", "execd"]


def package_sources(modules: Sequence[str] = EXECD_MODULES) -> dict[str, str]:
    """Top-level non-stdlib module name -> its file or package directory."""
    result = subprocess.run(
        [sys.executable, "-c", _FIND_SOURCES, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise WorkerPythonUnavailable(f"cannot import execd's modules: {result.stderr[-500:]}")
    found: dict[str, str] = json.loads(result.stdout)
    return {
        name: where
        for name, where in found.items()
        if not any(name.startswith(prefix) for prefix in _SKIP_TOP_LEVEL)
    }


def _open_up(root: Path) -> None:
    """Make ``root`` and everything below it readable (and dirs searchable) by all."""
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o755)  # noqa: S103 - meant to be read by the workspace user
        for name in files:
            path = os.path.join(directory, name)
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            os.chmod(path, mode | 0o444)


def copy_packages(dest: Path, sources: dict[str, str]) -> None:
    """Copy every source (package directory or single module) into ``dest``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name, where in sorted(sources.items()):
        source = Path(where)
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore, symlinks=False)
        else:
            shutil.copy2(source, dest / source.name)
    _open_up(dest)


def candidate_interpreters() -> list[str]:
    """System interpreters of this Python's version, best first (deduplicated)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    names = [
        os.path.realpath(sys.executable),
        f"/usr/bin/python{version}",
        f"/usr/local/bin/python{version}",
        "/usr/bin/python3",
    ]
    seen: list[str] = []
    for name in names:
        if name not in seen and os.path.isfile(name) and os.access(name, os.X_OK):
            seen.append(name)
    return seen


def make_package_dir(parent: str | None = None) -> Path:
    """A new world-readable (0755) directory holding copies of execd's packages."""
    sources = package_sources()
    dest = Path(tempfile.mkdtemp(prefix="sx-worker-py-", dir=parent))
    try:
        os.chmod(dest, 0o755)  # noqa: S103 - meant to be read by the workspace user
        copy_packages(dest, sources)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest


def prepare(run_as: Sequence[str], package_dir: Path) -> WorkerPython:
    """Pick an interpreter that ``run_as + [python, ...]`` can run with ``package_dir``.

    ``run_as`` is the prefix that runs a command as the workspace user (e.g.
    ``setpriv --reuid U --regid G --clear-groups``). Raises
    WorkerPythonUnavailable with every candidate's failure otherwise.
    """
    want = f"({sys.version_info.major}, {sys.version_info.minor})"
    failures: list[str] = []
    for python in candidate_interpreters():
        worker = WorkerPython(python=python, path=str(package_dir))
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", **worker.environment()}
        assignments = [f"{name}={value}" for name, value in env.items()]
        result = subprocess.run(
            [*run_as, "env", "-i", *assignments, python, "-c", _PROBE, *EXECD_MODULES],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd="/",
        )
        if result.returncode == 0 and result.stdout.strip() == want:
            return worker
        detail = (result.stderr.strip().splitlines() or [result.stdout.strip()])[-1:]
        failures.append(f"{python}: {detail[0] if detail else result.returncode}")
    raise WorkerPythonUnavailable(
        "no interpreter the workspace user can run execd with: " + "; ".join(failures)
    )


def worker_python_or_skip(run_as: Sequence[str]) -> Iterator[WorkerPython]:
    r"""A fixture body: a :func:`prepare`\ d interpreter for ``run_as``, or the test skipped.

    The package directory is removed when the fixture ends.
    """
    package_dir = make_package_dir()
    try:
        try:
            worker = prepare(run_as, package_dir)
        except WorkerPythonUnavailable as exc:
            pytest.skip(str(exc))
        yield worker
    finally:
        shutil.rmtree(package_dir, ignore_errors=True)
