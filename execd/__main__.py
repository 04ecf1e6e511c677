"""execd's command line: ``execd [options]`` serves; ``execd cleanup ...`` cleans up by marker;
``execd tool ...`` runs a workspace utility (:mod:`execd.toolbox`).

The token comes from ``--token-file`` (read, then removed unless
``--keep-token-file``) or from ``EXECD_TOKEN``; never from argv. It is removed
from execd's environment before any child starts, and execd makes itself
non-dumpable so processes of the same user cannot read it out of execd's
memory or initial environment through /proc.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    # Importing execd makes many long-lived objects (classes, schemas, tables), and
    # the collector kept walking them: dozens of collections, about 13 ms, before
    # execd could listen. main() turns it back on once all that is made.
    gc.disable()

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import sys
from typing import Final, NoReturn

import msgspec

from execd import frozen, marker
from execd.app import Execd, StartupError, announce
from execd.budget import fit_process_limits
from execd.config import Config, Limits, default_state_dir
from protocol.rpc.resources import LIMIT_NAMES
from protocol.rpc.resources import Limits as CommandLimits
from protocol.values import (
    DEFAULT_MARKER_VAR,
    LIMIT_OPTIONS,
    TOKEN_VAR,
    TokenFileUnreadable,
    bind_port,
    count,
    from_options,
    new_marker,
    option_name,
    positive_seconds,
    read_token,
    validate_marker,
    validate_marker_var,
)
from protocol.version import VersionAction

_PR_SET_DUMPABLE = 4
_DEFAULTS = Limits()
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_DAEMON_LIMITS: Final = (
    # (option, field of Limits it sets and takes its type and default from, help)
    ("--max-connections", "max_connections", None),
    ("--max-unauthenticated", "max_unauthenticated", None),
    ("--handshake-timeout", "handshake_timeout", None),
    (
        "--idle-timeout",
        "idle_timeout",
        "seconds a client may send nothing (it is pinged at half of it) before its connection "
        "is given up as a peer that vanished",
    ),
    ("--max-inflight", "max_inflight_calls", None),
    ("--max-processes", "max_processes", "processes execd runs at once, of every kind"),
    (
        "--max-processes-per-connection",
        "max_processes_per_connection",
        "commands running at once for the calls of one connection",
    ),
    ("--max-open-files", "max_open_files", "files the files.* calls hold open at once"),
    (
        "--max-open-files-per-connection",
        "max_open_files_per_connection",
        "files the files.* calls of one connection hold open at once",
    ),
    ("--max-frame", "max_frame", None),
    ("--output-cap", "output_cap", None),
    (
        "--request-grace",
        "request_grace",
        "seconds a call with a request id keeps running after its connection is lost",
    ),
    (
        "--request-retention",
        "request_retention",
        "finished calls whose outcome is kept for a reattach (oldest evicted first)",
    ),
    (
        "--request-retention-bytes",
        "request_retention_bytes",
        "bytes of kept outcomes (results and unread output) over all finished calls",
    ),
)
"""execd's own bounds on the command line, in the order ``--help`` lists them."""


class _Parser(argparse.ArgumentParser):
    """Usage errors become a StartupError: one line on stderr, an ``exited`` line, status 2."""

    def error(self, message: str) -> NoReturn:
        raise StartupError(f"{message} (see {self.prog} --help)", 2)


def _log_level(text: str) -> str:
    if text.upper() not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a log level (one of {', '.join(_LOG_LEVELS)})"
        )
    return text.upper()


def _checking_formatter(prog: str) -> argparse.HelpFormatter:
    """The formatter ``add_argument`` checks each metavar with, of a fixed width.

    argparse's default asks for the terminal's width (importing :mod:`shutil`
    and its compressors) once per argument; the width plays no part in that
    check, and execd's cold start pays for every import before it listens.
    """
    return argparse.HelpFormatter(prog, width=80)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="execd",
        description=(
            "Workspace worker: serves shell, files, services, watches and the session ledger "
            "over an authenticated RPC protocol. Subcommands: 'execd cleanup --marker ID' kills "
            "every process of this user carrying the marker, then removes the cgroups of execds "
            "that died without removing them; 'execd tool --help' lists the workspace utilities "
            "built in for workspaces without a shell."
        ),
        formatter_class=_checking_formatter,
    )
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=bind_port, default=0, help="port to bind (default 0: the kernel picks)"
    )
    parser.add_argument("--token-file", help="file holding the token (else $EXECD_TOKEN)")
    parser.add_argument(
        "--keep-token-file",
        action="store_true",
        help="do not remove the token file after reading it (so clients can read it too)",
    )
    parser.add_argument("--marker", help="marker value (default: random 128-bit hex)")
    parser.add_argument(
        "--marker-var", default=DEFAULT_MARKER_VAR, help="marker variable name (EXECD_MARKER)"
    )
    parser.add_argument(
        "--lease",
        type=positive_seconds,
        help="clean up by marker and exit once no authenticated client has sent a frame for "
        "this many seconds (default: no lease)",
    )
    parser.add_argument(
        "--state-dir",
        help="where the ledger lives (default $XDG_STATE_HOME/execd or ~/.local/state/execd; "
        "when that cannot be created, a private directory under the temporary directory)",
    )
    for option, field, text in _DAEMON_LIMITS:
        default = getattr(_DEFAULTS, field)
        parser.add_argument(
            option,
            dest=field,
            metavar=option[2:].upper().replace("-", "_"),
            # A count is a whole number >= 0; seconds are finite and above zero (a timer of 0 would spin).
            type=count if isinstance(default, int) else positive_seconds,
            default=default,
            help=text,
        )
    limit = parser.add_argument_group(
        "command limits", "defaults for every command; a call may lower them, never raise them"
    )
    for name, kind, unit in LIMIT_OPTIONS:
        limit.add_argument(option_name(name), type=kind, metavar=unit)
    parser.add_argument(
        "--log-level", type=_log_level, default="INFO", help=f"one of {', '.join(_LOG_LEVELS)}"
    )
    # Help and usage (printed only on --help or an error) fit the terminal again.
    parser.formatter_class = argparse.HelpFormatter
    return parser


