"""The OpenAI-compatible chat-completions client: :class:`OpenAIChatModel`.

It speaks the chat-completions wire format with tool
calling over httpx: one keep-alive connection pool per model and event loop,
proxies and CA bundles from the environment (``HTTPS_PROXY``, ``NO_PROXY``,
``SSL_CERT_FILE``, ...), bounded replies, and retries that honour
``Retry-After``. httpx is imported when the first request is made, so
importing this module (or :mod:`harnessd`) does not load it.

The API key is read from the environment variable whose *name* is given and
stays in this object: it is sent in the ``Authorization`` header and nowhere
else, and never appears in ``repr()`` or in error messages.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import os
import random
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

if TYPE_CHECKING:
    import httpx

from harnessd.models import (
    MAX_ID,
    MAX_TOOL_CALLS,
    AssistantTurn,
    CallInfo,
    ChatMessage,
    ModelAuthError,
    ModelConfigError,
    ModelHTTPError,
    ModelReplyError,
    ModelTransportError,
    Role,
    ToolCall,
    ToolSpec,
    current_call,
)

# -- the OpenAI-compatible client --------------------------------------------------------------

MAX_REPLY_BYTES = 64 * 1024 * 1024
"""Largest response body accepted from the endpoint."""

RETRY_STATUSES = frozenset({408, 409, 425, 429})
"""Statuses retried besides every 5xx."""

DEFAULT_TIMEOUT = 120.0
DEFAULT_RETRIES = 4
DEFAULT_MAX_RETRY_WAIT = 120.0
CONNECT_TIMEOUT = 30.0
KEEPALIVE_EXPIRY = 60.0
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


class _WireErrorDetail(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    param: str | None = None


class _WireError(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    error: _WireErrorDetail | str | None = None


class OutFunction(msgspec.Struct, kw_only=True):
    """The function of a tool call, as requests carry it."""

    name: str
    arguments: str


class OutToolCall(msgspec.Struct, kw_only=True):
    """A tool call of an assistant message, as requests carry it."""

    id: str
    function: OutFunction
    type: str = "function"


class OutMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message of a request (``content`` is always sent, ``null`` included)."""

    role: Role
    content: str | None
    tool_calls: list[OutToolCall] | None = None
    tool_call_id: str | None = None


class OutTool(msgspec.Struct, kw_only=True):
    """One tool of a request."""

    function: ToolSpec
    type: str = "function"


def wire_messages(messages: Sequence[ChatMessage]) -> list[OutMessage]:
    """``messages`` in the chat-completions request shape (encode with msgspec)."""
    out: list[OutMessage] = []
    for message in messages:
        calls = None
        if message.tool_calls:
            calls = [
                OutToolCall(
                    id=call.id, function=OutFunction(name=call.name, arguments=call.arguments)
                )
                for call in message.tool_calls
            ]
        out.append(
            OutMessage(
                role=message.role,
                content=message.content,
                tool_calls=calls,
                tool_call_id=message.tool_call_id,
            )
        )
    return out


def wire_tools(tools: Sequence[ToolSpec]) -> list[OutTool]:
    """``tools`` in the chat-completions request shape (encode with msgspec)."""
    return [OutTool(function=tool) for tool in tools]


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
            arguments = msgspec.json.encode(raw).decode()
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


