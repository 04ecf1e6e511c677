"""The bounded types several RPC declarations share, each declared once.

A field that takes a path, a command line, an environment, a number of
seconds or a byte offset takes it with the same bounds in every method, so
decoding refuses the same absurd values everywhere and a bound cannot drift
between methods. A bound that belongs to one capability (a service name's
pattern, a terminal's rows) stays in that capability's module.

The numbers are part of the wire contract: PROTOCOL.md section 15 shows them
in each method's field table.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from protocol import limits

MAX_PATH: Final = 4096
"""Longest path accepted, in characters."""

MAX_ARGV: Final = 4096
"""Most argv items."""

MAX_ARG: Final = 128 * 1024
"""Longest single argument (Linux's MAX_ARG_STRLEN), in characters."""

MAX_COMMAND: Final = 1024 * 1024
"""Longest ``command`` string (run through ``/bin/sh -c``), in characters."""

MAX_ENV: Final = 4096
"""Most ``env`` entries, and most ``unset`` names."""

MAX_ENV_NAME: Final = 4096
"""Longest environment variable name."""

MAX_ENV_VALUE: Final = MAX_ARG
"""Longest environment variable value (an argument's bound: the kernel's is the same)."""

MAX_STDIN: Final = 16 * 1024 * 1024
"""Largest inline ``stdin``."""

MAX_SECONDS: Final = 30 * 24 * 3600.0
"""Largest timeout or grace period accepted, in seconds."""

MAX_OUTPUT_CAP: Final = 2**40
"""Schema bound of ``output_cap``; the daemon clamps it to its own limit."""

MAX_OFFSET: Final = limits.MAX_U63
"""Largest byte offset or size in a file or log (a ``u63``)."""


PathStr = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH)]
"""A path: 1 to :data:`MAX_PATH` characters; a relative one resolves against the daemon's cwd."""

Arg = Annotated[str, msgspec.Meta(max_length=MAX_ARG)]
Argv = Annotated[list[Arg], msgspec.Meta(min_length=1, max_length=MAX_ARGV)]
"""A program and its arguments, run without a shell."""

Command = Annotated[str, msgspec.Meta(max_length=MAX_COMMAND)]
"""A command line for ``/bin/sh -c``."""

EnvName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ENV_NAME)]
EnvValue = Annotated[str, msgspec.Meta(max_length=MAX_ENV_VALUE)]
Env = Annotated[dict[EnvName, EnvValue], msgspec.Meta(max_length=MAX_ENV)]
"""Variables set over the daemon's base environment."""

Unset = Annotated[list[EnvName], msgspec.Meta(max_length=MAX_ENV)]
"""Variables removed from the daemon's base environment."""

Stdin = Annotated[bytes, msgspec.Meta(max_length=MAX_STDIN)]
OutputCap = Annotated[int, msgspec.Meta(ge=0, le=MAX_OUTPUT_CAP)]

Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
"""A timeout or grace period: 0 to :data:`MAX_SECONDS`."""

Count = Annotated[int, msgspec.Meta(ge=0)]
"""A count in a result: of bytes, commands, processes."""

Offset = Annotated[int, msgspec.Meta(ge=0, le=MAX_OFFSET)]
"""A byte offset, length or size in a file or log."""
