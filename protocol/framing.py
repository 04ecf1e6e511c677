"""Length-prefixed framing: a 4-byte big-endian body length, then the body.

Theory of operation
-------------------
:class:`FrameReader` accepts bytes in any chunking via :meth:`FrameReader.feed`
and hands out one complete body at a time via :meth:`FrameReader.next_frame`.
The caller pulls frames one by one because the rules may change between two
frames of the same read: the cap drops from the pre-authentication limit to
the negotiated one, and encryption starts, exactly at the end of the
handshake. A header that declares more than the current cap raises
:class:`~protocol.errors.FrameTooLarge` at once, before any of that body is
buffered; after every pull the buffer holds at most one partial frame, so it
never exceeds header + cap.

Bytes can also be received in place, for ``recv_into`` (asyncio's
``BufferedProtocol``): :meth:`FrameReader.get_buffer` says where the next
bytes should go and :meth:`FrameReader.buffer_updated` takes note of how
many arrived. While a large body (64 KiB or more) is being filled, that is
the rest of the body itself, so its bytes are copied by the kernel only;
otherwise it is a small scratch area. Complete frames are taken straight out
of the scratch area (one copy, into the body handed out); the bytes of an
incomplete frame at its end are copied into the reader's own buffer when
:meth:`FrameReader.next_frame` reaches them, as by :meth:`FrameReader.feed`. The scratch
area belongs to the thread, not to the reader: the caller takes frames until
:meth:`FrameReader.next_frame` returns None before any other reader on the
thread is asked for a buffer (an event loop receives on one transport at a
time; a reader given up half-way, a closed connection's, is never read
again), so a thousand idle connections hold one scratch area, not a
thousand.
A caller done with a large body hands it back with :meth:`FrameReader.recycle`
and the next body of the same size is received into it (stream chunks mostly
have one size), sparing an allocation and its zero-fill per frame.

:func:`encode_frame` writes the header in place in front of the msgpack body
(``msgspec.Encoder.encode_into`` at offset 4), so the body is never copied;
it is also the one place a sealed frame is laid out (header, then ciphertext
and tag authenticated with that header). :func:`encode_chunk` frames a Chunk
whose data is large and immutable without copying the data: a
:class:`SplicedFrame` of the encoded fields around the data as it is, which
the glue writes with one ``writelines`` (a ``writev``). Its bytes are exactly
those :func:`encode_frame` produces (the same encoder lays out every field).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Final, final

import msgspec

from protocol import limits
from protocol.errors import FrameTooLarge, LocalProtocolError
from protocol.messages import Chunk

_HEADER: Final = struct.Struct(">I")
#: msgpack's bin 32 header: the marker byte and a 4-byte big-endian length.
_BIN32: Final = struct.Struct(">BI")
#: Chunk data from this size on is spliced into its frame, not copied (bin 32 from here).
SPLICE_MIN: Final = 64 * 1024
_COMPACT_AT: Final = 256 * 1024
_PREALLOCATE_AT: Final = 64 * 1024
#: Size of the scratch area :meth:`FrameReader.get_buffer` offers between large bodies.
SCRATCH_SIZE: Final = 64 * 1024

_per_thread = threading.local()


def _thread_scratch() -> memoryview:
    """This thread's scratch area, shared by every reader used on the thread."""
    try:
        scratch: memoryview = _per_thread.scratch
    except AttributeError:
        scratch = _per_thread.scratch = memoryview(bytearray(SCRATCH_SIZE))
    return scratch


def _over_cap(length: int, max_frame: int) -> FrameTooLarge:
    """What a received header that declares more than the cap raises."""
    return FrameTooLarge(f"frame of {length} bytes exceeds the cap of {max_frame} bytes")


