"""The nodes of a Ray cluster as :mod:`harnessd.ray` uses them: placement, node agents, remote workspaces.

Needs the ``ray`` extra; ``import harnessd`` never imports this module.

*Placement.* A :class:`~harnessd.ray.RolloutPool` pins each of its actors to
a node (:func:`spread_over` picks them round robin, so N actors over M nodes
differ by at most one per node), or puts them into the bundles of a
placement group. It knows where every actor is, and so where every
rollout's harness and (for :class:`~harnessd.rollouts.LocalWorkspace`)
workspace are.

*Node agents.* The pool starts one small actor per node it uses
(:class:`NodeAgent`). An agent does what has to happen on its machine and
cannot wait for a rollout actor there: it stops a lost attempt by its
marker and removes its directory (:meth:`NodeAgent.reap`), and it is the
workspace end of :class:`NodeRuntime`.

*Remote workspaces.* :class:`NodeWorkspace` is a runtime factory whose
execd runs on a chosen node while the rollout's harness runs in an actor
elsewhere: the four operations of :class:`~harnessd.runtime.Runtime` are
calls to the agent on the workspace's node (:class:`NodeRuntime`), execd
binds that node's address, and the harness connects to it over the network
with the usual token, lease and keepalives. Closing, the lease and the
marker cleanup work as for a local execd; a lost attempt is reaped by the
agent on the workspace's node.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayError, RayTaskError

from harnessd.errors import LaunchFailed
from harnessd.launcher import Launch
from harnessd.rollouts import (
    ExecdSettings,
    Reaped,
    RolloutInfo,
    Workspace,
    launch_execd,
    reap_marked,
)
from harnessd.runtime import (
    DEFAULT_MAX_READ,
    CommandResult,
    LocalRuntime,
    WorkspaceError,
    remove_workdir,
)
from protocol.values import DEFAULT_MARKER_VAR

__all__ = [
    "NodeAgent",
    "NodeInfo",
    "NodeRuntime",
    "NodeWorkspace",
    "PlacedWorkspace",
    "actor_resources",
    "live_nodes",
    "spread_over",
]


# -- placement ------------------------------------------------------------------------------


def live_nodes() -> dict[str, dict[str, float]]:
    """The live nodes of the cluster: node id -> its total resources."""
    table: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return {
        str(node["NodeID"]): dict(node.get("Resources", {})) for node in table if node.get("Alive")
    }


def actor_resources(per_session: Mapping[str, float], sessions: int) -> dict[str, Any]:
    """Ray actor options reserving ``per_session`` resources for each of ``sessions`` sessions.

    ``CPU``, ``GPU`` and ``memory`` (bytes) map to Ray's own options; any
    other name is a custom resource.
    """
    options: dict[str, Any] = {}
    custom: dict[str, float] = {}
    for name, amount in per_session.items():
        if amount < 0:
            raise ValueError(f"resource {name!r} per session must not be negative")
        total = amount * sessions
        if name == "CPU":
            options["num_cpus"] = total
        elif name == "GPU":
            options["num_gpus"] = total
        elif name == "memory":
            options["memory"] = total
        else:
            custom[name] = total
    if custom:
        options["resources"] = custom
    return options


def _demand(options: Mapping[str, Any]) -> dict[str, float]:
    """The resources actor ``options`` ask for, by Ray's resource names."""
    demand = {
        "CPU": float(options.get("num_cpus") or 0),
        "GPU": float(options.get("num_gpus") or 0),
        "memory": float(options.get("memory") or 0),
    }
    demand.update(
        {name: float(amount) for name, amount in (options.get("resources") or {}).items()}
    )
    return {name: amount for name, amount in demand.items() if amount > 0}


def spread_over(count: int, options: Mapping[str, Any], nodes: Sequence[str] | None) -> list[str]:
    """Nodes for ``count`` actors, round robin over the nodes that can ever hold one.

    ``nodes``: the candidates (default: every live node). A node holds an
    actor when its total resources cover what ``options`` ask for; ValueError
    when none does.
    """
    alive = live_nodes()
    candidates = list(nodes) if nodes is not None else sorted(alive)
    demand = _demand(options)
    fit = [
        node
        for node in candidates
        if node in alive
        and all(alive[node].get(name, 0.0) >= need for name, need in demand.items())
    ]
    if not fit:
        raise ValueError(f"no live node can hold an actor needing {demand or 'nothing'}")
    return [fit[index % len(fit)] for index in range(count)]


