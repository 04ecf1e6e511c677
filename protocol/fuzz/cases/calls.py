"""Cases of section 8 (calls, request ids)."""

from __future__ import annotations

import os

from protocol.fuzz import script as s
from protocol.fuzz.cases import (
    MIN_FRAME,
    MIN_WINDOW,
    SLOW_METHOD,
    SLOW_PARAMS,
    Case,
    Group,
    aborts,
    alive,
    bin_,
    call,
    code,
    expect,
    post,
)

_RID = bytes(range(0xA0, 0xB0))
_NOOP = ("server.noop",)
_ECHO = ("server.echo",)


def cases() -> list[Case]:
    """The cases of section 8."""
    g = Group(8)
    g.add(
        "8",
        "a call answered",
        "a server.noop Call",
        "exactly one Reply, result nil",
        post(
            s.Send(body=call(1, "server.noop")),
            expect(s.ReplyWant(id=1, result=None, check_result=True)),
        ),
        methods=_NOOP,
    )
    g.add(
        "8",
        "a duplicate call id in flight",
        f"a {SLOW_METHOD} Call that stays in flight, then another Call with the same id",
        "Abort DUPLICATE_CALL_ID (12)",
        post(
            s.Send(body=call(1, SLOW_METHOD, SLOW_PARAMS)),
            alive(),
            s.Send(body=call(1, "server.noop")),
            aborts("DUPLICATE_CALL_ID"),
        ),
        methods=(SLOW_METHOD,),
    )
    g.add(
        "8",
        "an id reused after its answer",
        "a server.noop Call answered, then another Call with the same id",
        "ids of finished calls may be reused: a second Reply",
        post(
            s.Send(body=call(5, "server.noop")),
            expect(s.ReplyWant(id=5)),
            s.Send(body=call(5, "server.noop")),
            expect(s.ReplyWant(id=5)),
        ),
        methods=_NOOP,
    )
    g.add(
        "8",
        "an unknown method",
        'a Call of "no.such.method"',
        "Error UNKNOWN_METHOD (100), and the connection lives",
        post(
            s.Send(body=call(1, "no.such.method")), expect(s.ErrorWant(id=1, codes=[100])), alive()
        ),
    )
    g.add(
        "8",
        "a call cancelled",
        f"a {SLOW_METHOD} Call that stays in flight, then a Cancel of it",
        "the call is still answered exactly once: Error CANCELLED (102)",
        post(
            s.Send(body=call(1, SLOW_METHOD, SLOW_PARAMS)),
            alive(),
            s.Send(body={"t": "cancel", "id": 1}),
            expect(s.ErrorWant(id=1, codes=[code("CANCELLED")])),
            alive(),
        ),
        methods=(SLOW_METHOD,),
    )
    g.add(
        "8",
        "a cancel of an unknown call",
        "a Cancel of id 77, which was never sent",
        "ignored: nothing is sent for it, the connection lives",
        post(s.Send(body={"t": "cancel", "id": 77}), alive()),
    )
    g.add(
        "8",
        "a cancel after the answer",
        "a server.noop Call answered, then a Cancel of it",
        "ignored: the connection lives",
        post(
            s.Send(body=call(1, "server.noop")),
            expect(s.ReplyWant(id=1)),
            s.Send(body={"t": "cancel", "id": 1}),
            alive(),
        ),
        methods=_NOOP,
    )
    ids = [9, 3, 1_000_000, 7, 2**40, 12, 4, 99, 8, 2**62]
    g.add(
        "8",
        "pipelined calls",
        "ten server.echo Calls with scattered ids in one go",
        "exactly one answer each, each with its own data",
        post(
            *(s.Send(body=call(i, "server.echo", {"data": bin_(str(i).encode())})) for i in ids),
            *(
                expect(s.ReplyWant(id=i, result=bin_(str(i).encode()), check_result=True))
                for i in ids
            ),
        ),
        methods=_ECHO,
    )
    budget = (
        MIN_FRAME - 67
    )  # the result budget at the smallest cap: max_frame - 64, less the bin header
    g.add(
        "8",
        "a result at the smallest frame cap",
        f"with hello.max_frame = {MIN_FRAME}: server.echo of {budget} bytes",
        "answers fit the client's cap: a Reply of those bytes within 4096",
        post(
            s.Send(body=call(1, "server.echo", {"data": {"$fill": budget}})),
            expect(s.ReplyWant(id=1, result={"$fill": budget}, check_result=True)),
            max_frame=MIN_FRAME,
            window=MIN_WINDOW,
        ),
        methods=_ECHO,
    )
    g.add(
        "8",
        "a result over the client's frame cap",
        f"with hello.max_frame = {MIN_FRAME}: server.echo of {MIN_FRAME} bytes",
        "Error TOO_LARGE (204) within the cap (never a larger frame), and the connection lives",
        post(
            s.Send(body=call(1, "server.echo", {"data": {"$fill": MIN_FRAME}})),
            expect(s.ErrorWant(id=1, codes=[code("TOO_LARGE")])),
            alive(),
            max_frame=MIN_FRAME,
            window=MIN_WINDOW,
        ),
        methods=_ECHO,
    )
    g.add(
        "8",
        "collected output at the smallest frame cap",
        f"with hello.max_frame = window = {MIN_FRAME}: shell.run of head -c 10000 /dev/zero, "
        "output collected",
        "the result is cut to fit (head and tail kept, *_dropped counts) within the cap",
        post(
            s.Send(body=call(1, "shell.run", {"command": "head -c 10000 /dev/zero"})),
            expect(s.ReplyWant(id=1), timeout=30.0),
            alive(),
            max_frame=MIN_FRAME,
            window=MIN_WINDOW,
        ),
        methods=("shell.run",),
        area="small frame cap",
    )
    g.add(
        "8.1",
        "a request id",
        "a server.echo Call carrying a request id",
        "a Reply (a server that does not know rid ignores it)",
        post(
            s.Send(body=call(1, "server.echo", {"data": bin_(b"r")}, rid=bin_(os.urandom(16)))),
            expect(s.ReplyWant(id=1, result=bin_(b"r"), check_result=True)),
        ),
        methods=_ECHO,
    )
    g.add(
        "8.1",
        "at most once per request id",
        "a shell.run Call printing its shell's pid, with a request id; then a second Call "
        "with another call id and the same request id",
        "the second is not run again: it is answered like an attach, with the same result",
        _at_most_once(),
        methods=("shell.run", "request.attach"),
    )
    g.add(
        "8.1",
        "attach of an unknown request id",
        "request.attach of a request id never sent, naming this connection's server nonce",
        'Error REQUEST_NOT_KNOWN (800), data.reason "unknown", data.rid its hex',
        post(
            s.Send(body=call(1, "request.attach", {"rid": bin_(_RID)})),
            expect(s.ErrorWant(id=1, codes=[800], data={"reason": "unknown", "rid": _RID.hex()})),
            alive(),
        ),
        methods=("request.attach",),
    )
    g.add(
        "8.1",
        "a call that outlives its connection",
        "a shell.run Call (sleep 0.5, then echo) with a request id; the connection is reset; "
        "a new connection attaches to the request id",
        "the call ran on unbound: the attach is answered with its result, output included",
        _outlives(),
        methods=("shell.run", "request.attach"),
        slow=True,
    )
    g.add(
        "8",
        "too many calls in flight",
        "1100 calls that stay in flight (execd's bound is 1024 per connection)",
        "a server MAY bound them: calls beyond the bound get Error TOO_MANY_CALLS (103) "
        "and the connection lives; every call is answered once cancelled",
        _too_many(),
        methods=(SLOW_METHOD,),
        area="call bounds",
    )
    return g.cases


