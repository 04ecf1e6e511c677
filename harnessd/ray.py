"""Rollouts over a Ray cluster: a pool of actors, each hosting many harnessd sessions.

Needs the ``ray`` extra (in a checkout of splitexec: ``pip install -e '.[ray]'``,
or ``pip install '/path/to/checkout[ray]'`` when not editable); ``import harnessd``
never imports this module or Ray.

Theory of operation
-------------------
A :class:`RolloutPool` starts ``actors`` Ray actors. Each is an asyncio
actor: one event loop in the actor's process runs up to
``sessions_per_actor`` rollouts at once (:func:`harnessd.rollouts.run_rollout`:
launch execd through the request's runtime factory, run the agent loop,
close the session), so one actor holds hundreds of idle sessions as cheaply
as one harness process does. A rollout's result comes back as the value of a
Ray object ref.

The pool is the only submitter to its actors, so it keeps their load itself:
:meth:`RolloutPool.submit` sends a request to the live actor with the most
free slots, or raises :class:`~harnessd.rollouts.PoolFull` when every live
actor is at its bound (backpressure) and
:class:`~harnessd.rollouts.NoLiveActor` when none is left.
:meth:`RolloutPool.run` queues any number of requests and submits them as
slots free up.

Faults: an actor that dies (killed, out of memory, its node lost) fails
every rollout it was running with Ray's actor error. The pool drops the actor
and reports each of those rollouts as :class:`~harnessd.rollouts.RolloutLost`
(all of them are kept in :attr:`RolloutPool.lost`); a rollout is tried again,
on another live actor, up to ``retries`` times (default once), with a fresh
workspace and marker. What the dead actor had started is not stranded: its
connections closed with its process, so each of its execds cleans up by its
marker and exits once its lease runs out (the runtime factory sets the lease,
:class:`~harnessd.rollouts.LocalWorkspace` 30 s by default). A rollout that
raises (execd would not launch, ...) is a
:class:`~harnessd.rollouts.RolloutFailed` and is not retried.
"""

from __future__ import annotations

import collections
import itertools
import os
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from harnessd.rollouts import (
    NoLiveActor,
    PoolFull,
    RolloutError,
    RolloutFailed,
    RolloutInfo,
    RolloutLost,
    RolloutRequest,
    RolloutResult,
    run_rollout,
)

__all__ = ["ActorStatus", "RolloutHandle", "RolloutPool"]

Outcome = RolloutResult | RolloutError
"""What a rollout ends with: its result, or the error that ended it for good."""

#: Method calls an actor takes beyond its sessions (status queries).
_SPARE_CALLS = 8


@dataclass(frozen=True, slots=True)
class ActorStatus:
    """One actor's view of itself: its process, rollouts running, execds launched, rollouts done."""

    name: str
    pid: int
    running: int
    launched: int
    completed: int


class _RolloutActor:
    """Runs rollouts on the actor's event loop, at most ``max_sessions`` at once."""

    def __init__(self, name: str, max_sessions: int) -> None:
        self.name = name
        self.max_sessions = max_sessions
        self.running = 0
        self.launched = 0
        self.completed = 0

    async def run(self, request: RolloutRequest, info: RolloutInfo) -> RolloutResult:
        if self.running >= self.max_sessions:
            raise PoolFull(f"actor {self.name} already runs {self.running} sessions")
        self.running += 1
        try:
            result = await run_rollout(request, info, host=self.name, on_launched=self._launched)
        finally:
            self.running -= 1
        self.completed += 1
        return result

    def _launched(self) -> None:
        self.launched += 1

    def status(self) -> ActorStatus:
        return ActorStatus(self.name, os.getpid(), self.running, self.launched, self.completed)


_Actor = ray.remote(_RolloutActor)


@dataclass(slots=True)
class RolloutHandle:
    """A rollout given to the pool: its current attempt, where it runs, and its object ref.

    ``actor`` and ``ref`` are None while the rollout waits in the queue for a
    free slot. ``lost_on``: actors on which earlier attempts were lost.
    """

    request: RolloutRequest
    attempt: int = 1
    actor: str | None = None
    ref: ray.ObjectRef[RolloutResult] | None = None
    lost_on: list[str] = field(default_factory=list)

    @property
    def rollout_id(self) -> str:
        return self.request.rollout_id


