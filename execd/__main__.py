"""execd's command line: ``execd [options]`` serves; ``execd cleanup ...`` cleans up by marker.

The token comes from ``--token-file`` (read, then removed unless
``--keep-token-file``) or from ``EXECD_TOKEN``; never from argv. It is removed
from execd's environment before any child starts, and execd makes itself
non-dumpable so processes of the same user cannot read it out of execd's
memory or initial environment through /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import sys

from execd import marker
from execd.app import Execd, announce
from execd.config import DEFAULT_MARKER_VAR, Config, Limits

TOKEN_VAR = "EXECD_TOKEN"  # noqa: S105 - a variable name, not a secret
_PR_SET_DUMPABLE = 4
_DEFAULTS = Limits()


class StartupError(Exception):
    """execd cannot start; ``status`` is the exit status to use."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="execd",
        description=(
            "Workspace worker: serves shell, files, services, watches and the session ledger "
            "over an authenticated RPC protocol. Subcommand: 'execd cleanup --marker ID' kills "
            "every process of this user carrying the marker."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=0, help="port to bind (default 0: kernel picks)"
    )
    parser.add_argument("--token-file", help="file holding the token (else $EXECD_TOKEN)")
    parser.add_argument(
        "--keep-token-file", action="store_true", help="do not remove the token file after reading"
    )
    parser.add_argument("--marker", help="marker value (default: random 128-bit hex)")
    parser.add_argument(
        "--marker-var", default=DEFAULT_MARKER_VAR, help="marker variable name (EXECD_MARKER)"
    )
    parser.add_argument(
        "--lease",
        type=float,
        help="seconds without an authenticated connection before cleaning up and exiting",
    )
    parser.add_argument("--state-dir", help="where the ledger lives (default ~/.local/state/execd)")
    parser.add_argument("--max-connections", type=int, default=_DEFAULTS.max_connections)
    parser.add_argument("--max-unauthenticated", type=int, default=_DEFAULTS.max_unauthenticated)
    parser.add_argument("--handshake-timeout", type=float, default=_DEFAULTS.handshake_timeout)
    parser.add_argument("--max-inflight", type=int, default=_DEFAULTS.max_inflight_calls)
    parser.add_argument("--max-processes", type=int, default=_DEFAULTS.max_processes)
    parser.add_argument("--max-frame", type=int, default=_DEFAULTS.max_frame)
    parser.add_argument("--output-cap", type=int, default=_DEFAULTS.output_cap)
    parser.add_argument("--log-level", default="INFO")
    return parser


def _read_token(args: argparse.Namespace) -> bytes:
    if args.token_file:
        try:
            with open(args.token_file, "rb") as handle:
                token = handle.read(4096).strip()
        except OSError as exc:
            raise StartupError(f"cannot read the token file: {exc.strerror}", 2) from None
        if not args.keep_token_file:
            with contextlib.suppress(OSError):
                os.unlink(args.token_file)
    else:
        token = os.environ.get(TOKEN_VAR, "").strip().encode()
    marker.scrub_own_environment((TOKEN_VAR,))
    if not token:
        raise StartupError(
            f"no token: pass --token-file FILE or set {TOKEN_VAR} (never on the command line)", 2
        )
    return token


def _config(args: argparse.Namespace) -> Config:
    try:
        marker.validate_marker_var(args.marker_var)
        value = args.marker if args.marker else marker.new_marker()
        marker.validate_marker(value)
    except ValueError as exc:
        raise StartupError(str(exc), 2) from None
    state_dir = args.state_dir or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "execd"
    )
    limits = Limits(
        max_connections=args.max_connections,
        max_unauthenticated=args.max_unauthenticated,
        handshake_timeout=args.handshake_timeout,
        max_inflight_calls=args.max_inflight,
        max_processes=args.max_processes,
        max_frame=args.max_frame,
        output_cap=args.output_cap,
    )
    return Config(
        host=args.host,
        port=args.port,
        marker=value,
        marker_var=args.marker_var,
        lease=args.lease,
        state_dir=os.path.abspath(state_dir),
        limits=limits,
    )


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
    args_list = sys.argv[1:] if argv is None else argv
    if args_list and args_list[0] == "cleanup":
        return marker.cleanup_main(args_list[1:])
    args = _parser().parse_args(args_list)
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s execd[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    try:
        token = _read_token(args)
        config = _config(args)
        os.makedirs(config.state_dir, mode=0o700, exist_ok=True)
        _harden()
        status = _run(config, token)
    except StartupError as exc:
        print(f"execd: {exc}", file=sys.stderr)
        announce({"event": "exited", "code": exc.status, "error": str(exc)})
        return exc.status
    except OSError as exc:
        message = f"{exc.strerror or exc}"
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
