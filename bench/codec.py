"""Cost of the wire codec: encode + frame + read + decode, per message and per byte.

Run: ``python -m bench.codec [--quick] [--seconds S]``.

Each sample takes one message through the whole path a frame travels:
the sender encodes it and writes the 4-byte header (and, with a cipher,
seals the body), the receiver feeds the bytes to a
:class:`~protocol.framing.FrameReader`, pulls the frame, opens it and
decodes it back into a message. Workloads:

* ``call``: a Call with small params (a ``files.read`` request);
* ``reply``: a Reply with a small result map;
* ``chunk 64 B``: a Chunk carrying 64 bytes;
* ``chunk 1 MiB``: a Chunk carrying 1 MiB (reported in MB/s of payload).

Modes: ``msgpack`` (cipher ``none``), ``aes-256-gcm`` and
``chacha20-poly1305`` (sealed as on the wire), against a baseline measured in
the same run: the same content as a JSON object behind a 4-byte length
prefix, bytes carried as base64 (JSON has no byte strings), read back with
``json.loads``. Every path is checked to round-trip before it is timed.
The table gives each cell's speed and its ratio to the baseline (above 1:
faster than JSON).
"""

from __future__ import annotations

import argparse
import base64
import json
import platform
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from protocol import limits
from protocol.aead import FrameOpener, FrameSealer
from protocol.codec import ENCODER, decode_message, to_raw
from protocol.framing import FrameReader, encode_frame, frame_header
from protocol.messages import Call, Chunk, Message, Reply

BASELINE = "json"
MODES: tuple[str, ...] = (BASELINE, "msgpack", limits.CIPHER_AESGCM, limits.CIPHER_CHACHA20)
MIB = 1024 * 1024
_HEADER = struct.Struct(">I")
_KEY = bytes(range(32))


@dataclass(frozen=True, slots=True)
class Workload:
    """One message shape, as a protocol message and as its JSON twin."""

    name: str
    message: Message
    as_json: dict[str, Any]
    payload_bytes: int = 0

    @property
    def throughput(self) -> bool:
        """Report MB/s of payload instead of microseconds per message."""
        return self.payload_bytes >= MIB


@dataclass(slots=True)
class Row:
    """One workload's result in every mode."""

    workload: str
    unit: str
    values: dict[str, float] = field(default_factory=dict)

    def ratio(self, mode: str) -> float:
        """Speed of ``mode`` relative to the JSON baseline (above 1: faster)."""
        base = self.values[BASELINE]
        value = self.values[mode]
        if self.unit == "MB/s":
            return value / base
        return base / value


def workloads() -> list[Workload]:
    """The four measured message shapes."""
    params = {"path": "/work/src/project/main.py", "offset": 0, "length": 65536}
    result = {"size": 4096, "sha256": "ab" * 32, "eof": True, "streamed": False}
    small = bytes(range(64))
    large = bytes(i % 251 for i in range(MIB))

    def chunk_json(data: bytes) -> dict[str, Any]:
        return {
            "t": "chunk",
            "id": 7,
            "stream": "stdout",
            "seq": 3,
            "data": base64.b64encode(data).decode(),
        }

    return [
        Workload(
            "call",
            Call(id=7, method="files.read", params=to_raw(params)),
            {"t": "call", "id": 7, "method": "files.read", "params": params},
        ),
        Workload(
            "reply", Reply(id=7, result=to_raw(result)), {"t": "reply", "id": 7, "result": result}
        ),
        Workload(
            "chunk 64 B",
            Chunk(id=7, stream="stdout", seq=3, data=small),
            chunk_json(small),
            payload_bytes=len(small),
        ),
        Workload(
            "chunk 1 MiB",
            Chunk(id=7, stream="stdout", seq=3, data=large),
            chunk_json(large),
            payload_bytes=len(large),
        ),
    ]


