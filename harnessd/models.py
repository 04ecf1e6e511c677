"""The model side of the agent loop: one interface, a scripted model and an OpenAI-compatible client.

A :class:`Model` is given the conversation so far (:class:`ChatMessage`) and
the tools on offer (:class:`ToolSpec`) and returns the next assistant turn
(:class:`AssistantTurn`): text, tool calls (id, name, JSON arguments), or
both. A turn without tool calls ends the session.

:class:`ScriptedModel` replays a fixed list of turns (for tests and the demo).
:class:`OpenAIChatModel` speaks the chat-completions wire format with tool
calling over HTTP or HTTPS, written on asyncio streams so a call can be
cancelled at any point and hundreds of sessions can wait on their models at
once without a thread each.

The API key is read from the environment variable whose *name* is given and
stays in this object: it is sent in the ``Authorization`` header and nowhere
else, and never appears in ``repr()`` or in error messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import ssl
import string
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, runtime_checkable
from urllib.parse import urlsplit

import msgspec

from harnessd.errors import HarnessError

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
    """A :class:`ScriptedModel` was asked for more turns than its script holds."""


# -- the scripted model ---------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}")


class _ScriptCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)
    id: str | None = None


class _ScriptTurn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    content: str | None = None
    tool_calls: list[_ScriptCall] = msgspec.field(default_factory=list)


class _Script(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    turns: list[_ScriptTurn]
    task: str | None = None


def _substitute(value: Any, variables: Mapping[str, Any]) -> Any:
    """Fill ``{{name}}`` placeholders: a string that is exactly one placeholder takes the
    variable's value as is (any JSON type); inside longer strings its text is spliced in."""
    if isinstance(value, str):
        whole = _PLACEHOLDER.fullmatch(value)
        if whole is not None:
            return _lookup(whole.group(1), variables)
        return _PLACEHOLDER.sub(lambda match: str(_lookup(match.group(1), variables)), value)
    if isinstance(value, list):
        return [_substitute(item, variables) for item in value]
    if isinstance(value, dict):
        return {key: _substitute(item, variables) for key, item in value.items()}
    return value


def _lookup(key: str, variables: Mapping[str, Any]) -> Any:
    if key not in variables:
        raise ModelConfigError(f"script placeholder {{{{{key}}}}} has no value")
    return variables[key]


class ScriptedModel:
    """Replays a fixed list of assistant turns, one per call, whatever the history says.

    The script is JSON::

        {"task": "optional task text",
         "turns": [{"content": "text", "tool_calls": [
                        {"name": "shell", "arguments": {"command": "ls"}}]},
                   {"content": "done"}]}

    ``arguments`` is an object (or JSON text). Tool call ids default to
    ``call_<turn>_<index>``. Placeholders ``{{name}}`` are filled from
    ``variables`` when the model is built: a string that is exactly one
    placeholder becomes the value itself (so ``"{{port}}"`` can become an
    integer), elsewhere the value's text is spliced in; an unknown name is a
    :class:`ModelConfigError`. Asking for a turn past the end raises
    :class:`ScriptExhausted`. Each instance keeps its own position.
    """

    def __init__(
        self,
        turns: Sequence[Mapping[str, Any]],
        *,
        variables: Mapping[str, Any] | None = None,
        name: str = "scripted",
        task: str | None = None,
    ) -> None:
        values = dict(variables or {})
        try:
            script = msgspec.convert(
                {"turns": _substitute(list(turns), values), "task": task}, _Script
            )
        except msgspec.ValidationError as exc:
            raise ModelConfigError(f"invalid script: {exc}") from None
        self._turns = [_materialise(index, turn) for index, turn in enumerate(script.turns, 1)]
        self._name = name
        self.task = _substitute(task, values) if task is not None else None
        self.position = 0
        self.seen: list[int] = []

    @classmethod
    def from_json(
        cls,
        text: str | bytes,
        *,
        variables: Mapping[str, Any] | None = None,
        name: str = "scripted",
    ) -> ScriptedModel:
        """A model from script JSON (see the class docstring)."""
        try:
            script = msgspec.json.decode(text, type=dict[str, Any])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ModelConfigError(f"script is not a JSON object: {exc}") from None
        turns = script.get("turns")
        if not isinstance(turns, list):
            raise ModelConfigError("script has no 'turns' list")
        task = script.get("task")
        return cls(
            turns,
            variables=variables,
            name=name,
            task=task if isinstance(task, str) else None,
        )

    @classmethod
    def from_file(
        cls, path: str | Path, *, variables: Mapping[str, Any] | None = None
    ) -> ScriptedModel:
        """A model from a script file."""
        data = Path(path).read_bytes()
        return cls.from_json(data, variables=variables, name=f"scripted:{Path(path).name}")

    @classmethod
    def from_resource(
        cls, package: str, resource: str, *, variables: Mapping[str, Any] | None = None
    ) -> ScriptedModel:
        """A model from a script shipped as package data (``resource`` may contain ``/``)."""
        node = resources.files(package)
        for part in resource.split("/"):
            node = node.joinpath(part)
        return cls.from_json(node.read_bytes(), variables=variables, name=f"scripted:{resource}")

    @property
    def name(self) -> str:
        return self._name

    @property
    def remaining(self) -> int:
        """Turns not replayed yet."""
        return len(self._turns) - self.position

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """The next scripted turn (the history is only counted, not checked)."""
        if self.position >= len(self._turns):
            raise ScriptExhausted(f"the script has only {len(self._turns)} turns")
        turn = self._turns[self.position]
        self.position += 1
        self.seen.append(len(messages))
        return msgspec.structs.replace(turn, tool_calls=list(turn.tool_calls))


