"""A peer section: another tool-call server and execd on the same operations, side by side.

SWE-ReX (:mod:`bench.swerex_peer`) and OpenSSH (:mod:`bench.ssh_peer`) each
time an execd of their own beside the peer, operation by operation, in
interleaved batches (:func:`bench.stats.interleaved`). Every operation gives
two rows, ``PREFIX.OP.execd`` and ``PREFIX.OP.PEER``, the peer's compared with
execd's. An operation that fails for the peer leaves its two rows out and
says so in the report (:meth:`bench.env.Env.skip`); a peer that cannot run
at all skips its section the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from bench.env import Env
from bench.report import Row
from bench.stats import Call, Timed, interleaved, interleaved_timed, summarize


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation both sides do: its key, its label, its sample count (full run, quick run)."""

    key: str
    label: str
    full: int
    quick: int

    def count(self, quick: bool) -> int:
        """The sample count of a run."""
        return self.quick if quick else self.full


@dataclass(frozen=True, slots=True)
class Peer:
    """A peer section: its title, its row keys' prefix, the peer's name in labels and keys."""

    section: str
    prefix: str
    name: str
    key: str
    operations: tuple[Operation, ...]

    @property
    def row_keys(self) -> tuple[str, ...]:
        """Every row key the section can give, in table order."""
        return tuple(
            f"{self.prefix}.{op.key}.{who}" for op in self.operations for who in ("execd", self.key)
        )

    async def measure(self, env: Env, op: Operation, execd: Call, peer: Call) -> list[Row]:
        """Both sides of ``op``, interleaved; no rows (and a line in the report) if one fails."""
        count = op.count(env.settings.quick)
        return await self._rows(
            env,
            op,
            lambda: interleaved(
                {"execd": execd, self.key: peer},
                {"execd": count, self.key: count},
                rounds=max(2, count // 25),
                warmup=3,
            ),
        )

    async def measure_timed(self, env: Env, op: Operation, execd: Timed, peer: Timed) -> list[Row]:
        """:meth:`measure` for calls that time themselves (:func:`bench.stats.interleaved_timed`)."""
        count = op.count(env.settings.quick)
        return await self._rows(
            env,
            op,
            lambda: interleaved_timed(
                {"execd": execd, self.key: peer},
                {"execd": count, self.key: count},
                rounds=max(2, count // 10),
                warmup=2,
            ),
        )

    async def _rows(
        self, env: Env, op: Operation, sample: Callable[[], Awaitable[dict[str, list[float]]]]
    ) -> list[Row]:
        try:
            samples = await sample()
        except Exception as exc:
            env.skip(self.section, f"{op.label}: rows left out, {self.name} failed: {exc!r}")
            return []
        return self.rows(op, samples)

    def rows(self, op: Operation, samples: dict[str, list[float]]) -> list[Row]:
        """execd's row and the peer's (compared with execd's), in milliseconds."""
        execd_key = f"{self.prefix}.{op.key}.execd"
        execd = summarize([s / 1000 for s in samples["execd"]])
        peer = summarize([s / 1000 for s in samples[self.key]])
        return [
            Row(
                key=execd_key,
                section=self.section,
                label=f"execd: {op.label}",
                unit="ms",
                short="execd",
                **execd.figures(),
            ),
            Row(
                key=f"{self.prefix}.{op.key}.{self.key}",
                section=self.section,
                label=f"{self.name}: {op.label}",
                unit="ms",
                baselines=(execd_key,),
                **peer.figures(),
            ),
        ]