def pinned(node: str) -> dict[str, Any]:
    """Actor options that keep an actor on ``node`` (it dies with the node)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def bundle_nodes(group: Any) -> list[str]:
    """The node of each bundle of a ready placement group."""
    from ray.util.placement_group import placement_group_table

    ray.get(group.ready())
    table = placement_group_table(group)
    by_index = table["bundles_to_node_id"]
    return [str(by_index[index]) for index in range(len(by_index))]


def in_bundle(group: Any, index: int) -> dict[str, Any]:
    """Actor options that put an actor into bundle ``index`` of ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=index
        )
    }


# -- node agents ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """An agent's account of its node: id, address, temporary directory, agent process id."""

    node: str
    address: str
    tmpdir: str
    pid: int


class NodeAgent:
    """One per node a pool uses: runs workspace operations and reaps lost attempts there.

    Every method runs on the agent's event loop or, when it blocks, in a
    thread. Commands and files follow :class:`~harnessd.runtime.LocalRuntime`
    (processes of this machine, as the agent's user); ``env`` adds
    variables to the scrubbed environment of what they start.
    """

    def describe(self) -> NodeInfo:
        """Where the agent runs."""
        context = ray.get_runtime_context()
        return NodeInfo(
            node=context.get_node_id(),
            address=str(ray.util.get_node_ip_address()),  # type: ignore[no-untyped-call]
            tmpdir=tempfile.gettempdir(),
            pid=os.getpid(),
        )

    async def run(
        self,
        argv: list[str],
        stdin: bytes | None,
        timeout: float | None,
        env: dict[str, str],
    ) -> CommandResult:
        """:meth:`~harnessd.runtime.Runtime.run` on this node."""
        return await _local(env).run(argv, stdin=stdin, timeout=timeout)

    async def start_background(self, argv: list[str], log_path: str, env: dict[str, str]) -> None:
        """:meth:`~harnessd.runtime.Runtime.start_background` on this node."""
        await _local(env).start_background(argv, log_path=log_path)

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        """:meth:`~harnessd.runtime.Runtime.read_file` on this node."""
        return await _local({}).read_file(path, max_bytes=max_bytes)

    async def write_file(self, path: str, data: bytes, mode: int, make_parents: bool) -> None:
        """:meth:`~harnessd.runtime.Runtime.write_file` on this node."""
        await _local({}).write_file(path, data, mode=mode, make_parents=make_parents)

    async def remove(self, path: str) -> None:
        """Remove a workspace directory and everything in it (an absolute path, not ``/``)."""
        await remove_workdir(_local({}), path)

    async def reap(self, factory: Any, info: RolloutInfo) -> Reaped:
        """Stop the attempt ``info`` of ``factory`` (a :class:`~harnessd.rollouts.Reapable`) here."""
        reaped: Reaped = await asyncio.to_thread(factory.reap, info)
        return reaped


def _local(env: Mapping[str, str]) -> LocalRuntime:
    return LocalRuntime(env={**os.environ, **env})


AgentClass = ray.remote(NodeAgent)


def start_agent(node: str) -> ActorHandle[NodeAgent]:
    """A new agent pinned to ``node``, reserving nothing."""
    agent = AgentClass.options(num_cpus=0, max_restarts=0, max_concurrency=1000, **pinned(node))
    return cast("ActorHandle[NodeAgent]", agent.remote())


