"""The model clients: ScriptedModel replay, and OpenAIChatModel against a real local HTTP server.

Retries, Retry-After, proxies, URL joining and request options are in test_model_client.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harnessd.models import (
    AssistantTurn,
    ChatMessage,
    ModelAuthError,
    ModelConfigError,
    ModelHTTPError,
    ModelReplyError,
    ModelTransportError,
    ScriptExhausted,
    ToolCall,
    ToolSpec,
)
from harnessd.openai_model import OpenAIChatModel
from harnessd.scripted_model import PacedModel, ScriptedModel
from tests.support.model_endpoint import Answer, ModelEndpoint, completion

pytestmark = pytest.mark.timeout(60)

KEY_VAR = "HARNESSD_TEST_MODEL_KEY"
KEY = "sk-test-0123456789abcdef"

TOOLS = [
    ToolSpec(
        name="shell",
        description="run a command",
        parameters={
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    )
]


@pytest.fixture
def endpoint() -> Iterator[ModelEndpoint]:
    server = ModelEndpoint()
    yield server
    server.close()


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_VAR, KEY)
    return KEY


def model_for(endpoint: ModelEndpoint, **kwargs: Any) -> OpenAIChatModel:
    options: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.05, "timeout": 10.0}
    options.update(kwargs)
    return OpenAIChatModel("test-model", endpoint.base_url, KEY_VAR, **options)


HISTORY = [
    ChatMessage(role="system", content="be brief"),
    ChatMessage(role="user", content="list files"),
    ChatMessage(
        role="assistant",
        content=None,
        tool_calls=[ToolCall(id="call_a", name="shell", arguments='{"command": "ls"}')],
    ),
    ChatMessage(role="tool", content="exit code 0\nstdout:\nREADME\n", tool_call_id="call_a"),
]


# -- ScriptedModel ---------------------------------------------------------------------------


def test_scripted_model_replays_turns_in_order() -> None:
    model = ScriptedModel(
        [
            {
                "content": "looking",
                "tool_calls": [
                    {"name": "shell", "arguments": {"command": "ls {{dir}}"}},
                    {"name": "read_file", "arguments": '{"path": "a"}', "id": "mine"},
                ],
            },
            {"content": "done"},
        ],
        variables={"dir": "/tmp"},
    )

    async def main() -> list[AssistantTurn]:
        first = await model.complete([ChatMessage(role="user", content="x")], TOOLS)
        second = await model.complete([], TOOLS)
        with pytest.raises(ScriptExhausted):
            await model.complete([], TOOLS)
        return [first, second]

    first, second = asyncio.run(main())
    assert first.content == "looking"
    assert [c.id for c in first.tool_calls] == ["call_1_1", "mine"]
    assert json.loads(first.tool_calls[0].arguments) == {"command": "ls /tmp"}
    assert json.loads(first.tool_calls[1].arguments) == {"path": "a"}
    assert second.content == "done" and second.tool_calls == []
    assert model.remaining == 0
    assert model.seen == [1, 0]


def test_scripted_model_placeholders_keep_types_and_refuse_unknown_names() -> None:
    model = ScriptedModel(
        [{"tool_calls": [{"name": "x", "arguments": {"port": "{{port}}", "s": "p={{port}}"}}]}],
        variables={"port": 8123},
    )
    turn = asyncio.run(model.complete([], []))
    assert json.loads(turn.tool_calls[0].arguments) == {"port": 8123, "s": "p=8123"}
    with pytest.raises(ModelConfigError, match="nope"):
        ScriptedModel([{"content": "{{nope}}"}])
    with pytest.raises(ModelConfigError):
        ScriptedModel([{"tool_calls": [{"arguments": {}}]}])


def test_scripted_model_from_file_and_resource(tmp_path: Path) -> None:
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"task": "do {{x}}", "turns": [{"content": "ok"}]}))
    model = ScriptedModel.from_file(script, variables={"x": "it"})
    assert model.task == "do it"
    assert asyncio.run(model.complete([], [])).content == "ok"
    demo = ScriptedModel.from_resource(
        "harnessd", "demo/task.json", variables={"python": "python3", "port": 1234}
    )
    assert demo.remaining > 5 and demo.task
    with pytest.raises(ModelConfigError):
        ScriptedModel.from_json(b"[1, 2]")


# -- OpenAIChatModel ----------------------------------------------------------------------


def test_request_shape_and_tool_call_parsing(endpoint: ModelEndpoint, api_key: str) -> None:
    endpoint.answers.append(
        Answer(
            200,
            completion(
                "let me check",
                [
                    {
                        "id": "call_7",
                        "type": "function",
                        "function": {"name": "shell", "arguments": '{"command": "pwd"}'},
                    }
                ],
            ),
        )
    )
    model = model_for(endpoint, extra_body={"temperature": 0})
    turn = asyncio.run(model.complete(HISTORY, TOOLS))

    assert turn.content == "let me check"
    assert turn.tool_calls == [ToolCall(id="call_7", name="shell", arguments='{"command": "pwd"}')]
    assert turn.finish_reason == "tool_calls"
    assert turn.usage == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}

    (seen,) = endpoint.seen
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == f"Bearer {api_key}"
    assert seen.headers["content-type"] == "application/json"
    body = seen.body
    assert body["model"] == "test-model"
    assert body["temperature"] == 0
    assert body["tool_choice"] == "auto"
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "shell",
                "description": "run a command",
                "parameters": TOOLS[0].parameters,
            },
        }
    ]
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool"]
    assistant = body["messages"][2]
    assert assistant["tool_calls"] == [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "shell", "arguments": '{"command": "ls"}'},
        }
    ]
    tool = body["messages"][3]
    assert tool["tool_call_id"] == "call_a"
    assert tool["content"].startswith("exit code 0")
    assert api_key not in repr(model)


def test_retries_on_500_and_429_then_succeeds(endpoint: ModelEndpoint, api_key: str) -> None:
    endpoint.answers += [
        Answer(500, b'{"error": "boom"}'),
        Answer(429, b'{"error": "slow down"}', {"Retry-After": "0"}),
        Answer(503, b"unavailable"),
        Answer(200, completion("fine"), chunked=True),
    ]
    model = model_for(endpoint, max_retries=4)
    turn = asyncio.run(model.complete(HISTORY[:2], TOOLS))
    assert turn.content == "fine"
    assert turn.tool_calls == []
    assert len(endpoint.seen) == 4
    assert model.retries == 3
    assert all(seen.body == endpoint.seen[0].body for seen in endpoint.seen)


def test_gives_up_after_bounded_retries(endpoint: ModelEndpoint, api_key: str) -> None:
    endpoint.answers += [Answer(502, b"bad gateway")] * 3
    model = model_for(endpoint, max_retries=2)
    with pytest.raises(ModelHTTPError) as info:
        asyncio.run(model.complete(HISTORY[:2], TOOLS))
    assert info.value.status == 502
    assert len(endpoint.seen) == 3


def test_401_is_a_typed_error_without_retry_or_key(endpoint: ModelEndpoint, api_key: str) -> None:
    endpoint.answers.append(Answer(401, json.dumps({"error": f"bad key {api_key}"}).encode()))
    model = model_for(endpoint)
    with pytest.raises(ModelAuthError) as info:
        asyncio.run(model.complete(HISTORY[:2], TOOLS))
    assert info.value.status == 401
    assert api_key not in str(info.value)
    assert "[redacted]" in str(info.value)
    assert len(endpoint.seen) == 1


def test_400_is_not_retried(endpoint: ModelEndpoint, api_key: str) -> None:
    endpoint.answers.append(Answer(400, b'{"error": "bad request"}'))
    with pytest.raises(ModelHTTPError) as info:
        asyncio.run(model_for(endpoint).complete(HISTORY[:2], TOOLS))
    assert info.value.status == 400 and not isinstance(info.value, ModelAuthError)
    assert len(endpoint.seen) == 1


@pytest.mark.parametrize(
    "body",
    [
        b"not json at all",
        b'{"choices": []}',
        b'{"choices": [{"message": {"tool_calls": [{"function": {}}]}}]}',
        b'{"choices": [{"message": {"content": 5}}]}',
    ],
)
def test_malformed_replies_are_typed_errors(
    endpoint: ModelEndpoint, api_key: str, body: bytes
) -> None:
    endpoint.answers.append(Answer(200, body))
    with pytest.raises(ModelReplyError):
        asyncio.run(model_for(endpoint).complete(HISTORY[:2], TOOLS))


def test_arguments_as_object_and_missing_ids_are_normalised(
    endpoint: ModelEndpoint, api_key: str
) -> None:
    calls = [{"function": {"name": "shell", "arguments": {"command": "id"}}}]
    endpoint.answers.append(Answer(200, completion(None, calls)))
    turn = asyncio.run(model_for(endpoint).complete(HISTORY[:2], TOOLS))
    (call,) = turn.tool_calls
    assert (call.id, call.name) == ("call_1", "shell")
    assert json.loads(call.arguments) == {"command": "id"}


def test_unreachable_endpoint_is_a_transport_error(api_key: str) -> None:
    server = ModelEndpoint()
    url = server.base_url
    server.close()
    model = OpenAIChatModel("m", url, KEY_VAR, max_retries=1, backoff=0.01, timeout=5.0)
    with pytest.raises(ModelTransportError):
        asyncio.run(model.complete(HISTORY[:2], TOOLS))
    assert model.requests == 2


def test_configuration_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_VAR, raising=False)
    with pytest.raises(ModelConfigError, match="unset or empty") as unset:
        OpenAIChatModel("m", "http://127.0.0.1:1/v1", KEY_VAR)
    # The name is not repeated: what was passed may be the key itself.
    assert KEY_VAR not in str(unset.value)
    pasted = "sk-" + "Zq81TfX0aBcD3eF4gH5i" * 2
    with pytest.raises(ModelConfigError) as echoed:
        OpenAIChatModel("m", "http://127.0.0.1:1/v1", pasted)
    assert pasted not in str(echoed.value)
    with pytest.raises(ModelConfigError):
        OpenAIChatModel("m", "ftp://example.com", None)
    with pytest.raises(ModelConfigError):
        OpenAIChatModel("m", "http://user:pw@example.com/v1", None)
    model = OpenAIChatModel("m", "https://example.com:8443/api/", None)
    assert model.name == "m"


def test_paced_model_waits_then_answers_with_the_wrapped_model() -> None:
    inner = ScriptedModel([{"content": "hi"}, {"content": "again"}], name="inner")

    async def timed(model: PacedModel) -> tuple[str | None, float]:
        started = asyncio.get_running_loop().time()
        turn = await model.complete([], [])
        return turn.content, asyncio.get_running_loop().time() - started

    paced = PacedModel(inner, 0.05)
    assert paced.name == "inner"
    content, waited = asyncio.run(timed(paced))
    assert content == "hi" and waited >= 0.045
    # With jitter the pause is drawn from [0, 2 x 0.05] s; the turn is still the next one.
    assert asyncio.run(timed(PacedModel(inner, 0.05, jitter=1.0)))[0] == "again"
    assert inner.position == 2
    with pytest.raises(ModelConfigError):
        PacedModel(inner, -1.0)
    with pytest.raises(ModelConfigError):
        PacedModel(inner, 1.0, jitter=2.0)
