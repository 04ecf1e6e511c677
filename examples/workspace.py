"""Run one command in a workspace that is reached through a command prefix.

The prefix is how this machine runs a command in the workspace: ``ssh host``,
``docker exec -i box``, ``ip netns exec ws setpriv ...``. execd must be
installed there (``--execd`` is the command that starts it); the harness
connects to the port execd announces, at ``--connect-host``. For example::

    python examples/workspace.py --via "ssh build-box" --remote-shell \\
        --bind-host 0.0.0.0 --connect-host build-box --encrypt -- make test
"""

import argparse
import asyncio
import shlex
import sys

import harnessd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--via", required=True, help='the prefix, e.g. "ssh build-box"')
    parser.add_argument("--remote-shell", action="store_true", help="the prefix is ssh-like")
    parser.add_argument("--execd", default="python3 -m execd", help="starts execd there")
    parser.add_argument("--bind-host", default="127.0.0.1", help="what execd listens on")
    parser.add_argument("--connect-host", default=None, help="where the harness connects")
    parser.add_argument("--encrypt", action="store_true", help="encrypt every frame")
    parser.add_argument("--state-dir", default=None, help="execd's ledger directory there")
    parser.add_argument("--cwd", default=None, help="the command's working directory")
    parser.add_argument("command", nargs="+", help="the command to run (after --)")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> int:
    runtime = harnessd.CommandPrefixRuntime(
        shlex.split(args.via), quote_for_remote_shell=args.remote_shell
    )
    handle = await harnessd.serve(
        runtime,
        execd_command=shlex.split(args.execd),
        bind_host=args.bind_host,
        connect_host=args.connect_host,
        encrypt=args.encrypt,
        lease=60,  # execd cleans up and exits if this harness vanishes
        extra_args=["--state-dir", args.state_dir] if args.state_dir else [],
    )
    try:
        result = await handle.client.run(args.command, cwd=args.cwd)
    finally:
        report = await handle.close()  # safe in finally and under cancellation
    sys.stdout.buffer.write(result.stdout)
    sys.stderr.buffer.write(result.stderr)
    if not report.clean:
        print(f"workspace: cleanup left processes behind: {report}", file=sys.stderr)
        return 1
    return result.exit_code if result.exit_code is not None else 128 + (result.signal or 0)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
