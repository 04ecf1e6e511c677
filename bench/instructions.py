"""Instructions per call at each end, counted by valgrind's callgrind.

Wall-clock figures on a shared machine move with its load, and comparing two
trees takes many alternating runs. The number of instructions a process
executes per call hardly moves at all, so this tool compares trees in one
run each: ``python -m bench.instructions`` from each tree's checkout.

Each end is counted in its own process under ``valgrind --tool=callgrind``
while the other runs at full speed: execd with the client here, then this
tool's client (a child process) with a plain execd. Each count is taken
twice, after ``--calls`` and after ``2 * --calls`` no-ops (64 in flight
on one connection, as section 2 of the bench, or ``--in-flight 1``, one
after another as section 1; ``--encrypt aes-256-gcm``: on an encrypted
connection, as section 1's AES-GCM row; ``--call read`` or ``write``: a
``files.read`` or ``files.write`` (``atomic=False``) of 4 KiB instead of a
no-op, as section 4's smallest rows); the difference,
divided by ``--calls``, is what one call costs, start-up and shutdown
cancelled out. Instructions are not time: cache misses, system calls and
wake-ups are not in them (a call made alone, one in flight, costs far more
time per instruction than a pipelined one). Use it to see what a change to
the per-call path does, and the bench for what a user waits.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import uvloop

from bench.execd_proc import start_execd
from bench.settings import IN_FLIGHT
from bench.stats import pipelined

#: valgrind's start of a Python process takes seconds: give execd's handshake room.
_SLOW_START = ("--handshake-timeout", "120")


def _callgrind(out: str) -> list[str]:
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no"]


def _total(path: str) -> int:
    """The instructions a callgrind output file counts in all."""
    with open(path, encoding="ascii", errors="replace") as handle:
        for line in handle:
            if line.startswith("summary:"):
                return int(line.split()[1])
    raise RuntimeError(f"no summary line in {path}")


class Load(NamedTuple):
    """How the counted no-ops are made."""

    request_ids: bool
    in_flight: int
    encrypt: str
    call: str


#: The size of section 4's smallest file, read or written by ``--call read`` / ``write``.
FILE_SIZE = 4096


def _workdir(data: bytes) -> tuple[str, str]:
    """A fresh directory for execd, and the path of a file in it holding ``data``."""
    workdir = tempfile.mkdtemp(prefix="execd-instr-")
    path = os.path.join(workdir, "file.bin")
    with open(path, "wb") as handle:
        handle.write(data)
    return workdir, path


async def _calls(calls: int, load: Load, wrapper: list[str]) -> None:
    """Start execd (under ``wrapper``), make ``calls`` calls as ``load`` says, stop it."""
    data = b"x" * FILE_SIZE
    workdir, path = _workdir(data)
    try:
        async with start_execd(workdir, *_SLOW_START, timeout=300.0, wrapper=wrapper) as execd:
            cipher = load.encrypt if load.encrypt != "none" else False
            client = await execd.connect(encrypt=cipher)
            client.request_ids = load.request_ids
            actions: dict[str, Callable[[], Awaitable[object]]] = {
                "noop": client.noop,
                "read": functools.partial(client.read_file, path),
                "write": functools.partial(client.write_file, path, data, atomic=False),
            }
            if calls:
                await pipelined(actions[load.call], calls, load.in_flight)
            await client.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _per_call(counts: dict[int, int], calls: int) -> float:
    return (counts[2 * calls] - counts[calls]) / calls


def _execd_side(calls: int, load: Load, scratch: str) -> float:
    counts = {}
    for n in (calls, 2 * calls):
        out = os.path.join(scratch, f"execd.{n}")
        uvloop.run(_calls(n, load, _callgrind(out)))
        counts[n] = _total(out)
    return _per_call(counts, calls)


def _client_side(calls: int, load: Load, scratch: str) -> float:
    counts = {}
    for n in (calls, 2 * calls):
        out = os.path.join(scratch, f"client.{n}")
        argv = [
            *_callgrind(out),
            sys.executable,
            "-m",
            "bench.instructions",
            "--client-run",
            str(n),
            "--in-flight",
            str(load.in_flight),
            "--encrypt",
            load.encrypt,
            "--call",
            load.call,
        ]
        if not load.request_ids:
            argv.append("--no-request-ids")
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        counts[n] = _total(out)
    return _per_call(counts, calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.instructions",
        description="Instructions per no-op call in execd and in the client "
        "(valgrind's callgrind).",
    )
    parser.add_argument(
        "--calls", type=int, default=10000, help="calls per measurement (default 10000)"
    )
    parser.add_argument(
        "--no-request-ids", action="store_true", help="calls without request ids (PROTOCOL.md 8.1)"
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=IN_FLIGHT,
        help=f"calls in flight at once (default {IN_FLIGHT}, as section 2; 1: as section 1)",
    )
    parser.add_argument(
        "--encrypt",
        default="none",
        choices=("none", "aes-256-gcm", "chacha20-poly1305"),
        help="the connection's cipher (default none)",
    )
    parser.add_argument(
        "--call",
        default="noop",
        choices=("noop", "read", "write"),
        help=f"what each call is: server.noop (default), or files.read / files.write "
        f"(atomic=false) of {FILE_SIZE} bytes",
    )
    parser.add_argument("--client-run", type=int, metavar="N", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    load = Load(not args.no_request_ids, args.in_flight, args.encrypt, args.call)
    if args.client_run is not None:  # the counted client, a child of the run below
        uvloop.run(_calls(args.client_run, load, []))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (Debian: apt install valgrind): nothing measured")
        return 2
    with tempfile.TemporaryDirectory(prefix="execd-instr-") as scratch:
        execd = _execd_side(args.calls, load, scratch)
        client = _client_side(args.calls, load, scratch)
    kind = "with request ids" if load.request_ids else "without request ids"
    print(
        f"instructions per call ({args.call}), {args.in_flight} in flight ({kind}, cipher {args.encrypt}, "
        f"{args.calls} calls):"
    )
    print(f"  execd  {execd:10,.0f}")
    print(f"  client {client:10,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
