"""Getting the self-contained worker into a workspace: probe, upload, verify, remove.

Theory of operation
-------------------
The worker is one file (``tools/build_worker.py``) on the harness machine.
:func:`install_worker` puts it into the workspace of a
:class:`~harnessd.runtime.CommandPrefixRuntime`, through the same prefix
(``docker exec -i box``, ``ssh host``, ``ip netns exec ...``) every other
command goes through. Its name there is ``execd-worker-<the first 16 hex
digits of its SHA-256>``, so builds never mix and a file already there is
recognised.

1. *Probe.* A short ``/bin/sh`` script reports the machine architecture and
   picks the directory: the one given, else the first of
   ``/tmp/splitexec-UID``, ``/var/tmp/splitexec-UID``,
   ``$XDG_CACHE_HOME/splitexec`` and ``$HOME/.cache/splitexec`` that is
   there or can be made (mode 0700, in a parent that exists) and is a
   directory of this user, not a symbolic link. It says whether the worker's
   file is there.
   When the prefix finds no ``/bin/sh`` (status 126 or 127 without the
   script's first line) the workspace is *bare*: the directory is :data:`BARE_DIRECTORY`
   unless given, the file is looked for by running it, and only a runtime
   that can place a file without running anything in the workspace
   (a :class:`FilePlacer`, such as :class:`harnessd.docker.DockerWorkspace`)
   can upload it.
2. *Check a file that is there.* Its SHA-256 must be the worker's: then the
   install is cached and costs nothing more. The probe hashes it with
   ``sha256sum`` where there is one; elsewhere the file is run (``tool
   probe``, see ``execd.toolbox``) and reports its own. Anything else is
   replaced.
3. *Upload.* Over the prefix's stdin into a new temporary name beside the
   final one (0600 until it is whole, then 0700), verified as in step 2, and
   renamed over the final name (``mv``: atomic within a directory, so two
   harnesses installing at once both end with a whole file). On a bare
   workspace the placer writes the final name.
4. *Remove* (:func:`remove_worker`) when the workspace no longer needs it,
   unless it is to be kept for the next session: the file, execd's state
   beside it (``state/``), and the directory when it was not given and is
   empty then. On a bare workspace the worker's own ``tool rm`` removes it
   with a directory of its own (:data:`BARE_DIRECTORY`) in one go; a running
   program's file can be removed. Harnesses sharing one workspace at once should keep
   the worker: one's removal would take it from under the others.

The result, :class:`InstalledWorker`, names the file (execd's command is just
its path) and the runtime to launch through: the given one where there is a
shell, a :class:`~harnessd.worker_runtime.WorkerToolRuntime` on a bare
workspace.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import posixpath
import secrets
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from harnessd.runtime import CommandPrefixRuntime, CommandResult, WorkspaceError, stderr_text
from harnessd.worker_runtime import WorkerToolRuntime

InstallMode = Literal["auto", "never"]
"""``"auto"``: install the worker when it is not there yet; ``"never"``: use ``execd_command``."""

WORKER_VARIABLE = "EXECD_WORKER"
"""Where :meth:`WorkerFile.locate` looks for the worker file when none is named."""

BARE_DIRECTORY = "/tmp/splitexec-worker"  # noqa: S108 - a directory of its own, 0700
"""Where the worker goes in a workspace without a shell, unless told otherwise."""

NAME_PREFIX = "execd-worker-"
STATE_DIR = "state"
"""execd's state directory when it runs from the installed worker: beside it."""
_TIMEOUT = 60.0
_UPLOAD_TIMEOUT = 300.0
_NOT_RUNNABLE = (126, 127)
_ELF_MACHINES = {0x3E: "x86_64", 0xB7: "aarch64", 0x03: "i686", 0xF3: "riscv64"}

# Runs as: sh -c PROBE sh DIRECTORY NAME.  Prints arch=, then dir= and, when
# the file is there, cached=1 and (with sha256sum) its sha256=; exits 3 when
# no directory will do. Only the
# directory itself is created (mode 0700), never a missing parent.
_PROBE = """\
arch=$(uname -m 2>/dev/null) || arch=
printf 'arch=%s\\n' "$arch"
name=$2
if [ -n "$1" ]; then
    set -- "$1"
else
    uid=$(id -u 2>/dev/null) || uid=unknown
    set -- "/tmp/splitexec-$uid" "/var/tmp/splitexec-$uid" \\
        "${XDG_CACHE_HOME:+$XDG_CACHE_HOME/splitexec}" "${HOME:+$HOME/.cache/splitexec}"
fi
for dir in "$@"; do
    [ -n "$dir" ] || continue
    [ -d "$dir" ] || (umask 077 && mkdir -- "$dir") 2>/dev/null || continue
    if [ -d "$dir" ] && [ ! -L "$dir" ] && [ -O "$dir" ] && [ -w "$dir" ]; then
        printf 'dir=%s\\n' "$dir"
        if [ -f "$dir/$name" ]; then
            echo cached=1
            if command -v sha256sum >/dev/null 2>&1; then
                sum=$(sha256sum <"$dir/$name") && printf 'sha256=%s\\n' "${sum%% *}"
            fi
        fi
        exit 0
    fi
done
exit 3
"""