def _at_most_once() -> s.Script:
    rid = bin_(os.urandom(16))
    params = {"command": "echo $$"}
    return post(
        s.Send(body=call(1, "shell.run", params, rid=rid)),
        expect(s.ReplyWant(id=1), timeout=30.0),
        s.Send(body=call(2, "shell.run", params, rid=rid)),
        expect(s.ReplyWant(id=2, same_as=1), timeout=30.0),
        s.Send(body=call(3, "request.attach", {"rid": rid})),
        expect(s.ReplyWant(id=3, same_as=1), timeout=30.0),
    )


def _outlives() -> s.Script:
    rid = bin_(os.urandom(16))
    params = {"command": "sleep 0.5; echo outlived"}
    return s.script(
        s.Connect(),
        s.Handshake(),
        s.Send(body=call(1, "shell.run", params, rid=rid)),
        s.Sleep(seconds=0.1),
        s.Close(reset=True),
        s.Connect(conn=1),
        s.Handshake(conn=1),
        s.Send(conn=1, body=call(1, "request.attach", {"rid": rid})),
        expect(s.ReplyWant(id=1), conn=1, timeout=30.0),
    )


def _too_many() -> s.Script:
    count = 1100
    steps: list[s.AnyStep] = [
        s.Send(body=call(i, SLOW_METHOD, SLOW_PARAMS)) for i in range(1, count + 1)
    ]
    steps.append(alive())
    steps.extend(s.Send(body={"t": "cancel", "id": i}) for i in range(1, count + 1))
    steps.extend(expect(s.AnswerWant(id=i, codes=[102, 103])) for i in range(1, count + 1))
    steps.append(alive())
    return post(*steps)
