"""Cases of sections 4 (messages), 5 (connection states) and 6 (handshake)."""

from __future__ import annotations

from protocol import limits
from protocol.fuzz import script as s
from protocol.fuzz.cases import (
    MAX_FRAME,
    MAX_ID,
    MAX_NAME,
    MAX_WINDOW,
    MIN_FRAME,
    MIN_WINDOW,
    NONCE,
    Build,
    Case,
    Facts,
    Group,
    aborts,
    alive,
    bin_,
    call,
    expect,
    hello,
    post,
    pre,
    preauth_then,
)

_MAC = bin_(bytes(32))


def _messages() -> Group:
    g = Group(4)
    invalid = [
        ("4", "no versions", "a Hello with an empty versions list", hello(versions=[])),
        (
            "4",
            "too many versions",
            "a Hello offering 17 versions",
            hello(versions=list(range(1, 18))),
        ),
        ("4", "too many ciphers", "a Hello offering 9 ciphers", hello(ciphers=["none"] * 9)),
        (
            "4",
            "a cipher name too long",
            "a Hello offering a 33-character cipher",
            hello(ciphers=["c" * 33, "none"]),
        ),
        (
            "4",
            "an empty cipher name",
            'a Hello offering the cipher ""',
            hello(ciphers=["", "none"]),
        ),
        ("4", "a short nonce", "a Hello whose nonce has 31 bytes", hello(nonce=bin_(bytes(31)))),
        ("4", "a long nonce", "a Hello whose nonce has 33 bytes", hello(nonce=bin_(bytes(33)))),
        ("4", "a version above u32", "a Hello offering version 2^32", hello(versions=[1, 1 << 32])),
    ]
    for ref, title, sends, body in invalid:
        g.add(
            ref,
            title,
            sends,
            "Abort INVALID_MESSAGE (5)",
            pre(s.Send(body=body), aborts("INVALID_MESSAGE")),
        )
    g.add(
        "4",
        "a short MAC",
        "a Hello, then an Auth whose mac has 31 bytes",
        "Abort INVALID_MESSAGE (5)",
        preauth_then(s.Send(body={"t": "auth", "mac": bin_(bytes(31))}), aborts("INVALID_MESSAGE")),
    )
    open_invalid = [
        ("a call id above u63", "a Call with id 2^63", call(MAX_ID + 1, "server.noop")),
        ("a negative call id", "a Call with id -1", call(-1, "server.noop")),
        ("an empty method", 'a Call whose method is ""', call(1, "")),
        (
            "a method too long",
            f"a Call whose method has {MAX_NAME + 1} characters",
            call(1, "m" * (MAX_NAME + 1)),
        ),
        (
            "a short request id",
            "a Call whose rid has 15 bytes",
            call(1, "server.noop", rid=bin_(bytes(15))),
        ),
        (
            "credit of zero",
            "a Credit of 0 bytes",
            {"t": "credit", "id": 1, "stream": "x", "bytes": 0},
        ),
        (
            "credit above the largest window",
            f"a Credit of {MAX_WINDOW + 1} bytes",
            {"t": "credit", "id": 1, "stream": "x", "bytes": MAX_WINDOW + 1},
        ),
        ("a ping seq above u63", "a Ping with seq 2^63", {"t": "ping", "seq": MAX_ID + 1}),
        (
            "a stream name too long",
            f"a Chunk on a stream named with {MAX_NAME + 1} characters",
            {"t": "chunk", "id": 1, "stream": "s" * (MAX_NAME + 1), "seq": 0},
        ),
        (
            "an empty stream name",
            'a Chunk on the stream ""',
            {"t": "chunk", "id": 1, "stream": "", "seq": 0},
        ),
        (
            "an abort message too long",
            "an Abort whose message has 4097 characters",
            {"t": "abort", "code": 15, "message": "m" * 4097},
        ),
    ]
    for title, sends, body in open_invalid:
        g.add(
            "4",
            title,
            f"after the handshake, {sends[0].lower()}{sends[1:]}",
            "Abort INVALID_MESSAGE (5)",
            post(s.Send(body=body), aborts("INVALID_MESSAGE")),
        )
    g.add(
        "4",
        "the largest ids",
        "after the handshake, a Ping with seq 2^63 - 1 and a server.noop Call with id 2^63 - 1",
        "values at their bound are valid: a Pong and a Reply",
        post(
            s.Send(body={"t": "ping", "seq": MAX_ID}),
            expect(s.PongWant(seq=MAX_ID)),
            s.Send(body=call(MAX_ID, "server.noop")),
            expect(s.ReplyWant(id=MAX_ID)),
        ),
        methods=("server.noop",),
    )
    return g


