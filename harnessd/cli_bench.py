"""``harnessd bench``: tool-call latency and throughput beside the floor and the alternatives.

The same bench as ``python -m bench`` (see :mod:`bench.suite`): one run on
loopback, every figure with p50, p99 and its ratio to baselines measured in
the same run, written as markdown, JSON and (with matplotlib) a PNG.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench`` on the harnessd command line."""
    from bench.options import add_arguments

    parser = sub.add_parser(
        "bench",
        help="measure tool-call latency and throughput against the floor and the alternatives",
        description=(
            "Measure execd on loopback beside a raw uvloop floor, FastAPI/uvicorn and gRPC; "
            "write bench.md, bench.json and bench.png into --out."
        ),
    )
    add_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run the bench with parsed options; the exit status is 0 once it ran."""
    from bench.suite import run_from_args

    return run_from_args(args)
