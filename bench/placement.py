"""Where the bench's processes run: clients and servers pinned to cores for a like-for-like comparison.

A round trip on loopback costs very different times by placement. With the
client and the server on one core, a call hands the core from one to the
other (the raw floor's no-op: some 25 us here); on two cores each message
wakes the other core from idle (the same no-op: 57-92 us). Left to the
scheduler, a light server such as the floor tends to be woken on the
client's core and a busier one on the other, and the placement can change
from one batch to the next: the same code measured 1.09x and 1.93x the floor
in two full runs (2.5-3.4x in runs of that section alone). :func:`pinned`
gives every approach of a section the same placement:

* ``"cross"``: the client process on one core, every server on another, as
  a split deployment runs them (the harness and the workspace never share a
  core when they are different machines);
* ``"same"``: everything on one core: what is left is CPU time per round
  trip, each end's code with no wake-up latency to hide it.

Every thread of each process is pinned (``sched_setaffinity`` on a pid pins
that thread only), and each process's previous affinity comes back on exit.
With fewer than two usable cores, ``"cross"`` leaves everything where it is
and says so. :func:`one_core_rows` turns what was timed on one core into
rows compared with the first of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Literal

from bench.report import Row
from bench.stats import summarize

Placement = Literal["cross", "same"]


def _threads(pid: int) -> list[int]:
    """Thread ids of ``pid`` (just ``pid`` when /proc cannot tell)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _pin(pid: int, cores: set[int], saved: dict[int, set[int]]) -> None:
    """Pin every thread of ``pid``; remember the process's affinity (its main thread's)."""
    try:
        saved.setdefault(pid, os.sched_getaffinity(pid))
    except OSError:
        return  # gone
    _set_all(pid, cores)


def _set_all(pid: int, cores: set[int]) -> None:
    for tid in _threads(pid):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cores)


@contextlib.contextmanager
def placed(servers: Iterable[int], client_core: int, server_core: int) -> Iterator[None]:
    """Pin this process to ``client_core`` and ``servers`` (pids) to ``server_core``, for the block.

    On exit every thread of each process, those started meanwhile included,
    gets the process's previous affinity back.
    """
    saved: dict[int, set[int]] = {}
    try:
        _pin(os.getpid(), {client_core}, saved)
        for pid in servers:
            _pin(pid, {server_core}, saved)
        yield
    finally:
        for pid, affinity in saved.items():
            _set_all(pid, affinity)


@contextlib.contextmanager
def pinned(servers: Iterable[int], placement: Placement) -> Iterator[str]:
    """Pin this process and ``servers`` (pids) as ``placement`` says, for the block.

    Yields a short description of where they run, for row labels (see
    :func:`placed`).
    """
    cores = sorted(os.sched_getaffinity(0))
    if placement == "cross" and len(cores) < 2:
        yield "unpinned: one usable core"
        return
    client_core = cores[0]
    server_core = cores[1] if placement == "cross" else cores[0]
    with placed(servers, client_core, server_core):
        if placement == "cross":
            yield f"client on core {client_core}, servers on core {server_core}"
        else:
            yield f"client and server on core {client_core}"


def one_core_rows(
    samples: Mapping[str, Sequence[float]],
    labels: Mapping[str, str],
    *,
    prefix: str,
    section: str,
    short: str,
) -> list[Row]:
    """Rows of latencies (us) measured with everything on one core (``"same"``), no target.

    ``labels`` gives each sample's key its label, the first key being the
    baseline the others are compared with (``short`` is its short name); the
    rows' keys are ``prefix`` + the sample's key.
    """
    base = next(iter(labels))
    rows: list[Row] = []
    for key, label in labels.items():
        summary = summarize(list(samples[key]))
        rows.append(
            Row(
                key=f"{prefix}{key}",
                section=section,
                label=label,
                short=short if key == base else "",
                unit="us",
                **summary.figures(),
                baselines=() if key == base else (f"{prefix}{base}",),
                extra={"mean": summary.mean},
            )
        )
    return rows
