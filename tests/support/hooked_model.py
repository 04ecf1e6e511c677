"""A scripted model that does something of the test's before answering one turn."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from harnessd.models import AssistantTurn, ChatMessage, ToolSpec
from harnessd.scripted_model import ScriptedModel


class Hook:
    """A model wrapper that runs ``action`` before answering turn ``at``."""

    def __init__(
        self, inner: ScriptedModel, at: int, action: Callable[[], Awaitable[None]]
    ) -> None:
        self.inner = inner
        self.at = at
        self.action = action
        self.turn = 0

    @property
    def name(self) -> str:
        return "hooked"

    async def complete(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        self.turn += 1
        if self.turn == self.at:
            await self.action()
        return await self.inner.complete(messages, tools)