class PacedModel:
    """Another model, answering each turn only after ``seconds`` (a remote model's latency).

    With ``jitter`` the wait is drawn uniformly from ``seconds * [1 - jitter,
    1 + jitter]``, so many paced sessions started together drift apart as
    real ones do. For benchmarks and tests at scale, where what happens
    between turns matters as much as the turns.
    """

    def __init__(self, model: Model, seconds: float, *, jitter: float = 0.0) -> None:
        if seconds < 0 or not 0 <= jitter <= 1:
            raise ModelConfigError("seconds must be >= 0 and jitter within [0, 1]")
        self.model = model
        self.seconds = seconds
        self.jitter = jitter

    @property
    def name(self) -> str:
        return self.model.name

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """The wrapped model's turn, after the pause."""
        spread = self.seconds * self.jitter
        await asyncio.sleep(self.seconds + random.uniform(-spread, spread))
        return await self.model.complete(messages, tools)


def _materialise(index: int, turn: _ScriptTurn) -> AssistantTurn:
    calls: list[ToolCall] = []
    for number, call in enumerate(turn.tool_calls, 1):
        arguments = (
            call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
        )
        calls.append(
            ToolCall(id=call.id or f"call_{index}_{number}", name=call.name, arguments=arguments)
        )
    return AssistantTurn(
        content=turn.content,
        tool_calls=calls,
        finish_reason="tool_calls" if calls else "stop",
    )


# -- the OpenAI-compatible client --------------------------------------------------------------

MAX_REPLY_BYTES = 64 * 1024 * 1024
"""Largest response body accepted from the endpoint."""

MAX_HEADER_LINE = 64 * 1024
MAX_HEADERS = 256
RETRY_STATUSES = frozenset({408, 409, 429})
_EXCERPT = 300


class _WireFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID)]
    arguments: str | dict[str, Any] | None = None


class _WireToolCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    function: _WireFunction
    id: Annotated[str, msgspec.Meta(max_length=MAX_ID)] | None = None
    type: str = "function"


class _WireMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    content: str | None = None
    tool_calls: Annotated[list[_WireToolCall], msgspec.Meta(max_length=MAX_TOOL_CALLS)] | None = (
        None
    )


class _WireChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    message: _WireMessage
    finish_reason: str | None = None


