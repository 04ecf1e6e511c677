"""Vectors for other languages: section 16's test vectors and the catalogue, as JSON.

``python -m protocol.fuzz --export-vectors vectors.json`` writes one file an
implementation in any language can check itself against without Python:

* ``handshake``: every value of section 16 (inputs, transcript, MACs, keys,
  the four handshake frames and a sealed Ping), in hex;
* ``request_ids``: section 16.1's message bodies, in hex;
* ``api``: section 15.10's frames, in hex;
* ``cases``: every case of the catalogue with its section, what it sends,
  what the spec requires back, and its script (the JSON of
  :mod:`protocol.fuzz.script`, built for a server that accepts every cipher
  and has every method; sizes that depend on the server stay as expressions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from protocol.fuzz.cases import Facts, catalogue


def _hex_fields(pairs: list[tuple[str, bytes | str | int]]) -> dict[str, Any]:
    return {label: value.hex() if isinstance(value, bytes) else value for label, value in pairs}


def vectors() -> dict[str, Any]:
    """Everything the export holds, as plain data."""
    from protocol import api_vectors
    from protocol.codec import encode_message
    from protocol.vectors import all_vectors, message_vectors, vector_fields

    cases = []
    for case in catalogue():
        built = case.script_for(Facts())
        cases.append(
            {
                "id": case.id,
                "section": case.ref,
                "title": case.title,
                "sends": case.sends,
                "requires": case.requires,
                "slow": case.slow,
                "script": msgspec.to_builtins(built) if not isinstance(built, str) else None,
            }
        )
    return {
        "kit": "splitexec-fuzz",
        "format": 1,
        "handshake": [_hex_fields(vector_fields(v)) for v in all_vectors()],
        "request_ids": [
            {"label": label, "body": encode_message(m).hex()} for label, m in message_vectors()
        ],
        "api": [
            {"label": label, "frame": api_vectors.frame_of(m).hex()}
            for label, m, _ in api_vectors.CASES
        ],
        "cases": cases,
    }


def write_vectors(path: Path) -> None:
    """Write the export to ``path``."""
    path.write_bytes(msgspec.json.format(msgspec.json.encode(vectors()), indent=2) + b"\n")