def _states() -> Group:
    g = Group(5)
    first = [
        ("an Auth first", "an Auth as the first frame", {"t": "auth", "mac": _MAC}),
        ("a Call before the handshake", "a Call as the first frame", call(1, "server.noop")),
        ("a Ping before the handshake", "a Ping as the first frame", {"t": "ping", "seq": 1}),
        (
            "a Challenge to the server",
            "a Challenge (a server's message) as the first frame",
            {
                "t": "challenge",
                "version": 1,
                "nonce": bin_(NONCE),
                "cipher": "none",
                "max_frame": 4096,
                "window": 4096,
            },
        ),
        ("a Reply to the server", "a Reply as the first frame", {"t": "reply", "id": 1}),
    ]
    for title, sends, body in first:
        g.add(
            "5",
            title,
            sends,
            "Abort UNEXPECTED_MESSAGE (6)",
            pre(s.Send(body=body), aborts("UNEXPECTED_MESSAGE")),
        )
    g.add(
        "5",
        "a second Hello",
        "a Hello, then another Hello",
        "Abort UNEXPECTED_MESSAGE (6)",
        preauth_then(s.Send(body=hello()), aborts("UNEXPECTED_MESSAGE")),
    )
    g.add(
        "5",
        "a Call between Hello and Auth",
        "a Hello, then a Call",
        "Abort UNEXPECTED_MESSAGE (6)",
        preauth_then(s.Send(body=call(1, "server.noop")), aborts("UNEXPECTED_MESSAGE")),
    )
    after = [
        ("a Hello after the handshake", hello()),
        ("an Auth after the handshake", {"t": "auth", "mac": _MAC}),
        ("a Reply to the server", {"t": "reply", "id": 1}),
        ("an Error to the server", {"t": "error", "id": 1, "code": 106}),
        ("an Event to the server", {"t": "event", "topic": 1, "name": "x"}),
        ("a Welcome to the server", {"t": "welcome", "mac": _MAC}),
    ]
    for title, body in after:
        g.add(
            "5",
            title,
            f"after the handshake, {title.split(' after')[0].split(' to the')[0]}",
            "Abort UNEXPECTED_MESSAGE (6)",
            post(s.Send(body=body), aborts("UNEXPECTED_MESSAGE")),
        )
    g.add(
        "5",
        "an Abort from the client before the handshake",
        "an Abort GOING_AWAY (15) as the first frame",
        "the server closes and never answers an Abort",
        pre(
            s.Send(body={"t": "abort", "code": 15, "message": "bye"}),
            expect(s.ClosedWant(quiet=True)),
        ),
    )
    g.add(
        "5",
        "an Abort from the client after the handshake",
        "after the handshake, an Abort GOING_AWAY (15)",
        "the server closes and never answers an Abort",
        post(s.Send(body={"t": "abort", "code": 15}), expect(s.ClosedWant(quiet=True))),
    )
    return g


