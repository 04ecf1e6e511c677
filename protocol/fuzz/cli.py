"""``python -m protocol.fuzz`` and ``harnessd fuzz``: the kit's command line.

::

    python -m protocol.fuzz HOST:PORT [--token-file T] [--out DIR]   # catalogue, then fuzzing
    python -m protocol.fuzz --replay DIR/repros/9.3.json HOST:PORT --token-file T
    python -m protocol.fuzz --list                                   # the case catalogue
    python -m protocol.fuzz --export-vectors vectors.json            # for other languages

Exit status: 0 when nothing failed, 1 when a case or the fuzzing failed (or a
replayed repro still fails), 2 for a usage error. With ``--strict``
non-strict verdicts fail the run too. Only this module's :func:`main` and
what it calls import the runner (and, for fuzzing, hypothesis).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from protocol.values import count, non_negative, positive_int, positive_seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The kit's options, on ``parser``."""
    parser.add_argument("address", nargs="?", help="HOST:PORT of the server under test")
    parser.add_argument(
        "--token-file", type=Path, help="file holding the token (post-auth cases need it)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("fuzz-report"),
        help="where reports and repros go (default ./fuzz-report)",
    )
    parser.add_argument(
        "--cases",
        nargs="*",
        default=[],
        metavar="ID",
        help="run only these cases (ids, sections such as 9, or globs such as '15.files.*')",
    )
    parser.add_argument(
        "--skip-slow", action="store_true", help="leave out the cases that wait for timeouts"
    )
    parser.add_argument(
        "--fuzz-time",
        type=non_negative,
        default=30.0,
        metavar="S",
        help="seconds of open-ended fuzzing after the catalogue (0: none; default 30)",
    )
    parser.add_argument(
        "--fuzz-examples",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop the fuzzing after N examples",
    )
    parser.add_argument(
        "--seed", type=count, default=None, help="seed of the fuzzing (default: random, reported)"
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=5.0,
        metavar="S",
        help="how long to wait for each required answer (default 5)",
    )
    parser.add_argument(
        "--health-timeout",
        type=positive_seconds,
        default=5.0,
        metavar="S",
        help="bound on serving a healthy client after each case (default 5)",
    )
    parser.add_argument(
        "--settle",
        type=non_negative,
        default=3.0,
        metavar="S",
        help="how long a local server may take to close what a case opened (default 3)",
    )
    parser.add_argument(
        "--pid",
        type=positive_int,
        default=None,
        help="the server's pid, for the local checks (found by port on loopback)",
    )
    parser.add_argument(
        "--marker",
        default=None,
        metavar="NAME=VALUE",
        help="environment entry of the server's processes (default: from server.info)",
    )
    parser.add_argument(
        "--launch",
        default=None,
        metavar="COMMAND",
        help="start the server with this command (binding HOST:PORT) and again after a crash",
    )
    parser.add_argument(
        "--no-minimize", action="store_true", help="save failing scripts as they are"
    )
    parser.add_argument(
        "--strict", action="store_true", help="fail the run on non-strict verdicts too"
    )
    parser.add_argument(
        "--replay",
        type=Path,
        default=None,
        metavar="FILE",
        help="run a repro file again and report whether it still fails",
    )
    parser.add_argument("--list", action="store_true", help="print the case catalogue and exit")
    parser.add_argument(
        "--export-vectors",
        type=Path,
        default=None,
        metavar="FILE",
        help="write section 16's vectors and the catalogue's scripts and expected answers as JSON",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the summary")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``fuzz`` on a command line (``harnessd fuzz``)."""
    parser = sub.add_parser(
        "fuzz",
        help="run the protocol conformance and fuzzing kit against a server",
        description=(
            "Run PROTOCOL.md's case catalogue, then open-ended fuzzing, against any server "
            "that speaks it; write Markdown, HTML, JSON and JUnit reports and a repro per "
            "failure. Fuzzing needs the 'fuzz' extra (pip install 'splitexec[fuzz]')."
        ),
    )
    add_arguments(parser)
    parser.set_defaults(func=main)


def _address(text: str | None) -> tuple[str, int]:
    if not text or ":" not in text:
        raise SystemExit("fuzz: give the server as HOST:PORT")
    host, _, port = text.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise SystemExit(f"fuzz: not a port: {port!r}") from None


def _token(path: Path | None) -> bytes | None:
    if path is None:
        return None
    from protocol.handshake import MAX_TOKEN_BYTES, token_bytes

    try:
        with open(path, "rb") as handle:
            return token_bytes(handle.read(MAX_TOKEN_BYTES + 1))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"fuzz: cannot use the token file {path}: {exc}") from None


