"""Cases of sections 2 (transport and framing) and 3 (message encoding)."""

from __future__ import annotations

import msgspec

from protocol.fuzz import script as s
from protocol.fuzz.cases import (
    PREAUTH,
    Case,
    Group,
    aborts,
    alive,
    bin_,
    call,
    expect,
    frame_hex,
    hello,
    post,
    pre,
)
from protocol.fuzz.spec import nesting_bound

_HELLO = msgspec.msgpack.encode(
    {k: bytes.fromhex(v["$bin"]) if isinstance(v, dict) else v for k, v in hello().items()}
)


def _framing() -> Group:
    g = Group(2)
    g.add(
        "2",
        "a Hello written one byte at a time",
        "a valid Hello frame in single-byte writes",
        "the receiver reassembles frames from any chunking: a Challenge",
        pre(s.SendBytes(hex=frame_hex(_HELLO), split=1), expect(s.ChallengeWant())),
    )
    g.add(
        "2",
        "a header over the pre-authentication cap",
        f"only a header announcing {PREAUTH + 1} bytes (PREAUTH_MAX_FRAME + 1), no body",
        "the cap is checked from the header alone: Abort FRAME_TOO_LARGE (2) at once",
        pre(s.SendBytes(hex=(PREAUTH + 1).to_bytes(4, "big").hex()), aborts("FRAME_TOO_LARGE")),
    )
    g.add(
        "2",
        "the largest header",
        "only a header announcing 2^32 - 1 bytes",
        "Abort FRAME_TOO_LARGE (2)",
        pre(s.SendBytes(hex="ffffffff"), aborts("FRAME_TOO_LARGE")),
    )
    g.add(
        "2",
        "a Hello of exactly the pre-authentication cap",
        f"a Hello padded with an unknown field to a body of exactly {PREAUTH} bytes",
        "a frame at the cap is accepted: a Challenge",
        pre(s.Send(body=hello(), pad_to=PREAUTH), expect(s.ChallengeWant())),
    )
    g.add(
        "2",
        "an empty body",
        "a frame of length 0",
        "a body of length 0 is not a message: Abort MALFORMED_MESSAGE (3)",
        pre(s.SendBytes(hex="00000000"), aborts("MALFORMED_MESSAGE")),
    )
    g.add(
        "2",
        "a header over the negotiated cap",
        "after the handshake, only a header announcing the server's max_frame + 1",
        "Abort FRAME_TOO_LARGE (2)",
        post(s.SendHeader(length="server_max_frame+1"), aborts("FRAME_TOO_LARGE")),
    )
    g.add(
        "2",
        "the cap switches after the Auth",
        f"after the handshake, a Ping padded to {PREAUTH + 1000} bytes",
        "frames after the Auth are held to the server's own max_frame: a Pong",
        post(
            s.Send(body={"t": "ping", "seq": 7}, pad_to=PREAUTH + 1000), expect(s.PongWant(seq=7))
        ),
    )
    g.add(
        "2",
        "a frame of exactly the negotiated cap",
        "after the handshake, a Ping padded to exactly the server's max_frame",
        "a frame at the cap is accepted: a Pong",
        post(
            s.Send(body={"t": "ping", "seq": 8}, pad_to="server_max_frame"),
            expect(s.PongWant(seq=8), timeout=30.0),
        ),
    )
    g.add(
        "2",
        "many frames in one write",
        "after the handshake, 20 Pings in one write",
        "every frame of a read is taken: 20 Pongs",
        post(
            s.SendBytes(hex=_pings(100, 20)),
            *(expect(s.PongWant(seq=100 + i)) for i in range(20)),
        ),
    )
    g.add(
        "2",
        "a frame cut off by the client's close",
        "half a Hello, then a close",
        "nothing: the server forgets the connection (checked: it still serves, leaks nothing)",
        pre(s.SendBytes(hex=frame_hex(_HELLO)[:60]), s.Close()),
    )
    return g


def _pings(first: int, count: int) -> str:
    frames = b""
    for seq in range(first, first + count):
        body = msgspec.msgpack.encode({"t": "ping", "seq": seq})
        frames += len(body).to_bytes(4, "big") + body
    return frames.hex()


