"""Cases of section 7 (frame protection), run once per AEAD cipher the server accepts."""

from __future__ import annotations

from collections.abc import Callable

from protocol.fuzz import script as s
from protocol.fuzz.cases import Case, Facts, Group, aborts, each_aead, expect

_PING = {"t": "ping", "seq": 3}


def _per_cipher(steps: Callable[[str], list[s.AnyStep]]) -> Callable[[Facts], s.Script | str]:
    return lambda facts: each_aead(facts, steps)


def cases() -> list[Case]:
    """The cases of section 7."""
    g = Group(7)
    g.add(
        "7",
        "a sealed round trip",
        "after a handshake with each AEAD cipher the server accepts, a sealed Ping",
        "a sealed Pong that opens with the server -> client key",
        _per_cipher(
            lambda c: [
                s.Connect(),
                s.Handshake(cipher=c),
                s.Send(body=_PING),
                expect(s.PongWant(seq=3)),
            ]
        ),
    )
    g.add(
        "7",
        "an altered frame",
        "a sealed Ping with one bit of its ciphertext flipped",
        "Abort DECRYPT_FAILED (9)",
        _per_cipher(
            lambda c: [
                s.Connect(),
                s.Handshake(cipher=c),
                s.Send(body=_PING, tamper=True),
                aborts("DECRYPT_FAILED"),
            ]
        ),
    )
    g.add(
        "7",
        "a replayed frame",
        "a sealed Ping answered, then the same frame byte for byte",
        "the counter moved on: Abort DECRYPT_FAILED (9)",
        _per_cipher(
            lambda c: [
                s.Connect(),
                s.Handshake(cipher=c),
                s.Send(body=_PING),
                expect(s.PongWant(seq=3)),
                s.Resend(source=0, index=-1),
                aborts("DECRYPT_FAILED"),
            ]
        ),
    )
    g.add(
        "7",
        "a body shorter than the tag",
        "a frame of 15 bytes after the handshake",
        "Abort DECRYPT_FAILED (9)",
        _per_cipher(
            lambda c: [
                s.Connect(),
                s.Handshake(cipher=c),
                s.SendBytes(hex="0000000f" + "00" * 15),
                aborts("DECRYPT_FAILED"),
            ]
        ),
    )
    g.add(
        "7",
        "a plaintext frame after the handshake",
        "an unsealed Ping where a sealed one is due",
        "Abort DECRYPT_FAILED (9)",
        _per_cipher(
            lambda c: [
                s.Connect(),
                s.Handshake(cipher=c),
                s.Send(body=_PING, plain=True),
                aborts("DECRYPT_FAILED"),
            ]
        ),
    )
    g.add(
        "7",
        "an empty sealed frame",
        "a frame of length 0 after the handshake",
        "Abort DECRYPT_FAILED (9) or MALFORMED_MESSAGE (3)",
        _per_cipher(
            lambda c: [
                s.Connect(),
                s.Handshake(cipher=c),
                s.SendBytes(hex="00000000"),
                aborts("DECRYPT_FAILED", "MALFORMED_MESSAGE"),
            ]
        ),
    )
    g.add(
        "7",
        "a sealed Abort",
        "after the handshake, a sealed Abort GOING_AWAY (15)",
        "the server closes without answering",
        _per_cipher(
            lambda c: [
                s.Connect(),
                s.Handshake(cipher=c),
                s.Send(body={"t": "abort", "code": 15}),
                expect(s.ClosedWant(quiet=True)),
            ]
        ),
    )
    return g.cases
