"""What the broker reads of a message: only the leading fields it routes on, never a tensor.

  read_head(type, body)  -> (session, seq) of a session-scoped body (seq 0 for OPEN / CLOSE)
  open_tokens(body)      -> how many prompt tokens an OPEN carries (for the per-client token quota)
"""

from __future__ import annotations

import msgspec

from specrelay.common import protocol
from specrelay.common.errors import InvalidRequest
from specrelay.common.protocol import CLOUD_REPLIES, MsgType

_SEQ_TYPES = frozenset({MsgType.VERIFY, MsgType.RESAMPLE}) | CLOUD_REPLIES


class _Head(protocol.Base):
    """[session, seq]: the first two fields of VERIFY, RESAMPLE, VERDICT and RESAMPLED bodies."""

    session: protocol.U63
    seq: protocol.U63


class _ErrorHead(protocol.Base):
    session: protocol.U63
    seq: protocol.U63 = 0  # ERROR omits a zero seq


class _OpenHead(protocol.Base):
    session: protocol.U63
    tokens: msgspec.Raw  # the array's bytes, undecoded: only its length is read


_head_decoders = {t: msgspec.msgpack.Decoder(_ErrorHead if t == MsgType.ERROR else _Head) for t in _SEQ_TYPES}
_open_decoder = msgspec.msgpack.Decoder(_OpenHead)


def read_head(msg_type: MsgType, body: bytes) -> tuple[int, int]:
    """(session, seq) of a session-scoped body, decoding nothing past them; seq is 0 for OPEN/CLOSE."""
    if msg_type not in _SEQ_TYPES:
        return protocol.session_of(body), 0
    try:
        head = _head_decoders[msg_type].decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        protocol.session_of(body)  # raises, naming the session, when that is the fault
        raise InvalidRequest(f"{msg_type.name}.seq is missing or invalid: {exc}", field="seq") from None
    return head.session, head.seq


def open_tokens(body: bytes) -> int:
    """The length of OPEN.tokens, read from the MessagePack array header (the worker validates the ids)."""
    try:
        raw = bytes(_open_decoder.decode(body).tokens)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(f"OPEN.tokens is missing or invalid: {exc}", field="tokens") from None
    tag = raw[0] if raw else 0
    if 0x90 <= tag <= 0x9F:  # fixarray
        n = tag & 0x0F
    elif tag == 0xDC and len(raw) >= 3:  # array 16
        n = int.from_bytes(raw[1:3], "big")
    elif tag == 0xDD and len(raw) >= 5:  # array 32
        n = int.from_bytes(raw[1:5], "big")
    else:
        raise InvalidRequest("OPEN.tokens must be an array of token ids", field="tokens")
    if not 1 <= n <= protocol.MAX_CONTEXT:
        raise InvalidRequest(f"OPEN.tokens holds {n} ids; 1..{protocol.MAX_CONTEXT} allowed", field="tokens")
    return n

