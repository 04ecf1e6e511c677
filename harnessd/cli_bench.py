"""``harnessd bench``: tool-call latency and throughput beside the floor and the alternatives.

The same bench as ``python -m bench`` (see :mod:`bench.suite`): one run on
loopback, every figure with p50, p99 and its ratio to baselines measured in
the same run, written as markdown, JSON and (with matplotlib) a PNG. The
baselines need the ``bench`` extra; without it the command says which
packages are missing and how to install them for this installation
(splitexec is not on the package index: from the checkout it came from).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from importlib import metadata
from urllib.parse import unquote, urlparse

from harnessd.cli_common import say

DISTRIBUTION = "splitexec"
#: Import name of each baseline package -> the name pip installs it by.
_PIP_NAMES = {"grpc": "grpcio"}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench`` on the harnessd command line."""
    from bench.options import add_arguments

    parser = sub.add_parser(
        "bench",
        help="measure tool-call latency and throughput against the floor and the alternatives",
        description=(
            "Measure execd on loopback beside a raw uvloop floor, FastAPI/uvicorn, gRPC, "
            "SWE-ReX and OpenSSH's sshd; write bench.md, bench.json and bench.png into --out. "
            "The baselines need the 'bench' extra: in a checkout of splitexec, "
            "pip install -e '.[bench]' (or pip install '/path/to/checkout[bench]' for an install "
            "that is not editable); without sshd (Debian: openssh-server) the OpenSSH section is "
            "skipped, and the report says so."
        ),
    )
    add_arguments(parser)
    parser.set_defaults(func=main)


CHECKOUT = "/path/to/splitexec"
"""Stands for the user's checkout when nothing records where this installation came from."""


def install_command() -> str:
    """The pip command that adds the ``bench`` extra to this very installation.

    splitexec is not on the package index, so the command installs from
    where this installation came from, as its ``direct_url.json`` records:
    an editable checkout gets ``-e 'DIR[bench]'``, a directory ``'DIR[bench]'``,
    a wheel or archive file ``'FILE[bench]'``, a URL ``'splitexec[bench] @ URL'``.
    Without a record the command names :data:`CHECKOUT`, to be replaced by
    the directory of a checkout. Either way through this interpreter, so it
    lands in the environment harnessd runs from.
    """
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    origin = _origin()
    if origin is None:
        return f"{pip} {shlex.quote(CHECKOUT + '[bench]')} (your checkout of splitexec)"
    url, editable = origin
    parsed = urlparse(url)
    if parsed.scheme != "file":
        return f"{pip} {shlex.quote(f'{DISTRIBUTION}[bench] @ {url}')}"
    path = shlex.quote(unquote(parsed.path) + "[bench]")
    return f"{pip} -e {path}" if editable else f"{pip} {path}"


def _origin() -> tuple[str, bool] | None:
    """Where this installation came from (``direct_url.json``): its URL and whether editable."""
    try:
        text = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    try:
        origin = json.loads(text)
    except ValueError:
        return None
    url = origin.get("url") if isinstance(origin, dict) else None
    if not isinstance(url, str):
        return None
    dir_info = origin.get("dir_info")
    return url, isinstance(dir_info, dict) and bool(dir_info.get("editable"))


def main(args: argparse.Namespace) -> int:
    """Run the bench with parsed options; the exit status is 0 once it ran."""
    from bench.baselines import missing_packages

    missing = [_PIP_NAMES.get(name, name) for name in missing_packages()]
    if missing:
        say(
            f"harnessd bench: the baselines need packages that are not installed "
            f"({', '.join(missing)}); install the bench extra: {install_command()}"
        )
        return 1
    from bench.suite import run_from_args

    return run_from_args(args)
