"""The shared-vocabulary bitmap on the wire (OPEN.shared_vocab, OPEN.shared_vocab_hash).

V_c travels as one bit per target id (numpy packbits, little bit order), `(V + 7) // 8` bytes: 32 KiB for a
262,144-token target. An edge sends it with its first OPEN for a pair and names it by `digest` after that; a
worker keeps the bitmaps it was sent (cloud_worker/bitmaps.py) and answers UNKNOWN_VOCAB to a hash it lacks.
When it travels, it is zlib-compressed whenever that is shorter (gemma-3-270m's 262,144 ids with SmolLM2-135M as
the draft: 18.7 KB); the receiver tells the forms apart by length: exactly `(V + 7) // 8` bytes is packed.
"""

from __future__ import annotations

import hashlib
import zlib

import numpy as np

from .errors import InvalidRequest

DIGEST_BYTES = 16  # of SHA-256: a collision needs ~2**64 bitmaps; 16 bytes on the wire per OPEN


def digest(packed: bytes) -> bytes:
    """The content hash that names a packed bitmap."""
    return hashlib.sha256(packed).digest()[:DIGEST_BYTES]


def pack(mask: np.ndarray) -> tuple[bytes, bytes]:
    """(wire form, digest) of a [V] bool mask: zlib-compressed when shorter, else packed."""
    packed = np.packbits(mask.astype(bool), bitorder="little").tobytes()
    small = zlib.compress(packed, 9)
    return (small if len(small) < len(packed) else packed), digest(packed)


def unpack(wire: bytes, vocab_size: int) -> bytes:
    """The packed bitmap of a wire form for a `vocab_size`-token target; InvalidRequest naming shared_vocab when it
    is neither. Decompression stops at the packed size, so a small frame cannot inflate past it."""
    size = (vocab_size + 7) // 8
    if len(wire) == size:
        return wire
    inflate = zlib.decompressobj()
    try:
        packed = inflate.decompress(wire, size)
    except zlib.error:
        packed = b""
    if len(packed) != size or not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
        raise InvalidRequest(f"shared_vocab must be {size} bytes of bits for a {vocab_size}-token target, or their "
                             "zlib stream", field="shared_vocab")
    return packed


def to_mask(packed: bytes, vocab_size: int) -> np.ndarray:
    """[vocab_size] bool of a packed bitmap."""
    return np.unpackbits(np.frombuffer(packed, dtype=np.uint8), bitorder="little")[:vocab_size].astype(bool)
