"""Run one command through the self-contained worker: installed through a prefix, or in a new container.

The workspace needs no Python. With ``--via``, harnessd uploads the worker
(built with ``python tools/build_worker.py``) through the prefix's standard
input, checks its hash, starts execd from it and removes it at the end --
unless ``--keep-worker``: then the next run finds it there and uploads
nothing. With ``--image``, harnessd creates a container from the image (which
needs no shell either, only a ``/tmp``), copies the worker into it, and removes
the container at the end. For example::

    python examples/worker_workspace.py --via "docker exec -i box" \\
        --worker dist/execd-worker -- uname -a
    python examples/worker_workspace.py --image debian:bookworm-slim \\
        --worker dist/execd-worker -- cat /etc/os-release
"""

import argparse
import asyncio
import shlex
import sys

import harnessd
from harnessd.docker import DockerWorkspace
from harnessd.workspace import Workspace


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--via", help='install through this prefix, e.g. "ssh build-box"')
    where.add_argument("--image", help="start a container from this image")
    parser.add_argument("--remote-shell", action="store_true", help="the prefix is ssh-like")
    parser.add_argument("--docker", default="docker", help='the client, e.g. "docker -H URL"')
    parser.add_argument("--worker", default=None, help="the worker file (else $EXECD_WORKER)")
    parser.add_argument("--directory", default=None, help="where it goes there (else probed)")
    parser.add_argument("--keep-worker", action="store_true", help="leave it for the next run")
    parser.add_argument("--cwd", default=None, help="where execd and the command run")
    parser.add_argument("command", nargs="+", help="the command to run (after --)")
    return parser.parse_args()


def workspace_of(args: argparse.Namespace) -> Workspace:
    options = {"worker": args.worker, "directory": args.directory, "keep_worker": args.keep_worker}
    if args.image is not None:
        # open() creates the container, puts the worker in and starts it; close() removes it.
        return DockerWorkspace(image=args.image, docker=shlex.split(args.docker), **options)
    prefix = harnessd.CommandPrefixRuntime(
        shlex.split(args.via), quote_for_remote_shell=args.remote_shell
    )
    return Workspace(prefix, **options)


async def main(args: argparse.Namespace) -> int:
    async with workspace_of(args) as workspace:  # probed, uploaded unless there, verified
        installed = workspace.installed
        assert installed is not None
        how = "uploaded to" if installed.uploaded else "in place at"
        print(f"worker: {how} {installed.path}", file=sys.stderr)
        if isinstance(workspace, DockerWorkspace):
            print(f"container: {workspace.container}", file=sys.stderr)
        async with workspace.serve(cwd=args.cwd, lease=60) as session:
            result = await session.client.run(args.command)
            report = await session.close()
    # Leaving the workspace removed the worker and execd's state (unless kept),
    # and the container it started.
    sys.stdout.buffer.write(result.stdout)
    sys.stderr.buffer.write(result.stderr)
    if not report.clean:
        print(f"worker_workspace: cleanup left processes behind: {report}", file=sys.stderr)
        return 1
    return result.exit_code if result.exit_code is not None else 128 + (result.signal or 0)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
