"""The exported connection state machine, run against the sans-I/O server in this process."""

from __future__ import annotations

from hypothesis import settings

from protocol import limits
from protocol.fuzz.loopback import LoopbackTarget
from protocol.fuzz.machine import connection_machine
from protocol.fuzz.strategies import examples

TOKEN = b"\x5a" * 32

LoopbackMachine = connection_machine(
    lambda: LoopbackTarget(TOKEN), TOKEN, ciphers=limits.KNOWN_CIPHERS, timeout=0.5
)
LoopbackMachine.TestCase.settings = settings(
    max_examples=examples(60), stateful_step_count=30, deadline=None
)
TestLoopbackMachine = LoopbackMachine.TestCase
