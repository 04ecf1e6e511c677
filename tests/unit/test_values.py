"""The argparse types execd and harnessd share: what they take and what they say."""

from __future__ import annotations

from argparse import ArgumentTypeError
from collections.abc import Callable

import pytest

from protocol.values import bind_port, port_number, positive_seconds


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        (port_number, "1", 1),
        (port_number, "65535", 65535),
        (bind_port, "0", 0),
        (bind_port, "8080", 8080),
        (positive_seconds, "0.5", 0.5),
        (positive_seconds, "30", 30.0),
    ],
)
def test_values_a_person_writes_parse(
    parse: Callable[[str], float], text: str, value: float
) -> None:
    assert parse(text) == value


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (port_number, "0", "'0' is not a port number (1-65535)"),
        (port_number, "65536", "'65536' is not a port number (1-65535)"),
        (bind_port, "-1", "'-1' is not a port number (0-65535; 0: any)"),
        (bind_port, "٣", "'٣' is not a port number (0-65535; 0: any)"),
        (positive_seconds, "0", "'0' is not a positive number of seconds"),
        (positive_seconds, "inf", "'inf' is not a positive number of seconds"),
        (positive_seconds, "soon", "'soon' is not a positive number of seconds"),
    ],
)
def test_a_bad_value_is_named_in_one_line(
    parse: Callable[[str], float], text: str, message: str
) -> None:
    with pytest.raises(ArgumentTypeError) as caught:
        parse(text)
    assert str(caught.value) == message