class RolloutPool:
    """Ray actors running harnessd rollouts, with backpressure and retries of lost rollouts.

    ``actors``: how many actors; ``sessions_per_actor``: the most rollouts one
    actor runs at once; ``retries``: how many more times a lost rollout is
    tried, each time on another live actor; ``actor_options``: passed to
    Ray's ``.options()`` (default: no CPU reserved, since the actors mostly
    wait on models and execds, and no restart). Needs Ray initialised (or
    initialises a local Ray, as any first Ray call does). Use a pool from one
    thread.
    """

    def __init__(
        self,
        actors: int = 4,
        *,
        sessions_per_actor: int = 25,
        retries: int = 1,
        actor_options: Mapping[str, Any] | None = None,
    ) -> None:
        if actors < 1 or sessions_per_actor < 1 or retries < 0:
            raise ValueError("need actors >= 1, sessions_per_actor >= 1 and retries >= 0")
        self.tag = f"rollouts-{secrets.token_hex(4)}"
        """Starts every actor name and every marker of this pool."""
        self.sessions_per_actor = sessions_per_actor
        self.retries = retries
        self.lost: list[RolloutLost] = []
        """Every attempt lost with its actor, retried or not."""
        options: dict[str, Any] = {
            "num_cpus": 0,
            "max_restarts": 0,
            **(actor_options or {}),
            "max_concurrency": sessions_per_actor + _SPARE_CALLS,
        }
        self._actors: dict[str, ActorHandle[_RolloutActor]] = {}
        for index in range(actors):
            name = f"{self.tag}-a{index}"
            actor = _Actor.options(**options).remote(name, sessions_per_actor)
            self._actors[name] = cast("ActorHandle[_RolloutActor]", actor)
        self._load = dict.fromkeys(self._actors, 0)
        self._inflight: dict[ray.ObjectRef[RolloutResult], RolloutHandle] = {}
        self._queue: collections.deque[RolloutHandle] = collections.deque()
        self._markers = itertools.count(1)

    # -- actors ----------------------------------------------------------------------

    @property
    def actors(self) -> list[str]:
        """Names of the live actors."""
        return list(self._actors)

    def actor(self, name: str) -> ActorHandle[_RolloutActor]:
        """The Ray handle of a live actor (KeyError once it is gone)."""
        return self._actors[name]

    def status(self, name: str, timeout: float = 30.0) -> ActorStatus:
        """An actor's own account of its rollouts."""
        status: object = ray.get(self._actors[name].status.remote(), timeout=timeout)
        return cast(ActorStatus, status)

    @property
    def free_slots(self) -> int:
        """Rollouts the live actors can take now."""
        return sum(self.sessions_per_actor - self._load[name] for name in self._actors)

    @property
    def pending(self) -> int:
        """Rollouts submitted or queued that have not ended."""
        return len(self._inflight) + len(self._queue)

    # -- submitting --------------------------------------------------------------------

    def submit(self, request: RolloutRequest) -> RolloutHandle:
        """Start ``request`` on the least loaded live actor; its handle holds the object ref.

        Raises PoolFull when every live actor is at its bound and NoLiveActor
        when every actor has died.
        """
        handle = RolloutHandle(request)
        self._start(handle)
        return handle

    def _start(self, handle: RolloutHandle) -> None:
        if not self._actors:
            raise NoLiveActor(f"every actor of pool {self.tag} has died")
        name = min(self._actors, key=lambda actor: self._load[actor])
        if self._load[name] >= self.sessions_per_actor:
            raise PoolFull(
                f"all {len(self._actors)} actors of pool {self.tag} run "
                f"{self.sessions_per_actor} sessions each"
            )
        info = RolloutInfo(
            rollout_id=handle.rollout_id,
            attempt=handle.attempt,
            marker=f"{self.tag}-{next(self._markers)}",
        )
        ref: ray.ObjectRef[RolloutResult] = self._actors[name].run.remote(handle.request, info)
        handle.actor, handle.ref = name, ref
        self._load[name] += 1
        self._inflight[ref] = handle

    def _pump(self) -> None:
        """Start queued rollouts (retries first) while slots are free."""
        while self._queue and self._actors and self.free_slots > 0:
            self._start(self._queue.popleft())

    # -- results ---------------------------------------------------------------------------

    def results(self, *, timeout: float | None = None) -> Iterator[Outcome]:
        """Yield each rollout's outcome as it ends, until none is pending.

        Lost rollouts with retries left are started again (on another live
        actor) instead of being yielded. ``timeout``: seconds for the whole
        iteration; GetTimeoutError when they run out.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pending:
            self._pump()
            if not self._inflight:
                # Queued rollouts and no live actor to run them.
                while self._queue:
                    handle = self._queue.popleft()
                    yield self._lost(handle, "", "no live actor is left to run it")
                return
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=left)
            if not ready:
                raise GetTimeoutError(f"{self.pending} rollouts still pending after {timeout} s")
            for ref in ready:
                outcome = self._settle(ref)
                if outcome is not None:
                    yield outcome

    def run(
        self, requests: Iterable[RolloutRequest], *, timeout: float | None = None
    ) -> list[Outcome]:
        """Run every request (as slots free up); the outcomes in the order of ``requests``.

        Rollout ids must be distinct, and the pool idle (ValueError otherwise:
        mix :meth:`submit` and :meth:`results` instead).
        """
        if self.pending:
            raise ValueError(f"the pool still has {self.pending} rollouts pending")
        handles = [RolloutHandle(request) for request in requests]
        order = {handle.rollout_id: index for index, handle in enumerate(handles)}
        if len(order) != len(handles):
            raise ValueError("two requests have the same rollout_id")
        self._queue.extend(handles)
        outcomes: dict[int, Outcome] = {}
        for outcome in self.results(timeout=timeout):
            index = order.get(outcome.rollout_id)
            if index is not None:
                outcomes[index] = outcome
        return [outcomes[index] for index in sorted(outcomes)]

    def _settle(self, ref: ray.ObjectRef[RolloutResult]) -> Outcome | None:
        handle = self._inflight.pop(ref)
        actor = handle.actor or ""
        handle.actor, handle.ref = None, None
        if actor in self._load:
            self._load[actor] -= 1
        try:
            result: RolloutResult = ray.get(ref)
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            if isinstance(cause, PoolFull):
                self._queue.appendleft(handle)  # the actor's own bound: try again
                return None
            return RolloutFailed(
                f"rollout {handle.rollout_id} failed: {type(cause).__name__}: {cause}",
                handle.rollout_id,
                handle.attempt,
                cause,
            )
        except RayError as exc:
            # The actor died, or the node holding the result did: the rollout is lost.
            if isinstance(exc, RayActorError):
                self._bury(actor)
            lost = self._lost(handle, actor, f"{type(exc).__name__} on actor {actor}")
            if handle.attempt <= self.retries:
                handle.lost_on.append(actor)
                handle.attempt += 1
                self._queue.appendleft(handle)
                return None
            return lost
        return result.retried(handle.lost_on) if handle.lost_on else result

    def _lost(self, handle: RolloutHandle, actor: str, why: str) -> RolloutLost:
        lost = RolloutLost(
            f"rollout {handle.rollout_id} (attempt {handle.attempt}) was lost: {why}",
            handle.rollout_id,
            handle.attempt,
            actor,
        )
        self.lost.append(lost)
        return lost

    def _bury(self, name: str) -> None:
        """Forget a dead actor (and make sure Ray does not bring it back)."""
        actor = self._actors.pop(name, None)
        self._load.pop(name, None)
        if actor is not None:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone: nothing to do
                return

    # -- the end -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill every actor (rollouts still running are lost; their execds end by lease)."""
        for name in list(self._actors):
            self._bury(name)
        self._inflight.clear()
        self._queue.clear()

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
