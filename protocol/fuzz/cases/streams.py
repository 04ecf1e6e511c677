"""Cases of sections 9 (streams and credit), 10 (events), 11 (ping), 12 (abort) and 13 (codes)."""

from __future__ import annotations

from protocol.fuzz import script as s
from protocol.fuzz.cases import (
    MAX_WINDOW,
    MIN_WINDOW,
    SLOW_METHOD,
    SLOW_PARAMS,
    Case,
    Group,
    aborts,
    alive,
    call,
    code,
    expect,
    post,
)

_SLOW = (SLOW_METHOD,)
_CAT = {"argv": ["cat"], "stdin_stream": True, "stream": True}


def _slow_then(*steps: s.AnyStep, **handshake: object) -> s.Script:
    """A call that stays in flight (id 1), then ``steps``."""
    return post(s.Send(body=call(1, SLOW_METHOD, SLOW_PARAMS)), alive(), *steps, **handshake)  # type: ignore[arg-type]


def _chunk(stream: str, seq: int, size: int = 0, end: bool = False, call_id: int = 1) -> s.Send:
    body = {"t": "chunk", "id": call_id, "stream": stream, "seq": seq, "data": {"$fill": size}}
    if end:
        body["end"] = True
    return s.Send(body=body)


def _streams() -> Group:
    g = Group(9)
    g.add(
        "9",
        "a chunk out of sequence",
        "with a call in flight, a first chunk whose seq is 1",
        "Abort INVALID_MESSAGE (5)",
        _slow_then(_chunk("x", 1, 10), aborts("INVALID_MESSAGE")),
        methods=_SLOW,
    )
    g.add(
        "9",
        "a chunk after the end",
        "with a call in flight, a chunk with end, then another chunk on that stream",
        "Abort FLOW_CONTROL_VIOLATION (10)",
        _slow_then(
            _chunk("x", 0, 10, end=True),
            alive(),
            _chunk("x", 1, 10),
            aborts("FLOW_CONTROL_VIOLATION"),
        ),
        methods=_SLOW,
    )
    g.add(
        "9",
        "a chunk beyond the credit",
        "with a call in flight that reads no stream, the server's window + 1 bytes on one stream",
        "Abort FLOW_CONTROL_VIOLATION (10)",
        _slow_then(
            s.Upload(id=1, stream="x", total="server_window+1", end=False, respect_credit=False),
            aborts("FLOW_CONTROL_VIOLATION", timeout=30.0),
        ),
        methods=_SLOW,
    )
    g.add(
        "9",
        "a stream's whole window",
        "with a call in flight that reads no stream, exactly the server's window on one stream",
        "within the credit: the connection lives",
        _slow_then(
            s.Upload(id=1, stream="x", total="server_window", end=False, respect_credit=False),
            expect(s.AliveWant(), timeout=30.0),
        ),
        methods=_SLOW,
    )
    names = [f"s{i}" for i in range(16)]
    g.add(
        "9",
        "too many stream names",
        "with a call in flight, empty chunks on 16 stream names (accepted), then on a 17th",
        "Abort INVALID_MESSAGE (5) for the 17th",
        _slow_then(
            *(_chunk(n, 0) for n in names), alive(), _chunk("s16", 0), aborts("INVALID_MESSAGE")
        ),
        methods=_SLOW,
    )
    g.add(
        "9",
        "a chunk for a call never made",
        "a chunk for call 4242",
        "discarded silently: the connection lives",
        post(_chunk("x", 0, 100, call_id=4242), alive()),
    )
    g.add(
        "9",
        "a chunk after the call's answer",
        "a server.noop Call answered, then a chunk for it",
        "discarded silently (the race with a final answer): the connection lives",
        post(
            s.Send(body=call(1, "server.noop")),
            expect(s.ReplyWant(id=1)),
            _chunk("x", 0, 100),
            alive(),
        ),
        methods=("server.noop",),
    )
    g.add(
        "9",
        "credit for a call never made",
        "a Credit for call 4242",
        "discarded silently: the connection lives",
        post(s.Send(body={"t": "credit", "id": 4242, "stream": "stdout", "bytes": 100}), alive()),
    )
    g.add(
        "9",
        "credit for a stream not sent on",
        "with a call in flight, a Credit of the largest window for a stream it never sent on",
        "a sender ignores it: the connection lives",
        _slow_then(s.Grant(id=1, stream="stdout", bytes=MAX_WINDOW), alive()),
        methods=_SLOW,
    )
    g.add(
        "9",
        "credit above the largest window",
        "shell.run streaming output; once its first bytes arrived, a Credit raising the "
        f"server's credit above {MAX_WINDOW}",
        "Abort FLOW_CONTROL_VIOLATION (10) at the sender",
        post(
            s.Send(body=call(1, "shell.run", {"command": "echo a; sleep 10", "stream": True})),
            expect(s.ChunksWant(id=1, stream="stdout", bytes=2), timeout=30.0),
            s.Grant(id=1, stream="stdout", bytes=MAX_WINDOW),
            aborts("FLOW_CONTROL_VIOLATION"),
        ),
        methods=("shell.run",),
    )
    g.add(
        "9",
        "the server keeps to the client's window",
        f"hello.window = {MIN_WINDOW}, no credit granted; shell.run streaming 20000 bytes",
        f"{MIN_WINDOW} bytes, then nothing until credit is granted; then the rest, the "
        "stream's end, then the Reply",
        post(
            s.Configure(auto_grant=False),
            s.Send(
                body=call(
                    1, "shell.run", {"argv": ["head", "-c", "20000", "/dev/zero"], "stream": True}
                )
            ),
            expect(s.ChunksWant(id=1, stream="stdout", bytes=MIN_WINDOW), timeout=30.0),
            expect(s.NoChunksWant(id=1, stream="stdout", seconds=0.5)),
            s.Grant(id=1, stream="stdout", bytes=20000),
            expect(s.ChunksWant(id=1, stream="stdout", bytes=20000, end=True), timeout=30.0),
            expect(s.ReplyWant(id=1), timeout=30.0),
            window=MIN_WINDOW,
        ),
        methods=("shell.run",),
    )
    g.add(
        "9",
        "an upload beyond one window, echoed",
        "shell.run of cat with stdin_stream and stream; the server's window + 100000 bytes "
        "uploaded within the credit it grants, downloads granted as read",
        "every byte comes back in order, the stream ends, then the Reply",
        post(
            s.Send(body=call(1, "shell.run", _CAT)),
            s.Upload(id=1, stream="stdin", total="server_window+100000"),
            expect(
                s.ChunksWant(id=1, stream="stdout", bytes="server_window+100000", end=True),
                timeout=60.0,
            ),
            expect(s.ReplyWant(id=1), timeout=30.0),
        ),
        methods=("shell.run",),
    )
    g.add(
        "9",
        "a bare end costs nothing",
        "shell.run of cat; the server's whole window uploaded without waiting, then an "
        "empty chunk with end",
        "an empty chunk is always allowed: the data comes back and the call ends",
        post(
            s.Send(body=call(1, "shell.run", _CAT)),
            s.Upload(id=1, stream="stdin", total="server_window", end=False, respect_credit=False),
            s.Upload(id=1, stream="stdin", total=0, end=True, respect_credit=False),
            expect(
                s.ChunksWant(id=1, stream="stdout", bytes="server_window", end=True), timeout=60.0
            ),
            expect(s.ReplyWant(id=1), timeout=30.0),
        ),
        methods=("shell.run",),
    )
    return g