def completions_url(base_url: str) -> str:
    """The chat-completions URL for ``base_url``.

    ``/chat/completions`` is appended to the path unless it already ends so
    (``https://host/v1``, ``https://host/v1/`` and
    ``https://host/v1/chat/completions`` all give the last); a query string
    is kept. ModelConfigError for anything but ``http(s)://host[:port][/path]``
    without credentials.
    """
    parts = urlsplit(base_url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ModelConfigError(f"base URL must be http(s)://host[:port][/path], not {base_url!r}")
    if parts.username or parts.password:
        raise ModelConfigError("base URL must not carry credentials; use the API key variable")
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError:
        raise ModelConfigError(f"base URL has an invalid port: {base_url!r}") from None
    path = parts.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path += "/chat/completions"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds an answer asks to wait before retrying, or None when it does not say.

    ``retry-after-ms`` (milliseconds, sent by some endpoints) wins over
    ``Retry-After``, which may be seconds or an HTTP date (a date in the past
    means now). ``now`` is the Unix time to count a date from (default: the clock).
    """
    millis = headers.get("retry-after-ms")
    if millis is not None:
        value = _seconds(millis)
        if value is not None:
            return value / 1000.0
    text = headers.get("retry-after")
    if text is None:
        return None
    seconds = _seconds(text)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    clock = time.time() if now is None else now
    return max(0.0, when.timestamp() - clock)


def _seconds(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


_TLS_CONTEXTS: dict[tuple[str, str], ssl.SSLContext] = {}


def default_tls_context() -> ssl.SSLContext:
    """The certificate check for HTTPS endpoints and proxies.

    ``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` set: exactly those CAs (OpenSSL
    reads the variables). Otherwise the system's CA store and certifi's
    bundle together, so a host with no CA store of its own still works. One
    context per distinct setting, shared by every model of the process.
    """
    key = (os.environ.get("SSL_CERT_FILE", ""), os.environ.get("SSL_CERT_DIR", ""))
    context = _TLS_CONTEXTS.get(key)
    if context is None:
        context = ssl.create_default_context()
        if key == ("", ""):
            import certifi

            context.load_verify_locations(certifi.where())
        _TLS_CONTEXTS[key] = context
    return context


@dataclass(frozen=True, slots=True)
class HttpReply:
    """One HTTP response: status, headers (case-insensitive), body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


def _retryable(status: int) -> bool:
    return status in RETRY_STATUSES or status >= 500


class OpenAIChatModel:
    """An OpenAI-compatible chat-completions endpoint with tool calling.

    ``base_url``: e.g. ``https://api.openai.com/v1``; requests go to
    ``{base_url}/chat/completions`` (see :func:`completions_url`).
    ``api_key_env``: the *name* of the environment variable holding the key,
    read once here (None: send no ``Authorization`` header, for local
    servers that need none).

    Transport: httpx with keep-alive (up to ``max_connections`` per event
    loop), proxies from ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` unless
    ``NO_PROXY`` names the host, certificates per
    :func:`default_tls_context` (or ``ssl_context``). ``timeout``: seconds
    one attempt may take, connecting included. Replies over
    :data:`MAX_REPLY_BYTES` are refused.

    Retries: 408, 409, 425, 429, every 5xx and transport failures are tried
    again, up to ``max_retries`` more times. The wait is what the answer's
    ``Retry-After`` (seconds or an HTTP date; ``retry-after-ms`` too) asks,
    capped at ``max_retry_wait``; without one, exponential backoff from
    ``backoff`` seconds doubling up to ``max_backoff``, with jitter. Each
    retry is reported as a ``model_retry`` event to the agent's
    :func:`~harnessd.models.current_call` reporter.

    Request body: ``temperature`` and ``max_tokens`` when given;
    ``parallel_tool_calls`` when tools are offered and the agent said how
    the calls will run (:class:`~harnessd.models.CallInfo`), unless
    ``send_parallel_tool_calls`` is False. An endpoint that refuses
    ``parallel_tool_calls`` (400 naming it, as some reasoning models do) is
    asked again without it, and ``max_tokens`` is renamed
    ``max_completion_tokens`` for one that refuses that; each change is
    reported (``model_adapted``) and kept for later turns. ``extra_body`` is
    merged into every request: its keys win over these optional fields but
    not over ``model``, ``messages`` and ``tools``.

    Call :meth:`aclose` (or use ``async with``) to close the connections.
    """

    def __init__(
        self,
        model: str,
        base_url: str,
        api_key_env: str | None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_RETRIES,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        max_retry_wait: float = DEFAULT_MAX_RETRY_WAIT,
        temperature: float | None = None,
        max_tokens: int | None = None,
        send_parallel_tool_calls: bool = True,
        extra_body: Mapping[str, Any] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 100,
    ) -> None:
        self._model = model
        self.url = completions_url(base_url)
        self.base_url = base_url
        self._where = urlsplit(self.url).netloc
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
        if not (math.isfinite(timeout) and timeout > 0):
            raise ModelConfigError(f"timeout must be a positive number of seconds, not {timeout}")
        if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
            raise ModelConfigError(f"temperature must be a number of at least 0, not {temperature}")
        if max_tokens is not None and max_tokens < 1:
            raise ModelConfigError(f"max_tokens must be at least 1, not {max_tokens}")
        if not (math.isfinite(max_retry_wait) and max_retry_wait >= 0):
            raise ModelConfigError(f"max_retry_wait must be at least 0, not {max_retry_wait}")
        self.timeout = timeout
        self.max_retries = max(0, max_retries)
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_retry_wait = max_retry_wait
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.send_parallel_tool_calls = send_parallel_tool_calls
        self.extra_body = dict(extra_body or {})
        self.max_connections = max(1, max_connections)
        self._ssl = ssl_context
        self._max_tokens_field = "max_tokens"
        self._headers = {"Content-Type": "application/json"}
        if self._key is not None:
            self._headers["Authorization"] = f"Bearer {self._key}"
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self.requests = 0
        self.retries = 0

    def __repr__(self) -> str:
        return f"OpenAIChatModel(model={self._model!r}, base_url={self.base_url!r})"

    @property
    def name(self) -> str:
        return self._model

    async def __aenter__(self) -> OpenAIChatModel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections (idempotent; a later call opens new ones)."""
        client, self._client = self._client, None
        loop, self._client_loop = self._client_loop, None
        if client is not None and loop is asyncio.get_running_loop():
            await client.aclose()

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """POST the conversation and the tools; return the parsed assistant turn."""
        call = current_call()
        wired_messages = wire_messages(messages)
        wired_tools = wire_tools(tools)
        for _ in range(3):
            body = self._body(wired_messages, wired_tools, call)
            reply = await self._send(msgspec.json.encode(body), call)
            if 200 <= reply.status < 300:
                return parse_reply(reply.body)
            if not self._adapt(reply, body, call):
                raise self._http_error(reply)
        raise self._http_error(reply)

    def _body(
        self, messages: list[OutMessage], tools: list[OutTool], call: CallInfo
    ) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if tools:
            body["tool_choice"] = "auto"
            if self.send_parallel_tool_calls and call.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = call.parallel_tool_calls
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body[self._max_tokens_field] = self.max_tokens
        body.update(self.extra_body)
        body["model"] = self._model
        body["messages"] = messages
        if tools:
            body["tools"] = tools
        return body

    def _adapt(self, reply: HttpReply, body: dict[str, Any], call: CallInfo) -> bool:
        """Change what was refused (400 naming a field this client chose); True to ask again."""
        if reply.status != 400:
            return False
        try:
            detail = msgspec.json.decode(reply.body, type=_WireError).error
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        param = detail.param if isinstance(detail, _WireErrorDetail) else None
        change: str | None = None
        if (
            param == "parallel_tool_calls"
            and "parallel_tool_calls" in body
            and "parallel_tool_calls" not in self.extra_body
        ):
            self.send_parallel_tool_calls = False
            change = "parallel_tool_calls is no longer sent"
        elif (
            param == "max_tokens"
            and self._max_tokens_field == "max_tokens"
            and "max_tokens" in body
            and "max_tokens" not in self.extra_body
        ):
            self._max_tokens_field = "max_completion_tokens"
            change = "max_tokens is sent as max_completion_tokens"
        if change is None:
            return False
        _report(call, "model_adapted", {"status": reply.status, "param": param, "change": change})
        return True

    async def _send(self, payload: bytes, call: CallInfo) -> HttpReply:
        """POST ``payload``, retrying as the class docstring says; the last answer."""
        attempts = self.max_retries + 1
        attempt = 0
        while True:
            attempt += 1
            status: int | None = None
            error: str | None = None
            asked: float | None = None
            try:
                reply = await self._post(payload)
            except ModelTransportError as exc:
                if attempt >= attempts:
                    if attempts > 1:
                        raise ModelTransportError(
                            f"{exc} (gave up after {attempts} attempts)"
                        ) from None
                    raise
                error = str(exc)
            else:
                if not _retryable(reply.status) or attempt >= attempts:
                    return reply
                status = reply.status
                asked = retry_after(reply.headers)
            if asked is not None:
                wait = min(asked, self.max_retry_wait)
            else:
                wait = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
                wait *= random.uniform(0.5, 1.0)
            self.retries += 1
            _report(
                call,
                "model_retry",
                {
                    "attempt": attempt,
                    "attempts": attempts,
                    "status": status,
                    "error": error,
                    "wait": round(wait, 3),
                    "retry_after": None if asked is None else round(asked, 3),
                    "capped": asked is not None and asked > self.max_retry_wait,
                },
            )
            await asyncio.sleep(wait)

    def _http_error(self, reply: HttpReply) -> ModelHTTPError:
        text = reply.body[:_EXCERPT].decode("utf-8", "replace")
        if self._key:
            text = text.replace(self._key, "[redacted]")
        text = " ".join(text.split())
        message = f"{self._where} answered HTTP {reply.status}: {text}"
        if _retryable(reply.status) and self.max_retries:
            message += f" (gave up after {self.max_retries + 1} attempts)"
        if reply.status in (401, 403):
            return ModelAuthError(message, reply.status)
        return ModelHTTPError(message, reply.status)

    def _http(self) -> httpx.AsyncClient:
        """This event loop's connection pool (a model used from a new loop gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._client is not None and self._client_loop is loop:
            return self._client
        import httpx

        self._client = httpx.AsyncClient(
            verify=self._ssl if self._ssl is not None else default_tls_context(),
            trust_env=True,
            follow_redirects=False,
            timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, CONNECT_TIMEOUT)),
            limits=httpx.Limits(
                max_connections=self.max_connections,
                max_keepalive_connections=self.max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY,
            ),
            headers={"User-Agent": "harnessd", "Accept": "application/json", **self._headers},
        )
        self._client_loop = loop
        return self._client

    async def _post(self, payload: bytes) -> HttpReply:
        import httpx

        client = self._http()
        self.requests += 1
        started = time.monotonic()
        try:
            async with (
                asyncio.timeout(self.timeout),
                client.stream("POST", self.url, content=payload) as response,
            ):
                body = await _read_capped(response)
                return HttpReply(response.status_code, response.headers, body)
        except (TimeoutError, httpx.TimeoutException):
            spent = time.monotonic() - started
            raise ModelTransportError(
                f"{self._where} did not answer within {spent:.1f} s"
            ) from None
        except httpx.HTTPError as exc:
            reason = str(exc) or type(exc).__name__
            raise ModelTransportError(
                f"HTTP exchange with {self._where} failed: {reason}"
            ) from None


async def _read_capped(response: httpx.Response) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REPLY_BYTES:
        raise ModelReplyError(f"the reply of {declared} bytes is over the {MAX_REPLY_BYTES} cap")
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise ModelReplyError(f"the reply is over the {MAX_REPLY_BYTES} bytes cap")
        chunks.append(chunk)
    return b"".join(chunks)


def _report(call: CallInfo, event: str, fields: dict[str, Any]) -> None:
    if call.report is not None:
        call.report(event, fields)
