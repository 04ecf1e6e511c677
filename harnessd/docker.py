"""A Docker container as a workspace: started from an image, or a running one joined.

:class:`DockerWorkspace` is a :class:`~harnessd.workspace.Workspace` whose
prefix is ``docker exec -i CONTAINER`` (with ``-u USER`` when given).

``DockerWorkspace(image=...)``
    :meth:`~DockerWorkspace.open` creates a container of its own
    (``docker create --init`` with ``run_args``, by default ``--network
    host``), copies the worker into it before it starts (``docker cp`` of a
    tar stream on stdin, into :data:`~harnessd.worker_install.BARE_DIRECTORY`)
    and starts it with the worker's ``tool hold`` as its long-running process
    -- so an image needs no shell, no ``sleep``, nothing but a ``/tmp`` the
    worker can unpack into. The install step then finds the worker in place.
    :meth:`~DockerWorkspace.close` removes the container (``docker rm -f``)
    unless ``keep_container``.
``DockerWorkspace(container=...)``
    Joins a running container: the worker is installed through ``docker exec
    -i`` (its stdin) where the container has ``/bin/sh``, and placed with
    ``docker cp`` where it has none; close removes it unless ``keep_worker``.

With ``install="never"`` execd must be in the image (``execd_command``), and a
container started from an image runs ``sleep infinity``.

Networking: harnessd connects to the port execd announces on the address it
binds (``serve(bind_host=...)``, default 127.0.0.1). With ``--network host``
(the default here) that is the harness machine's loopback. On a bridge
network, bind ``0.0.0.0`` and connect to the container's address
(``connect_host=``, from ``docker inspect``), or publish a fixed port
(``run_args=("-p", "127.0.0.1:7000:7000")``, ``serve(bind_host="0.0.0.0",
port=7000, connect_host="127.0.0.1")``); docs/workspaces.md shows both.
"""

from __future__ import annotations

import asyncio
import io
import posixpath
import secrets
import tarfile
import time
from collections.abc import Sequence

from harnessd.runtime import CommandPrefixRuntime, WorkspaceError, run_process, stderr_text
from harnessd.worker_install import BARE_DIRECTORY, InstallMode, WorkerFile
from harnessd.workspace import Workspace

DEFAULT_RUN_ARGS = ("--network", "host")
LABEL = "splitexec.workspace"
"""Label on every container a DockerWorkspace starts (its value: the workspace's name)."""

_TIMEOUT = 120.0