def _events() -> Group:
    g = Group(10)
    g.add(
        "10",
        "an event of a subscription",
        'watch.subscribe of ".", then watch.unsubscribe of its watch_id',
        'an Event "ended" with topic = watch_id, then the Reply',
        post(
            s.Send(body=call(1, "watch.subscribe", {"path": "."})),
            expect(s.ReplyWant(id=1, capture=["watch_id"])),
            s.Send(body=call(2, "watch.unsubscribe", {"watch_id": {"$int": "watch_id"}})),
            expect(s.EventWant(topic="watch_id", name="ended")),
            expect(s.ReplyWant(id=2)),
        ),
        methods=("watch.subscribe", "watch.unsubscribe"),
    )
    return g


def _pings() -> Group:
    g = Group(11)
    g.add(
        "11",
        "a ping",
        "a Ping with seq 0",
        "a Pong with seq 0",
        post(s.Send(body={"t": "ping", "seq": 0}), expect(s.PongWant(seq=0))),
    )
    g.add(
        "11",
        "an unsolicited pong",
        "a Pong matching no Ping",
        "not an error: the connection lives",
        post(s.Send(body={"t": "pong", "seq": 12345}), alive()),
    )
    g.add(
        "11",
        "pings among calls",
        "a server.noop Call, a Ping, a server.noop Call",
        "both Replies and the Pong",
        post(
            s.Send(body=call(1, "server.noop")),
            s.Send(body={"t": "ping", "seq": 9}),
            s.Send(body=call(2, "server.noop")),
            expect(s.PongWant(seq=9)),
            expect(s.ReplyWant(id=1)),
            expect(s.ReplyWant(id=2)),
        ),
        methods=("server.noop",),
    )
    return g


