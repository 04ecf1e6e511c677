"""A runtime for workspaces with no shell: the installed worker is its own toolbox.

:class:`~harnessd.runtime.CommandPrefixRuntime` needs ``/bin/sh``, ``cat``,
``mkdir``, ``chmod`` and ``rm`` in the workspace. An image made from an empty
root has none of them; once the self-contained worker is there
(:mod:`harnessd.worker_install`), :class:`WorkerToolRuntime` runs the same
steps as the worker's built-in utilities (``WORKER tool ...``, see
``execd.toolbox``) through the same prefix:

* ``run(argv)`` runs ``prefix + argv``, except that the utilities the launcher
  and the installer use (:data:`BUILT_IN`: ``mkdir``, ``rm``, ``rmdir``, ``cat``) run as
  ``WORKER tool NAME ...`` with the same arguments;
* ``start_background`` runs ``WORKER tool start --settle S LOG -- ARGV...``,
  whose supervisor appends the ``exited`` line itself (``supervises``),
  so the launcher does not wrap execd in its ``/bin/sh`` supervisor; with
  ``cwd`` the supervisor enters that directory first (``--cwd``); it
  returns once execd has written its first line (or :data:`START_SETTLE`
  passed);
* ``read_file`` (through ``cat``) and ``write_file`` run ``WORKER tool cat``
  and ``WORKER tool write`` (a new file, 0600 until it is whole, data on
  stdin).

Each of these is one start of the worker in the workspace (a fraction of a
second each, where the shell's are a few milliseconds), so this runtime is
only chosen where there is no shell.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from harnessd.runtime import (
    DEFAULT_MAX_OUTPUT,
    CommandPrefixRuntime,
    WorkspaceError,
    stderr_text,
)

BUILT_IN = frozenset({"mkdir", "rm", "rmdir", "cat"})
"""Utilities the worker provides in place of the workspace's own."""

START_SETTLE = 10.0
"""Seconds ``start_background`` waits in the workspace for the log to grow (execd's first line).

The launcher reads the log right after; each read is one more start of the
worker, so waiting there spares the reads that would find nothing yet."""


class WorkerToolRuntime(CommandPrefixRuntime):
    """Like :class:`~harnessd.runtime.CommandPrefixRuntime`, with the worker at ``worker`` standing in for the shell."""

    supervises = True
    """``start_background`` appends the ``exited`` line itself (see :mod:`harnessd.launcher`)."""

    def __init__(
        self,
        prefix: Sequence[str],
        worker: str,
        *,
        quote_for_remote_shell: bool = False,
        max_output: int = DEFAULT_MAX_OUTPUT,
        env: Mapping[str, str] | None = None,
        scrub: Iterable[str] = (),
    ) -> None:
        super().__init__(
            prefix,
            quote_for_remote_shell=quote_for_remote_shell,
            max_output=max_output,
            env=env,
            scrub=scrub,
        )
        self.worker = worker

    def __repr__(self) -> str:
        return f"WorkerToolRuntime({self.prefix!r}, worker={self.worker!r})"

    def tool(self, name: str, *args: str) -> list[str]:
        """The argv that runs the worker's utility ``name`` in the workspace."""
        return [self.worker, "tool", name, *args]

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The argv run on this machine: ``mkdir``, ``rm``, ``rmdir`` and ``cat`` are the worker's."""
        if argv and argv[0] in BUILT_IN:
            argv = self.tool(*argv)
        return super().wrap(argv)

    async def start_background(
        self, argv: Sequence[str], *, log_path: str, cwd: str | None = None
    ) -> None:
        """Start ``argv`` detached and supervised by the worker, in ``cwd`` when given.

        See :class:`~harnessd.runtime.Runtime`, and
        :class:`~harnessd.runtime.SupervisingRuntime` for ``cwd``.
        """
        if not argv:
            raise WorkspaceError("cannot start an empty argv")
        options = ["--settle", repr(START_SETTLE)]
        if cwd is not None:
            options += ["--cwd", cwd]
        result = await self.run(self.tool("start", *options, log_path, "--", *argv))
        if result.exit_code != 0:
            raise WorkspaceError(
                f"cannot start {argv[0]} in the background "
                f"(status {result.exit_code}): {stderr_text(result)}"
            )

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o600, make_parents: bool = False
    ) -> None:
        """Create ``path`` with ``data`` and ``mode`` via the worker's ``write``."""
        flags = ["-m", format(mode & 0o7777, "o")] + (["-p"] if make_parents else [])
        result = await self.run(self.tool("write", *flags, "--", path), stdin=data)
        if result.exit_code != 0:
            raise WorkspaceError(f"cannot write {path}: {stderr_text(result)}")