class NodeRuntime:
    """A :class:`~harnessd.runtime.Runtime` on another node, through the agent there.

    ``env``: variables set for every command it starts (the attempt's
    marker, so execd itself can be found by it). An agent that is gone (its
    node lost) fails every operation with WorkspaceError.
    """

    def __init__(self, agent: ActorHandle[NodeAgent], node: str, env: Mapping[str, str]) -> None:
        self._agent = agent
        self.node = node
        self._env = dict(env)

    def __repr__(self) -> str:
        return f"NodeRuntime(node={self.node[:12]!r})"

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run ``argv`` on the node to completion; see :class:`~harnessd.runtime.Runtime`."""
        result: CommandResult = await self._call(
            self._agent.run.remote(list(argv), stdin, timeout, self._env)
        )
        return result

    async def start_background(self, argv: Sequence[str], *, log_path: str) -> None:
        """Start ``argv`` detached on the node; see :class:`~harnessd.runtime.Runtime`."""
        await self._call(self._agent.start_background.remote(list(argv), log_path, self._env))

    async def read_file(self, path: str, *, max_bytes: int = DEFAULT_MAX_READ) -> bytes:
        """The content of ``path`` on the node; see :class:`~harnessd.runtime.Runtime`."""
        data: bytes = await self._call(self._agent.read_file.remote(path, max_bytes))
        return data

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o600, make_parents: bool = False
    ) -> None:
        """Create ``path`` on the node; see :class:`~harnessd.runtime.Runtime`."""
        await self._call(self._agent.write_file.remote(path, data, mode, make_parents))

    async def _call(self, ref: Any) -> Any:
        try:
            return await ref
        except RayTaskError as exc:
            if isinstance(exc.cause, WorkspaceError):
                raise exc.cause from None
            raise WorkspaceError(f"on node {self.node[:12]}: {exc.cause!r}") from None
        except RayActorError:
            raise WorkspaceError(f"the agent of node {self.node[:12]} is gone") from None
        except RayError as exc:
            raise WorkspaceError(f"on node {self.node[:12]}: {type(exc).__name__}") from None


# -- remote workspaces --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeWorkspace(ExecdSettings):
    """A runtime factory: execd on another node of the Ray cluster than the rollout's harness.

    ``node``: the Ray node id the workspace lives on (None: the pool picks
    the node holding the fewest of its workspaces). The pool places it and
    hands the rollout a :class:`PlacedWorkspace`; calling a NodeWorkspace
    outside a pool is a ValueError. The attempt's directory, on that node,
    and execd are as :class:`~harnessd.rollouts.ExecdSettings` describes.
    execd binds the node's address; ``encrypt`` is passed to
    :func:`~harnessd.launcher.serve` (set it when the network between nodes
    is not trusted).
    """

    node: str | None = None
    encrypt: bool | str = False

    def __call__(self, info: RolloutInfo) -> Workspace:
        raise ValueError("a NodeWorkspace runs only in a RolloutPool, which places it on a node")

    def placed(self, agent: ActorHandle[NodeAgent], node: NodeInfo) -> PlacedWorkspace:
        """This workspace on ``node``, reached through its ``agent``."""
        return PlacedWorkspace(self, agent, node)


@dataclass(frozen=True, slots=True)
class PlacedWorkspace:
    """A :class:`NodeWorkspace` placed on a node: the runtime factory a pool's rollout calls."""

    spec: NodeWorkspace
    agent: ActorHandle[NodeAgent] = field(repr=False, compare=False)
    node: NodeInfo

    @property
    def lease(self) -> float:
        """The execds' lease (seconds)."""
        return self.spec.lease

    def directory(self, info: RolloutInfo) -> str:
        """The attempt's directory on the node."""
        return posixpath.join(self.spec.base_dir or self.node.tmpdir, f"rollout-{info.marker}")

    def __call__(self, info: RolloutInfo) -> Workspace:
        base = self.directory(info)
        root = posixpath.join(base, "ws")
        runtime = NodeRuntime(self.agent, self.node.node, {DEFAULT_MARKER_VAR: info.marker})
        spec = self.spec

        async def start() -> Any:
            made = await runtime.run(["mkdir", "-m", "700", "--", base, root], timeout=30.0)
            if made.exit_code != 0:
                detail = made.stderr.decode("utf-8", "replace").strip()[:500]
                raise LaunchFailed(f"cannot create {base} on node {self.node.node[:12]}: {detail}")
            launch = launch_execd(
                runtime, base, info, spec, bind_host=self.node.address, encrypt=spec.encrypt
            )
            return await launch

        return Workspace(
            launch=Launch(start),
            root=root,
            cleanup=None if spec.keep else lambda: self._remove(base),
        )

    def _remove(self, base: str) -> None:
        with contextlib.suppress(RayError):  # the node is gone, and its directory with it
            ray.get(self.agent.remove.remote(base), timeout=60.0)

    def reap(self, info: RolloutInfo) -> Reaped:
        """Kill the attempt's processes and remove its directory; runs on the workspace's node."""
        return reap_marked(self.directory(info), info.marker)
