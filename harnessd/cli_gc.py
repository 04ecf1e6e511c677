"""``harnessd gc``: remove what killed sessions left on this machine (see :mod:`harnessd.leftovers`).

One line per directory or cgroup looked at on stdout: ``removed PATH (KIND)``
or ``kept PATH (KIND): WHY``. Exit status 0, or 1 when something that should
have gone could not be removed.
"""

from __future__ import annotations

import argparse

from harnessd.cli_common import say
from harnessd.leftovers import DEFAULT_OLDER_THAN, collect, search_dirs, sweep_cgroups
from protocol.values import non_negative

PROG = "harnessd gc"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``gc`` on the harnessd command line."""
    parser = sub.add_parser(
        "gc",
        help="remove what killed sessions left on this machine (directories, cgroups)",
        description=(
            "Remove what harnessd and execd sessions that were killed left behind on this "
            "machine: launcher directories (execd-*), run and demo workspaces "
            "(harnessd-run-*, harnessd-demo-*) and rollout directories (rollout-*) in the "
            "temporary directory, kept logs of failed sessions included, and the cgroups of "
            "execds that died. Only what belongs to you and is not in use goes; run it where "
            "execd runs."
        ),
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would be removed, remove nothing"
    )
    parser.add_argument(
        "--older-than",
        type=non_negative,
        default=DEFAULT_OLDER_THAN,
        metavar="SECONDS",
        help=f"leave directories changed in the last SECONDS (default {DEFAULT_OLDER_THAN:g})",
    )
    parser.add_argument(
        "--dir",
        action="append",
        default=[],
        metavar="DIR",
        help="also look in DIR (a rollout base_dir, say); the temporary directory and /tmp "
        "are always searched",
    )
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Entry of ``harnessd gc``."""
    gone = "would remove" if args.dry_run else "removed"
    failed = False
    for found in collect(search_dirs(args.dir), older_than=args.older_than, dry_run=args.dry_run):
        if found.removed:
            print(f"{gone} {found.path} ({found.kind})")
        else:
            print(f"kept {found.path} ({found.kind}): {found.why}")
            failed |= found.why.startswith("cannot remove")
    try:
        removed, busy = sweep_cgroups(dry_run=args.dry_run)
    except OSError as exc:
        say(f"{PROG}: cannot sweep cgroups: {exc}")
        return 1
    for path in removed:
        print(f"{gone} {path} (cgroup of a dead execd)")
    for path in busy:
        print(f"kept {path} (cgroup of a dead execd): processes are still in it")
    return 1 if failed else 0