class _WireReply(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    choices: Annotated[list[_WireChoice], msgspec.Meta(min_length=1)]
    usage: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class HttpReply:
    """One HTTP response: status, lower-cased headers, body."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class _Endpoint:
    secure: bool
    host: str
    port: int
    path: str
    host_header: str


def _endpoint(base_url: str) -> _Endpoint:
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ModelConfigError(f"base URL must be http(s)://host[:port][/path], not {base_url!r}")
    if parts.username or parts.password:
        raise ModelConfigError("base URL must not carry credentials; use the API key variable")
    secure = parts.scheme == "https"
    try:
        port = parts.port or (443 if secure else 80)
    except ValueError:
        raise ModelConfigError(f"base URL has an invalid port: {base_url!r}") from None
    path = parts.path.rstrip("/") + "/chat/completions"
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    default_port = 443 if secure else 80
    host_header = shown if port == default_port else f"{shown}:{port}"
    return _Endpoint(secure=secure, host=host, port=port, path=path, host_header=host_header)


def wire_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """``messages`` in the chat-completions request shape."""
    out: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def wire_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """``tools`` in the chat-completions request shape."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
            },
        }
        for tool in tools
    ]


def parse_reply(body: bytes) -> AssistantTurn:
    """The assistant turn in a chat-completions response body; ModelReplyError if malformed."""
    try:
        reply = msgspec.json.decode(body, type=_WireReply)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ModelReplyError(f"not a chat completion: {exc}") from None
    choice = reply.choices[0]
    calls: list[ToolCall] = []
    for number, call in enumerate(choice.message.tool_calls or (), 1):
        if call.type != "function":
            raise ModelReplyError(f"tool call {number} has unsupported type {call.type!r}")
        raw = call.function.arguments
        if raw is None or raw == "":
            arguments = "{}"
        elif isinstance(raw, dict):
            arguments = json.dumps(raw)
        else:
            arguments = raw
        calls.append(
            ToolCall(id=call.id or f"call_{number}", name=call.function.name, arguments=arguments)
        )
    usage = None
    if reply.usage is not None:
        usage = {k: v for k, v in reply.usage.items() if isinstance(v, int)}
    return AssistantTurn(
        content=choice.message.content,
        tool_calls=calls,
        finish_reason=choice.finish_reason,
        usage=usage,
    )


class OpenAIChatModel:
    """An OpenAI-compatible chat-completions endpoint with tool calling.

    ``base_url``: e.g. ``https://api.openai.com/v1`` (requests go to
    ``{base_url}/chat/completions``). ``api_key_env``: the *name* of the
    environment variable holding the key, read once here (None: send no
    ``Authorization`` header, for local servers that need none).
    ``timeout``: seconds for one HTTP exchange. Retries: 408/409/429 and 5xx
    answers and transport failures are retried up to ``max_retries`` times
    with exponential backoff (``backoff`` doubling, capped at
    ``max_backoff``, with jitter; a ``Retry-After`` in seconds is honoured up
    to the cap). ``extra_body`` is merged into every request (temperature,
    max_tokens, ...).
    """

    def __init__(
        self,
        model: str,
        base_url: str,
        api_key_env: str | None,
        *,
        timeout: float = 120.0,
        max_retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        extra_body: Mapping[str, Any] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._model = model
        self._endpoint = _endpoint(base_url)
        self.base_url = base_url
        self.api_key_env = api_key_env
        self._key: str | None = None
        if api_key_env is not None:
            key = os.environ.get(api_key_env, "").strip()
            # The name is not repeated back: a key pasted in its place would be.
            if not key:
                raise ModelConfigError("the API key variable (api_key_env) is unset or empty")
            if any(ch in key for ch in "\r\n"):
                raise ModelConfigError("the API key (from api_key_env) contains a line break")
            self._key = key
        self.timeout = timeout
        self.max_retries = max(0, max_retries)
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.extra_body = dict(extra_body or {})
        self._ssl = ssl_context
        self.requests = 0
        self.retries = 0

    def __repr__(self) -> str:
        return f"OpenAIChatModel(model={self._model!r}, base_url={self.base_url!r})"

    @property
    def name(self) -> str:
        return self._model

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """POST the conversation and the tools; return the parsed assistant turn."""
        body: dict[str, Any] = {**self.extra_body, "model": self._model}
        body["messages"] = wire_messages(messages)
        if tools:
            body["tools"] = wire_tools(tools)
            body["tool_choice"] = "auto"
        payload = json.dumps(body, ensure_ascii=False).encode()
        reply = await self._post_with_retries(payload)
        return parse_reply(reply.body)

    async def _post_with_retries(self, payload: bytes) -> HttpReply:
        attempt = 0
        while True:
            delay: float | None = None
            try:
                reply = await self._post(payload)
            except ModelTransportError:
                if attempt >= self.max_retries:
                    raise
            else:
                if 200 <= reply.status < 300:
                    return reply
                if not (reply.status in RETRY_STATUSES or reply.status >= 500):
                    raise self._http_error(reply)
                if attempt >= self.max_retries:
                    raise self._http_error(reply)
                delay = _retry_after(reply.headers.get("retry-after"))
            backoff = min(self.max_backoff, self.backoff * (2**attempt))
            wait = backoff * random.uniform(0.5, 1.0) if delay is None else delay
            attempt += 1
            self.retries += 1
            await asyncio.sleep(min(wait, self.max_backoff))

    def _http_error(self, reply: HttpReply) -> ModelHTTPError:
        text = reply.body[:_EXCERPT].decode("utf-8", "replace")
        if self._key:
            text = text.replace(self._key, "[redacted]")
        text = " ".join(text.split())
        message = f"{self._endpoint.host_header} answered HTTP {reply.status}: {text}"
        if reply.status in (401, 403):
            return ModelAuthError(message, reply.status)
        return ModelHTTPError(message, reply.status)

    async def _post(self, payload: bytes) -> HttpReply:
        endpoint = self._endpoint
        headers = [
            f"POST {endpoint.path} HTTP/1.1",
            f"Host: {endpoint.host_header}",
            "User-Agent: harnessd",
            "Accept: application/json",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            "Connection: close",
        ]
        if self._key is not None:
            headers.append(f"Authorization: Bearer {self._key}")
        request = ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + payload
        self.requests += 1
        where = f"{endpoint.host_header}"
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout):
                return await _exchange(endpoint, request, self._tls())
        except TimeoutError:
            spent = time.monotonic() - started
            raise ModelTransportError(f"{where} did not answer within {spent:.1f} s") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise ModelTransportError(f"HTTP exchange with {where} failed: {exc}") from None

    def _tls(self) -> ssl.SSLContext | None:
        if not self._endpoint.secure:
            return None
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


