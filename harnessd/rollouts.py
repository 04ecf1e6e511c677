"""Rollouts: one agent session in a workspace of its own, described by data, run to a result.

A :class:`RolloutRequest` says everything one rollout needs, as values that
can be pickled and shipped to another process or machine: the task, how to
build the model there (a *model factory*, e.g. :class:`ScriptedModelSpec` or
:class:`OpenAIModelSpec`, which reads its API key from that process's
environment), and how to launch execd in the rollout's workspace (a *runtime
factory*, e.g. :class:`LocalWorkspace`, or any callable returning a
:class:`Workspace` around :func:`~harnessd.launcher.serve`). :func:`run_rollout` runs
it: launch execd, run the agent loop, read execd's ledger head, close the
session (marker cleanup), and return a :class:`RolloutResult` -- transcript,
trace, ledger head, timings -- that is plain data too.

Every attempt's workspace is named by its marker (``<base>/rollout-<marker>``) and
every process of it, execd included, carries that marker, so an attempt whose
harness died can be stopped and its directory removed from the machine the
workspace is on (:meth:`LocalWorkspace.reap`) without knowing any PID.

This module does not need Ray; :mod:`harnessd.ray` spreads rollouts over a
pool of Ray actors and is the one place that imports it. The errors that
pool raises live here, so code can catch them without importing Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import msgspec

from harnessd.agent import DEFAULT_SYSTEM_PROMPT, AgentLimits, AgentSession
from harnessd.errors import HarnessError
from harnessd.launcher import Launch, serve
from harnessd.models import Model
from harnessd.openai_model import OpenAIChatModel
from harnessd.runtime import LocalRuntime, Runtime
from harnessd.scripted_model import PacedModel, ScriptedModel
from harnessd.toolbox import ToolConfig
from harnessd.trace import Trace
from protocol.values import DEFAULT_MARKER_VAR

# -- errors ------------------------------------------------------------------------------


class PoolUnavailable(HarnessError):
    """No actor of the pool can take the rollout now."""


class PoolFull(PoolUnavailable):
    """Every live actor already hosts as many sessions as it may (back off and retry)."""


class NoLiveActor(PoolUnavailable):
    """Every actor of the pool has died; nothing can run."""


def _rebuild_error(cls: type[RolloutError], message: str, state: dict[str, Any]) -> RolloutError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class RolloutError(HarnessError):
    """A rollout ended without a result; ``rollout_id`` and ``attempt`` say which.

    Outcomes pickle with all their fields, so they can cross process boundaries.
    """

    def __init__(self, message: str, rollout_id: str, attempt: int) -> None:
        super().__init__(message)
        self.rollout_id = rollout_id
        self.attempt = attempt

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), str(self), dict(self.__dict__)))


@dataclass(frozen=True, slots=True)
class Reaped:
    """What stopping an attempt from outside did, on the machine its workspace was on.

    ``killed``: processes carrying its marker that were killed (execd and its
    supervisor among them when they still ran); ``remaining``: marked processes
    still alive afterwards (empty on success); ``directory``: its workspace
    directory, and ``removed`` whether that was removed now.
    """

    killed: int
    remaining: tuple[int, ...]
    directory: str | None
    removed: bool

    @property
    def clean(self) -> bool:
        """True when no process of the attempt is left."""
        return not self.remaining


class RolloutLost(RolloutError):
    """The actor running the rollout died (or hung and was killed); ``actor`` names it.

    ``marker``: the lost attempt's marker, carried by every process it started.
    ``node``: where its workspace was (a Ray node id with :mod:`harnessd.ray`).
    ``workspace``: its workspace directory there, when known. ``reaped``: what
    stopping it did (its processes killed by the marker, its directory
    removed) before anything else ran -- None when nothing could reach that
    machine (its node is gone too, or the runtime factory cannot reap): the
    attempt then ends by its execd's lease, and ``retry_delay`` says how long
    its retry waited for that (0: it was not held back, so the two may have
    overlapped). ``noticed_at``: when the loss was noticed (``time.time()``).
    """

    def __init__(
        self,
        message: str,
        rollout_id: str,
        attempt: int,
        actor: str,
        *,
        marker: str = "",
        node: str = "",
        workspace: str | None = None,
        reaped: Reaped | None = None,
        retry_delay: float = 0.0,
        noticed_at: float = 0.0,
    ) -> None:
        super().__init__(message, rollout_id, attempt)
        self.actor = actor
        self.marker = marker
        self.node = node
        self.workspace = workspace
        self.reaped = reaped
        self.retry_delay = retry_delay
        self.noticed_at = noticed_at


class RolloutFailed(RolloutError):
    """The rollout raised (execd did not launch, the ledger could not be synced, ...).

    ``cause`` is the exception the rollout raised.
    """

    def __init__(self, message: str, rollout_id: str, attempt: int, cause: BaseException) -> None:
        super().__init__(message, rollout_id, attempt)
        self.cause = cause


class RolloutTimedOut(RolloutError):
    """The attempt outlived the request's ``deadline``; it is not tried again.

    ``hung``: False when the rollout was stopped where it ran (its session
    closed, its workspace cleaned up); True when its host did not end it in
    time and was killed (:mod:`harnessd.ray`: the actor was declared hung).
    """

    def __init__(self, message: str, rollout_id: str, attempt: int, *, hung: bool = False) -> None:
        super().__init__(message, rollout_id, attempt)
        self.hung = hung


# -- what a rollout is given ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RolloutInfo:
    """Handed to the runtime factory: which rollout and attempt, and the marker to use.

    ``marker`` is unique to this attempt and starts with the pool's tag, so
    every process of every rollout of a pool can be found (pass it to
    :func:`~harnessd.launcher.serve` as ``marker=``).
    """

    rollout_id: str
    attempt: int
    marker: str


@dataclass(slots=True)
class Workspace:
    """What a runtime factory returns for one rollout.

    ``launch``: :func:`~harnessd.launcher.serve`'s result, not awaited yet. ``root``:
    the directory in the workspace the tools work in (None: execd's working
    directory). ``cleanup``: called once the session is closed, whatever
    happened (removes what the factory made, for instance).
    """

    launch: Launch
    root: str | None = None
    cleanup: Callable[[], None] | None = None


RuntimeFactory = Callable[[RolloutInfo], Workspace]
"""How to launch execd in one rollout's workspace; called where the rollout runs."""

