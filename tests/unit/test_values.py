"""What execd and harnessd both take from a person: what they accept and what they say."""

from __future__ import annotations

import argparse
from argparse import ArgumentTypeError
from collections.abc import Callable

import msgspec
import pytest

from protocol.rpc.resources import LIMIT_NAMES, Limits
from protocol.values import (
    LIMIT_OPTIONS,
    bind_port,
    byte_count,
    count,
    from_options,
    new_marker,
    non_negative,
    option_name,
    port_number,
    positive_int,
    positive_seconds,
    validate_marker,
    validate_marker_var,
)


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        (port_number, "1", 1),
        (port_number, "65535", 65535),
        (bind_port, "0", 0),
        (bind_port, "8080", 8080),
        (positive_seconds, "0.5", 0.5),
        (positive_seconds, "30", 30.0),
        (non_negative, "0", 0.0),
        (non_negative, "0.7", 0.7),
        (positive_int, "1", 1),
        (positive_int, "30", 30),
        (count, "0", 0),
        (count, "12", 12),
        (byte_count, "1048576", 1 << 20),
        (byte_count, "512K", 512 << 10),
        (byte_count, "256M", 256 << 20),
        (byte_count, "2GiB", 2 << 30),
        (byte_count, "1g", 1 << 30),
        (byte_count, "64MB", 64 << 20),
        (byte_count, "0", 0),
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
        (non_negative, "-0.1", "'-0.1' is not a number of at least 0"),
        (non_negative, "nan", "'nan' is not a number of at least 0"),
        (positive_int, "0", "'0' is not a whole number of at least 1"),
        (positive_int, "1.5", "'1.5' is not a whole number of at least 1"),
        (count, "-1", "'-1' is not a whole number of at least 0"),
        (count, "٣", "'٣' is not a whole number of at least 0"),
    ],
)
def test_a_bad_value_is_named_in_one_line(
    parse: Callable[[str], float], text: str, message: str
) -> None:
    with pytest.raises(ArgumentTypeError) as caught:
        parse(text)
    assert str(caught.value) == message


@pytest.mark.parametrize("text", ["", "M", "1.5G", "-1", "12X", "1KK", "0x10", "٣K"])
def test_what_is_not_a_byte_count_is_refused(text: str) -> None:
    with pytest.raises(ArgumentTypeError, match="not a byte count"):
        byte_count(text)


def test_the_limit_options_parse_into_limits() -> None:
    parser = argparse.ArgumentParser()
    for name, kind, unit in LIMIT_OPTIONS:
        parser.add_argument(option_name(name), type=kind, metavar=unit)
    assert [name for name, _, _ in LIMIT_OPTIONS] == list(LIMIT_NAMES)
    args = parser.parse_args(
        ["--limit-memory", "256M", "--limit-cpu", "1.5", "--limit-open-files", "64"]
    )
    given: dict[str, float | None] = {name: getattr(args, f"limit_{name}") for name in LIMIT_NAMES}
    assert from_options(given) == Limits(memory=256 << 20, cpu=1.5, open_files=64)
    assert from_options(dict.fromkeys(LIMIT_NAMES)) is None
    with pytest.raises(msgspec.ValidationError):
        from_options({"open_files": 2})


def test_new_marker_is_random_hex() -> None:
    a, b = new_marker(), new_marker()
    assert a != b
    assert len(a) == 32
    int(a, 16)
    assert validate_marker(a) == a


@pytest.mark.parametrize("good", ["a", "A-b_c.9", "x" * 128])
def test_validate_marker_accepts(good: str) -> None:
    assert validate_marker(good) == good


@pytest.mark.parametrize("bad", ["", "x" * 129, "a b", "a=b", "a\0b", "é", "a\n", "$(x)"])
def test_validate_marker_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        validate_marker(bad)


@pytest.mark.parametrize("good", ["EXECD_MARKER", "_", "a1", "_X_9"])
def test_validate_marker_var_accepts(good: str) -> None:
    assert validate_marker_var(good) == good


@pytest.mark.parametrize("bad", ["", "1A", "A-B", "A=B", "A B", "A.B", "Ä", "A\0", "A" * 300])
def test_validate_marker_var_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        validate_marker_var(bad)
