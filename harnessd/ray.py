"""Rollouts over a Ray cluster: a pool of actors, each hosting many harnessd sessions.

Needs the ``ray`` extra (in a checkout of splitexec: ``pip install -e '.[ray]'``,
or ``pip install '/path/to/checkout[ray]'`` when not editable); ``import harnessd``
never imports this module or Ray.

Theory of operation
-------------------
A :class:`RolloutPool` starts ``actors`` Ray actors, each pinned to a node:
round robin over the live nodes by default (even spread), over the nodes
given, or into the bundles of a placement group. Each is an asyncio actor:
one event loop runs up to ``sessions_per_actor`` rollouts at once
(:func:`harnessd.rollouts.run_rollout`), at most ``launches_per_actor`` of
them starting execd at a time. Beside them runs one small agent per node
used (:class:`~harnessd.ray_nodes.NodeAgent`), which acts on its machine for
the pool: it reaps lost attempts and hosts remote workspaces
(:class:`~harnessd.ray_nodes.NodeWorkspace`).

The pool is the only submitter to its actors, so it keeps their load
itself. Work waits in three places, served in this order whenever a slot
frees: *retries* of lost attempts, then the backlog of :meth:`RolloutPool.run`, then
new :meth:`RolloutPool.submit` calls. :attr:`RolloutPool.free_slots` counts the slots of live
actors minus the retries waiting for one (also those whose lost attempt is
still being reaped), so a caller that refills the pool while
``free_slots`` is positive never takes a retry's place, and
:meth:`RolloutPool.submit` raises :class:`~harnessd.rollouts.PoolFull` when no slot is
left for it (:class:`~harnessd.rollouts.NoLiveActor` when no actor is).

An attempt moves through these states::

    queued --dispatch--> running --result / raised--> done
                            |
                   actor died / hung (killed)
                            v
                         reaping --agent reaped it--> retry queued (front) or done (lost)
                            |
                  no agent on that machine
                            v
                         held until its execd's lease ran out --> retry queued / done

*Loss.* When an actor dies (killed, out of memory, its node lost), every
attempt it ran is lost. Before anything else happens to such an attempt,
the agent on the node its workspace is on kills every process carrying its
marker -- execd included -- and removes its workspace directory
(:meth:`~harnessd.rollouts.LocalWorkspace.reap`). Only then is its retry
queued (up to ``retries`` more attempts, each with a fresh marker and
workspace), so a lost attempt never runs beside its retry. When that
machine cannot be reached (its node is gone too), the retry is held until
the attempt's execd lease has run out, after which execd has killed
everything of the attempt itself; the directory stays on that machine and
:class:`~harnessd.rollouts.RolloutLost` names it. Every loss is kept in
:attr:`RolloutPool.lost`. A rollout that raises is a
:class:`~harnessd.rollouts.RolloutFailed` and is not retried, unless what
failed was a remote workspace whose node is gone: that counts as a loss.

*Deadlines and hung actors.* A request's ``deadline`` is enforced where the
rollout runs (:class:`~harnessd.rollouts.RolloutTimedOut`, the session
closed). The pool watches too: an attempt still running ``hang_grace``
seconds after its deadline, or an actor that does not answer a ping for
``hang_timeout`` seconds, means the actor's event loop is stuck; the pool
kills the actor. Its attempts past their deadline end as timed out (hung),
the others are lost and retried; all are reaped first. These checks run
while :meth:`RolloutPool.results` (or :meth:`RolloutPool.run`) waits.

:meth:`RolloutPool.metrics` is a snapshot of the pool: rollouts in flight and queued,
losses, retries, sessions per node, tool-call latency.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import os
import secrets
import statistics
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from harnessd.ray_nodes import (
    NodeAgent,
    NodeInfo,
    NodeWorkspace,
    actor_resources,
    bundle_nodes,
    in_bundle,
    live_nodes,
    pinned,
    spread_over,
    start_agent,
)
from harnessd.rollouts import (
    NoLiveActor,
    PoolFull,
    Reapable,
    Reaped,
    RolloutError,
    RolloutFailed,
    RolloutInfo,
    RolloutLost,
    RolloutRequest,
    RolloutResult,
    RolloutTimedOut,
    RuntimeFactory,
    run_rollout,
)

__all__ = ["ActorStatus", "PoolMetrics", "RolloutHandle", "RolloutPool"]

Outcome = RolloutResult | RolloutError
"""What a rollout ends with: its result, or the error that ended it for good."""

#: Method calls an actor takes beyond its sessions (pings, status queries).
_SPARE_CALLS = 8
#: Seconds past an execd's lease before the retry of an attempt nobody could reap starts.
_LEASE_MARGIN = 2.0
#: Tool-call durations kept for the latency figures of :meth:`RolloutPool.metrics`.
_LATENCY_SAMPLES = 10_000


@dataclass(frozen=True, slots=True)
class ActorStatus:
    """One actor's view of itself.

    ``running``: rollouts it runs; ``launching``: of those, how many start
    execd now, and ``peak_launching`` the most that ever did at once;
    ``launched``/``completed``: execds started and rollouts finished so far.
    """

    name: str
    pid: int
    node: str
    running: int
    launching: int
    peak_launching: int
    launched: int
    completed: int


class _LaunchGate:
    """At most ``limit`` execd launches at once on one actor, counted."""

    def __init__(self, limit: int) -> None:
        self._slots = asyncio.Semaphore(limit)
        self.inside = 0
        self.peak = 0

    async def __aenter__(self) -> None:
        await self._slots.acquire()
        self.inside += 1
        self.peak = max(self.peak, self.inside)

    async def __aexit__(self, *exc: object) -> None:
        self.inside -= 1
        self._slots.release()


class _RolloutActor:
    """Runs rollouts on the actor's event loop, at most ``max_sessions`` at once."""

    def __init__(self, name: str, max_sessions: int, max_launching: int) -> None:
        self.name = name
        self.max_sessions = max_sessions
        self.running = 0
        self.launched = 0
        self.completed = 0
        self._gate = _LaunchGate(max_launching)

    async def run(self, request: RolloutRequest, info: RolloutInfo) -> RolloutResult:
        if self.running >= self.max_sessions:
            raise PoolFull(f"actor {self.name} already runs {self.running} sessions")
        self.running += 1
        try:
            result = await run_rollout(
                request, info, host=self.name, on_launched=self._launched, launch_slots=self._gate
            )
        finally:
            self.running -= 1
        self.completed += 1
        return result

    def _launched(self) -> None:
        self.launched += 1

    async def ping(self) -> int:
        """Answered on the event loop: a loop that is stuck does not answer."""
        return os.getpid()

    async def status(self) -> ActorStatus:
        return ActorStatus(
            name=self.name,
            pid=os.getpid(),
            node=ray.get_runtime_context().get_node_id(),
            running=self.running,
            launching=self._gate.inside,
            peak_launching=self._gate.peak,
            launched=self.launched,
            completed=self.completed,
        )