ModelFactory = Callable[[], Model]
"""Builds the rollout's model where the rollout runs."""


@runtime_checkable
class Reapable(Protocol):
    """A runtime factory that can stop an attempt from outside, on the workspace's machine.

    :mod:`harnessd.ray` calls :meth:`reap` for an attempt whose harness died,
    before the attempt is tried again, in a process on the machine the
    workspace is on.
    """

    def reap(self, info: RolloutInfo) -> Reaped:
        """Kill every process of the attempt ``info`` and remove its workspace."""
        ...


def reap_marked(directory: str | None, marker: str, *, timeout: float = 10.0) -> Reaped:
    """Kill every process of this machine carrying ``marker``, then remove ``directory``.

    The marker variable is the launcher's default, ``EXECD_MARKER``; only
    processes of this user are touched. Blocking (``/proc`` scans and
    ``rm -r``): call it from a thread in async code.
    """
    from execd.marker import cleanup  # the workspace side's own cleanup, in this process

    report = cleanup(DEFAULT_MARKER_VAR, marker, timeout=timeout)
    removed = False
    if directory is not None and os.path.isdir(directory):
        shutil.rmtree(directory, ignore_errors=True)
        removed = not os.path.exists(directory)
    return Reaped(report.killed, tuple(report.remaining), directory, removed)


@dataclass(frozen=True, slots=True)
class ExecdSettings:
    """How a runtime factory lays out each attempt's directory and starts execd in it.

    Each attempt gets ``<base_dir>/rollout-<marker>/`` (``base_dir`` default: the
    temporary directory of the machine the workspace is on) holding the
    workspace the tools work in (``ws/``), execd's private directory (token
    file and log) and its state directory (the ledger). execd and
    everything it starts carry the attempt's marker. ``lease``: execd cleans
    up by the marker and exits this many seconds after its harness is gone
    (an actor killed, a machine lost). The directory is removed after the
    session closes unless ``keep``.
    """

    base_dir: str | None = None
    lease: float = 30.0
    execd_command: tuple[str, ...] | None = None
    extra_args: tuple[str, ...] = ()
    start_timeout: float = 60.0
    keep: bool = False


