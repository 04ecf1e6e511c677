"""OpenAIChatModel on httpx, against real servers on loopback.

Keep-alive, URL joining, Retry-After (seconds, HTTP dates, milliseconds,
capped), retries reported to the agent, request options in the body,
endpoints that refuse an optional field, proxies from the environment
(a real forward proxy: absolute-form HTTP and CONNECT to an HTTPS
endpoint), NO_PROXY, timeouts and the reply cap.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harnessd import openai_model
from harnessd.models import (
    CallInfo,
    ChatMessage,
    ModelHTTPError,
    ModelReplyError,
    ModelTransportError,
    ToolSpec,
    calling,
)
from harnessd.openai_model import OpenAIChatModel, completions_url, retry_after
from tests.support.model_endpoint import (
    Answer,
    ForwardProxy,
    ModelEndpoint,
    completion,
    self_signed,
    tool_call,
)

pytestmark = pytest.mark.timeout(60)

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
TOOLS = [
    ToolSpec(
        name="shell",
        description="run a command",
        parameters={"type": "object", "properties": {"command": {"type": "string"}}},
    )
]
ASK = [ChatMessage(role="user", content="hello")]


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the machine has, these tests choose their own proxies."""
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


@pytest.fixture
def endpoint() -> Iterator[ModelEndpoint]:
    with ModelEndpoint() as server:
        yield server


def model_for(url: str, **options: Any) -> OpenAIChatModel:
    settings: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.05, "timeout": 10.0}
    settings.update(options)
    return OpenAIChatModel("test-model", url, None, **settings)


