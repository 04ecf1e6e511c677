"""execd run from the self-contained worker file, and the traces its packagers leave.

The worker (``tools/build_worker.py``) is execd frozen by PyInstaller and
wrapped by staticx: the file unpacks its own C library and loader, then
PyInstaller's bootloader unpacks Python and execd's modules, each into a
private temporary directory that goes away when the program ends. On the way
they put variables into the environment of the Python process -- among them
``LD_LIBRARY_PATH`` pointing at the bundled libraries. Every command execd
starts would inherit them, and a workspace program loading the worker's
OpenSSL instead of its own is the least of what could go wrong, so
:func:`restore_environment` takes them out of ``os.environ`` (restoring the
``LD_LIBRARY_PATH`` the worker itself was started with) before anything else
runs. It also clears the variables a second copy of the worker, started by
this one, would take as a sign to reuse this copy's unpacked files.

:func:`worker_path` is the worker file this process was started from, or
``None`` when execd runs from an ordinary Python installation.
"""

from __future__ import annotations

import os
import sys

PACKAGER_VARIABLES = (
    "_PYI_APPLICATION_HOME_DIR",
    "_PYI_ARCHIVE_FILE",
    "_PYI_LINUX_PROCESS_NAME",
    "_PYI_PARENT_PROCESS_LEVEL",
    "_PYI_SPLASH_IPC",
    "_MEIPASS2",
    "PYINSTALLER_RESET_ENVIRONMENT",
    "STATICX_BUNDLE_DIR",
    "STATICX_PROG_PATH",
)
"""What PyInstaller's and staticx's bootloaders add to the environment."""

_LIBRARY_PATH = "LD_LIBRARY_PATH"
_ORIGINAL_LIBRARY_PATH = "LD_LIBRARY_PATH_ORIG"

_worker: str | None = None


def frozen() -> bool:
    """True when this process runs from the worker file, not from a Python installation."""
    return bool(getattr(sys, "frozen", False))


def restore_environment() -> None:
    """Take the packagers' variables out of ``os.environ`` (once; a no-op unless frozen).

    Remembers the worker's own path (:func:`worker_path`) first.
    """
    global _worker
    if not frozen() or _worker is not None:
        return
    _worker = os.environ.get("STATICX_PROG_PATH") or sys.executable
    for name in PACKAGER_VARIABLES:
        os.environ.pop(name, None)
    original = os.environ.pop(_ORIGINAL_LIBRARY_PATH, None)
    if original is not None:
        os.environ[_LIBRARY_PATH] = original
    else:
        os.environ.pop(_LIBRARY_PATH, None)


def worker_path() -> str | None:
    """The worker file this process was started from; ``None`` outside the worker."""
    restore_environment()
    return _worker