async def _exchange(endpoint: _Endpoint, request: bytes, tls: ssl.SSLContext | None) -> HttpReply:
    reader, writer = await asyncio.open_connection(
        endpoint.host,
        endpoint.port,
        ssl=tls,
        server_hostname=endpoint.host if tls is not None else None,
        limit=MAX_HEADER_LINE,
    )
    try:
        writer.write(request)
        await writer.drain()
        return await read_response(reader)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def read_response(reader: asyncio.StreamReader) -> HttpReply:
    """Parse one HTTP/1.x response (Content-Length, chunked, or until EOF)."""
    status_line = (await reader.readuntil(b"\n")).decode("latin-1").strip()
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP status line: {status_line[:80]!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADERS + 1):
        line = (await reader.readuntil(b"\n")).decode("latin-1").strip()
        if not line:
            break
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    else:
        raise ValueError("too many response headers")
    if 100 <= status < 200:
        return await read_response(reader)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
    elif "content-length" in headers:
        length = int(headers["content-length"])
        if not 0 <= length <= MAX_REPLY_BYTES:
            raise ValueError(f"response body of {length} bytes is over the cap")
        body = await reader.readexactly(length)
    else:
        body = await reader.read(MAX_REPLY_BYTES + 1)
        while len(body) <= MAX_REPLY_BYTES:
            more = await reader.read(MAX_REPLY_BYTES + 1 - len(body))
            if not more:
                break
            body += more
        if len(body) > MAX_REPLY_BYTES:
            raise ValueError("response body is over the cap")
    return HttpReply(status=status, headers=headers, body=body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = (await reader.readuntil(b"\n")).decode("latin-1").strip()
        size_text = size_line.split(";", 1)[0].strip()
        if not size_text or any(ch not in string.hexdigits for ch in size_text):
            raise ValueError(f"bad chunk size line {size_line[:40]!r}")
        size = int(size_text, 16)
        if size == 0:
            while (await reader.readuntil(b"\n")).strip():
                pass
            return bytes(body)
        if len(body) + size > MAX_REPLY_BYTES:
            raise ValueError("response body is over the cap")
        body += await reader.readexactly(size)
        await reader.readexactly(2)