@dataclass(frozen=True, slots=True)
class LocalWorkspace(ExecdSettings):
    """A runtime factory: execd on the machine running the rollout, in a fresh directory.

    The directory and execd are as :class:`ExecdSettings` describes.
    """

    def directory(self, info: RolloutInfo) -> str:
        """The attempt's directory (where ``base_dir`` is None: in this machine's temporary directory)."""
        return os.path.join(self.base_dir or tempfile.gettempdir(), f"rollout-{info.marker}")

    def __call__(self, info: RolloutInfo) -> Workspace:
        base = self.directory(info)
        os.mkdir(base, 0o700)
        root = os.path.join(base, "ws")
        os.mkdir(root, 0o700)
        runtime = LocalRuntime(env={**os.environ, DEFAULT_MARKER_VAR: info.marker})
        launch = launch_execd(runtime, base, info, self)
        cleanup = None if self.keep else lambda: shutil.rmtree(base, ignore_errors=True)
        return Workspace(launch=launch, root=root, cleanup=cleanup)

    def reap(self, info: RolloutInfo) -> Reaped:
        """Kill the attempt's processes by its marker and remove its directory (on its machine)."""
        return reap_marked(self.directory(info), info.marker)


def launch_execd(
    runtime: Runtime,
    base: str,
    info: RolloutInfo,
    settings: ExecdSettings,
    *,
    bind_host: str = "127.0.0.1",
    encrypt: bool | str = False,
) -> Launch:
    """:func:`~harnessd.launcher.serve` for one attempt whose directory ``base`` and ``base/ws`` exist.

    execd runs in ``base/ws``; its private directory is ``base/execd``, its
    state ``base/state``; its marker is the attempt's.
    """
    return serve(
        runtime,
        execd_command=settings.execd_command,
        bind_host=bind_host,
        workdir=os.path.join(base, "execd"),
        cwd=os.path.join(base, "ws"),
        marker=info.marker,
        lease=settings.lease,
        encrypt=encrypt,
        start_timeout=settings.start_timeout,
        extra_args=("--state-dir", os.path.join(base, "state"), *settings.extra_args),
    )


@dataclass(frozen=True, slots=True)
class ScriptedModelSpec:
    """A model factory: a :class:`~harnessd.scripted_model.ScriptedModel` of ``turns``.

    ``turns`` are checked when the model is built (ModelConfigError).
    ``think``: seconds each turn waits first (a remote model's latency, see
    :class:`~harnessd.scripted_model.PacedModel`), spread by ``jitter``.
    """

    turns: Sequence[Any]
    think: float = 0.0
    jitter: float = 0.0
    name: str = "scripted"

    def __call__(self) -> Model:
        model: Model = ScriptedModel(self.turns, name=self.name)
        if self.think:
            model = PacedModel(model, self.think, jitter=self.jitter)
        return model


@dataclass(frozen=True, slots=True)
class OpenAIModelSpec:
    """A model factory: an OpenAI-compatible endpoint (:class:`~harnessd.openai_model.OpenAIChatModel`).

    The key is read from ``api_key_env`` in the process that runs the
    rollout, when the model is built: it travels in no request.
    """

    model: str
    base_url: str
    api_key_env: str | None
    timeout: float = 120.0
    max_retries: int = 4
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self) -> Model:
        return OpenAIChatModel(
            self.model,
            self.base_url,
            self.api_key_env,
            timeout=self.timeout,
            max_retries=self.max_retries,
            extra_body=self.extra_body,
        )


def new_rollout_id() -> str:
    """A fresh rollout id."""
    return f"rollout-{secrets.token_hex(6)}"


@dataclass(frozen=True, slots=True)
class RolloutRequest:
    """One rollout: the task, the model factory, the runtime factory, and the agent's bounds.

    ``tools``: the tools' settings (their ``root`` defaults to the
    workspace's). ``deadline``: seconds one attempt may take in all --
    launch, agent run and close -- before it is stopped and ends as
    :class:`RolloutTimedOut` (None: no deadline). Everything here must pickle
    when the rollout runs elsewhere.
    """

    task: str
    model: ModelFactory
    runtime: RuntimeFactory
    rollout_id: str = field(default_factory=new_rollout_id)
    limits: AgentLimits = field(default_factory=AgentLimits)
    tools: ToolConfig | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    deadline: float | None = None


# -- what a rollout gives back --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds spent launching execd, running the agent, closing the session, and in all."""

    launch: float
    run: float
    close: float
    total: float


