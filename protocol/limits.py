"""Framing constants and protocol limits: the one home of every wire number."""

from __future__ import annotations

#: Current protocol version; the handshake negotiates the highest shared one.
PROTOCOL_VERSION = 1
#: Every version this implementation speaks.
SUPPORTED_VERSIONS: tuple[int, ...] = (1,)

#: Length of the frame header: a big-endian unsigned 32-bit body length.
HEADER_SIZE = 4
#: Largest value the header can express.
MAX_HEADER_VALUE = 0xFFFF_FFFF

#: Default cap on one frame's body once authenticated (16 MiB).
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
#: Smallest cap a peer may announce: below this, handshake messages cannot fit.
MIN_MAX_FRAME = 4 * 1024
#: Largest cap a peer may announce (1 GiB).
MAX_MAX_FRAME = 1024 * 1024 * 1024
#: Cap on every frame received before the handshake completes.
PREAUTH_MAX_FRAME = 4 * 1024

#: Default per-stream window: stream bytes a receiver accepts before granting credit.
DEFAULT_STREAM_WINDOW = 4 * 1024 * 1024
#: Smallest and largest window a peer may announce.
MIN_STREAM_WINDOW = 4 * 1024
MAX_STREAM_WINDOW = 1024 * 1024 * 1024

#: Nonce length each side contributes to the handshake.
NONCE_SIZE = 32
#: Bytes of a request id (random; PROTOCOL.md section 8.1).
REQUEST_ID_SIZE = 16
#: Length of an HMAC-SHA256 tag.
MAC_SIZE = 32
#: Length of the AEAD authentication tag appended to every encrypted body.
AEAD_TAG_SIZE = 16
#: Room reserved in a frame for the Chunk envelope around its data.
CHUNK_OVERHEAD = 1024
#: Room reserved in a frame for the Reply envelope around its result.
REPLY_OVERHEAD = 64

#: Longest method, stream or event name.
MAX_NAME = 128
#: Longest error message carried on the wire.
MAX_ERROR_MESSAGE = 4096
#: Distinct stream names one call may open per direction.
MAX_STREAMS_PER_CALL = 8
#: Largest ``u63``: the wire's ids, seqs, offsets and sizes stay below 2^63 so that every
#: msgpack library can carry them.
MAX_U63 = 2**63 - 1
#: Largest call id.
MAX_CALL_ID = MAX_U63

#: Cipher names, in this implementation's order of preference.
CIPHER_NONE = "none"
CIPHER_CHACHA20 = "chacha20-poly1305"
CIPHER_AESGCM = "aes-256-gcm"
KNOWN_CIPHERS: tuple[str, ...] = (CIPHER_AESGCM, CIPHER_CHACHA20, CIPHER_NONE)
