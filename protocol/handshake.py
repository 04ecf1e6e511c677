"""Mutual challenge-response authentication and per-connection key derivation.

Theory of operation
-------------------
Both sides hold the same secret token; it never crosses the wire.

1. client -> server ``Hello``: versions, a fresh 32-byte nonce Nc, offered
   ciphers in preference order, the client's frame cap and stream window.
2. server -> client ``Challenge``: the highest shared version, a fresh nonce
   Ns, the first offered cipher the server accepts, the server's cap and window.
3. client -> server ``Auth``: ``HMAC-SHA256(token, "execd client auth\\0" || T)``
4. server -> client ``Welcome``: ``HMAC-SHA256(token, "execd server auth\\0" || T)``

``T`` (:func:`transcript`) binds every negotiated value and both nonces, so a
downgrade of the cipher or a replayed Auth (the server's nonce is fresh each
time) fails. The server proves itself only after the client has, so an
unauthenticated peer learns nothing. Per-connection keys come from
``HKDF-SHA256(ikm=token, salt=SHA256(T), info="execd v1 frame keys")``: 64
bytes, the first 32 protecting client-to-server frames, the last 32 the other
direction.

The token must be high-entropy (execd and harnessd make 32 random bytes): a
recorded transcript lets an eavesdropper test guesses of a weak one offline.
Every reader turns what it was given into the same bytes with
:func:`token_bytes` (PROTOCOL.md 6.8).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Final

import msgspec

from protocol import limits

TRANSCRIPT_LABEL: Final = b"execd-handshake-v1\x00"
CLIENT_LABEL: Final = b"execd client auth\x00"
SERVER_LABEL: Final = b"execd server auth\x00"
KEY_INFO: Final = b"execd v1 frame keys"
KEY_SIZE: Final = 32
MAX_TOKEN_BYTES: Final = 4096
"""The most a reader takes from a token file; longer tokens are refused."""

_ASCII_WHITESPACE: Final = b" \t\n\x0b\x0c\r"


class EmptyToken(ValueError):
    """Nothing is left of a token once the whitespace at its ends is removed."""


def token_bytes(token: bytes | str) -> bytes:
    """The token's byte form: what the MACs and the key derivation are keyed with.

    A ``str`` (a parameter, an environment variable) is encoded as UTF-8
    (undecodable bytes that ``os.environ`` escaped come back as they were).
    Then leading and trailing ASCII whitespace -- space, tab, LF, VT, FF, CR --
    is removed, exactly as ``bytes.strip()`` does, so a file written by
    ``echo`` works; nothing else changes (no decoding of hex or base64).
    Raises :class:`EmptyToken` (a ValueError) when nothing is left, and
    ValueError when more than :data:`MAX_TOKEN_BYTES` are.
    """
    raw = token.encode("utf-8", "surrogateescape") if isinstance(token, str) else bytes(token)
    stripped = raw.strip(_ASCII_WHITESPACE)
    if not stripped:
        raise EmptyToken("the token is empty")
    if len(stripped) > MAX_TOKEN_BYTES:
        raise ValueError(f"the token is longer than {MAX_TOKEN_BYTES} bytes")
    return stripped


class Negotiated(msgspec.Struct, frozen=True):
    """Everything both sides agreed on, as it enters the transcript."""

    version: int
    client_nonce: bytes
    server_nonce: bytes
    offered_ciphers: tuple[str, ...]
    cipher: str
    client_max_frame: int
    server_max_frame: int
    client_window: int
    server_window: int


def _short_string(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > 255:
        raise ValueError("string too long for the transcript")
    return bytes([len(raw)]) + raw


def transcript(n: Negotiated) -> bytes:
    """The byte string both MACs and the key derivation are computed over.

    Layout (all integers big-endian)::

        "execd-handshake-v1\\0"
        u32 version
        32  client nonce
        32  server nonce
        u8  count of offered ciphers, then each as u8 length + UTF-8 name
        u8 length + chosen cipher name
        u32 client max_frame, u32 server max_frame
        u32 client window,    u32 server window
    """
    if len(n.client_nonce) != limits.NONCE_SIZE or len(n.server_nonce) != limits.NONCE_SIZE:
        raise ValueError("nonces must be 32 bytes")
    parts = [
        TRANSCRIPT_LABEL,
        struct.pack(">I", n.version),
        n.client_nonce,
        n.server_nonce,
        bytes([len(n.offered_ciphers)]),
        *(_short_string(c) for c in n.offered_ciphers),
        _short_string(n.cipher),
        struct.pack(
            ">IIII", n.client_max_frame, n.server_max_frame, n.client_window, n.server_window
        ),
    ]
    return b"".join(parts)


def client_mac(token: bytes, transcript_bytes: bytes) -> bytes:
    """The client's proof of the token."""
    return hmac.digest(token, CLIENT_LABEL + transcript_bytes, "sha256")


def server_mac(token: bytes, transcript_bytes: bytes) -> bytes:
    """The server's proof of the token."""
    return hmac.digest(token, SERVER_LABEL + transcript_bytes, "sha256")


def verify_mac(expected: bytes, received: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(expected, received)


class FrameKeys(msgspec.Struct, frozen=True):
    """The two per-connection directional keys."""

    client_to_server: bytes
    server_to_client: bytes


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 HKDF with SHA-256: extract, then expand to ``length`` bytes."""
    if length > 255 * hashlib.sha256().digest_size:
        raise ValueError("HKDF-SHA256 cannot produce that many bytes")
    prk = hmac.digest(salt, ikm, "sha256")
    okm = b""
    block = b""
    counter = 1
    while len(okm) < length:
        block = hmac.digest(prk, block + info + bytes([counter]), "sha256")
        okm += block
        counter += 1
    return okm[:length]


def derive_keys(token: bytes, transcript_bytes: bytes) -> FrameKeys:
    """HKDF-SHA256 the token into two 32-byte directional frame keys."""
    okm = hkdf_sha256(token, hashlib.sha256(transcript_bytes).digest(), KEY_INFO, 2 * KEY_SIZE)
    return FrameKeys(client_to_server=okm[:KEY_SIZE], server_to_client=okm[KEY_SIZE:])


def choose_version(offered: list[int]) -> int | None:
    """The highest version both sides speak, or None."""
    shared = set(offered) & set(limits.SUPPORTED_VERSIONS)
    return max(shared) if shared else None


def choose_cipher(offered: list[str], accepted: tuple[str, ...]) -> str | None:
    """The first cipher in the client's order that the server accepts, or None."""
    for name in offered:
        if name in accepted and name in limits.KNOWN_CIPHERS:
            return name
    return None