def _encoding() -> Group:
    g = Group(3)
    g.add(
        "3",
        "a truncated body",
        "a Hello body with its last byte missing",
        "Abort MALFORMED_MESSAGE (3)",
        pre(s.SendBytes(hex=frame_hex(_HELLO[:-1])), aborts("MALFORMED_MESSAGE")),
    )
    g.add(
        "3",
        "an invalid msgpack byte",
        "a body of the never-used byte 0xc1",
        "Abort MALFORMED_MESSAGE (3)",
        pre(s.SendBytes(hex=frame_hex(b"\xc1")), aborts("MALFORMED_MESSAGE")),
    )
    g.add(
        "3",
        "trailing bytes",
        "a valid Hello body followed by one more byte",
        "the body must be exactly one value: Abort MALFORMED_MESSAGE (3)",
        pre(s.SendBytes(hex=frame_hex(_HELLO + b"\xc0")), aborts("MALFORMED_MESSAGE")),
    )
    g.add(
        "3",
        "a body that is not a map",
        'an array ["hello"]',
        "Abort INVALID_MESSAGE (5)",
        pre(s.Send(body=["hello"]), aborts("INVALID_MESSAGE")),
    )
    g.add(
        "3",
        "a map without a tag",
        'a Hello without its "t"',
        "Abort INVALID_MESSAGE (5)",
        pre(s.Send(body=hello(t=None)), aborts("INVALID_MESSAGE")),
    )
    g.add(
        "3",
        "a tag that is not a string",
        '{"t": 1}',
        "Abort INVALID_MESSAGE (5)",
        pre(s.Send(body={"t": 1}), aborts("INVALID_MESSAGE")),
    )
    g.add(
        "3",
        "an unknown tag before the handshake",
        '{"t": "hullo"} as the first frame',
        "unknown tags are fatal: Abort UNKNOWN_MESSAGE_TYPE (4)",
        pre(s.Send(body={"t": "hullo", "versions": [1]}), aborts("UNKNOWN_MESSAGE_TYPE")),
    )
    g.add(
        "3",
        "an unknown tag after the handshake",
        '{"t": "stream-reset", "id": 1}',
        "Abort UNKNOWN_MESSAGE_TYPE (4)",
        post(s.Send(body={"t": "stream-reset", "id": 1}), aborts("UNKNOWN_MESSAGE_TYPE")),
    )
    g.add(
        "3",
        "unknown fields are ignored",
        "a Hello with extra fields of every shape (nil, map, array, binary)",
        "a Challenge",
        pre(
            s.Send(
                body=hello(
                    zz_nil={"$raw": "c0"},
                    zz_map={"a": [1, 2, {"b": bin_(b"x")}]},
                    zz_bin=bin_(b"\x00" * 40),
                )
            ),
            expect(s.ChallengeWant()),
        ),
    )
    g.add(
        "3",
        "the tag anywhere in the map",
        'a Hello whose "t" is its last key',
        "a Challenge",
        pre(s.Send(body={**hello(t=None), "t": "hello"}), expect(s.ChallengeWant())),
    )
    g.add(
        "3",
        "wide integer encodings",
        "a Hello whose max_frame and window are uint 64 encoded and versions an int 8",
        "any integer encoding within bounds is accepted: a Challenge",
        pre(
            s.Send(
                body=hello(
                    max_frame={"$raw": "cf0000000001000000"},
                    window={"$raw": "cf0000000000400000"},
                    versions=[{"$raw": "d001"}],
                )
            ),
            expect(s.ChallengeWant(version=1)),
        ),
    )
    g.add(
        "3",
        "a float where an integer is required",
        "a Hello whose max_frame is 65536.0",
        "Abort INVALID_MESSAGE (5)",
        pre(s.Send(body=hello(max_frame=65536.0)), aborts("INVALID_MESSAGE")),
    )
    g.add(
        "3",
        "a string where binary is required",
        "a Hello whose nonce is a 32-character string",
        "Abort INVALID_MESSAGE (5)",
        pre(s.Send(body=hello(nonce="n" * 32)), aborts("INVALID_MESSAGE")),
    )
    g.add(
        "3",
        "binary where a string is required",
        "after the handshake, a Call whose method is binary",
        "Abort INVALID_MESSAGE (5)",
        post(
            s.Send(body=call(1, "x") | {"method": bin_(b"server.noop")}), aborts("INVALID_MESSAGE")
        ),
    )
    g.add(
        "3",
        "a required field missing",
        "a Hello without window",
        "Abort INVALID_MESSAGE (5)",
        pre(s.Send(body=hello(window=None)), aborts("INVALID_MESSAGE")),
    )
    g.add(
        "3",
        "a boolean where an integer is required",
        "after the handshake, a Ping whose seq is true",
        "Abort INVALID_MESSAGE (5)",
        post(s.Send(body={"t": "ping", "seq": True}), aborts("INVALID_MESSAGE")),
    )
    g.add(
        "3",
        "a malformed body after the handshake",
        "after the handshake, a body of the byte 0xc1 (sealed when a cipher is on)",
        "Abort MALFORMED_MESSAGE (3)",
        post(s.SendBody(hex="c1"), aborts("MALFORMED_MESSAGE")),
    )
    g.add(
        "3",
        "default params",
        "after the handshake, a server.noop Call without params",
        "an absent field takes its default (an empty map): a Reply",
        post(s.Send(body=call(1, "server.noop")), expect(s.ReplyWant(id=1))),
        methods=("server.noop",),
    )
    g.add(
        "3",
        "params nested too deeply",
        "after the handshake, a server.echo Call whose params hold 2000 nested arrays",
        "a call whose only deep part is its params is valid: Error INVALID_PARAMS (101), "
        "and the connection lives",
        post(
            s.Send(body=call(1, "server.echo", {"data": bin_(b""), "x": {"$nest": 2000}})),
            expect(s.ErrorWant(id=1, codes=[101])),
            alive(),
        ),
        methods=("server.echo",),
        area="nesting",
    )
    bound = nesting_bound()
    if bound is not None:
        _nesting_at_bound(g, bound)
    return g


