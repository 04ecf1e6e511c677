"""An agent session's ledger on the harness side, and its incremental sync to execd.

Theory of operation
-------------------
:class:`LocalLedger` is the session's history as harnessd keeps it: entries
are msgpack-encoded dicts, numbered from 1, hash-chained with
:func:`protocol.ledger_chain.entry_hash`. It holds every payload and every
entry hash in memory (the hash of entry ``seq`` at ``hashes[seq - 1]``), so
the chain at any seq is known without recomputing anything.

:class:`LedgerSync` mirrors it into execd's ledger store. Its one piece of
state is ``acked``: the seq execd is known to hold (``None`` = unknown, at
start and after anything that may have lost an answer)::

    acked unknown ──ledger.head──► adopt(head) ──► acked = head.seq
         ▲                              │ head ahead of ours, or its hash
         │                              │ differs from ours at that seq
         │ connection lost,             ▼
         │ unexpected error        LedgerDiverged (never overwritten)
         │
    acked known ──append seqs acked+1.. in batches──► acked = new head
                     │ LedgerConflict(data = execd's head)
                     └──► adopt(head) and continue from there

:meth:`LedgerSync.sync` sends only entries past ``acked``, so its cost
depends on what was added since the last sync, never on the session's length.
Batches are cut so the encoded ``ledger.append`` parameters stay within
``batch_bytes`` (by default half the peer's frame cap); an entry too big for
a batch on its own goes through ``ledger.append_large``. Every batch carries
the entry hashes, which execd checks against its own, and every head execd
returns is compared with the local chain.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from harnessd.errors import HarnessError, LedgerConflict
from protocol.ledger_chain import GENESIS_HASH, MAX_SEQ, entry_hash
from protocol.rpc import ledger as rpc

if TYPE_CHECKING:
    from protocol.connection import HandshakeComplete

MIN_BATCH_BYTES = 1024
"""Smallest batch budget accepted."""

MAX_CONFLICTS = 8
"""Conflicts one sync tolerates before giving up (each one moves to execd's head)."""

_ENCODER = msgspec.msgpack.Encoder()


class LedgerDiverged(HarnessError):
    """execd's ledger for the session is not a prefix of the local one.

    ``local_seq`` is the local head; ``remote_seq``/``remote_hash`` what execd
    holds. Nothing is overwritten: the session must be inspected.
    """

    def __init__(self, message: str, *, local_seq: int, remote_seq: int, remote_hash: bytes):
        super().__init__(message)
        self.local_seq = local_seq
        self.remote_seq = remote_seq
        self.remote_hash = remote_hash


def encode_entry(entry: Mapping[str, Any]) -> bytes:
    """The payload of a ledger entry: the dict, msgpack-encoded."""
    return _ENCODER.encode(dict(entry))


def decode_entry(payload: bytes) -> dict[str, Any]:
    """A ledger entry payload back as a dict."""
    return msgspec.msgpack.decode(payload, type=dict[str, Any])


class LocalLedger:
    """The session's append-only history in memory: payloads and chain hashes."""

    def __init__(self) -> None:
        self._payloads: list[bytes] = []
        self._hashes: list[bytes] = []

    def __len__(self) -> int:
        return len(self._payloads)

    @property
    def seq(self) -> int:
        """The head seq (0 when empty)."""
        return len(self._payloads)

    @property
    def head_hash(self) -> bytes:
        """The head hash (GENESIS_HASH when empty)."""
        return self._hashes[-1] if self._hashes else GENESIS_HASH

    def append(self, entry: Mapping[str, Any]) -> int:
        """Append a dict entry; return its seq."""
        return self.append_payload(encode_entry(entry))

    def append_payload(self, payload: bytes) -> int:
        """Append an already encoded entry; return its seq."""
        seq = len(self._payloads) + 1
        if seq > MAX_SEQ:
            raise OverflowError("ledger is full")
        self._hashes.append(entry_hash(self.head_hash, seq, payload))
        self._payloads.append(bytes(payload))
        return seq

    def hash_at(self, seq: int) -> bytes:
        """The hash of entry ``seq`` (GENESIS_HASH for 0)."""
        if seq == 0:
            return GENESIS_HASH
        if not 1 <= seq <= len(self._hashes):
            raise IndexError(f"no entry {seq} (head is {len(self._hashes)})")
        return self._hashes[seq - 1]

    def payload(self, seq: int) -> bytes:
        """The payload of entry ``seq``."""
        if not 1 <= seq <= len(self._payloads):
            raise IndexError(f"no entry {seq} (head is {len(self._payloads)})")
        return self._payloads[seq - 1]

    def payloads(self, first: int = 1, last: int | None = None) -> Sequence[bytes]:
        """Payloads of entries ``first..last`` (default: to the head)."""
        end = len(self._payloads) if last is None else last
        return self._payloads[first - 1 : end]

    def entries(self) -> list[dict[str, Any]]:
        """Every entry decoded (for inspection and tests)."""
        return [decode_entry(payload) for payload in self._payloads]


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What one :meth:`LedgerSync.sync` did.

    ``entries``/``bytes``: entries and payload bytes sent; ``batches``: append
    calls made (``large`` of them ``append_large``); ``head_queries``: calls
    to ``ledger.head``; ``conflicts``: LedgerConflict answers resumed from;
    ``resumed_from``: the seq execd turned out to hold when that was learnt
    from execd rather than known; ``head``: execd's head afterwards;
    ``ms``: wall time.
    """

    entries: int
    bytes: int
    batches: int
    large: int
    head_queries: int
    conflicts: int
    resumed_from: int | None
    head: int
    ms: float

    def as_dict(self) -> dict[str, Any]:
        """The figures as a plain dict (for traces)."""
        return {
            "entries": self.entries,
            "bytes": self.bytes,
            "batches": self.batches,
            "large": self.large,
            "head_queries": self.head_queries,
            "conflicts": self.conflicts,
            "resumed_from": self.resumed_from,
            "head": self.head,
            "ms": round(self.ms, 3),
        }


class _Counters:
    __slots__ = ("batches", "bytes", "conflicts", "entries", "head_queries", "large", "resumed")

    def __init__(self) -> None:
        self.entries = 0
        self.bytes = 0
        self.batches = 0
        self.large = 0
        self.head_queries = 0
        self.conflicts = 0
        self.resumed: int | None = None


class LedgerPeer(Protocol):
    """What a sync needs of its peer: the handshake's frame cap and the ledger calls.

    :class:`harnessd.api.ExecdClient` is one; anything that forwards these to one will do.
    """

    @property
    def info(self) -> HandshakeComplete: ...

    async def ledger_head(self, session: str) -> rpc.LedgerHead: ...

    async def ledger_append(
        self,
        session: str,
        first_seq: int,
        prev_hash: bytes,
        entries: list[bytes],
        hashes: list[bytes] | None = None,
    ) -> rpc.LedgerHead: ...

    async def ledger_append_large(
        self, session: str, seq: int, prev_hash: bytes, payload: bytes
    ) -> rpc.LedgerHead: ...

    async def ledger_read(
        self, session: str, from_seq: int = 1, *, prev_hash: bytes | None = None
    ) -> list[rpc.LedgerRecord]: ...


class LedgerSync:
    """Keeps execd's copy of ``session`` equal to ``ledger``; see the module docstring.

    ``batch_bytes``: the budget of one ``ledger.append`` call's encoded
    parameters (default: half the peer's frame cap, at least
    :data:`MIN_BATCH_BYTES`). One instance serves one session; calls to
    :meth:`sync` must not overlap.
    """

    def __init__(
        self, session: str, ledger: LocalLedger, *, batch_bytes: int | None = None
    ) -> None:
        msgspec.convert({"session": session}, rpc.HeadParams)  # validates the name
        if batch_bytes is not None and batch_bytes < MIN_BATCH_BYTES:
            raise ValueError(f"batch_bytes must be at least {MIN_BATCH_BYTES}")
        self.session = session
        self.ledger = ledger
        self.batch_bytes = batch_bytes
        self.acked: int | None = None
        self._fixed = _fixed_overhead(session)

    def forget_ack(self) -> None:
        """Mark execd's head unknown (after a reconnect or a lost answer)."""
        self.acked = None

    def budget(self, peer: LedgerPeer) -> int:
        """The byte budget of one batch against ``peer``."""
        if self.batch_bytes is not None:
            return self.batch_bytes
        return max(MIN_BATCH_BYTES, peer.info.peer_max_frame // 2)

    @staticmethod
    def entry_cost(payload: bytes) -> int:
        """Upper bound of what one entry adds to the encoded parameters (payload + hash)."""
        return len(payload) + 5 + 2 + 32

    async def sync(self, peer: LedgerPeer) -> SyncReport:
        """Send every entry execd does not hold yet; return the figures.

        Raises LedgerDiverged when execd's ledger is not a prefix of ours,
        and whatever the connection raises (ConnectionLost, ...) after
        forgetting the ack so the next sync starts by asking for the head.
        """
        started = time.perf_counter()
        counts = _Counters()
        try:
            await self._sync(peer, counts)
        except BaseException:
            self.acked = None
            raise
        assert self.acked is not None
        return SyncReport(
            entries=counts.entries,
            bytes=counts.bytes,
            batches=counts.batches,
            large=counts.large,
            head_queries=counts.head_queries,
            conflicts=counts.conflicts,
            resumed_from=counts.resumed,
            head=self.acked,
            ms=(time.perf_counter() - started) * 1000.0,
        )

    async def _sync(self, peer: LedgerPeer, counts: _Counters) -> None:
        if self.acked is None:
            counts.head_queries += 1
            self._adopt(await peer.ledger_head(self.session))
            counts.resumed = self.acked
        budget = self.budget(peer)
        while True:
            acked = self.acked
            assert acked is not None
            if acked >= self.ledger.seq:
                return
            first = acked + 1
            batch = self._cut(first, budget)
            prev = self.ledger.hash_at(acked)
            try:
                if batch is None:
                    payload = self.ledger.payload(first)
                    head = await peer.ledger_append_large(self.session, first, prev, payload)
                    sent, size = 1, len(payload)
                    counts.large += 1
                else:
                    payloads = list(self.ledger.payloads(first, batch))
                    hashes = [self.ledger.hash_at(seq) for seq in range(first, batch + 1)]
                    head = await peer.ledger_append(
                        self.session, first, prev, payloads, hashes=hashes
                    )
                    sent, size = len(payloads), sum(map(len, payloads))
            except LedgerConflict as exc:
                counts.conflicts += 1
                if counts.conflicts > MAX_CONFLICTS:
                    raise
                remote = _head_of(exc.data)
                if remote is None:
                    counts.head_queries += 1
                    remote = await peer.ledger_head(self.session)
                self._adopt(remote)
                counts.resumed = self.acked
                continue
            counts.batches += 1
            counts.entries += sent
            counts.bytes += size
            expected = first + sent - 1
            if head.seq != expected or head.hash != self.ledger.hash_at(expected):
                raise self._diverged(head, f"after appending up to {expected}")
            self.acked = expected

    def _cut(self, first: int, budget: int) -> int | None:
        """The last seq of the batch starting at ``first``; None: send ``first`` alone, large."""
        used = self._fixed
        last = first - 1
        for seq in range(first, self.ledger.seq + 1):
            cost = self.entry_cost(self.ledger.payload(seq))
            if used + cost > budget or seq - first >= rpc.MAX_BATCH_ENTRIES:
                break
            used += cost
            last = seq
        return last if last >= first else None

    def _adopt(self, head: rpc.LedgerHead) -> None:
        if head.seq > self.ledger.seq:
            raise self._diverged(head, "execd is ahead of the local ledger")
        if head.hash != self.ledger.hash_at(head.seq):
            raise self._diverged(head, f"execd's entry {head.seq} differs from the local one")
        self.acked = head.seq

    def _diverged(self, head: rpc.LedgerHead, why: str) -> LedgerDiverged:
        return LedgerDiverged(
            f"ledger {self.session!r} diverged: {why} "
            f"(execd at {head.seq}, local head {self.ledger.seq})",
            local_seq=self.ledger.seq,
            remote_seq=head.seq,
            remote_hash=head.hash,
        )

    async def verify_remote(self, peer: LedgerPeer) -> int:
        """Read execd's whole ledger back (chain-checked) and compare it with ours.

        Returns the number of entries compared; raises LedgerDiverged on any
        difference (missing, extra, or different entries).
        """
        records = await peer.ledger_read(self.session, 1, prev_hash=GENESIS_HASH)
        for record in records:
            if record.seq > self.ledger.seq or record.hash != self.ledger.hash_at(record.seq):
                raise self._diverged(
                    rpc.LedgerHead(seq=record.seq, hash=record.hash),
                    f"entry {record.seq} read back differs",
                )
            if record.payload != self.ledger.payload(record.seq):
                raise self._diverged(
                    rpc.LedgerHead(seq=record.seq, hash=record.hash),
                    f"payload {record.seq} read back differs",
                )
        if len(records) != self.ledger.seq:
            last = records[-1] if records else None
            raise LedgerDiverged(
                f"ledger {self.session!r}: execd holds {len(records)} entries, "
                f"local {self.ledger.seq}",
                local_seq=self.ledger.seq,
                remote_seq=len(records),
                remote_hash=last.hash if last is not None else GENESIS_HASH,
            )
        return len(records)


def _fixed_overhead(session: str) -> int:
    """Encoded size of AppendParams with empty lists, plus room for two 5-byte array headers."""
    empty = rpc.AppendParams(
        session=session, first_seq=MAX_SEQ, prev_hash=GENESIS_HASH, entries=[], hashes=[]
    )
    return len(_ENCODER.encode(empty)) + 8


def _head_of(data: Any) -> rpc.LedgerHead | None:
    """execd's head from a LedgerConflict's data, when it is well formed."""
    try:
        return msgspec.convert(data, rpc.LedgerHead)
    except (msgspec.ValidationError, TypeError):
        return None
