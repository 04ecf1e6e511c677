"""Authenticated encryption of frame bodies after the handshake.

Each direction has its own key and a 64-bit frame counter that starts at 0
and grows by one per frame. The 12-byte nonce is four zero bytes followed by
the counter, big-endian; the additional data is the frame's 4-byte header.
Since the counter is implicit, a dropped, replayed, reordered or altered
frame fails to authenticate, and the receiver closes the connection.
"""

from __future__ import annotations

import struct
from typing import Final, Protocol

from protocol import limits
from protocol.errors import DecryptionFailed

_NONCE: Final = struct.Struct(">4xQ")


class _Aead(Protocol):
    def encrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes: ...

    def decrypt(
        self, nonce: bytes, data: bytes | bytearray, associated_data: bytes | None
    ) -> bytes: ...


def _make(cipher: str, key: bytes) -> _Aead:
    # Imported here: the cryptography bindings cost tens of milliseconds at
    # start-up, and plaintext connections never need them.
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    if cipher == limits.CIPHER_CHACHA20:
        return ChaCha20Poly1305(key)
    if cipher == limits.CIPHER_AESGCM:
        return AESGCM(key)
    raise ValueError(f"not an AEAD cipher: {cipher!r}")


class FrameSealer:
    """Encrypts outgoing bodies for one direction."""

    __slots__ = ("_aead", "_counter")

    def __init__(self, cipher: str, key: bytes) -> None:
        self._aead = _make(cipher, key)
        self._counter = 0

    def seal(self, header: bytes, body: bytes) -> bytes:
        """Ciphertext plus tag of ``body``, authenticated with ``header``."""
        nonce = _NONCE.pack(self._counter)
        self._counter += 1
        return self._aead.encrypt(nonce, body, header)


class FrameOpener:
    """Decrypts and authenticates incoming bodies for one direction."""

    __slots__ = ("_aead", "_counter", "_invalid_tag")

    def __init__(self, cipher: str, key: bytes) -> None:
        self._aead = _make(cipher, key)
        self._counter = 0
        from cryptography.exceptions import InvalidTag

        self._invalid_tag: type[Exception] = InvalidTag

    def open(self, header: bytes, sealed: bytes | bytearray) -> bytes:
        """The plaintext of ``sealed``; raises DecryptionFailed when it does not verify."""
        if len(sealed) < limits.AEAD_TAG_SIZE:
            raise DecryptionFailed("encrypted frame shorter than its tag")
        nonce = _NONCE.pack(self._counter)
        try:
            plain = self._aead.decrypt(nonce, sealed, header)
        except self._invalid_tag:
            raise DecryptionFailed(
                "encrypted frame failed authentication (tampered, replayed or reordered)"
            ) from None
        self._counter += 1
        return plain