_Actor = ray.remote(_RolloutActor)


@dataclass(slots=True, eq=False)
class RolloutHandle:
    """A rollout given to the pool: its current attempt, where it runs, and its object ref.

    ``actor`` and ``ref`` are None while the attempt waits for a slot (or
    while a lost attempt is being reaped). ``marker``: the current attempt's
    marker; ``node``/``workspace_node``: where its harness and workspace are.
    ``lost_on``: actors on which earlier attempts were lost.
    """

    request: RolloutRequest
    attempt: int = 1
    actor: str | None = None
    ref: ray.ObjectRef[RolloutResult] | None = None
    lost_on: list[str] = field(default_factory=list)
    marker: str = ""
    node: str = ""
    workspace_node: str = ""
    runtime: RuntimeFactory | None = field(default=None, repr=False)
    dispatched: float = 0.0
    hung: bool = False

    @property
    def rollout_id(self) -> str:
        return self.request.rollout_id


@dataclass(frozen=True, slots=True)
class PoolMetrics:
    """A snapshot of a pool (:meth:`RolloutPool.metrics`).

    Now: ``in_flight`` (attempts running on actors), ``queued`` (waiting for
    a slot: retries first, then the backlog), ``reaping`` (lost attempts
    being stopped), ``held`` (retries waiting out a lease), ``actors``
    (live), ``sessions_by_node`` (rollouts running per node of their
    harness) and ``workspaces_by_node`` (per node of their workspace). So
    far: ``completed``, ``failed``, ``timed_out``, ``lost`` (attempts),
    ``retried`` (attempts started again), ``unreaped`` (lost attempts no
    agent could stop), ``hung_actors`` (killed as hung). ``retry_wait``: p50
    and max seconds from a loss being noticed to its retry's dispatch.
    ``tool_call_ms``: p50, p95 and max duration of the tool calls of the
    last finished rollouts, and ``tool_calls`` how many those are.
    """

    in_flight: int
    queued: int
    reaping: int
    held: int
    actors: int
    sessions_by_node: dict[str, int]
    workspaces_by_node: dict[str, int]
    completed: int
    failed: int
    timed_out: int
    lost: int
    retried: int
    unreaped: int
    hung_actors: int
    retry_wait: tuple[float, float]
    tool_call_ms: tuple[float, float, float]
    tool_calls: int