class WorkerInstallFailed(WorkspaceError):
    """The worker could not be put into the workspace, or is not the file it should be."""


@runtime_checkable
class FilePlacer(Protocol):
    """A runtime that can put a file into the workspace without running anything there."""

    async def place_file(self, path: str, data: bytes, *, mode: int) -> None:
        """Create ``path`` (its parent made 0700 when missing) holding ``data`` with ``mode``."""
        ...


@dataclass(frozen=True, slots=True)
class WorkerFile:
    """The worker file on this machine: its path, SHA-256, size and architecture."""

    path: str
    sha256: str
    size: int
    arch: str

    @property
    def name(self) -> str:
        """Its file name in a workspace."""
        return NAME_PREFIX + self.sha256[:16]

    def read(self) -> bytes:
        """The file's bytes."""
        with open(self.path, "rb") as handle:
            return handle.read()

    @classmethod
    def load(cls, path: str) -> WorkerFile:
        """Hash and describe the file at ``path`` (blocking: call it in a thread)."""
        digest = hashlib.sha256()
        size = 0
        with open(path, "rb") as handle:
            head = handle.read(64)
            digest.update(head)
            size += len(head)
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
        if head[:4] != b"\x7fELF" or len(head) < 20:
            raise WorkerInstallFailed(f"{path} is not an executable (no ELF header)")
        machine = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
        return cls(path, digest.hexdigest(), size, _ELF_MACHINES.get(machine, f"elf-{machine}"))

    @classmethod
    async def locate(cls, path: str | None = None) -> WorkerFile:
        """The worker at ``path``, else at ``$EXECD_WORKER``; WorkerInstallFailed when there is none."""
        where = path or os.environ.get(WORKER_VARIABLE)
        if not where:
            raise WorkerInstallFailed(
                "no worker file: build one with `python tools/build_worker.py` and pass its "
                f"path (worker=...) or set {WORKER_VARIABLE}"
            )
        try:
            return await asyncio.to_thread(cls.load, where)
        except OSError as exc:
            raise WorkerInstallFailed(f"cannot read the worker {where}: {exc.strerror}") from None


@dataclass(frozen=True, slots=True)
class InstalledWorker:
    """The worker in a workspace, and how to launch execd there.

    ``path``: the file in the workspace; ``runtime``: what to pass to
    :func:`~harnessd.launcher.serve` (the prefix runtime where there is a
    shell, else a :class:`~harnessd.worker_runtime.WorkerToolRuntime`);
    ``uploaded``: False when the file was already there (a cached install);
    ``bare``: the workspace has no ``/bin/sh``; ``own_directory``: the
    directory was chosen here, not given (removing the worker removes it
    when nothing else is left in it).
    """

    path: str
    runtime: CommandPrefixRuntime
    uploaded: bool
    bare: bool
    own_directory: bool = True

    @property
    def execd_command(self) -> tuple[str, ...]:
        """execd's command in the workspace (``serve(execd_command=...)``)."""
        return (self.path,)

    @property
    def directory(self) -> str:
        """The directory the worker is in."""
        return posixpath.dirname(self.path)

    @property
    def state_dir(self) -> str:
        """Where execd keeps its state (the session ledgers) when started from this worker."""
        return posixpath.join(self.directory, STATE_DIR)


@dataclass(frozen=True, slots=True)
class _Probe:
    arch: str
    directory: str
    present: bool
    bare: bool
    sha256: str | None = None


def _parse_probe(result: CommandResult) -> _Probe:
    facts: dict[str, str] = {}
    for line in result.stdout.decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            facts[key] = value
    if result.exit_code != 0 or "dir" not in facts:
        raise WorkerInstallFailed(
            "no directory in the workspace to install the worker into "
            f"(status {result.exit_code}): {stderr_text(result)}; pass directory=..."
        )
    return _Probe(
        facts.get("arch", ""),
        facts["dir"],
        present=facts.get("cached") == "1",
        bare=False,
        sha256=facts.get("sha256"),
    )


async def _probe(
    runtime: CommandPrefixRuntime, worker: WorkerFile, directory: str | None
) -> _Probe:
    result = await runtime.run(
        ["/bin/sh", "-c", _PROBE, "sh", directory or "", worker.name], timeout=_TIMEOUT
    )
    # The shell prints arch= first; docker reports a missing /bin/sh on stdout.
    if result.exit_code in _NOT_RUNNABLE and not result.stdout.startswith(b"arch="):
        return _Probe("", directory or BARE_DIRECTORY, present=True, bare=True)
    return _parse_probe(result)