class Recorder:
    """Collects what a model reports during calls."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        self.events.append((event, fields))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [fields for event, fields in self.events if event == kind]


async def complete_all(model: OpenAIChatModel, count: int, info: CallInfo | None = None) -> None:
    try:
        with calling(info or CallInfo()):
            for _ in range(count):
                await model.complete(ASK, TOOLS)
    finally:
        await model.aclose()


# -- transport ---------------------------------------------------------------------------------


def test_turns_share_one_keep_alive_connection(endpoint: ModelEndpoint) -> None:
    model = model_for(endpoint.base_url)
    asyncio.run(complete_all(model, 5))
    assert len(endpoint.seen) == 5
    assert endpoint.connections == 1
    assert model.requests == 5


def test_a_model_survives_a_new_event_loop(endpoint: ModelEndpoint) -> None:
    model = model_for(endpoint.base_url)
    asyncio.run(model.complete(ASK, TOOLS))
    asyncio.run(complete_all(model, 1))
    assert len(endpoint.seen) == 2


@pytest.mark.parametrize(
    ("base", "url"),
    [
        ("http://h:8000/v1", "http://h:8000/v1/chat/completions"),
        ("http://h:8000/v1/", "http://h:8000/v1/chat/completions"),
        ("http://h:8000/v1/chat/completions", "http://h:8000/v1/chat/completions"),
        ("http://h:8000/v1/chat/completions/", "http://h:8000/v1/chat/completions"),
        ("https://h", "https://h/chat/completions"),
        ("https://h/", "https://h/chat/completions"),
        (
            "https://h/openai/deployments/d?api-version=2024-10-21",
            "https://h/openai/deployments/d/chat/completions?api-version=2024-10-21",
        ),
        ("  https://[::1]:9/v1  ", "https://[::1]:9/v1/chat/completions"),
    ],
)
def test_completions_url_appends_the_path_once(base: str, url: str) -> None:
    assert completions_url(base) == url


def test_a_base_url_ending_in_chat_completions_is_used_as_is(endpoint: ModelEndpoint) -> None:
    model = model_for(endpoint.base_url + "/chat/completions")
    asyncio.run(complete_all(model, 1))
    assert [seen.path for seen in endpoint.seen] == ["/v1/chat/completions"]


def test_a_hanging_endpoint_times_out_each_attempt_and_reports_it(
    endpoint: ModelEndpoint,
) -> None:
    endpoint.answers += [Answer(200, completion("late"), delay=30)] * 2
    model = model_for(endpoint.base_url, timeout=0.3, max_retries=1)
    recorder = Recorder()
    with pytest.raises(ModelTransportError, match=r"did not answer within .* 2 attempts"):
        asyncio.run(complete_all(model, 1, CallInfo(report=recorder)))
    assert model.requests == 2
    (retry,) = recorder.of("model_retry")
    assert retry["attempt"] == 1 and retry["attempts"] == 2
    assert retry["status"] is None and "did not answer" in retry["error"]


def test_a_reply_over_the_cap_is_refused(
    endpoint: ModelEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_model, "MAX_REPLY_BYTES", 100)
    endpoint.answers.append(Answer(200, completion("x" * 200), chunked=True))
    with pytest.raises(ModelReplyError, match="cap"):
        asyncio.run(complete_all(model_for(endpoint.base_url), 1))


# -- Retry-After ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": " 2.5 "}, 2.5),
        ({"retry-after": "0"}, 0.0),
        ({"retry-after": "-3"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 60.0),
        ({"retry-after": "Wed, 21 Oct 2015 07:26:00 GMT"}, 0.0),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after-ms": "junk", "retry-after": "9"}, 9.0),
        ({}, None),
    ],
)
def test_retry_after_reads_seconds_dates_and_milliseconds(
    headers: dict[str, str], expected: float | None
) -> None:
    now = email.utils.parsedate_to_datetime("Wed, 21 Oct 2015 07:27:00 GMT").timestamp()
    assert retry_after(headers, now=now) == expected


def test_retry_after_seconds_is_waited_for(endpoint: ModelEndpoint) -> None:
    endpoint.answers += [
        Answer(429, b'{"error": "slow down"}', {"Retry-After": "1"}),
        Answer(200, completion("fine")),
    ]
    recorder = Recorder()
    asyncio.run(complete_all(model_for(endpoint.base_url), 1, CallInfo(turn=3, report=recorder)))
    (retry,) = recorder.of("model_retry")
    assert retry == {
        "attempt": 1,
        "attempts": 5,
        "status": 429,
        "error": None,
        "wait": 1.0,
        "retry_after": 1.0,
        "capped": False,
    }
    first, second = endpoint.seen
    assert second.at - first.at >= 0.95


def test_retry_after_as_an_http_date_is_waited_for(endpoint: ModelEndpoint) -> None:
    when = email.utils.formatdate(time.time() + 2, usegmt=True)
    endpoint.answers += [
        Answer(503, b"busy", {"Retry-After": when}),
        Answer(200, completion("fine")),
    ]
    recorder = Recorder()
    asyncio.run(complete_all(model_for(endpoint.base_url), 1, CallInfo(report=recorder)))
    (retry,) = recorder.of("model_retry")
    # The date has whole seconds: between one and two seconds from when it was read.
    assert 0.5 <= retry["wait"] <= 2.0 and retry["retry_after"] == retry["wait"]
    first, second = endpoint.seen
    assert second.at - first.at >= retry["wait"] - 0.05


def test_retry_after_is_capped_by_max_retry_wait(endpoint: ModelEndpoint) -> None:
    endpoint.answers += [
        Answer(429, b"{}", {"Retry-After": "3600"}),
        Answer(429, b"{}", {"Retry-After": "3600"}),
        Answer(200, completion("fine")),
    ]
    recorder = Recorder()
    model = model_for(endpoint.base_url, max_retry_wait=0.2)
    asyncio.run(complete_all(model, 1, CallInfo(report=recorder)))
    retries = recorder.of("model_retry")
    assert [(r["wait"], r["retry_after"], r["capped"]) for r in retries] == [
        (0.2, 3600.0, True),
        (0.2, 3600.0, True),
    ]
    assert [r["attempt"] for r in retries] == [1, 2]
    assert model.retries == 2


def test_the_last_failure_names_the_attempts(endpoint: ModelEndpoint) -> None:
    endpoint.answers += [Answer(429, b'{"error": "quota"}', {"Retry-After": "0"})] * 3
    with pytest.raises(ModelHTTPError, match=r"HTTP 429.*gave up after 3 attempts") as info:
        asyncio.run(complete_all(model_for(endpoint.base_url, max_retries=2), 1))
    assert info.value.status == 429


# -- the request body ---------------------------------------------------------------------------


@pytest.mark.parametrize("concurrent", [True, False])
def test_options_and_parallel_tool_calls_reach_the_body(
    endpoint: ModelEndpoint, concurrent: bool
) -> None:
    model = model_for(endpoint.base_url, temperature=0.25, max_tokens=321)
    asyncio.run(complete_all(model, 1, CallInfo(parallel_tool_calls=concurrent)))
    body = endpoint.seen[0].body
    assert body["temperature"] == 0.25
    assert body["max_tokens"] == 321
    assert body["parallel_tool_calls"] is concurrent
    assert body["tool_choice"] == "auto"
    assert body["messages"] == [{"role": "user", "content": "hello"}]


def test_nothing_optional_is_sent_unless_asked(endpoint: ModelEndpoint) -> None:
    asyncio.run(complete_all(model_for(endpoint.base_url), 1))
    body = endpoint.seen[0].body
    assert set(body) == {"model", "messages", "tools", "tool_choice"}
    model = model_for(endpoint.base_url, send_parallel_tool_calls=False)
    asyncio.run(complete_all(model, 1, CallInfo(parallel_tool_calls=True)))
    assert "parallel_tool_calls" not in endpoint.seen[1].body


def test_extra_body_wins_over_options_but_not_over_the_conversation(
    endpoint: ModelEndpoint,
) -> None:
    extra = {"temperature": 1.5, "model": "other", "seed": 7, "parallel_tool_calls": True}
    model = model_for(endpoint.base_url, temperature=0.1, extra_body=extra)
    asyncio.run(complete_all(model, 1, CallInfo(parallel_tool_calls=False)))
    body = endpoint.seen[0].body
    assert body["temperature"] == 1.5 and body["seed"] == 7
    assert body["parallel_tool_calls"] is True
    assert body["model"] == "test-model"


def unsupported(param: str) -> Answer:
    message = f"Unsupported parameter: '{param}' is not supported with this model."
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param}}
    return Answer(400, json.dumps(body).encode())


def test_a_refused_optional_field_is_dropped_or_renamed_and_stays_so(
    endpoint: ModelEndpoint,
) -> None:
    endpoint.answers += [
        unsupported("parallel_tool_calls"),
        unsupported("max_tokens"),
        Answer(200, completion("one")),
        Answer(200, completion("two")),
    ]
    recorder = Recorder()
    model = model_for(endpoint.base_url, max_tokens=50)
    info = CallInfo(parallel_tool_calls=True, report=recorder)
    asyncio.run(complete_all(model, 2, info))
    bodies = [seen.body for seen in endpoint.seen]
    assert [("parallel_tool_calls" in b, "max_tokens" in b) for b in bodies] == [
        (True, True),
        (False, True),
        (False, False),
        (False, False),
    ]
    assert [b.get("max_completion_tokens") for b in bodies] == [None, None, 50, 50]
    assert [e["param"] for e in recorder.of("model_adapted")] == [
        "parallel_tool_calls",
        "max_tokens",
    ]
    assert model.retries == 0


def test_a_400_about_anything_else_is_an_error(endpoint: ModelEndpoint) -> None:
    endpoint.answers.append(unsupported("temperature"))
    with pytest.raises(ModelHTTPError, match="temperature"):
        asyncio.run(complete_all(model_for(endpoint.base_url, temperature=0.0), 1))
    assert len(endpoint.seen) == 1


def test_tool_calls_come_back_parsed(endpoint: ModelEndpoint) -> None:
    call = tool_call("c9", "shell", {"command": "ls"})
    endpoint.answers.append(Answer(200, completion(None, [call])))
    model = model_for(endpoint.base_url)

    async def main() -> list[str]:
        try:
            turn = await model.complete(ASK, TOOLS)
        finally:
            await model.aclose()
        return [c.id for c in turn.tool_calls]

    assert asyncio.run(main()) == ["c9"]


# -- proxies from the environment -----------------------------------------------------------------


def test_http_proxy_from_the_environment_carries_the_request(
    endpoint: ModelEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ForwardProxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        asyncio.run(complete_all(model_for(endpoint.base_url), 2))
        assert proxy.requests == [f"POST {endpoint.base_url}/chat/completions HTTP/1.1"] * 2
    assert [seen.path for seen in endpoint.seen] == ["/v1/chat/completions"] * 2


def test_no_proxy_names_the_hosts_reached_directly(
    endpoint: ModelEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ForwardProxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", "example.com,127.0.0.1")
        asyncio.run(complete_all(model_for(endpoint.base_url), 1))
        assert proxy.requests == [] and proxy.tunnels == []
    assert len(endpoint.seen) == 1


def test_https_proxy_tunnels_to_an_https_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))
    with ModelEndpoint(tls=(cert, key)) as endpoint, ForwardProxy() as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        model = model_for(endpoint.base_url, ssl_context=trust)
        asyncio.run(complete_all(model, 2))
        assert proxy.tunnels == [f"127.0.0.1:{endpoint.port}"]  # one tunnel, kept alive
        assert proxy.requests == []
        assert len(endpoint.seen) == 2


def test_an_unreachable_proxy_is_a_transport_error(
    endpoint: ModelEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ForwardProxy() as proxy:
        url = proxy.url
    monkeypatch.setenv("HTTP_PROXY", url)
    with pytest.raises(ModelTransportError, match="failed"):
        asyncio.run(complete_all(model_for(endpoint.base_url, max_retries=0), 1))
    assert endpoint.seen == []
