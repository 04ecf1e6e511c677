"""The model side of the agent loop: one interface, a scripted model and an OpenAI-compatible client.

This module holds the interface; :mod:`harnessd.scripted_model` and
:mod:`harnessd.openai_model` the two models.

A :class:`Model` is given the conversation so far (:class:`ChatMessage`) and
the tools on offer (:class:`ToolSpec`) and returns the next assistant turn
(:class:`AssistantTurn`): text, tool calls (id, name, JSON arguments), or
both. A turn without tool calls ends the session.

:class:`~harnessd.scripted_model.ScriptedModel` replays a fixed list of turns (for tests and the demo).
:class:`~harnessd.openai_model.OpenAIChatModel` speaks the chat-completions wire format with tool
calling over httpx: one keep-alive connection pool per model and event loop,
proxies and CA bundles from the environment (``HTTPS_PROXY``, ``NO_PROXY``,
``SSL_CERT_FILE``, ...), bounded replies, and retries that honour
``Retry-After``. httpx is imported when the first request is made, so
importing this module (or :mod:`harnessd`) does not load it.

The agent loop tells a model what it needs to know about the call in
progress through :func:`calling` (a context variable, so concurrent sessions
never see each other's): the turn, whether the turn's tool calls will run
concurrently, and where to report retries. Models that do not care can
ignore it.

The API key is read from the environment variable whose *name* is given and
stays in this object: it is sent in the ``Authorization`` header and nowhere
else, and never appears in ``repr()`` or in error messages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import msgspec

from harnessd.errors import HarnessError

if TYPE_CHECKING:
    pass

# -- messages ------------------------------------------------------------------------

MAX_TOOL_CALLS = 256
"""Most tool calls accepted in one assistant turn."""

MAX_ID = 256
"""Longest tool call id or tool name accepted from a model."""

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """One tool call of an assistant turn; ``arguments`` is JSON text (an object)."""

    id: str
    name: str
    arguments: str = "{}"


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """One message of the conversation, in the chat-completions shape.

    ``tool_calls`` is set on assistant messages that call tools; ``tool_call_id``
    on ``tool`` messages, which carry one call's result in ``content``.
    """

    role: Role
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class AssistantTurn(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """What a model answered: text and/or tool calls, and its accounting when known."""

    content: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None

    def as_message(self) -> ChatMessage:
        """The assistant message to append to the history."""
        return ChatMessage(
            role="assistant", content=self.content, tool_calls=list(self.tool_calls) or None
        )


class ToolSpec(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """A tool offered to the model: name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]


@runtime_checkable
class Model(Protocol):
    """Anything that produces the next assistant turn.

    ``name`` identifies the model in traces. ``complete`` must not mutate
    ``messages``; it may raise :class:`ModelError`.
    """

    @property
    def name(self) -> str: ...

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn: ...


class ModelWrapper:
    """A model around another: its name, and each turn the inner model's.

    Subclasses add to :meth:`complete` (a pause, a timestamp) and call this one.
    """

    def __init__(self, model: Model) -> None:
        self.model = model

    @property
    def name(self) -> str:
        return self.model.name

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """The inner model's turn."""
        return await self.model.complete(messages, tools)


# -- errors -----------------------------------------------------------------------------


class ModelError(HarnessError):
    """Base of every failure to get a turn from a model."""


class ModelConfigError(ModelError):
    """The model is misconfigured: bad URL, API key variable unset, bad script."""


class ModelTransportError(ModelError):
    """The endpoint could not be reached or did not answer in time (after retries)."""


class ModelHTTPError(ModelError):
    """The endpoint answered with an HTTP error ``status`` (after retries when retryable)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ModelAuthError(ModelHTTPError):
    """401 or 403: the endpoint refused the credentials."""


class ModelReplyError(ModelError):
    """The endpoint answered 2xx with something that is not a valid chat completion."""


class ScriptExhausted(ModelError):
    """A :class:`~harnessd.scripted_model.ScriptedModel` was asked for more turns than its script holds."""


# -- what the agent loop tells a model about the call in progress ------------------------------

Reporter = Callable[[str, dict[str, Any]], None]
"""Receives ``(event, fields)`` while a call is in progress (see :class:`CallInfo`)."""


@dataclass(frozen=True, slots=True)
class CallInfo:
    """The model call in progress, as the agent loop describes it.

    ``turn``: the turn's number (0: not in a session). ``parallel_tool_calls``:
    True when the answer's tool calls will run concurrently, False when they
    will run one after another in the order given, None when nobody said.
    ``report``: where a model reports what happens during the call --
    ``model_retry`` events with their fields; the agent loop writes them to
    the session's trace.
    """

    turn: int = 0
    parallel_tool_calls: bool | None = None
    report: Reporter | None = None


_CALL: ContextVar[CallInfo | None] = ContextVar("harnessd_model_call", default=None)
_NO_CALL = CallInfo()


@contextlib.contextmanager
def calling(info: CallInfo) -> Iterator[None]:
    """Describe the model call made inside the block (this task and its children only)."""
    token = _CALL.set(info)
    try:
        yield
    finally:
        _CALL.reset(token)


def current_call() -> CallInfo:
    """The description of the model call in progress (an empty one outside :func:`calling`)."""
    return _CALL.get() or _NO_CALL