@dataclass(slots=True)
class _Counts:
    completed: int = 0
    failed: int = 0
    timed_out: int = 0
    lost: int = 0
    retried: int = 0
    unreaped: int = 0
    hung_actors: int = 0


@dataclass(slots=True)
class _Loss:
    """A lost attempt on its way to being reaped."""

    handle: RolloutHandle
    actor: str
    why: str
    noticed_at: float
    timed_out: bool


@dataclass(order=True, slots=True)
class _Held:
    due: float
    sequence: int
    handle: RolloutHandle = field(compare=False)


class RolloutPool:
    """Ray actors running harnessd rollouts, with backpressure, placement, reaping and retries.

    ``actors``: how many actors; ``sessions_per_actor``: the most rollouts
    one actor runs at once; ``launches_per_actor``: the most of them
    starting execd at once; ``retries``: how many more times a lost rollout
    is tried. Placement: ``nodes`` (node ids the actors are spread over,
    round robin; default every live node that can hold one) or
    ``placement_group`` (actors go into its bundles, round robin);
    ``resources_per_session`` (e.g. ``{"CPU": 0.1}``: an actor reserves
    ``sessions_per_actor`` times that; default nothing, since the actors
    mostly wait on models and execds); ``workspace_nodes``: where a
    :class:`~harnessd.ray_nodes.NodeWorkspace` without a node may go
    (default: the actors' nodes). ``hang_grace``/``hang_timeout``: see the
    module's theory of operation (``hang_timeout=None``: no pings).
    ``actor_options``: more of Ray's ``.options()`` for the actors (no
    scheduling strategy: placement is the pool's). ``start_timeout``: seconds
    for the node agents to start. Needs Ray initialised. Use a pool from one
    thread.
    """

    def __init__(
        self,
        actors: int = 4,
        *,
        sessions_per_actor: int = 25,
        launches_per_actor: int = 8,
        retries: int = 1,
        nodes: Sequence[str] | None = None,
        placement_group: Any = None,
        resources_per_session: Mapping[str, float] | None = None,
        workspace_nodes: Sequence[str] | None = None,
        hang_grace: float = 60.0,
        hang_timeout: float | None = 60.0,
        actor_options: Mapping[str, Any] | None = None,
        start_timeout: float = 120.0,
    ) -> None:
        if actors < 1 or sessions_per_actor < 1 or launches_per_actor < 1 or retries < 0:
            raise ValueError(
                "need actors >= 1, sessions_per_actor >= 1, launches_per_actor >= 1, retries >= 0"
            )
        if nodes is not None and placement_group is not None:
            raise ValueError("give nodes or a placement_group, not both")
        if actor_options and "scheduling_strategy" in actor_options:
            raise ValueError("placement is the pool's: use nodes= or placement_group=")
        if hang_grace <= 0 or (hang_timeout is not None and hang_timeout <= 0):
            raise ValueError("hang_grace and hang_timeout must be positive")
        self.tag = f"rollouts-{secrets.token_hex(4)}"
        """Starts every actor name and every marker of this pool."""
        self.sessions_per_actor = sessions_per_actor
        self.retries = retries
        self.hang_grace = hang_grace
        self.hang_timeout = hang_timeout
        self.lost: list[RolloutLost] = []
        """Every attempt lost with its actor, retried or not."""
        options: dict[str, Any] = {
            "num_cpus": 0,
            "max_restarts": 0,
            **actor_resources(resources_per_session or {}, sessions_per_actor),
            **(actor_options or {}),
            "max_concurrency": sessions_per_actor + _SPARE_CALLS,
        }
        if placement_group is not None:
            groups = bundle_nodes(placement_group)
            places = [
                (groups[index % len(groups)], in_bundle(placement_group, index % len(groups)))
                for index in range(actors)
            ]
        else:
            places = [(node, pinned(node)) for node in spread_over(actors, options, nodes)]
        self._actors: dict[str, ActorHandle[_RolloutActor]] = {}
        self._actor_node: dict[str, str] = {}
        for index, (node, strategy) in enumerate(places):
            name = f"{self.tag}-a{index}"
            actor = _Actor.options(**options, **strategy).remote(
                name, sessions_per_actor, launches_per_actor
            )
            self._actors[name] = cast("ActorHandle[_RolloutActor]", actor)
            self._actor_node[name] = node
        self._load = dict.fromkeys(self._actors, 0)
        self._start_timeout = start_timeout
        self._agents: dict[str, ActorHandle[NodeAgent]] = {}
        self._node_info: dict[str, NodeInfo] = {}
        self._workspace_nodes = list(workspace_nodes or dict.fromkeys(self._actor_node.values()))
        try:
            self._start_agents([*self._actor_node.values(), *self._workspace_nodes])
        except BaseException:
            handles: list[ActorHandle[Any]] = [*self._actors.values(), *self._agents.values()]
            for handle in handles:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
            raise
        self._inflight: dict[ray.ObjectRef[RolloutResult], RolloutHandle] = {}
        self._reaps: dict[ray.ObjectRef[Reaped], _Loss] = {}
        self._retries: collections.deque[RolloutHandle] = collections.deque()
        self._held: list[_Held] = []
        self._backlog: collections.deque[RolloutHandle] = collections.deque()
        self._done: collections.deque[Outcome] = collections.deque()
        self._markers = itertools.count(1)
        self._held_order = itertools.count()
        self._counts = _Counts()
        self._retry_waits: collections.deque[float] = collections.deque(maxlen=_LATENCY_SAMPLES)
        self._noticed: dict[str, float] = {}
        self._tool_ms: collections.deque[float] = collections.deque(maxlen=_LATENCY_SAMPLES)
        self._pings: dict[str, tuple[ray.ObjectRef[int], float]] = {}
        self._alive: set[str] = set()
        self._closing = False
        if hang_timeout is not None:
            # The first pings: answered as soon as each actor has started.
            started = time.monotonic()
            self._pings = {
                name: (actor.ping.remote(), started) for name, actor in self._actors.items()
            }

    # -- actors and nodes ------------------------------------------------------------------

    @property
    def actors(self) -> list[str]:
        """Names of the live actors."""
        return list(self._actors)

    def actor(self, name: str) -> ActorHandle[_RolloutActor]:
        """The Ray handle of a live actor (KeyError once it is gone)."""
        return self._actors[name]

    def node_of(self, name: str) -> str:
        """The node id an actor was placed on."""
        return self._actor_node[name]

    def status(self, name: str, timeout: float = 30.0) -> ActorStatus:
        """An actor's own account of its rollouts."""
        status: object = ray.get(self._actors[name].status.remote(), timeout=timeout)
        return cast(ActorStatus, status)

    def _start_agents(self, nodes: Iterable[str]) -> None:
        new = [node for node in dict.fromkeys(nodes) if node not in self._agents]
        for node in new:
            self._agents[node] = start_agent(node)
        described: list[object] = ray.get(
            [self._agents[node].describe.remote() for node in new], timeout=self._start_timeout
        )
        for node, info in zip(new, described, strict=True):
            self._node_info[node] = cast(NodeInfo, info)

    def _agent(self, node: str) -> ActorHandle[NodeAgent]:
        if node not in self._agents:
            self._start_agents([node])
        return self._agents[node]

    # -- load -------------------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        """Rollouts a caller may submit now: free slots of live actors not owed to retries."""
        raw = sum(self.sessions_per_actor - self._load[name] for name in self._actors)
        owed = len(self._retries) + sum(
            1 for loss in self._reaps.values() if self._will_retry(loss)
        )
        return max(0, raw - owed - len(self._backlog))

    @property
    def pending(self) -> int:
        """Rollouts submitted or queued that have not ended (or whose outcome is not yet taken)."""
        return (
            len(self._inflight)
            + len(self._reaps)
            + len(self._retries)
            + len(self._held)
            + len(self._backlog)
            + len(self._done)
        )

    def metrics(self) -> PoolMetrics:
        """A snapshot of the pool's load and history (see :class:`PoolMetrics`)."""
        by_node: collections.Counter[str] = collections.Counter()
        workspaces: collections.Counter[str] = collections.Counter()
        for handle in self._inflight.values():
            by_node[handle.node] += 1
            workspaces[handle.workspace_node] += 1
        waits = sorted(self._retry_waits)
        tools = sorted(self._tool_ms)
        counts = self._counts
        return PoolMetrics(
            in_flight=len(self._inflight),
            queued=len(self._retries) + len(self._backlog),
            reaping=len(self._reaps),
            held=len(self._held),
            actors=len(self._actors),
            sessions_by_node=dict(by_node),
            workspaces_by_node=dict(workspaces),
            completed=counts.completed,
            failed=counts.failed,
            timed_out=counts.timed_out,
            lost=counts.lost,
            retried=counts.retried,
            unreaped=counts.unreaped,
            hung_actors=counts.hung_actors,
            retry_wait=(statistics.median(waits), waits[-1]) if waits else (0.0, 0.0),
            tool_call_ms=(_quantile(tools, 0.5), _quantile(tools, 0.95), tools[-1])
            if tools
            else (0.0, 0.0, 0.0),
            tool_calls=len(tools),
        )

    # -- submitting ---------------------------------------------------------------------------

    def submit(self, request: RolloutRequest) -> RolloutHandle:
        """Start ``request`` on the live actor with the most free slots; its handle holds the ref.

        Retries waiting for a slot go first: raises PoolFull when no slot is
        left after them (:attr:`free_slots` is 0), NoLiveActor when every
        actor has died.
        """
        self._poll()
        if not self._actors:
            raise NoLiveActor(f"every actor of pool {self.tag} has died")
        if self.free_slots <= 0:
            raise PoolFull(
                f"all {len(self._actors)} actors of pool {self.tag} run "
                f"{self.sessions_per_actor} sessions each or owe their free slots to retries"
            )
        handle = RolloutHandle(request)
        self._start(handle)
        return handle

    def _start(self, handle: RolloutHandle) -> None:
        name = max(self._actors, key=lambda actor: self.sessions_per_actor - self._load[actor])
        request = handle.request
        runtime: RuntimeFactory = request.runtime
        node = self._actor_node[name]
        workspace_node = node
        if isinstance(runtime, NodeWorkspace):
            workspace_node = runtime.node or self._quietest_workspace_node()
            agent = self._agent(workspace_node)
            runtime = runtime.placed(agent, self._node_info[workspace_node])
            request = dataclasses.replace(request, runtime=runtime)
        marker = f"{self.tag}-{next(self._markers)}"
        info = RolloutInfo(rollout_id=handle.rollout_id, attempt=handle.attempt, marker=marker)
        ref: ray.ObjectRef[RolloutResult] = self._actors[name].run.remote(request, info)
        handle.actor, handle.ref, handle.marker = name, ref, marker
        handle.node, handle.workspace_node, handle.runtime = node, workspace_node, runtime
        handle.dispatched, handle.hung = time.monotonic(), False
        self._load[name] += 1
        self._inflight[ref] = handle
        if handle.attempt > 1:
            self._counts.retried += 1
            noticed = self._noticed.pop(handle.rollout_id, None)
            if noticed is not None:
                self._retry_waits.append(time.time() - noticed)

    def _quietest_workspace_node(self) -> str:
        alive = [node for node in self._workspace_nodes if node in self._agents]
        if not alive:
            raise NoLiveActor(f"pool {self.tag} has no live node for a workspace")
        busy = collections.Counter(handle.workspace_node for handle in self._inflight.values())
        return min(alive, key=lambda node: busy[node])

    def _pump(self) -> None:
        """Start retries, then the backlog, while live actors have free slots."""
        now = time.monotonic()
        while self._held and self._held[0].due <= now:
            self._retries.append(self._held.pop(0).handle)
        while self._actors and self._retries and self._raw_free() > 0:
            self._start(self._retries.popleft())
        while self._actors and self._backlog and self._raw_free() > 0:
            self._start(self._backlog.popleft())

    def _raw_free(self) -> int:
        return sum(self.sessions_per_actor - self._load[name] for name in self._actors)

    # -- results -------------------------------------------------------------------------------

    def results(self, *, timeout: float | None = None) -> Iterator[Outcome]:
        """Yield each rollout's outcome as it ends, until none is pending.

        Lost rollouts with retries left are reaped and started again instead
        of being yielded. ``timeout``: seconds for the whole iteration;
        GetTimeoutError when they run out.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pending:
            self._pump()
            if self._done:
                yield self._done.popleft()
                continue
            waiting = [*self._inflight, *self._reaps]
            if not waiting and not self._held:
                # Queued rollouts and no live actor to run them.
                self._give_up_queued()
                continue
            wake = self._next_check()
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GetTimeoutError(
                        f"{self.pending} rollouts still pending after {timeout} s"
                    )
                wake = left if wake is None else min(wake, left)
            if waiting:
                ready, _ = ray.wait(waiting, num_returns=1, timeout=wake)
                for ref in ready:
                    self._settle_any(ref)
            elif wake is not None:
                time.sleep(wake)
            self._watch()

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
        self._backlog.extend(handles)
        outcomes: dict[int, Outcome] = {}
        for outcome in self.results(timeout=timeout):
            index = order.get(outcome.rollout_id)
            if index is not None:
                outcomes[index] = outcome
        return [outcomes[index] for index in sorted(outcomes)]

    def _poll(self) -> None:
        """Take in what has ended without waiting (reaps, results), then fill free slots."""
        waiting = [*self._inflight, *self._reaps]
        if waiting:
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
            for ref in ready:
                self._settle_any(ref)
        self._pump()

    def _settle_any(self, ref: Any) -> None:
        if ref in self._reaps:
            self._reaped(ref)
        elif ref in self._inflight:
            self._settle(ref)
        self._pump()

    def _settle(self, ref: ray.ObjectRef[RolloutResult]) -> None:
        handle = self._inflight.pop(ref)
        actor = handle.actor or ""
        handle.actor, handle.ref = None, None
        if actor in self._load:
            self._load[actor] -= 1
        try:
            result: RolloutResult = ray.get(ref)
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            self._raised(handle, actor, cause)
        except RayError as exc:
            # The actor died, or the node holding the result did: the attempt is lost.
            if isinstance(exc, RayActorError):
                self._bury(actor)
            self._lose(handle, actor, f"{type(exc).__name__} on actor {actor}")
        else:
            self._counts.completed += 1
            self._tool_ms.extend(
                float(record["ms"])
                for record in result.trace
                if record.get("event") == "tool_call" and isinstance(record.get("ms"), int | float)
            )
            self._done.append(
                dataclasses.replace(
                    result,
                    lost_on=tuple(handle.lost_on),
                    node=handle.node,
                    workspace_node=handle.workspace_node,
                )
            )

    def _raised(self, handle: RolloutHandle, actor: str, cause: BaseException) -> None:
        if isinstance(cause, PoolFull):
            self._retries.appendleft(handle)  # the actor's own bound: try again
        elif isinstance(cause, RolloutTimedOut):
            self._counts.timed_out += 1
            self._done.append(cause)
        elif handle.workspace_node != handle.node and handle.workspace_node not in live_nodes():
            self._agents.pop(handle.workspace_node, None)  # gone with its node
            self._lose(handle, actor, f"the node of its workspace is gone ({cause!r})")
        else:
            self._counts.failed += 1
            self._done.append(
                RolloutFailed(
                    f"rollout {handle.rollout_id} failed: {type(cause).__name__}: {cause}",
                    handle.rollout_id,
                    handle.attempt,
                    cause,
                )
            )

    # -- losses -------------------------------------------------------------------------------

    def _will_retry(self, loss: _Loss) -> bool:
        return not (loss.timed_out or self._closing) and loss.handle.attempt <= self.retries

    def _lose(self, handle: RolloutHandle, actor: str, why: str) -> None:
        """Reap a lost attempt on its workspace's machine; its retry waits for that."""
        loss = _Loss(handle, actor, why, time.time(), timed_out=handle.hung)
        self._counts.lost += 1
        agent = self._agents.get(handle.workspace_node)
        info = RolloutInfo(handle.rollout_id, handle.attempt, handle.marker)
        if agent is not None and isinstance(handle.runtime, Reapable):
            self._reaps[agent.reap.remote(handle.runtime, info)] = loss
        else:
            self._lost_for_good(loss, None)

    def _reaped(self, ref: ray.ObjectRef[Reaped]) -> None:
        loss = self._reaps.pop(ref)
        try:
            reaped: Reaped | None = ray.get(ref)
        except RayError as exc:
            if isinstance(exc, RayActorError):
                self._agents.pop(loss.handle.workspace_node, None)
            reaped = None
        self._lost_for_good(loss, reaped)

    def _lost_for_good(self, loss: _Loss, reaped: Reaped | None) -> None:
        handle = loss.handle
        delay = 0.0
        if reaped is None:
            self._counts.unreaped += 1
            lease = getattr(handle.runtime, "lease", None)
            if isinstance(lease, int | float):
                delay = float(lease) + _LEASE_MARGIN
        workspace = reaped.directory if reaped is not None else self._directory_of(handle)
        lost = RolloutLost(
            f"rollout {handle.rollout_id} (attempt {handle.attempt}) was lost: {loss.why}",
            handle.rollout_id,
            handle.attempt,
            loss.actor,
            marker=handle.marker,
            node=handle.workspace_node,
            workspace=workspace,
            reaped=reaped,
            retry_delay=delay if self._will_retry(loss) else 0.0,
            noticed_at=loss.noticed_at,
        )
        self.lost.append(lost)
        if loss.timed_out:
            self._counts.timed_out += 1
            self._done.append(
                RolloutTimedOut(
                    f"rollout {handle.rollout_id} (attempt {handle.attempt}) passed its deadline "
                    f"and its actor {loss.actor} did not end it: the actor was killed",
                    handle.rollout_id,
                    handle.attempt,
                    hung=True,
                )
            )
        elif self._will_retry(loss):
            handle.lost_on.append(loss.actor)
            handle.attempt += 1
            self._noticed[handle.rollout_id] = loss.noticed_at
            if delay:
                due = time.monotonic() + delay - (time.time() - loss.noticed_at)
                self._held.append(_Held(due, next(self._held_order), handle))
                self._held.sort()
            else:
                self._retries.append(handle)
        elif not self._closing:
            self._done.append(lost)

    def _directory_of(self, handle: RolloutHandle) -> str | None:
        directory = getattr(handle.runtime, "directory", None)
        if not callable(directory):
            return None
        with contextlib.suppress(Exception):
            path = directory(RolloutInfo(handle.rollout_id, handle.attempt, handle.marker))
            return path if isinstance(path, str) else None
        return None

    def _give_up_queued(self) -> None:
        """No actor is left: what waits for one ends as lost."""
        for queue in (self._retries, self._backlog):
            while queue:
                handle = queue.popleft()
                lost = RolloutLost(
                    f"rollout {handle.rollout_id} (attempt {handle.attempt}) was lost: "
                    "no live actor is left to run it",
                    handle.rollout_id,
                    handle.attempt,
                    "",
                    noticed_at=time.time(),
                )
                self.lost.append(lost)
                self._done.append(lost)

    def _bury(self, name: str) -> None:
        """Forget a dead actor (and make sure Ray does not bring it back)."""
        actor = self._actors.pop(name, None)
        self._load.pop(name, None)
        self._pings.pop(name, None)
        if actor is not None:
            with contextlib.suppress(Exception):  # already gone: nothing to do
                ray.kill(actor, no_restart=True)

    # -- hung actors -------------------------------------------------------------------------------

    def _next_check(self) -> float | None:
        """Seconds until something must be looked at without a result arriving."""
        now = time.monotonic()
        times = [held.due for held in self._held[:1]]
        for handle in self._inflight.values():
            if handle.request.deadline is not None:
                times.append(handle.dispatched + handle.request.deadline + self.hang_grace)
        if self.hang_timeout is not None and self._actors:
            times.append(now + self.hang_timeout / 3)
        return max(0.0, min(times) - now) if times else None

    def _watch(self) -> None:
        """Kill actors that hold an attempt past its deadline or do not answer pings."""
        now = time.monotonic()
        stuck: set[str] = set()
        for handle in self._inflight.values():
            limit = handle.request.deadline
            if limit is not None and now > handle.dispatched + limit + self.hang_grace:
                handle.hung = True
                stuck.add(handle.actor or "")
        if self.hang_timeout is not None:
            stuck |= self._unanswered(now, self.hang_timeout)
        for name in stuck & set(self._actors):
            self._counts.hung_actors += 1
            self._bury(name)  # its attempts fail with the actor and are settled as lost

    def _unanswered(self, now: float, limit: float) -> set[str]:
        """Actors whose last ping went unanswered for ``limit`` s; sends the next pings.

        An actor counts only once it has answered a ping: one still starting
        (a cold start on a busy node) is not hung.
        """
        pending = {name: ping for name, ping in self._pings.items() if name in self._actors}
        answered: set[Any] = set()
        if pending:
            refs = [ref for ref, _ in pending.values()]
            answered.update(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        stuck: set[str] = set()
        for name in list(self._actors):
            ping = pending.get(name)
            if ping is not None and ping[0] not in answered:
                if now - ping[1] > limit and name in self._alive:
                    stuck.add(name)
                continue
            if ping is not None:
                try:
                    ray.get(ping[0])
                except RayActorError:
                    self._bury(name)  # died while idle: no attempt of its will tell
                    continue
                except RayError:
                    pass
                self._alive.add(name)
            if ping is None or now - ping[1] >= limit / 3:
                self._pings[name] = (self._actors[name].ping.remote(), now)
        return stuck

    # -- the end -------------------------------------------------------------------------------

    def shutdown(self, *, reap_timeout: float = 60.0) -> None:
        """Kill every actor, reap what they still ran, then stop the node agents.

        Rollouts still running are lost (recorded in :attr:`lost`, not
        retried); their processes are killed and their directories removed
        by the agents within ``reap_timeout`` seconds.
        """
        self._closing = True  # nothing is tried again from here on
        if not ray.is_initialized():  # Ray went first, and everything of the pool's with it
            self._inflight.clear()
            self._reaps.clear()
            self._actors.clear()
            self._agents.clear()
        running = list(self._inflight.values())
        for name in list(self._actors):
            self._bury(name)
        self._inflight.clear()
        for handle in running:
            self._lose(handle, handle.actor or "", "the pool shut down")
        if self._reaps:
            with contextlib.suppress(RayError):
                ray.wait(list(self._reaps), num_returns=len(self._reaps), timeout=reap_timeout)
            for ref in list(self._reaps):
                ready, _ = ray.wait([ref], timeout=0)
                if ready:
                    self._reaped(ref)
                else:
                    self._lost_for_good(self._reaps.pop(ref), None)
        for agent in self._agents.values():
            with contextlib.suppress(Exception):
                ray.kill(agent, no_restart=True)
        self._agents.clear()
        self._retries.clear()
        self._held.clear()
        self._backlog.clear()
        self._done.clear()

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ascending ``ordered`` (nearest rank)."""
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]