def main(args: argparse.Namespace) -> int:
    """Run what the options ask for; return the exit status."""
    if args.list:
        return _list()
    if args.export_vectors is not None:
        from protocol.fuzz.export import write_vectors

        write_vectors(args.export_vectors)
        print(f"wrote {args.export_vectors}")
        return 0
    host, port = _address(args.address)
    token = _token(args.token_file)
    from protocol.fuzz.live import Launched, SocketTarget
    from protocol.fuzz.runner import Options, Runner

    target = SocketTarget(host, port)
    options = Options(
        timeout=args.timeout,
        health_timeout=args.health_timeout,
        settle=args.settle,
        pid=args.pid,
        marker=args.marker,
        cases=list(args.cases),
        skip_slow=args.skip_slow,
        minimize=not args.no_minimize,
        out=args.out,
    )
    launched = None
    if not args.launch and not target.reachable(args.timeout):
        print(f"fuzz: cannot connect to {target.name}", file=sys.stderr)
        return 2
    if args.launch:
        args.out.mkdir(parents=True, exist_ok=True)
        launched = Launched(shlex.split(args.launch), target, args.out / "server.log")
        launched.start()
    try:
        runner = Runner(target, token, options, launched, port)
        if args.replay is not None:
            return _replay(runner, args.replay)
        return _run(runner, args)
    finally:
        if launched is not None:
            launched.stop()


def _list() -> int:
    from protocol.fuzz.cases import catalogue

    for case in catalogue():
        flags = " (slow)" if case.slow else ""
        print(f"{case.id:<40} [{case.ref}] {case.title}{flags}")
        print(f"{'':<40}   sends: {case.sends}")
        print(f"{'':<40}   requires: {case.requires}")
    return 0


def _replay(runner: object, path: Path) -> int:
    from protocol.fuzz.interpreter import FAIL
    from protocol.fuzz.repro import Repro
    from protocol.fuzz.runner import Runner

    assert isinstance(runner, Runner)
    repro = Repro.load(path)
    runner.learn()
    outcome = runner.judge(repro.script)
    print(f"replay of {repro.case} ({repro.title}) against {runner.target.name}: {outcome.verdict}")
    for finding in outcome.findings:
        print(f"  {finding.verdict}: {finding.text}")
    if repro.requires:
        print(f"  the specification requires: {repro.requires}")
    return 1 if outcome.verdict == FAIL else 0


def _run(runner: object, args: argparse.Namespace) -> int:
    from protocol.fuzz.interpreter import FAIL, NON_STRICT
    from protocol.fuzz.report import Report
    from protocol.fuzz.runner import CaseResult, Runner

    assert isinstance(runner, Runner)
    started = time.monotonic()
    report = Report(target=runner.target.name, started=time.strftime("%Y-%m-%d %H:%M:%S %z"))
    runner.learn()
    report.token = runner.token is not None
    report.local_pid = runner.local.pid if runner.local is not None else None
    report.ciphers = list(runner.facts.ciphers)

    def show(result: CaseResult) -> None:
        if not args.quiet:
            print(f"{result.id:<44} {result.verdict:<10} {result.title}", flush=True)

    report.cases = runner.run(runner.selected(), show)
    if args.fuzz_time > 0 and (args.fuzz_examples is None or args.fuzz_examples > 0):
        try:
            from protocol.fuzz.explore import explore
        except ImportError as exc:
            print(
                f"fuzz: open-ended fuzzing needs the 'fuzz' extra ({exc.name} is missing)",
                file=sys.stderr,
            )
        else:
            report.fuzz = explore(runner, args.fuzz_time, args.fuzz_examples, args.seed, args.out)
    report.restarts = runner.restarts
    report.elapsed = time.monotonic() - started
    paths = report.write(args.out)
    sys.stdout.write(report.terminal())
    print("reports: " + ", ".join(str(p) for p in paths))
    failing = {FAIL, NON_STRICT} if args.strict else {FAIL}
    return 1 if report.verdict in failing else 0


def cli(argv: list[str] | None = None) -> int:
    """``python -m protocol.fuzz``."""
    parser = argparse.ArgumentParser(
        prog="python -m protocol.fuzz",
        description="Protocol conformance and fuzzing kit for servers of PROTOCOL.md.",
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))
