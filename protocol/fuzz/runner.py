"""Running the catalogue against a server: learn it, run each case, check it after each one.

Theory of operation
-------------------
:class:`Runner` first learns the server (:meth:`Runner.learn`): which ciphers
it accepts (a Hello offering each alone), and with the token its methods and
session marker (``server.info``). When the server is local (its pid given,
or found listening on the port) it takes a baseline of its descriptors and
memory once a healthy client has been served.

Each case then runs as a script (:class:`~protocol.fuzz.interpreter.Session`)
and :meth:`Runner.judge` adds the checks after it: a healthy client is
served within the bound; locally, descriptors come back to the baseline (a
count left higher is confirmed by running the case once more: a leak grows
again, a lasting first allocation does not), memory stays within the slack,
and no process carrying the marker is left. A server that stopped answering
is started again when the run launched it.

A failing case is minimized (:func:`protocol.fuzz.repro.minimize`) and saved
as a repro file that ``--replay`` runs again with the same checks.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from protocol import limits
from protocol.codec import from_raw
from protocol.fuzz import script as s
from protocol.fuzz.cases import Case, Facts, catalogue, hello
from protocol.fuzz.checks import LocalServer, Usage, health, listening_pid
from protocol.fuzz.interpreter import FAIL, PASS, SKIPPED, Outcome, Session, worst
from protocol.fuzz.link import Target
from protocol.fuzz.live import Launched
from protocol.rpc.core import ServerInfo


@dataclass
class Options:
    """How a run behaves (the command line's options)."""

    timeout: float = 5.0
    health_timeout: float = 5.0
    settle: float = 3.0
    rss_slack_kib: int = 64 * 1024
    pid: int | None = None
    marker: str | None = None
    cases: list[str] = field(default_factory=list)
    skip_slow: bool = False
    minimize: bool = True
    out: Path | None = None


@dataclass
class CaseResult:
    """One case's verdict and what led to it."""

    id: str
    ref: str
    title: str
    sends: str
    requires: str
    verdict: str
    findings: list[str]
    elapsed: float
    log: list[str] = field(default_factory=list)
    repro: str | None = None
    area: str | None = None


class Runner:
    """Runs cases against one target with the checks after each."""

    def __init__(
        self,
        target: Target,
        token: bytes | None,
        options: Options,
        launched: Launched | None = None,
        port: int | None = None,
    ) -> None:
        self.target = target
        self.token = token
        self.options = options
        self.launched = launched
        self.port = port
        self.facts = Facts(token=token is not None)
        self.local: LocalServer | None = None
        self.info: ServerInfo | None = None
        self.restarts = 0
        #: Failure signatures already minimized in this run (one minimization each).
        self.minimized: set[frozenset[str]] = set()

    # -- learning the server ------------------------------------------------------------

    def learn(self) -> None:
        """Find the ciphers, methods, marker and (when local) the baseline of the server."""
        accepted = []
        for cipher in limits.KNOWN_CIPHERS:
            outcome = Session(self.target, None, self.options.timeout).run(
                s.script(
                    s.Connect(),
                    s.Send(body=hello(ciphers=[cipher])),
                    s.Expect(want=s.ChallengeWant()),
                )
            )
            if outcome.verdict == PASS:
                accepted.append(cipher)
        methods: frozenset[str] | None = None
        if self.token is not None:
            self.info = self._server_info()
            methods = frozenset(self.info.methods) if self.info is not None else None
        self.facts = Facts(ciphers=tuple(accepted), methods=methods, token=self.token is not None)
        self._watch_local()

    def _server_info(self) -> ServerInfo | None:
        session = Session(self.target, self.token, self.options.timeout)
        session.run_step(0, s.Connect())
        session.run_step(1, s.Handshake())
        session.run_step(2, s.Send(body={"t": "call", "id": 1, "method": "server.info"}))
        session.run_step(3, s.Expect(want=s.ReplyWant(id=1)))
        probe = session.probes.get(0)
        session.close()
        result = probe.results.get(1) if probe is not None else None
        if result is None:
            return None
        try:
            return from_raw(result, ServerInfo)
        except ValueError:
            return None

    def _watch_local(self) -> None:
        pid = self.options.pid
        if self.launched is not None:
            pid = self.launched.pid
        elif pid is None and self.port is not None:
            pid = listening_pid(self.port)
        marker = self.options.marker
        if marker is None and self.info is not None:
            marker = f"{self.info.marker_var}={self.info.marker}"
        self.local = LocalServer(pid, marker) if pid is not None else None
        self.rebaseline()

    def rebaseline(self) -> None:
        """Serve a healthy client, then take the local server's usage as the baseline."""
        health(self.target, self.token, self.options.health_timeout)
        if self.local is not None and self.local.alive():
            self.local.baseline = None
            time.sleep(0.05)
            self.local.baseline = self._steady_usage()

    def _steady_usage(self) -> Usage:
        assert self.local is not None
        last = self.local.usage()
        for _ in range(40):
            time.sleep(0.02)
            now = self.local.usage()
            if now.descriptors == last.descriptors:
                return now
            last = now
        return last

    # -- running ------------------------------------------------------------------------

    def selected(self) -> list[Case]:
        """The cases this run runs, in catalogue order."""
        chosen = []
        for case in catalogue():
            if self.options.cases and not any(
                fnmatch.fnmatchcase(case.id, pattern) or case.id.startswith(pattern + ".")
                for pattern in self.options.cases
            ):
                continue
            if self.options.skip_slow and case.slow:
                continue
            chosen.append(case)
        return chosen

    def run(
        self, cases: Iterable[Case], on_result: Callable[[CaseResult], None]
    ) -> list[CaseResult]:
        """Run ``cases``; ``on_result`` sees each result as it comes."""
        results = []
        for case in cases:
            result = self.run_case(case)
            results.append(result)
            on_result(result)
        return results

    def run_case(self, case: Case) -> CaseResult:
        """Run one case with the checks after it (and save a repro when it fails)."""
        built = case.script_for(self.facts)
        if isinstance(built, str):
            return CaseResult(
                case.id,
                case.ref,
                case.title,
                case.sends,
                case.requires,
                SKIPPED,
                [built],
                0.0,
                area=case.area,
            )
        outcome = self.judge(built)
        result = CaseResult(
            case.id,
            case.ref,
            case.title,
            case.sends,
            case.requires,
            outcome.verdict,
            [f.text for f in outcome.findings],
            outcome.elapsed,
            outcome.log,
            area=case.area,
        )
        if outcome.verdict == FAIL and self.options.out is not None:
            from protocol.fuzz.repro import Repro, minimize, signature

            seen = frozenset(signature(outcome))
            script = built
            if self.options.minimize and seen not in self.minimized:
                self.minimized.add(seen)
                script = minimize(built, outcome, self.judge)
            repro = Repro.of(case, script, self.judge(script), self.target.name, None)
            result.repro = str(repro.save(self.options.out / "repros"))
        return result

    def judge(self, script: s.Script, confirm: bool = True) -> Outcome:
        """Run ``script``, then the checks after it; the outcome holds both."""
        outcome = Session(self.target, self.token, self.options.timeout).run(script)
        self.check_after(outcome, script, confirm)
        return outcome

    def check_after(self, outcome: Outcome, script: s.Script, confirm: bool = True) -> None:
        """The checks after a script: health, and locally descriptors, memory, marked processes."""
        problem = health(self.target, self.token, self.options.health_timeout)
        if problem is not None:
            outcome.add(-1, FAIL, f"after the case: {problem}")
            self._recover()
            return
        local = self.local
        if local is None or local.baseline is None:
            return
        if not local.alive():
            outcome.add(-1, FAIL, "after the case: the server process is gone")
            self._recover()
            return
        now = local.settle(self.options.settle)
        base = local.baseline
        if now.descriptors > base.descriptors:
            if confirm:
                again = Session(self.target, self.token, self.options.timeout).run(script)
                del again
                later = local.settle(self.options.settle)
                if later.descriptors > now.descriptors:
                    outcome.add(
                        -1,
                        FAIL,
                        f"after the case: the server holds {now.descriptors - base.descriptors} "
                        f"more descriptors than before it, {later.descriptors - now.descriptors} "
                        "more after running it again (a leak)",
                    )
                    local.baseline = Usage(later.descriptors, base.rss_kib)
                    return
                local.baseline = Usage(max(now.descriptors, later.descriptors), base.rss_kib)
            else:
                outcome.add(
                    -1,
                    FAIL,
                    f"after the case: the server holds {now.descriptors - base.descriptors} more "
                    "descriptors than before it (a leak)",
                )
        if now.rss_kib > base.rss_kib + self.options.rss_slack_kib:
            outcome.add(
                -1,
                worst(FAIL),
                f"after the case: the server's memory grew from {base.rss_kib} to "
                f"{now.rss_kib} KiB (more than the {self.options.rss_slack_kib} KiB slack)",
            )
            local.baseline = Usage(local.baseline.descriptors, now.rss_kib)
        left = local.wait_unmarked(self.options.settle)
        if left:
            outcome.add(-1, FAIL, f"after the case: marked processes left: {left[:10]}")

    def _recover(self) -> None:
        """Start the server again when this run launched it; re-take the baseline."""
        if self.launched is None:
            return
        self.launched.start()
        self.restarts += 1
        if self.local is not None:
            self.local = LocalServer(self.launched.pid or 0, self.local.marker)
        self.rebaseline()


def summary_verdict(results: list[CaseResult]) -> str:
    """The worst verdict of a run."""
    return worst(*(r.verdict for r in results))