class FrameReader:
    """Incremental frame splitter with a cap enforced from the header alone."""

    __slots__ = (
        "_body",
        "_buf",
        "_filled",
        "_pos",
        "_scratch",
        "_scratch_end",
        "_scratch_pos",
        "_spare",
        "max_frame",
    )

    def __init__(self, max_frame: int) -> None:
        self._buf = bytearray()
        self._pos = 0
        #: Received bytes still in the scratch area: ``[_scratch_pos, _scratch_end)``.
        self._scratch_pos = 0
        self._scratch_end = 0
        self._body: bytearray | None = None
        self._filled = 0
        self._scratch: memoryview | None = None
        self._spare: bytearray | None = None
        self.max_frame = max_frame

    def recycle(self, body: bytes | bytearray) -> None:
        """Take back a large body returned by :meth:`next_frame` for reuse.

        Only for a body nothing refers to any more (its content was copied
        out); it will be overwritten by a later frame of the same size.
        """
        if type(body) is bytearray and len(body) >= _PREALLOCATE_AT:
            self._spare = body

    def get_buffer(self) -> memoryview:
        """Where the next received bytes should be written (never empty).

        The caller writes up to ``len()`` bytes into it, then calls
        :meth:`buffer_updated` with the count before anything else touches
        the reader, and before any other reader on this thread is asked for
        a buffer (the scratch area is the thread's).
        """
        body = self._body
        if body is not None and self._filled < len(body):
            return memoryview(body)[self._filled :]
        if self._scratch_end:
            self._keep_rest()  # the area is about to be written over
        scratch = self._scratch
        if scratch is None:
            # The thread's, fetched once: a reader stays on the thread that first used it.
            scratch = self._scratch = _thread_scratch()
        return scratch

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the buffer :meth:`get_buffer` returned."""
        body = self._body
        if body is not None and self._filled < len(body):
            self._filled += nbytes
            return
        assert self._scratch is not None, "buffer_updated without get_buffer"
        if body is None and self._pos == len(self._buf):
            # Nothing held back: frames are taken straight out of the scratch area.
            self._scratch_pos = 0
            self._scratch_end = nbytes
        else:
            self.feed(self._scratch[:nbytes])

    @property
    def buffered(self) -> int:
        """Bytes received but not yet handed out as frames."""
        held = len(self._buf) - self._pos + self._filled
        return held + self._scratch_end - self._scratch_pos

    def _keep_rest(self) -> None:
        """Move the bytes left in the scratch area into the reader's own buffer."""
        start, end = self._scratch_pos, self._scratch_end
        self._scratch_pos = self._scratch_end = 0
        if start < end:
            assert self._scratch is not None
            self.feed(self._scratch[start:end])

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes; call :meth:`next_frame` until it returns None."""
        if self._scratch_end:
            self._keep_rest()  # they came first
        body = self._body
        if body is not None:
            # A large body is being filled in place: copy straight into it.
            take = min(len(body) - self._filled, len(data))
            body[self._filled : self._filled + take] = data[:take] if take < len(data) else data
            self._filled += take
            if take == len(data):
                return
            data = memoryview(data)[take:]
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    def next_frame(self) -> bytes | bytearray | None:
        """The next complete body, or None when more bytes are needed.

        Raises FrameTooLarge as soon as a header over the cap is seen.
        """
        body = self._body
        if body is not None:
            if self._filled < len(body):
                return None
            self._body = None
            self._filled = 0
            return body
        end = self._scratch_end
        if end:
            scratch = self._scratch
            assert scratch is not None
            pos = self._scratch_pos
            if end - pos >= limits.HEADER_SIZE:
                (length,) = _HEADER.unpack_from(scratch, pos)
                if length > self.max_frame:
                    raise _over_cap(length, self.max_frame)
                stop = pos + limits.HEADER_SIZE + length
                if stop <= end:
                    if stop == end:
                        self._scratch_pos = self._scratch_end = 0
                    else:
                        self._scratch_pos = stop
                    return scratch[pos + limits.HEADER_SIZE : stop].tobytes()
            # The start of a frame: it waits for the rest in the reader's own buffer.
            self._keep_rest()
        buf = self._buf
        pos = self._pos
        available = len(buf) - pos
        if available < limits.HEADER_SIZE:
            if available == 0:
                # Everything was handed out (the common case): start afresh.
                if pos:
                    buf.clear()
                    self._pos = 0
            else:
                self._maybe_compact()
            return None
        (length,) = _HEADER.unpack_from(buf, pos)
        if length > self.max_frame:
            raise _over_cap(length, self.max_frame)
        start = pos + limits.HEADER_SIZE
        end = start + length
        if len(buf) < end:
            if length >= _PREALLOCATE_AT:
                self._start_body(start, length)
            else:
                self._maybe_compact()
            return None
        with memoryview(buf) as view:
            frame = bytes(view[start:end])
        if end == len(buf):
            buf.clear()
            self._pos = 0
        else:
            self._pos = end
        return frame

    def _start_body(self, start: int, length: int) -> None:
        """Give the large body that begins at ``start`` of the buffer its own bytearray.

        The whole body is allocated once and filled as bytes arrive
        (:meth:`feed` copies straight into it), instead of the buffer growing
        (and being copied) many times.
        """
        buf = self._buf
        have = len(buf) - start
        spare = self._spare
        if spare is not None and len(spare) == length:
            # Every byte of it is overwritten before it is handed out.
            body, self._spare = spare, None
        else:
            body = bytearray(length)
        body[:have] = memoryview(buf)[start:]
        self._body = body
        self._filled = have
        buf.clear()
        self._pos = 0

    def _maybe_compact(self) -> None:
        if self._pos >= _COMPACT_AT or (self._pos and self._pos * 2 >= len(self._buf)):
            del self._buf[: self._pos]
            self._pos = 0


def frame_header(length: int) -> bytes:
    """The 4-byte header for a body of ``length`` bytes."""
    return _HEADER.pack(length)


def _too_large(length: int, max_frame: int) -> LocalProtocolError:
    return LocalProtocolError(f"frame body of {length} bytes exceeds the peer's cap of {max_frame}")


def encode_frame(
    encoder: msgspec.msgpack.Encoder,
    message: object,
    max_frame: int,
    seal: Callable[[bytes, bytes], bytes] | None = None,
) -> bytes | bytearray:
    """Encode ``message`` as one frame: header written in place, body not copied.

    With ``seal`` (a :meth:`~protocol.aead.FrameSealer.seal`), the body is
    sealed and the header counts the tag. Raises LocalProtocolError when the
    body would exceed ``max_frame`` (the peer's announced cap): the caller
    must split its data.
    """
    if seal is None:
        buf = bytearray(limits.HEADER_SIZE)
        encoder.encode_into(message, buf, limits.HEADER_SIZE)
        length = len(buf) - limits.HEADER_SIZE
    else:
        body = encoder.encode(message)
        length = len(body) + limits.AEAD_TAG_SIZE
    if length > max_frame:
        raise _too_large(length, max_frame)
    if seal is None:
        _HEADER.pack_into(buf, 0, length)
        return buf
    header = _HEADER.pack(length)
    return header + seal(header, body)


@final
class SplicedFrame:
    """A frame in three parts: header and fields before the data, the data, the fields after.

    The data is the caller's own immutable object (never copied): it stays
    referenced until the transport has written it.
    """

    __slots__ = ("parts", "size")

    def __init__(self, head: bytes, data: bytes | memoryview, tail: bytes) -> None:
        self.parts = (head, data, tail)
        self.size = len(head) + len(data) + len(tail)

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def _immutable(data: object) -> bool:
    """Whether ``data`` can never change: bytes, or a read-only view of bytes."""
    if type(data) is bytes:
        return True
    return type(data) is memoryview and data.readonly and type(data.obj) is bytes


def encode_chunk(
    encoder: msgspec.msgpack.Encoder,
    chunk: Chunk,
    max_frame: int,
    seal: Callable[[bytes, bytes], bytes] | None,
    splice: bool,
) -> bytes | bytearray | SplicedFrame:
    """The frame of ``chunk``: spliced (see the module docstring) when ``splice`` allows it.

    Only plaintext frames of immutable data of at least :data:`SPLICE_MIN`
    bytes are spliced; anything else is :func:`encode_frame`'s. The fields
    are encoded around a bin 32 header standing in for the data, so their
    layout is the encoder's in both cases.
    """
    data = chunk.data
    if not splice or seal is not None or len(data) < SPLICE_MIN or not _immutable(data):
        return encode_frame(encoder, chunk, max_frame, seal)
    marker = _BIN32.pack(0xC6, len(data))
    fields = encoder.encode(msgspec.structs.replace(chunk, data=msgspec.Raw(marker)))
    # The data's header is the last one: only fields after the data (small) follow it.
    cut = fields.rindex(marker) + len(marker)
    length = len(fields) + len(data)
    if length > max_frame:
        raise _too_large(length, max_frame)
    return SplicedFrame(_HEADER.pack(length) + fields[:cut], data, fields[cut:])
