"""harnessd's command line: ``exec`` (and the launcher, agent, bench, MCP, gc and fuzz commands)."""

from __future__ import annotations

import argparse
import sys

from harnessd import cli_agent, cli_bench, cli_exec, cli_gc, cli_mcp
from harnessd.cli_common import Parser
from protocol.version import VersionAction


def _parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = Parser(
        prog="harnessd",
        description="Harness side of split execution: talk to execd in a workspace.",
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)
    cli_exec.add_parser(sub)
    cli_agent.add_parsers(sub)
    cli_bench.add_parser(sub)
    cli_mcp.add_parser(sub)
    cli_gc.add_parser(sub)
    # The protocol kit's own command line (its runner and hypothesis load only when it runs).
    from protocol.fuzz.cli import add_parser as add_fuzz_parser

    add_fuzz_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``harnessd`` console script."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
