"""The scripted model: a fixed list of turns replayed (tests, the demo, benchmarks).

:class:`ScriptedModel` replays turns given in code or read from a JSON file,
with ``{{name}}`` placeholders filled from variables; :class:`PacedModel`
wraps any model with a think time.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec

from harnessd.models import (
    AssistantTurn,
    ChatMessage,
    Model,
    ModelConfigError,
    ModelWrapper,
    ScriptExhausted,
    ToolCall,
    ToolSpec,
)

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
    :class:`~harnessd.models.ModelConfigError`. Asking for a turn past the end raises
    :class:`~harnessd.models.ScriptExhausted`. Each instance keeps its own position.
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


class PacedModel(ModelWrapper):
    """Another model, answering each turn only after ``seconds`` (a remote model's latency).

    With ``jitter`` the wait is drawn uniformly from ``seconds * [1 - jitter,
    1 + jitter]``, so many paced sessions started together drift apart as
    real ones do. For benchmarks and tests at scale, where what happens
    between turns matters as much as the turns.
    """

    def __init__(self, model: Model, seconds: float, *, jitter: float = 0.0) -> None:
        if seconds < 0 or not 0 <= jitter <= 1:
            raise ModelConfigError("seconds must be >= 0 and jitter within [0, 1]")
        super().__init__(model)
        self.seconds = seconds
        self.jitter = jitter

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """The wrapped model's turn, after the pause."""
        spread = self.seconds * self.jitter
        await asyncio.sleep(self.seconds + random.uniform(-spread, spread))
        return await super().complete(messages, tools)


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