@dataclass(frozen=True, slots=True)
class RolloutResult:
    """A finished rollout.

    ``transcript``: the conversation (chat-completions message dicts).
    ``trace``: every trace record (see :mod:`harnessd.trace`).
    ``ledger_seq``/``ledger_hash``: execd's ledger head after the run (the
    hash in hex), which the local ledger matched. ``killed``/``clean``: what
    the close's marker cleanup killed, and whether it left nothing. ``host``:
    where it ran (the actor's name); ``node``/``workspace_node``: where its
    harness and its workspace were (Ray node ids, set by :mod:`harnessd.ray`).
    ``started_at``: when the attempt began where it ran (``time.time()``).
    ``lost_on``: actors on which earlier attempts were lost.
    """

    rollout_id: str
    attempt: int
    host: str
    stop_reason: str
    final_text: str | None
    error: str | None
    transcript: list[dict[str, Any]]
    trace: list[dict[str, Any]]
    ledger_session: str
    ledger_seq: int
    ledger_hash: str
    tool_calls: int
    tool_errors: int
    killed: int
    clean: bool
    timings: Timings
    started_at: float = 0.0
    lost_on: tuple[str, ...] = ()
    node: str = ""
    workspace_node: str = ""


async def run_rollout(
    request: RolloutRequest,
    info: RolloutInfo,
    *,
    host: str = "",
    on_launched: Callable[[], object] | None = None,
    launch_slots: AbstractAsyncContextManager[Any] | None = None,
) -> RolloutResult:
    """Launch execd, run the agent on the task, close the session; the result.

    ``on_launched`` is called once execd is up and connected.
    ``launch_slots``: entered while execd starts (an
    :class:`asyncio.Semaphore`, say), to bound the launches in flight: cold
    starts compete for the machine's cores.

    Raises what fails on the way: LaunchFailed, ConnectionLost or
    LedgerDiverged when a sync cannot complete, ModelConfigError from the
    model factory, and :class:`RolloutTimedOut` once ``request.deadline``
    has passed. The session is closed and the workspace's ``cleanup`` called
    in every case (also when cancelled or out of time).
    """
    started_at = time.time()
    try:
        async with asyncio.timeout(request.deadline) as limit:
            result = await _run(request, info, host, on_launched, launch_slots)
    except TimeoutError:
        if not limit.expired():
            raise
        raise RolloutTimedOut(
            f"rollout {request.rollout_id} (attempt {info.attempt}) passed its deadline "
            f"of {request.deadline:g} s",
            request.rollout_id,
            info.attempt,
        ) from None
    return dataclasses.replace(result, started_at=started_at)


async def _run(
    request: RolloutRequest,
    info: RolloutInfo,
    host: str,
    on_launched: Callable[[], object] | None,
    launch_slots: AbstractAsyncContextManager[Any] | None,
) -> RolloutResult:
    started = time.perf_counter()
    workspace = request.runtime(info)
    try:
        if launch_slots is None:
            session = await workspace.launch
        else:
            async with launch_slots:
                session = await workspace.launch
        launched = time.perf_counter()
        if on_launched is not None:
            on_launched()
        try:
            records: list[dict[str, Any]] = []
            trace = Trace(session=request.rollout_id, listeners=[records.append])
            tools = request.tools or ToolConfig()
            if tools.root is None and workspace.root is not None:
                tools = dataclasses.replace(tools, root=workspace.root)
            agent = AgentSession(
                request.model(),
                lambda: session.client,
                limits=request.limits,
                tools=tools,
                trace=trace,
                reconnect=session.reconnect,
                system_prompt=request.system_prompt,
            )
            result = await agent.run(request.task)
            ran = time.perf_counter()
            head = await session.client.ledger_head(agent.session_id)
        finally:
            closed = await session.close(keep_log=False)
        done = time.perf_counter()
    finally:
        if workspace.cleanup is not None:
            await asyncio.to_thread(workspace.cleanup)
    return RolloutResult(
        rollout_id=request.rollout_id,
        attempt=info.attempt,
        host=host,
        stop_reason=result.stop_reason,
        final_text=result.final_text,
        error=result.error,
        transcript=[msgspec.to_builtins(message) for message in result.messages],
        trace=records,
        ledger_session=agent.session_id,
        ledger_seq=head.seq,
        ledger_hash=head.hash.hex(),
        tool_calls=result.tool_calls,
        tool_errors=result.tool_errors,
        killed=closed.killed,
        clean=closed.clean,
        timings=Timings(
            launch=launched - started, run=ran - launched, close=done - ran, total=done - started
        ),
    )
