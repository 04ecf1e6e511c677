"""Run one command through an execd that is already running.

Start execd with a token in its environment (or a token file), then::

    export EXECD_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
    execd &                      # prints {"event": "listening", "port": PORT, ...}
    python examples/connect.py 127.0.0.1 PORT -- uname -a
"""

import argparse
import asyncio
import os
import sys

import harnessd
from protocol.values import port_number, read_token


async def main(args: argparse.Namespace, token: bytes) -> int:
    try:
        async with harnessd.connect(args.host, args.port, token, encrypt=args.encrypt) as client:
            result = await client.run(args.command)
    except harnessd.SpawnFailed as exc:
        print(f"connect: cannot start {args.command[0]}: {exc.message}", file=sys.stderr)
        return 127
    except (harnessd.ConnectFailed, harnessd.HandshakeFailed) as exc:
        print(f"connect: {exc}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(result.stdout)
    sys.stderr.buffer.write(result.stderr)
    return result.exit_code if result.exit_code is not None else 128 + (result.signal or 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("host")
    parser.add_argument("port", type=port_number)
    parser.add_argument("--token-file", help="else $EXECD_TOKEN")
    parser.add_argument("--encrypt", action="store_true")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()
    try:
        token = read_token(args.token_file, os.environ)  # the rule execd reads by
    except ValueError as exc:
        parser.error(str(exc))
    sys.exit(asyncio.run(main(args, token)))
