"""A workspace behind a command prefix, with execd in it one way or the other.

:class:`Workspace` joins a :class:`~harnessd.runtime.CommandPrefixRuntime`
(``docker exec -i box``, ``ssh host``, ``ip netns exec ...``) to the way execd
gets there:

``install="auto"`` (the default)
    The self-contained worker (:mod:`harnessd.worker_install`) is installed
    when :meth:`Workspace.open` runs -- probed, uploaded through the prefix's
    stdin when it is not there yet, verified -- and every session
    :meth:`Workspace.serve` launches runs it. execd keeps its state (the
    session ledgers) in ``state/`` beside the worker. :meth:`Workspace.close`
    removes the worker and that state, with the directory when the install
    made it, unless ``keep_worker`` is set: then the next workspace over the
    same prefix finds the worker there and uploads nothing. Harnesses that
    share one workspace at the same time should all keep it.
``install="never"``
    execd is already in the workspace (its own Python with this package, an
    image layer): sessions run ``execd_command`` (default
    :func:`~harnessd.launcher.default_execd_command`), and nothing is
    installed or removed.

Usage::

    async with Workspace(CommandPrefixRuntime(["ssh", "box"], quote_for_remote_shell=True),
                         worker="dist/execd-worker") as workspace:
        async with workspace.serve() as session:
            await session.client.run(["uname", "-a"])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from harnessd.launcher import Launch, serve
from harnessd.runtime import CommandPrefixRuntime, Runtime, WorkspaceError
from harnessd.worker_install import (
    FilePlacer,
    InstalledWorker,
    InstallMode,
    WorkerFile,
    install_worker,
    remove_worker,
)


class Workspace:
    """A workspace reached through ``runtime``; see the module's description.

    ``worker``: the worker file on this machine (default ``$EXECD_WORKER``);
    ``directory``: where it goes in the workspace (default: probed);
    ``keep_worker``: leave it (and execd's state) there at :meth:`close`;
    ``execd_command``: execd's argv with ``install="never"``. ``placer``: what
    can put a file into a workspace without a shell (see
    :class:`~harnessd.worker_install.FilePlacer`).
    """

    def __init__(
        self,
        runtime: CommandPrefixRuntime,
        *,
        install: InstallMode = "auto",
        worker: str | None = None,
        directory: str | None = None,
        keep_worker: bool = False,
        execd_command: Sequence[str] | None = None,
        placer: FilePlacer | None = None,
    ) -> None:
        if install not in ("auto", "never"):
            raise ValueError('install must be "auto" or "never"')
        if install == "auto" and execd_command is not None:
            raise ValueError('execd_command is for install="never"; the worker is the command')
        self.base = runtime
        self.install: InstallMode = install
        self.worker = worker
        self.directory = directory
        self.keep_worker = keep_worker
        self._execd_command = tuple(execd_command) if execd_command is not None else None
        self._placer = placer
        self.installed: InstalledWorker | None = None
        """The worker in the workspace once :meth:`open` installed it (``install="auto"``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base!r}, install={self.install!r})"

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def runtime(self) -> Runtime:
        """What sessions are launched through (a worker-backed runtime where there is no shell)."""
        return self.installed.runtime if self.installed is not None else self.base

    @property
    def execd_command(self) -> tuple[str, ...] | None:
        """execd's argv in the workspace (None: the launcher's default)."""
        if self.installed is not None:
            return self.installed.execd_command
        return self._execd_command

    @property
    def state_dir(self) -> str | None:
        """execd's state directory when the worker is installed (beside it)."""
        return self.installed.state_dir if self.installed is not None else None

    async def open(self) -> None:
        """Install the worker (``install="auto"``); idempotent."""
        if self.install == "never" or self.installed is not None:
            return
        worker = await WorkerFile.locate(self.worker)
        self.installed = await install_worker(
            self.base, worker, directory=self.directory, placer=self._placer
        )

    def serve(self, **options: Any) -> Launch:
        """:func:`~harnessd.launcher.serve` in this workspace (same keyword options).

        With the worker installed, ``--state-dir`` (execd's state beside the
        worker) comes before any ``extra_args`` given.
        """
        if self.install == "auto" and self.installed is None:
            raise WorkspaceError("the workspace is not open: await open() (or use async with)")
        options.setdefault("execd_command", self.execd_command)
        if self.state_dir is not None:
            options["extra_args"] = ("--state-dir", self.state_dir, *options.get("extra_args", ()))
        return serve(self.runtime, **options)

    async def close(self) -> None:
        """Remove the worker and execd's state unless ``keep_worker``; idempotent.

        Sessions should be closed first. Raises WorkerInstallFailed when the
        removal fails.
        """
        installed, self.installed = self.installed, None
        if installed is not None and not self.keep_worker:
            await remove_worker(installed)