class DockerWorkspace(Workspace):
    """A container as a workspace; see the module's description.

    Exactly one of ``image`` and ``container``. ``docker``: the client's argv
    (e.g. ``("docker", "-H", "unix:///run/other.sock")``). ``user``: run
    everything as this user (``docker exec -u``); a numeric uid also owns the
    files placed with ``docker cp``. ``run_args``: more ``docker create``
    arguments for a started container. ``name``: that container's name
    (default ``splitexec-<random>``). Other arguments as for
    :class:`~harnessd.workspace.Workspace`.
    """

    def __init__(
        self,
        *,
        image: str | None = None,
        container: str | None = None,
        docker: Sequence[str] = ("docker",),
        user: str | None = None,
        run_args: Sequence[str] = DEFAULT_RUN_ARGS,
        name: str | None = None,
        keep_container: bool = False,
        install: InstallMode = "auto",
        worker: str | None = None,
        directory: str | None = None,
        keep_worker: bool = False,
        execd_command: Sequence[str] | None = None,
    ) -> None:
        if (image is None) == (container is None):
            raise ValueError("DockerWorkspace needs exactly one of image= and container=")
        self.image = image
        self.docker = tuple(docker)
        self.user = user
        self.run_args = tuple(run_args)
        self.keep_container = keep_container
        self.container = container if container is not None else (name or _new_name())
        self.started = False
        """True once this workspace created its container (and so removes it)."""
        exec_user = ("-u", user) if user else ()
        prefix = [*self.docker, "exec", "-i", *exec_user, self.container]
        if image is not None and install == "auto" and directory is None:
            directory = BARE_DIRECTORY
        super().__init__(
            CommandPrefixRuntime(prefix),
            install=install,
            worker=worker,
            directory=directory,
            keep_worker=keep_worker,
            execd_command=execd_command,
            placer=self,
        )

    def __repr__(self) -> str:
        what = f"image={self.image!r}" if self.image is not None else ""
        return f"DockerWorkspace(container={self.container!r}{', ' if what else ''}{what})"

    async def docker_run(self, *args: str, stdin: bytes | None = None) -> bytes:
        """Run ``docker ARGS...`` here; its stdout, or WorkspaceError with its stderr."""
        result = await run_process(
            [*self.docker, *args], stdin=stdin, timeout=_TIMEOUT, env=self.base.env
        )
        if result.exit_code != 0:
            raise WorkspaceError(f"docker {args[0]} failed: {stderr_text(result)}")
        return result.stdout

    async def place_file(self, path: str, data: bytes, *, mode: int) -> None:
        """Put ``data`` at ``path`` in the container with ``docker cp`` (a tar on its stdin).

        The parent directory is made with mode 0700 (owned by the numeric
        ``user``, else root) when missing; its own parent must exist.
        """
        parent = posixpath.dirname(path)
        if not posixpath.isabs(path) or parent == "/":
            raise ValueError(f"{path!r}: a file is placed in a directory of its own below /")
        archive = _tar_of(
            posixpath.basename(parent), posixpath.basename(path), data, mode, self._uid()
        )
        target = posixpath.dirname(parent) or "/"
        await self.docker_run("cp", "-", f"{self.container}:{target}", stdin=archive)

    def _uid(self) -> int:
        owner = (self.user or "").split(":")[0]
        return int(owner) if owner.isdigit() else 0

    async def open(self) -> None:
        """Start the container (``image=``), then install the worker; idempotent."""
        if self.image is not None and not self.started:
            await self._start_container()
        try:
            await super().open()
        except BaseException:
            await asyncio.shield(self._remove_container())
            raise

    async def close(self) -> None:
        """Remove the worker (unless kept), then the container this workspace started."""
        try:
            await super().close()
        finally:
            await asyncio.shield(self._remove_container())

    async def _start_container(self) -> None:
        assert self.image is not None
        user = ("-u", self.user) if self.user else ()
        create = [
            "create",
            "--name",
            self.container,
            "--init",
            "--label",
            f"{LABEL}={self.container}",
        ]
        create += [*user, *self.run_args]
        worker = await WorkerFile.locate(self.worker) if self.install == "auto" else None
        if worker is not None:
            entry = posixpath.join(self.directory or BARE_DIRECTORY, worker.name)
            create += ["--entrypoint", entry, self.image, "tool", "hold"]
        else:
            create += ["--entrypoint", "sleep", self.image, "infinity"]
        await self.docker_run(*create)
        self.started = True
        try:
            if worker is not None:
                await self.place_file(entry, await asyncio.to_thread(worker.read), mode=0o755)
            await self.docker_run("start", self.container)
        except BaseException:
            await asyncio.shield(self._remove_container())
            raise

    async def _remove_container(self) -> None:
        if not self.started or self.keep_container:
            return
        self.started = False
        await self.docker_run("rm", "-f", "-v", self.container)


def _new_name() -> str:
    return f"splitexec-{secrets.token_hex(6)}"


def _tar_of(directory: str, name: str, data: bytes, mode: int, uid: int) -> bytes:
    """A tar stream of ``directory/`` (0700) holding ``name`` with ``data`` and ``mode``."""
    buffer = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        folder = tarfile.TarInfo(directory)
        folder.type = tarfile.DIRTYPE
        folder.mode = 0o700
        folder.uid = folder.gid = uid
        folder.mtime = now
        archive.addfile(folder)
        entry = tarfile.TarInfo(f"{directory}/{name}")
        entry.size = len(data)
        entry.mode = mode
        entry.uid = entry.gid = uid
        entry.mtime = now
        archive.addfile(entry, io.BytesIO(data))
    return buffer.getvalue()
