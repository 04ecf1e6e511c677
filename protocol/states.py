"""Every state and transition of a connection, in one place (PROTOCOL.md section 5).

Everything that decides whether a message may be received or sent in a state
lives in the tables below; :mod:`protocol.connection` consults them and holds
no rule of its own about which message belongs where. A pair missing from a
table is the error: received, it is ``UNEXPECTED_MESSAGE``
(:class:`~protocol.errors.UnexpectedMessage`); asked to be sent, it is a
:class:`~protocol.errors.LocalProtocolError` and nothing is sent.

``tests/unit/test_states.py`` parses the acceptance table of PROTOCOL.md
section 5 and holds it against :data:`ACCEPTS` and :data:`HANDSHAKE_ORDER`, so
the spec and the code cannot drift apart.

The life of a connection, for either role::

    HANDSHAKE --(peer's proof verified)--> OPEN
    HANDSHAKE --(abort sent or received, violation, transport closed)--> CLOSED
    OPEN      --(abort sent or received, violation, transport closed)--> CLOSED

During the handshake each side accepts its two handshake messages in a fixed
order (:data:`HANDSHAKE_ORDER`) and an Abort at any point; the machine sends
the handshake messages itself, so an application may send nothing before
OPEN. Once open, a side may send exactly what the peer accepts when open
(:data:`SENDS`).
"""

from __future__ import annotations

import enum
from typing import Final

from protocol import messages as m
from protocol.messages import Message


class State(enum.Enum):
    """Where a connection is in its life."""

    HANDSHAKE = "handshake"
    OPEN = "open"
    CLOSED = "closed"


#: The states the per-frame checks compare with, as plain module names: on
#: Python 3.11 every ``State.X`` read goes through the enum class's attribute
#: lookup (some 860 instructions), and each frame sent or received made several.
OPEN: Final = State.OPEN
CLOSED: Final = State.CLOSED


class Role(enum.Enum):
    """Which end of the connection a machine is."""

    CLIENT = "client"
    SERVER = "server"


#: What the peer of each role is.
PEER: Final = {Role.CLIENT: Role.SERVER, Role.SERVER: Role.CLIENT}

#: role -> state -> the messages that role accepts in that state. Nothing is
#: accepted once CLOSED: received bytes are ignored.
ACCEPTS: Final[dict[Role, dict[State, frozenset[type[Message]]]]] = {
    Role.SERVER: {
        State.HANDSHAKE: frozenset({m.Hello, m.Auth, m.Abort}),
        State.OPEN: frozenset({m.Call, m.Chunk, m.Credit, m.Cancel, m.Ping, m.Pong, m.Abort}),
        State.CLOSED: frozenset(),
    },
    Role.CLIENT: {
        State.HANDSHAKE: frozenset({m.Challenge, m.Welcome, m.Abort}),
        State.OPEN: frozenset(
            {m.Reply, m.Error, m.Chunk, m.Credit, m.Event, m.Ping, m.Pong, m.Abort}
        ),
        State.CLOSED: frozenset(),
    },
}

#: role -> the handshake messages it accepts, in the order they must come.
HANDSHAKE_ORDER: Final[dict[Role, tuple[type[Message], ...]]] = {
    Role.SERVER: (m.Hello, m.Auth),
    Role.CLIENT: (m.Challenge, m.Welcome),
}

#: role -> what an application may ask that role's machine to send while OPEN:
#: what the peer accepts when open. (The machine sends the handshake messages
#: itself, and the m.Abort through ``close``.)
SENDS: Final[dict[Role, frozenset[type[Message]]]] = {
    role: ACCEPTS[PEER[role]][State.OPEN] for role in Role
}