def _json_path(workload: Workload) -> Callable[[], object]:
    obj = workload.as_json
    cap = limits.DEFAULT_MAX_FRAME

    def once() -> object:
        body = json.dumps(obj, separators=(",", ":")).encode()
        frame = _HEADER.pack(len(body)) + body
        (length,) = _HEADER.unpack_from(frame)
        if length > cap:
            raise ValueError("frame over the cap")
        decoded = json.loads(frame[4 : 4 + length])
        if "data" in decoded:
            decoded["data"] = base64.b64decode(decoded["data"])
        return decoded

    return once


def _msgpack_path(workload: Workload) -> Callable[[], object]:
    message = workload.message
    reader = FrameReader(limits.DEFAULT_MAX_FRAME)

    def once() -> object:
        reader.feed(encode_frame(ENCODER, message, limits.DEFAULT_MAX_FRAME))
        body = reader.next_frame()
        assert body is not None
        return decode_message(body)

    return once


def _sealed_path(workload: Workload, cipher: str) -> Callable[[], object]:
    message = workload.message
    sealer = FrameSealer(cipher, _KEY)
    opener = FrameOpener(cipher, _KEY)
    reader = FrameReader(limits.DEFAULT_MAX_FRAME)

    def once() -> object:
        body = ENCODER.encode(message)
        header = frame_header(len(body) + limits.AEAD_TAG_SIZE)
        reader.feed(header + sealer.seal(header, body))
        sealed = reader.next_frame()
        assert sealed is not None
        return decode_message(opener.open(frame_header(len(sealed)), sealed))

    return once


def make_path(workload: Workload, mode: str) -> Callable[[], object]:
    """The round trip of ``workload`` in ``mode``, checked once before it is returned."""
    if mode == BASELINE:
        path = _json_path(workload)
        expected: object = dict(workload.as_json)
        if isinstance(workload.message, Chunk):
            assert isinstance(expected, dict)
            expected["data"] = workload.message.data
    else:
        path = _msgpack_path(workload) if mode == "msgpack" else _sealed_path(workload, mode)
        expected = workload.message
    got = path()
    if got != expected:
        raise AssertionError(f"{mode} does not round-trip {workload.name}")
    return path


def measure(path: Callable[[], object], seconds: float) -> float:
    """Seconds per call of ``path``, timed over batches for about ``seconds``."""
    batch = 1
    while True:
        start = time.perf_counter()
        for _ in range(batch):
            path()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds / 8 or batch >= 1 << 20:
            break
        batch *= 2
    total = elapsed
    count = batch
    while total < seconds:
        start = time.perf_counter()
        for _ in range(batch):
            path()
        total += time.perf_counter() - start
        count += batch
    return total / count


def run(seconds: float) -> list[Row]:
    """Measure every workload in every mode, spending about ``seconds`` per cell."""
    rows: list[Row] = []
    for workload in workloads():
        unit = "MB/s" if workload.throughput else "µs/msg"
        row = Row(workload.name, unit)
        for mode in MODES:
            per_call = measure(make_path(workload, mode), seconds)
            if workload.throughput:
                row.values[mode] = workload.payload_bytes / per_call / 1e6
            else:
                row.values[mode] = per_call * 1e6
        rows.append(row)
    return rows


def render(rows: Sequence[Row]) -> str:
    """A markdown table: each cell is the speed and its ratio to the JSON baseline."""
    head = ["workload", "unit", f"{BASELINE} + length prefix", *MODES[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.workload, row.unit, f"{row.values[BASELINE]:.2f}"]
        cells += [f"{row.values[m]:.2f} ({row.ratio(m):.1f}x)" for m in MODES[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _versions() -> str:
    parts = [f"Python {platform.python_version()}"]
    for dist in ("msgspec", "cryptography"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} ?")
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """Run the benchmark, print the table, and return its rows."""
    parser = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="about two seconds in all (a smoke run)"
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="time spent per cell (default 0.5)"
    )
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (0.06 if args.quick else 0.5)
    rows = run(seconds)
    sys.stdout.write(f"codec round trip ({_versions()}; ratio = speed vs JSON)\n\n")
    sys.stdout.write(render(rows) + "\n")
    return rows


if __name__ == "__main__":
    main()
