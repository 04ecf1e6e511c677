"""The case catalogue: numbered requirements of PROTOCOL.md, each a script and its expected answer.

A :class:`Case` is keyed to the section of PROTOCOL.md it tests (``id`` is
``<section>.<n>``; ``ref`` names the exact subsection). It says in words what
it sends and what the specification requires back, and builds the
:class:`~protocol.fuzz.script.Script` that does it from the :class:`Facts`
learned about the server (which ciphers it accepts, which methods it has).
Cases that prove the token need one; without it they are skipped. Numbers are
stable: new cases are added at the end of their section, never renumbered.

:func:`catalogue` lists every case, section by section; the modules of this
package hold one group of sections each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol import limits
from protocol.errors import ErrorCode
from protocol.fuzz import script as s
from protocol.fuzz.spec import spec_limit


@dataclass(frozen=True)
class Facts:
    """What the runner learned about the server before the cases.

    ``ciphers``: the ciphers it accepts (each offered alone). ``methods``: its
    methods (``server.info``), or None when unknown (no token).
    """

    ciphers: tuple[str, ...] = limits.KNOWN_CIPHERS
    methods: frozenset[str] | None = None
    token: bool = True


Build = Callable[[Facts], "s.Script | str"]


@dataclass(frozen=True)
class Case:
    """One numbered requirement: what is sent, what must come back, and the script."""

    id: str
    ref: str
    title: str
    sends: str
    requires: str
    build: Build
    #: Methods the script calls; the case is skipped on a server that lacks one.
    methods: tuple[str, ...] = ()
    #: Takes seconds (a timeout, a grace period): listed as slow.
    slow: bool = False
    #: The spec area a case belongs to when that area is being settled (``nesting``...).
    area: str | None = None

    def script_for(self, facts: Facts) -> s.Script | str:
        """The script for this server, or why the case does not apply to it."""
        missing = [m for m in self.methods if facts.methods is not None and m not in facts.methods]
        if missing:
            return f"the server has no {', '.join(missing)}"
        built = self.build(facts)
        if isinstance(built, s.Script) and built.needs_token and not facts.token:
            return "needs the token (--token-file)"
        return built

    @property
    def section(self) -> int:
        """The top-level PROTOCOL.md section."""
        return int(self.id.split(".")[0])


@dataclass
class Group:
    """The cases of one section, numbered in the order they are added."""

    section: int
    cases: list[Case] = field(default_factory=list)

    def add(
        self,
        ref: str,
        title: str,
        sends: str,
        requires: str,
        build: Build | s.Script,
        *,
        methods: tuple[str, ...] = (),
        slow: bool = False,
        area: str | None = None,
        name: str | None = None,
    ) -> None:
        """Add the next case of this section (``name``: a stable suffix instead of a number)."""
        number = name if name is not None else str(len(self.cases) + 1)
        fixed = build

        def static(_: Facts) -> s.Script | str:
            assert isinstance(fixed, s.Script)
            return fixed

        self.cases.append(
            Case(
                id=f"{self.section}.{number}",
                ref=ref,
                title=title,
                sends=sends,
                requires=requires,
                build=static if isinstance(build, s.Script) else build,
                methods=methods,
                slow=slow,
                area=area,
            )
        )


@functools.cache
def catalogue() -> tuple[Case, ...]:
    """Every case, by section."""
    from protocol.fuzz.cases import calls, framing, handshake, methods, sealing, streams

    groups = (framing, handshake, sealing, calls, streams, methods)
    return tuple(case for group in groups for case in group.cases())


def by_id(case_id: str) -> Case:
    """The case numbered ``case_id``; KeyError when there is none."""
    for case in catalogue():
        if case.id == case_id:
            return case
    raise KeyError(case_id)


# -- helpers the section modules share ------------------------------------------------------

#: The client nonce of the catalogue's Hellos (fixed, so scripts replay byte for byte).
NONCE = bytes(range(0x40, 0x60))
PREAUTH = spec_limit("PREAUTH_MAX_FRAME")
MIN_FRAME = spec_limit("MIN_MAX_FRAME")
MAX_FRAME = spec_limit("MAX_MAX_FRAME")
MIN_WINDOW = spec_limit("MIN_STREAM_WINDOW")
MAX_WINDOW = spec_limit("MAX_STREAM_WINDOW")
MAX_ID = spec_limit("MAX_CALL_ID")
MAX_NAME = spec_limit("MAX_NAME")
AEAD = (limits.CIPHER_AESGCM, limits.CIPHER_CHACHA20)
#: A call that stays in flight until cancelled, starting no process.
SLOW_METHOD = "watch.wait_for_path"
SLOW_PARAMS: dict[str, Any] = {
    "path": "/nonexistent/splitexec-fuzz/never",
    "condition": "exists",
    "timeout": 600.0,
}


def code(name: str) -> int:
    """The wire code of ``name``."""
    return int(ErrorCode[name])


def bin_(data: bytes) -> dict[str, str]:
    """A JSON body node for binary ``data``."""
    return {"$bin": data.hex()}


def hello(**fields: Any) -> dict[str, Any]:
    """A valid Hello body (every cipher offered), with ``fields`` changed; None deletes one."""
    body: dict[str, Any] = {
        "t": "hello",
        "versions": [limits.PROTOCOL_VERSION],
        "nonce": bin_(NONCE),
        "ciphers": list(limits.KNOWN_CIPHERS),
        "max_frame": limits.DEFAULT_MAX_FRAME,
        "window": limits.DEFAULT_STREAM_WINDOW,
    }
    for key, value in fields.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def frame_hex(body: bytes) -> str:
    """The hex of a plaintext frame holding ``body``."""
    return (len(body).to_bytes(4, "big") + body).hex()


def call(call_id: int, method: str, params: Any = None, **extra: Any) -> dict[str, Any]:
    """A Call body (``params`` None: left out, so the default empty map)."""
    body: dict[str, Any] = {"t": "call", "id": call_id, "method": method}
    if params is not None:
        body["params"] = params
    body.update(extra)
    return body


def expect(want: s.Requirement, **options: Any) -> s.Expect:
    """An Expect step on connection 0 (``conn``, ``timeout``, ``otherwise`` as options)."""
    return s.Expect(want=want, **options)


def aborts(*names: str, **options: Any) -> s.Expect:
    """Require an Abort with one of the named codes, then a close."""
    return expect(s.AbortWant(codes=[code(n) for n in names]), **options)


def pre(*steps: s.AnyStep) -> s.Script:
    """A script on a fresh connection, before any handshake."""
    return s.script(s.Connect(), *steps)


def post(*steps: s.AnyStep, cipher: str = limits.CIPHER_NONE, **handshake: Any) -> s.Script:
    """A script on a fresh connection after a valid handshake (needs the token)."""
    return s.script(s.Connect(), s.Handshake(cipher=cipher, **handshake), *steps)


def preauth_then(*steps: s.AnyStep) -> s.Script:
    """A Hello answered by a Challenge, then ``steps``."""
    return pre(s.Send(body=hello()), expect(s.ChallengeWant()), *steps)


def alive() -> s.Expect:
    """Require that the connection still lives (a Ping is answered)."""
    return expect(s.AliveWant())


def each_aead(facts: Facts, build: Callable[[str], list[s.AnyStep]]) -> s.Script | str:
    """One connection per AEAD cipher the server accepts, each running ``build(cipher)``."""
    ciphers = [c for c in AEAD if c in facts.ciphers]
    if not ciphers:
        return "the server accepts no AEAD cipher"
    steps: list[s.AnyStep] = []
    for conn, cipher in enumerate(ciphers):
        for step in build(cipher):
            steps.append(_on(step, conn))
    return s.script(*steps)


def _on(step: s.AnyStep, conn: int) -> s.AnyStep:
    import msgspec

    return msgspec.structs.replace(step, conn=conn)