def _nesting_at_bound(g: Group, bound: int) -> None:
    """Cases of the one nesting bound section 14 states, on both sides of the handshake.

    Depth counts every array and map of the body, the message's own map included.
    """
    inner = bound - 2  # the message's map, and the unknown field's outer array
    g.add(
        "3",
        "a Hello nested to the bound",
        f"a Hello with an unknown field nested so the body is {bound} levels deep",
        "a message within the bound is decoded: a Challenge",
        pre(s.Send(body=hello(zz=[{"$nest": inner}])), expect(s.ChallengeWant())),
        area="nesting",
        name="nest-hello-at",
    )
    g.add(
        "3",
        "a Hello nested past the bound",
        f"a Hello with an unknown field nested so the body is {bound + 1} levels deep",
        "Abort INVALID_MESSAGE (5)",
        pre(s.Send(body=hello(zz=[{"$nest": inner + 1}])), aborts("INVALID_MESSAGE")),
        area="nesting",
        name="nest-hello-over",
    )
    g.add(
        "3",
        "a Ping nested to the bound",
        f"after the handshake, a Ping with an unknown field, {bound} levels deep in all",
        "a Pong",
        post(
            s.Send(body={"t": "ping", "seq": 5, "zz": [{"$nest": inner}]}),
            expect(s.PongWant(seq=5)),
        ),
        area="nesting",
        name="nest-ping-at",
    )
    g.add(
        "3",
        "a Ping nested past the bound",
        f"after the handshake, a Ping with an unknown field, {bound + 1} levels deep in all",
        "Abort INVALID_MESSAGE (5)",
        post(
            s.Send(body={"t": "ping", "seq": 5, "zz": [{"$nest": inner + 1}]}),
            aborts("INVALID_MESSAGE"),
        ),
        area="nesting",
        name="nest-ping-over",
    )


def cases() -> list[Case]:
    """The cases of sections 2 and 3."""
    return _framing().cases + _encoding().cases
