"""PROTOCOL.md section 5 and protocol/states.py say the same thing, and the machines obey it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import protocol
from protocol import limits
from protocol import messages as m
from protocol.codec import ENCODER
from protocol.connection import ClientConnection, Connection, ServerConnection
from protocol.errors import LocalProtocolError, UnexpectedMessage
from protocol.framing import encode_frame
from protocol.messages import MESSAGE_TYPES, Message, tag_of
from protocol.states import ACCEPTS, HANDSHAKE_ORDER, PEER, SENDS, Role, State

SPEC = Path(protocol.__file__).parent / "PROTOCOL.md"
TOKEN = b"\x42" * 32
BY_TAG = {tag_of(cls): cls for cls in MESSAGE_TYPES}


def section_5() -> str:
    text = SPEC.read_text()
    start = text.index("## 5. Connection states")
    return text[start : text.index("\n## 6.", start)]


def prose() -> str:
    """Section 5 with its lines joined, for phrases that wrap."""
    return " ".join(section_5().split())


def spec_table() -> dict[Role, dict[str, str]]:
    """The acceptance table of section 5: role -> column header -> cell text."""
    rows = [line for line in section_5().splitlines() if line.startswith("|")]
    header = [cell.strip().strip("`") for cell in rows[0].strip("|").split("|")]
    assert header[0] == "receiver", header
    table: dict[Role, dict[str, str]] = {}
    for row in rows[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        table[Role(cells[0])] = dict(zip(header[1:], cells[1:], strict=True))
    return table


def tags(cell: str) -> list[type[Message]]:
    """The messages a cell names, in the order it names them."""
    return [BY_TAG[tag] for tag in re.findall(r"`([a-z]+)`", cell)]


def test_the_spec_table_covers_both_roles_and_the_two_live_states() -> None:
    table = spec_table()
    assert set(table) == set(Role)
    for cells in table.values():
        assert set(cells) == {State.HANDSHAKE.name, State.OPEN.name}


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_open_acceptance_matches_the_spec(role: Role) -> None:
    assert set(tags(spec_table()[role]["OPEN"])) == ACCEPTS[role][State.OPEN]


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_handshake_acceptance_and_order_match_the_spec(role: Role) -> None:
    cell = spec_table()[role]["HANDSHAKE"]
    # "`hello` first, then `auth`; `abort` at any point"
    ordered, anytime = cell.split(";")
    assert "first, then" in ordered and "at any point" in anytime
    assert tuple(tags(ordered)) == HANDSHAKE_ORDER[role]
    assert set(tags(ordered)) | set(tags(anytime)) == ACCEPTS[role][State.HANDSHAKE]


def test_nothing_is_accepted_once_closed() -> None:
    assert "received bytes are ignored" in prose()
    assert all(not ACCEPTS[role][State.CLOSED] for role in Role)


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_a_side_sends_only_what_its_peer_accepts(role: Role) -> None:
    assert "MUST NOT send a message that the table does not allow the peer" in prose()
    assert SENDS[role] == ACCEPTS[PEER[role]][State.OPEN]


@pytest.mark.parametrize(
    ("machine", "role"), [(ClientConnection, Role.CLIENT), (ServerConnection, Role.SERVER)]
)
def test_the_machines_are_built_from_the_tables(machine: type[Connection], role: Role) -> None:
    assert machine.role is role
    assert set(machine._senders) == SENDS[role]
    assert set(machine._receivers) == set().union(*ACCEPTS[role].values())


SAMPLES: dict[type[Message], Message] = {
    type(sample): sample
    for sample in (
        m.Hello(versions=[1], nonce=bytes(32), ciphers=["none"], max_frame=65536, window=65536),
        m.Challenge(version=1, nonce=bytes(32), cipher="none", max_frame=65536, window=65536),
        m.Auth(mac=bytes(32)),
        m.Welcome(mac=bytes(32)),
        m.Call(id=1, method="m"),
        m.Reply(id=1),
        m.Error(id=1, code=100),
        m.Chunk(id=1, stream="s", seq=0),
        m.Cancel(id=1),
        m.Credit(id=1, stream="s", bytes=1),
        m.Event(topic=1, name="e"),
        m.Ping(seq=1),
        m.Pong(seq=1),
        m.Abort(code=15),
    )
}


def fresh(role: Role) -> Connection:
    return ClientConnection(TOKEN) if role is Role.CLIENT else ServerConnection(TOKEN)


def opened() -> tuple[ClientConnection, ServerConnection]:
    client, server = ClientConnection(TOKEN), ServerConnection(TOKEN)
    for _ in range(2):
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
    assert client.state is State.OPEN and server.state is State.OPEN
    return client, server


def test_there_is_a_sample_of_every_message() -> None:
    assert set(SAMPLES) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
@pytest.mark.parametrize("kind", MESSAGE_TYPES, ids=tag_of)
def test_a_message_the_table_leaves_out_is_unexpected(role: Role, kind: type[Message]) -> None:
    frame = bytes(encode_frame(ENCODER, SAMPLES[kind], limits.PREAUTH_MAX_FRAME))
    for state in (State.HANDSHAKE, State.OPEN):
        if kind in ACCEPTS[role][state]:
            continue
        client, server = opened() if state is State.OPEN else (ClientConnection(TOKEN), None)
        machine: Connection = client if role is Role.CLIENT else server or fresh(role)
        # Held in a local, so the check does not narrow machine.state for the assertion below.
        before = machine.state
        assert before is state
        with pytest.raises(UnexpectedMessage, match="does not accept"):
            machine.receive_data(frame)
        assert machine.state is State.CLOSED


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
@pytest.mark.parametrize("kind", MESSAGE_TYPES, ids=tag_of)
def test_a_message_the_table_does_not_let_a_side_send_is_refused(
    role: Role, kind: type[Message]
) -> None:
    client, server = opened()
    machine: Connection = client if role is Role.CLIENT else server
    if kind in SENDS[role]:
        return
    with pytest.raises(LocalProtocolError, match="cannot send"):
        machine.send(SAMPLES[kind])
    assert machine.state is State.OPEN


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_handshake_messages_out_of_turn_are_unexpected(role: Role) -> None:
    second = HANDSHAKE_ORDER[role][1]
    machine = fresh(role)
    frame = bytes(encode_frame(ENCODER, SAMPLES[second], limits.PREAUTH_MAX_FRAME))
    with pytest.raises(UnexpectedMessage, match="during the handshake"):
        machine.receive_data(frame)