def _read_token(args: argparse.Namespace) -> bytes:
    """The token, read by the shared rule; then the file it came from and the variable are gone.

    A token file that was read (even an empty one) is removed unless
    ``--keep-token-file``; one that could not be read is left alone. Whatever
    happens, ``EXECD_TOKEN`` leaves this process's environment, so nothing
    execd starts can inherit it.
    """
    path: str | None = args.token_file
    remove = path if path and not args.keep_token_file else None
    try:
        return read_token(path, os.environ)
    except TokenFileUnreadable as exc:
        remove = None
        raise StartupError(str(exc), 2) from None
    except ValueError as exc:
        raise StartupError(str(exc), 2) from None
    finally:
        if remove is not None:
            with contextlib.suppress(OSError):
                os.unlink(remove)
        marker.scrub_own_environment((TOKEN_VAR,))


def _config(args: argparse.Namespace) -> Config:
    try:
        validate_marker_var(args.marker_var)
        value = validate_marker(args.marker if args.marker else new_marker())
    except ValueError as exc:
        raise StartupError(str(exc), 2) from None
    fallback: str | None = None
    if args.state_dir:
        state_dir = _explicit_state_dir(os.path.abspath(args.state_dir))
    else:
        state_dir, fallback = default_state_dir()
    limits = fit_process_limits(
        Limits(
            **{field: getattr(args, field) for _, field, _ in _DAEMON_LIMITS},
            command_limits=_command_limits(args),
        )
    )
    return Config(
        host=args.host,
        port=args.port,
        marker=value,
        marker_var=args.marker_var,
        lease=args.lease,
        state_dir=state_dir,
        state_dir_fallback=fallback,
        limits=limits,
    )


def _command_limits(args: argparse.Namespace) -> CommandLimits | None:
    try:
        return from_options({name: getattr(args, f"limit_{name}") for name in LIMIT_NAMES})
    except msgspec.ValidationError as exc:
        raise StartupError(f"invalid command limit: {exc}", 2) from None


def _explicit_state_dir(path: str) -> str:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"cannot create the state directory {path}: {exc.strerror}", 1) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StartupError(f"cannot write to the state directory {path}", 1)
    return path


def _collect_from_now_on() -> None:
    """Turn the collector back on if startup turned it off, with what startup made frozen.

    Frozen objects stay out of every later collection, so serving does not walk
    execd's own modules either.
    """
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _harden() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    marker.set_child_subreaper()


def _run(config: Config, token: bytes) -> int:
    import uvloop

    async def main() -> int:
        return await Execd(config, token).run()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``execd`` console script."""
    frozen.restore_environment()
    args_list = sys.argv[1:] if argv is None else argv
    if args_list and args_list[0] == "cleanup":
        return marker.cleanup_main(args_list[1:])
    if args_list and args_list[0] == "tool":
        from execd import toolbox

        return toolbox.main(args_list[1:])
    try:
        args = _parser().parse_args(args_list)
        logging.basicConfig(
            stream=sys.stderr,
            level=getattr(logging, args.log_level),
            format="%(asctime)s execd[%(process)d] %(levelname)s %(name)s: %(message)s",
        )
        token = _read_token(args)
        config = _config(args)
        if config.state_dir_fallback is not None:
            logging.getLogger("execd").warning(
                "%s; the ledger lives in %s", config.state_dir_fallback, config.state_dir
            )
        _collect_from_now_on()
        _harden()
        status = _run(config, token)
    except StartupError as exc:
        print(f"execd: {exc}", file=sys.stderr)
        announce({"event": "exited", "code": exc.status, "error": str(exc)})
        return exc.status
    except OSError as exc:
        message = f"{exc.strerror or exc}"
        if exc.filename is not None:
            message = f"{exc.filename}: {message}"
        print(f"execd: {message}", file=sys.stderr)
        announce({"event": "exited", "code": 1, "error": message})
        return 1
    except Exception as exc:
        logging.getLogger("execd").exception("fatal error")
        announce({"event": "exited", "code": 1, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    announce({"event": "exited", "code": status})
    return status


if __name__ == "__main__":
    sys.exit(main())
