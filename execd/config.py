"""execd's configuration: identity (marker) and every limit a peer can push on."""

from __future__ import annotations

import os
import stat

import msgspec

from protocol.rpc.resources import Limits as CommandLimits
from protocol.values import DEFAULT_MARKER_VAR

LEDGER_PATH_VAR = "EXECD_LEDGER_DIR"


class Limits(msgspec.Struct, frozen=True):
    """Bounds on everything an authenticated or unauthenticated peer can grow.

    A frozen struct rather than a frozen dataclass: defining a dataclass of this
    many fields (generating its methods) took a visible part of execd's cold start.
    """

    max_connections: int = 256
    max_unauthenticated: int = 64
    handshake_timeout: float = 5.0
    max_inflight_calls: int = 1024
    max_processes: int = 512
    max_frame: int = 16 * 1024 * 1024
    stream_window: int = 4 * 1024 * 1024
    output_cap: int = 8 * 1024 * 1024
    detached_ring: int = 1024 * 1024
    detached_retention: float = 3600.0
    max_detached: int = 256
    kill_grace: float = 2.0
    drain_grace: float = 0.2
    max_list_entries: int = 100_000
    max_watches: int = 256
    watch_queue: int = 4096
    max_services: int = 64
    max_sessions: int = 64
    request_grace: float = 30.0
    request_retention: int = 4096
    request_retention_bytes: int = 64 * 1024 * 1024
    command_limits: CommandLimits | None = None
    """Default resource limits of every command; a call may lower them, never raise them."""


class Config(msgspec.Struct, frozen=True):
    """Everything execd needs to know about itself."""

    host: str = "127.0.0.1"
    port: int = 0
    marker: str = ""
    marker_var: str = DEFAULT_MARKER_VAR
    lease: float | None = None
    state_dir: str = ""
    state_dir_fallback: str | None = None
    """Why ``state_dir`` is the temporary fallback (None: it is the one asked for)."""
    limits: Limits = msgspec.field(default_factory=Limits)

    @property
    def ledger_dir(self) -> str:
        """Where the session ledgers live (documented; exported to children)."""
        return os.path.join(self.state_dir, "ledger")


def default_state_dir() -> tuple[str, str | None]:
    """execd's state directory when none is given, and why it fell back (None: it did not).

    ``$XDG_STATE_HOME/execd``, else ``~/.local/state/execd``, created with mode
    0700. When that cannot be created or written (a ``HOME`` the worker cannot
    write, as ``setpriv`` leaves it), a private directory under the temporary
    directory instead: ``execd-state-<uid>``, used only when it is a real
    directory owned by this user (then set to 0700), else a fresh one.
    """
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    wanted = os.path.abspath(os.path.join(base, "execd"))
    try:
        os.makedirs(wanted, mode=0o700, exist_ok=True)
        if os.access(wanted, os.W_OK | os.X_OK):
            return wanted, None
        reason = f"cannot write to {wanted}"
    except OSError as exc:
        reason = f"cannot create {wanted}: {exc.strerror}"
    return _private_temp_dir(), reason


def _private_temp_dir() -> str:
    import tempfile  # only on this fallback: it pulls in shutil and the compressors

    uid = os.getuid()
    path = os.path.join(tempfile.gettempdir(), f"execd-state-{uid}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return tempfile.mkdtemp(prefix=f"execd-state-{uid}-")
    # Someone else may have made the name first (or planted a symlink): only a
    # directory of our own is reused, and then made private whatever its mode.
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        return tempfile.mkdtemp(prefix=f"execd-state-{uid}-")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path
