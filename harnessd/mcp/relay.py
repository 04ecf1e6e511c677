"""A running command's output on its way to MCP notifications, bounded.

The shell tool hands each chunk of output to :meth:`OutputRelay.add` as it
arrives (synchronously, from the toolbox's output callback). The relay
decodes it as UTF-8 per stream (a character split across chunks is kept
whole), queues the text, and :meth:`OutputRelay.batches` yields it to the one
task that sends notifications, each batch at most :data:`BATCH_CHARS` of one
stream. When the client reads more slowly than the command writes, at most
``cap`` characters wait; what does not fit is counted and reported as one
marker line instead of being queued, so a fast command never grows memory
here (its result still carries the head and tail of its output).
"""

from __future__ import annotations

import asyncio
import codecs
from collections import deque
from collections.abc import AsyncIterator

BATCH_CHARS = 16 * 1024
"""Most characters one notification carries."""

DEFAULT_CAP = 1024 * 1024
"""Characters that may wait for the client before more are dropped."""


class OutputRelay:
    """Output chunks in, notification-sized text batches out."""

    def __init__(self, cap: int = DEFAULT_CAP) -> None:
        self._cap = cap
        self._queue: deque[tuple[str, str]] = deque()
        self._queued = 0
        self._dropped = 0
        self._decoders: dict[str, codecs.IncrementalDecoder] = {}
        self._ready = asyncio.Event()
        self._closed = False
        self.total_bytes = 0
        """Bytes of output seen so far (the progress figure)."""

    def add(self, stream: str, data: bytes) -> None:
        """Take the next bytes of ``stream`` (never blocks)."""
        if self._closed:
            return
        self.total_bytes += len(data)
        decoder = self._decoders.get(stream)
        if decoder is None:
            decoder = self._decoders[stream] = codecs.getincrementaldecoder("utf-8")("replace")
        self._push(stream, decoder.decode(data))

    def close(self) -> None:
        """No more output: flush what the decoders hold and end :meth:`batches`."""
        if self._closed:
            return
        for stream, decoder in self._decoders.items():
            self._push(stream, decoder.decode(b"", final=True))
        if self._dropped:
            self._enqueue("stderr", self._drop_marker())
        self._closed = True
        self._ready.set()

    def _push(self, stream: str, text: str) -> None:
        if self._queued + len(text) > self._cap:
            self._dropped += len(text)
            return
        if self._dropped:
            # Where the dropped text was: said before what came after it.
            self._enqueue(stream, self._drop_marker())
        self._enqueue(stream, text)

    def _drop_marker(self) -> str:
        dropped, self._dropped = self._dropped, 0
        return f"\n[... {dropped} characters of output not streamed ...]\n"

    def _enqueue(self, stream: str, text: str) -> None:
        if text:
            self._queue.append((stream, text))
            self._queued += len(text)
            self._ready.set()

    async def batches(self) -> AsyncIterator[tuple[str, str]]:
        """``(stream, text)`` batches in arrival order until :meth:`close` and the queue is empty."""
        while True:
            if self._queue:
                yield self._take()
            elif self._closed:
                return
            else:
                self._ready.clear()
                await self._ready.wait()

    def _take(self) -> tuple[str, str]:
        stream, text = self._queue.popleft()
        parts = [text]
        size = len(text)
        while self._queue and self._queue[0][0] == stream and size < BATCH_CHARS:
            more = self._queue.popleft()[1]
            parts.append(more)
            size += len(more)
        joined = "".join(parts)
        if len(joined) > BATCH_CHARS:
            self._queue.appendleft((stream, joined[BATCH_CHARS:]))
            joined = joined[:BATCH_CHARS]
        self._queued -= len(joined)
        return stream, joined