def _handshake() -> Group:
    g = Group(6)
    g.add(
        "6.1",
        "a valid Hello",
        "a Hello offering version 1 and every cipher",
        "a Challenge: version 1, a 32-byte nonce, an offered cipher, limits in range",
        preauth_then(),
    )
    g.add(
        "6.1",
        "the highest shared version",
        "a Hello offering versions 7, 1 and 99",
        "the highest version both speak: a Challenge for version 1",
        pre(s.Send(body=hello(versions=[7, 1, 99])), expect(s.ChallengeWant(version=1))),
    )
    g.add(
        "6.1",
        "no shared version",
        "a Hello offering versions 2 and 3 only",
        "Abort VERSION_MISMATCH (8)",
        pre(s.Send(body=hello(versions=[2, 3])), aborts("VERSION_MISMATCH")),
    )
    g.add(
        "6.1",
        "no known cipher",
        'a Hello offering only "rot13" and "rot26"',
        "Abort UNSUPPORTED_CIPHER (13)",
        pre(s.Send(body=hello(ciphers=["rot13", "rot26"])), aborts("UNSUPPORTED_CIPHER")),
    )
    g.add(
        "6.1",
        "the client's order of ciphers",
        "one Hello per known cipher offering it alone, then a Hello offering an unknown "
        "cipher and then every known one, in the reverse of the reference order",
        "the first offered cipher the server accepts (unknown names skipped)",
        s.script(
            *(
                step
                for conn, cipher in enumerate(limits.KNOWN_CIPHERS, start=1)
                for step in (s.Connect(conn=conn), s.Send(conn=conn, body=hello(ciphers=[cipher])))
            ),
            s.Connect(),
            s.Send(body=hello(ciphers=["rot13", *reversed(limits.KNOWN_CIPHERS)])),
            expect(s.FirstAcceptedWant(probes=[1, 2, 3])),
        ),
    )
    bounds = [
        ("max_frame", MIN_FRAME - 1, "below"),
        ("max_frame", MAX_FRAME + 1, "above"),
        ("window", MIN_WINDOW - 1, "below"),
        ("window", MAX_WINDOW + 1, "above"),
    ]
    for name, value, where in bounds:
        g.add(
            "6.1",
            f"hello.{name} {where} its range",
            f"a Hello announcing {name} = {value}",
            "Abort INVALID_MESSAGE (5)",
            pre(s.Send(body=hello(**{name: value})), aborts("INVALID_MESSAGE")),
        )
    g.add(
        "6.1",
        "limits at their bounds",
        f"a Hello announcing max_frame = window = {MIN_FRAME}, another announcing {MAX_FRAME}",
        "both are in range: a Challenge each",
        s.script(
            s.Connect(),
            s.Send(body=hello(max_frame=MIN_FRAME, window=MIN_WINDOW)),
            expect(s.ChallengeWant()),
            s.Connect(conn=1),
            s.Send(conn=1, body=hello(max_frame=MAX_FRAME, window=MAX_WINDOW)),
            expect(s.ChallengeWant(), conn=1),
        ),
    )
    g.add(
        "6.1",
        "a wrong MAC",
        "a Hello, then an Auth with a random MAC",
        'Abort AUTH_FAILED (7) with the message exactly "authentication failed"',
        preauth_then(
            s.Auth(mac="random"),
            expect(s.AbortWant(codes=[7], message="authentication failed")),
        ),
    )
    g.add(
        "6.1",
        "an Abort instead of the Auth",
        "a Hello, then an Abort",
        "the server closes without answering",
        preauth_then(s.Send(body={"t": "abort", "code": 1}), expect(s.ClosedWant(quiet=True))),
    )
    g.add(
        "6.4",
        "a valid handshake, no cipher",
        'a Hello offering "none", the valid Auth, then a Ping',
        "a Welcome whose MAC verifies, then a Pong",
        post(alive()),
    )
    for cipher in (limits.CIPHER_AESGCM, limits.CIPHER_CHACHA20):
        g.add(
            "6.5",
            f"a valid handshake with {cipher}",
            f"a Hello offering {cipher}, the valid Auth, then a sealed Ping",
            "a Welcome whose MAC verifies, then a sealed Pong",
            _with_cipher(cipher),
        )
    g.add(
        "6.3",
        "a downgraded transcript",
        "a Hello offering every cipher, then an Auth whose MAC was computed as if only "
        '"none" had been offered (an on-path downgrade)',
        "the transcripts differ: Abort AUTH_FAILED (7)",
        preauth_then(s.Auth(transcript_ciphers=["none"]), aborts("AUTH_FAILED")),
    )
    g.add(
        "6.3",
        "a replayed Auth",
        "a complete handshake; then, on a second connection, the same Hello (same client "
        "nonce) and the first connection's Auth frame byte for byte",
        "the server's fresh nonce makes the old Auth fail: Abort AUTH_FAILED (7)",
        s.script(
            s.Connect(),
            s.Handshake(nonce=NONCE.hex()),
            s.Connect(conn=1),
            s.Send(conn=1, body=hello(ciphers=["none"])),
            expect(s.ChallengeWant(), conn=1),
            s.Resend(conn=1, source=0, index=1),
            aborts("AUTH_FAILED", conn=1),
        ),
    )
    g.add(
        "6.1",
        "a fresh server nonce per connection",
        "the same Hello on three connections",
        "three Challenges with three different server nonces",
        s.script(
            *(
                step
                for conn in range(3)
                for step in (s.Connect(conn=conn), s.Send(conn=conn, body=hello()))
            ),
            expect(s.DistinctNoncesWant(conns=[0, 1, 2])),
        ),
    )
    g.add(
        "6.1",
        "a silent client",
        "a connection that sends nothing",
        "the server SHOULD bound the handshake: Abort HANDSHAKE_TIMEOUT (11) in time "
        "(execd: 5 s; waited for up to 30 s)",
        pre(expect(s.AbortWant(codes=[11]), timeout=30.0, otherwise="non-strict")),
        slow=True,
    )
    g.add(
        "6.1",
        "a client that stops after its Hello",
        "a Hello, then nothing",
        "Abort HANDSHAKE_TIMEOUT (11) in time (SHOULD; waited for up to 30 s)",
        preauth_then(expect(s.AbortWant(codes=[11]), timeout=30.0, otherwise="non-strict")),
        slow=True,
    )
    g.add(
        "6.1",
        "idle peers cannot lock a client out",
        "80 connections that send half a Hello and stay, then a complete handshake",
        "a client with the token is served (execd sheds the oldest idle peer, "
        "CONNECTION_LIMIT 14); a server MAY refuse, so anything else is non-strict",
        s.script(
            *(
                step
                for conn in range(1, 81)
                for step in (s.Connect(conn=conn), s.SendBytes(conn=conn, hex="00000083"))
            ),
            s.Connect(),
            s.Handshake(),
            expect(s.AliveWant(), otherwise="non-strict"),
        ),
    )
    return g


def _with_cipher(cipher: str) -> Build:
    def build(facts: Facts) -> s.Script | str:
        if cipher not in facts.ciphers:
            return f"the server does not accept {cipher}"
        return post(alive(), cipher=cipher)

    return build


def cases() -> list[Case]:
    """The cases of sections 4, 5 and 6."""
    return _messages().cases + _states().cases + _handshake().cases
