"""Numbers the cases take from the specification itself: PROTOCOL.md section 14's table.

The cases read every bound they test from here, so a change of the spec moves
them with it. :func:`spec_limits` parses the table of section 14 of the
PROTOCOL.md installed with the package (``| `NAME` | value | meaning |``);
:func:`nesting_bound` is the nesting bound, once the table states one (a row
whose name mentions nesting or depth).
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Final

_ROW: Final = re.compile(r"^\|\s*`([A-Z_0-9]+)`\s*\|\s*(\d+)")


def spec_text() -> str:
    """The text of the PROTOCOL.md shipped with :mod:`protocol`."""
    return resources.files("protocol").joinpath("PROTOCOL.md").read_text(encoding="utf-8")


def _section(text: str, number: int) -> str:
    start = re.search(rf"^## {number}\. ", text, re.MULTILINE)
    if start is None:
        return ""
    end = re.search(r"^## \d+\. ", text[start.end() :], re.MULTILINE)
    return text[start.start() : start.end() + end.start() if end else len(text)]


@functools.cache
def spec_limits() -> dict[str, int]:
    """Every named number of PROTOCOL.md section 14: name -> value."""
    found: dict[str, int] = {}
    for line in _section(spec_text(), 14).splitlines():
        match = _ROW.match(line)
        if match:
            found[match.group(1)] = int(match.group(2))
    return found


def spec_limit(name: str) -> int:
    """One number of section 14; KeyError when the table does not name it."""
    return spec_limits()[name]


def nesting_bound() -> int | None:
    """The nesting bound section 14 states (arrays and maps, every message), or None."""
    for name, value in spec_limits().items():
        if "NEST" in name or "DEPTH" in name:
            return value
    return None