async def _identify(runtime: CommandPrefixRuntime, path: str) -> dict[str, object] | None:
    """What the worker at ``path`` says of itself; None when nothing runs there."""
    try:
        result = await runtime.run([path, "tool", "probe"], timeout=_TIMEOUT)
    except WorkspaceError:
        # An empty prefix runs the file itself: a missing or damaged one cannot start.
        return None
    if result.exit_code != 0:
        return None
    try:
        facts = json.loads(result.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return facts if isinstance(facts, dict) else None


def _check(facts: dict[str, object] | None, worker: WorkerFile, path: str) -> None:
    if facts is None:
        raise WorkerInstallFailed(
            f"the worker uploaded to {path} does not run there (a directory mounted noexec, "
            "or no writable temporary directory for it to unpack into?)"
        )
    if facts.get("sha256") != worker.sha256:
        raise WorkerInstallFailed(f"the worker at {path} is not the file that was uploaded")


async def _upload(
    runtime: CommandPrefixRuntime, worker: WorkerFile, final: str, placer: FilePlacer | None
) -> None:
    data = await asyncio.to_thread(worker.read)
    if placer is not None:
        await placer.place_file(final, data, mode=0o755)
        _check(await _identify(runtime, final), worker, final)
        return
    staged = posixpath.join(posixpath.dirname(final), f".{worker.name}.{secrets.token_hex(6)}")
    await runtime.write_file(staged, data, mode=0o700)
    try:
        _check(await _identify(runtime, staged), worker, staged)
        moved = await runtime.run(["mv", "-f", "--", staged, final], timeout=_TIMEOUT)
        if moved.exit_code != 0:
            raise WorkerInstallFailed(f"cannot rename {staged}: {stderr_text(moved)}")
    except BaseException:
        await asyncio.shield(runtime.run(["rm", "-f", "--", staged], timeout=_TIMEOUT))
        raise


async def install_worker(
    runtime: CommandPrefixRuntime,
    worker: WorkerFile,
    *,
    directory: str | None = None,
    placer: FilePlacer | None = None,
) -> InstalledWorker:
    """Make sure ``worker`` is in the workspace of ``runtime``; see the module's description.

    ``directory``: where it goes (default: probed). ``placer``: a runtime that
    can put a file there without a shell (needed on a bare workspace, and used
    there only). Raises :class:`WorkerInstallFailed`; WorkspaceError when a
    command cannot be run at all.
    """
    if directory is not None and not posixpath.isabs(directory):
        raise ValueError("directory must be an absolute path in the workspace")
    found = await _probe(runtime, worker, directory)
    if found.arch and found.arch != worker.arch:
        raise WorkerInstallFailed(
            f"the worker is built for {worker.arch}; the workspace runs {found.arch}"
        )
    path = posixpath.join(found.directory, worker.name)
    tools = WorkerToolRuntime(runtime.prefix, path, env=runtime.env, max_output=runtime.max_output)
    tools.quote_for_remote_shell = runtime.quote_for_remote_shell
    chosen = tools if found.bare else runtime
    if found.present:
        # The shell's sha256sum is the cheap check; else the file says what it is.
        facts = {"sha256": found.sha256} if found.sha256 else await _identify(runtime, path)
        if facts is not None and facts.get("sha256") == worker.sha256:
            return InstalledWorker(path, chosen, False, found.bare, own_directory=directory is None)
    if found.bare and placer is None:
        raise WorkerInstallFailed(
            "the workspace has no /bin/sh to receive the worker through, and "
            f"{runtime!r} cannot place files: put {worker.name} into {found.directory} "
            "some other way (an image layer, a mount) or use a runtime that can"
        )
    # A stale or damaged file of that name is replaced (mv -f, or placed over).
    await _upload(runtime, worker, path, placer if found.bare else None)
    return InstalledWorker(path, chosen, True, found.bare, own_directory=directory is None)


async def remove_worker(installed: InstalledWorker) -> None:
    """Remove the worker and execd's state beside it, and its own directory if that is empty then.

    Raises WorkerInstallFailed when the worker or the state cannot be removed.
    """
    runtime = installed.runtime
    if installed.bare and installed.own_directory:
        # The worker removes itself: nothing could run the next step. The
        # directory of its own holds nothing but workers and their state.
        doomed = [installed.directory]
    else:
        doomed = [installed.state_dir, installed.path]
    result = await runtime.run(["rm", "-rf", "--", *doomed], timeout=_TIMEOUT)
    if result.exit_code != 0:
        raise WorkerInstallFailed(f"cannot remove {doomed[-1]}: {stderr_text(result)}")
    if installed.own_directory and not installed.bare:
        # Fails, and is meant to, while other builds or a kept install's state are in it.
        await runtime.run(["rmdir", "--", installed.directory], timeout=_TIMEOUT)