def _aborts() -> Group:
    g = Group(12)
    g.add(
        "12",
        "an abort code the server does not know",
        "after the handshake, an Abort with code 77",
        "the server closes and never answers an Abort",
        post(
            s.Send(body={"t": "abort", "code": 77, "message": "?"}),
            expect(s.ClosedWant(quiet=True)),
        ),
    )
    g.add(
        "12",
        "bytes after an Abort",
        "an Abort, then a Ping and garbage in the same write",
        "everything after the Abort is ignored: the server closes without answering",
        post(
            s.Send(body={"t": "abort", "code": 15}),
            s.Send(body={"t": "ping", "seq": 1}),
            s.SendBytes(hex="deadbeef"),
            expect(s.ClosedWant(quiet=True)),
        ),
    )
    g.add(
        "12",
        "a reset in the middle of a call",
        "shell.run of sleep 30, then a TCP reset",
        "the call's work is cancelled (checked: no process of it is left)",
        post(
            s.Send(body=call(1, "shell.run", {"argv": ["sleep", "30"]})),
            s.Sleep(seconds=0.2),
            s.Close(reset=True),
        ),
        methods=("shell.run",),
    )
    return g


def _codes() -> Group:
    g = Group(13)
    g.add(
        "13",
        "call-level errors keep the connection",
        "an unknown method, bad params and files.stat of a missing path, in a row",
        "Errors 100, 101 and NOT_FOUND (200, data errno and path), then the connection lives",
        post(
            s.Send(body=call(1, "no.such.method")),
            s.Send(body=call(2, "server.echo", {"data": "not bytes"})),
            s.Send(body=call(3, "files.stat", {"path": "/nonexistent/splitexec-fuzz"})),
            expect(s.ErrorWant(id=1, codes=[100])),
            expect(s.ErrorWant(id=2, codes=[101])),
            expect(
                s.ErrorWant(
                    id=3,
                    codes=[code("NOT_FOUND")],
                    data={"errno": "ENOENT", "path": "/nonexistent/splitexec-fuzz"},
                )
            ),
            alive(),
        ),
        methods=("server.echo", "files.stat"),
    )
    return g


def cases() -> list[Case]:
    """The cases of sections 9 to 13."""
    groups = (_streams(), _events(), _pings(), _aborts(), _codes())
    return [case for group in groups for case in group.cases]
