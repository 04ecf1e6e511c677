"""Bounded output buffers: a byte ring and a head+tail capture.

Both keep memory proportional to their capacity, never to the amount of
output written through them, and both allocate lazily: a buffer with a large
capacity that receives a few bytes holds a few bytes.

* :class:`ByteRing` keeps the last ``capacity`` bytes of a stream and counts
  every byte ever written, so a reader that remembers an absolute offset can
  resume from it and learn how many bytes it lost off the ring.
* :class:`HeadTailBuffer` keeps the first half of its cap verbatim and the
  last half in a ring; what falls in between is counted in ``dropped``.
  :func:`cut` applies the same rule to a capture after the fact, with a
  smaller cap, and :func:`fit_pair` shares one byte budget between two
  captures, so that a command's collected stdout and stderr always fit the
  reply that carries them.
"""

from __future__ import annotations


class ByteRing:
    """The most recent ``capacity`` bytes of a stream, addressed by absolute offset.

    Offsets count bytes since the ring was created: byte ``i`` of the stream
    has offset ``i``. The ring holds offsets ``[start, total)``.
    """

    __slots__ = ("_buf", "_capacity", "_pos", "_total")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self._capacity = capacity
        self._buf = bytearray()
        # Once the buffer is full, _pos is the index of the oldest byte (and
        # where the next byte goes); before that the oldest byte is at 0.
        self._pos = 0
        self._total = 0

    @property
    def capacity(self) -> int:
        """The most bytes the ring retains."""
        return self._capacity

    @property
    def total(self) -> int:
        """Bytes written since creation: the offset of the next byte."""
        return self._total

    @property
    def start(self) -> int:
        """Offset of the oldest retained byte."""
        return self._total - len(self._buf)

    def __len__(self) -> int:
        return len(self._buf)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``, overwriting the oldest bytes once full."""
        view = memoryview(data).cast("B")
        size = len(view)
        if size == 0:
            return
        self._total += size
        cap = self._capacity
        if cap == 0:
            return
        buf = self._buf
        if size >= cap:
            buf[:] = view[size - cap :]
            self._pos = 0
            return
        room = cap - len(buf)
        if room > 0:
            take = min(room, size)
            buf += view[:take]
            view = view[take:]
            size -= take
            if size == 0:
                return
            self._pos = 0
        pos = self._pos
        first = min(size, cap - pos)
        buf[pos : pos + first] = view[:first]
        rest = size - first
        if rest:
            buf[:rest] = view[first:]
            self._pos = rest
        else:
            self._pos = (pos + first) % cap

    def getvalue(self) -> bytes:
        """Every retained byte, oldest first."""
        buf = self._buf
        if len(buf) < self._capacity or self._pos == 0:
            return bytes(buf)
        return bytes(buf[self._pos :]) + bytes(buf[: self._pos])

    def read_from(self, offset: int, limit: int | None = None) -> tuple[bytes, int]:
        """Bytes from absolute ``offset`` on, and how many were lost before them.

        When ``offset`` is older than :attr:`start`, reading begins at
        ``start`` and the second value says how many bytes were skipped.
        ``limit`` bounds how many bytes are returned.
        """
        if offset < 0:
            raise ValueError("offset must be >= 0")
        start = self.start
        lost = max(0, start - offset)
        begin = max(offset, start)
        end = self._total if limit is None else min(self._total, begin + max(0, limit))
        if begin >= end:
            return b"", lost
        buf = self._buf
        # Physical index of the oldest byte, then of ``begin`` and ``end``.
        oldest = self._pos if len(buf) == self._capacity else 0
        size = len(buf)
        lo = (oldest + (begin - start)) % size
        count = end - begin
        if lo + count <= size:
            return bytes(buf[lo : lo + count]), lost
        return bytes(buf[lo:]) + bytes(buf[: lo + count - size]), lost


class HeadTailBuffer:
    """Capture of a stream bounded by ``cap``: its head and its tail.

    The first ``cap // 2`` bytes are kept as they come; after that the last
    ``cap - cap // 2`` bytes are kept in a ring. When the stream is longer
    than ``cap``, :attr:`dropped` bytes between head and tail are lost and
    :meth:`getvalue` returns head followed directly by tail.
    """

    __slots__ = ("_head", "_head_cap", "_tail")

    def __init__(self, cap: int) -> None:
        if cap < 0:
            raise ValueError("cap must be >= 0")
        self._head_cap = cap // 2
        self._head = bytearray()
        self._tail = ByteRing(cap - self._head_cap)

    @property
    def total(self) -> int:
        """Bytes written, kept or not."""
        return len(self._head) + self._tail.total

    @property
    def dropped(self) -> int:
        """Bytes written but kept neither in the head nor in the tail."""
        return self._tail.total - len(self._tail)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``."""
        view = memoryview(data).cast("B")
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += view[:room]
            view = view[room:]
        if len(view):
            self._tail.write(view)

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    def getvalue(self) -> bytes:
        """Head then tail; the ``dropped`` bytes between them are gone."""
        if not len(self._tail):
            return bytes(self._head)
        return bytes(self._head) + self._tail.getvalue()

    def take(self) -> tuple[bytes, int]:
        """:meth:`getvalue` and :attr:`dropped`, releasing the buffers (the capture is emptied)."""
        value, dropped = self.getvalue(), self.dropped
        self._head = bytearray()
        self._tail = ByteRing(self._tail.capacity)
        return value, dropped


Capture = tuple[bytes, int]
"""A captured stream as a result carries it: the bytes kept, and how many were dropped."""


def cut(capture: Capture, limit: int) -> Capture:
    """``capture`` cut to at most ``limit`` bytes, by the rule of :class:`HeadTailBuffer`.

    As if the cap had been ``limit``: the first ``limit // 2`` bytes, then
    the last ``limit - limit // 2``, the bytes between them counted as
    dropped. Whenever bytes were dropped, the head is therefore the first
    half (rounded down) of what is kept, as before the cut.
    """
    value, dropped = capture
    limit = max(limit, 0)
    if len(value) <= limit:
        return capture
    keep_head = limit // 2
    keep_tail = limit - keep_head
    with memoryview(value) as view:
        kept = bytes(view[:keep_head]) + bytes(view[len(value) - keep_tail :])
    return kept, dropped + len(value) - limit


def fit_pair(first: Capture, second: Capture, budget: int) -> tuple[Capture, Capture]:
    """Cut two captures (see :func:`cut`) to ``budget`` bytes together.

    When both do not fit, each gets half the budget, and a capture smaller
    than its half leaves the rest to the other.
    """
    budget = max(budget, 0)
    one, two = len(first[0]), len(second[0])
    if one + two <= budget:
        return first, second
    half = budget // 2
    if one <= half:
        return first, cut(second, budget - one)
    if two <= budget - half:
        return cut(first, budget - two), second
    return cut(first, half), cut(second, budget - half)
