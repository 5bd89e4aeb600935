"""How values pack into the protocol's MessagePack bodies (common/protocol.py holds the messages): an enum
member from its name or int (the Python API's boundary), float32 probability arrays as bytes, an array's length
from its header, a decoder of a message's first fields, the field a msgspec error points at, and the defaults
`encode` leaves off a message's end. numpy and torch load with the first float array only: the broker, which
reads no tensor, never loads them."""

from __future__ import annotations

import enum
import re

import msgspec

from .errors import InvalidRequest


def enum_value(kind: type[enum.IntEnum], value, field: str):
    """A member of `kind` from a member, its int or its name in any case ('srdv' -> Strategy.SRDV); None stays
    None. Anything else raises InvalidRequest naming the field and the choices (the Python API's boundary)."""
    if value is None or isinstance(value, kind):
        return value
    try:
        return kind[value.upper()] if isinstance(value, str) else kind(value)
    except (KeyError, ValueError):
        choices = ", ".join(m.name.lower() for m in kind)
        raise InvalidRequest(f"{field} must be one of {choices}, got {value!r}", field=field) from None


def f32(values) -> bytes:
    """float32 little-endian bytes of a 1-D tensor / sequence."""
    import numpy as np

    if hasattr(values, "detach"):
        values = values.detach().to("cpu").float().numpy()
    return np.asarray(values, dtype="<f4").tobytes()


def from_f32(data: bytes, expected: int | None = None, field: str = "p"):
    """bytes -> float32 tensor [n] of finite probabilities >= 0; checks the length (and, if given, the element
    count), raising InvalidRequest naming the field."""
    import numpy as np
    import torch

    if len(data) % 4:
        raise InvalidRequest(f"{field} must be float32 bytes (length divisible by 4), got {len(data)}", field=field)
    arr = np.frombuffer(data, dtype="<f4")
    if expected is not None and arr.shape[0] != expected:
        raise InvalidRequest(f"{field} has {arr.shape[0]} values, expected {expected}", field=field)
    if not (np.isfinite(arr).all() and (arr >= 0).all()):
        raise InvalidRequest(f"{field} must hold finite probabilities >= 0", field=field)
    return torch.from_numpy(arr.copy())


def array_length(raw: msgspec.Raw) -> int:
    """The element count of an undecoded MessagePack array, from its header alone; -1 if it is no array."""
    head = bytes(memoryview(raw)[:5])  # a tag and at most 4 length bytes
    tag = head[0] if head else 0
    if 0x90 <= tag <= 0x9F:  # fixarray
        return tag & 0x0F
    width = {0xDC: 2, 0xDD: 4}.get(tag, 0)  # array 16 / array 32: the length's bytes
    return int.from_bytes(head[1:1 + width], "big") if width and len(head) > width else -1


def field_name(cls: type[msgspec.Struct], error: str) -> str:
    """msgspec reports an array_like Struct's positions as `$[i]`; the name of that field ("body" if none)."""
    m = re.search(r"\$\[(\d+)\]", error)
    if not m:
        return "body"
    i = int(m.group(1))
    return cls.__struct_fields__[i] if i < len(cls.__struct_fields__) else f"[{i}]"


def field_defaults(cls: type[msgspec.Struct]) -> tuple:
    """Each field's default (NODEFAULT for a required one), in order."""
    return tuple(f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
                 if f.default_factory is not msgspec.NODEFAULT else msgspec.NODEFAULT
                 for f in msgspec.structs.fields(cls))


def prefix_decoder(cls: type[msgspec.Struct], n: int, **types: object) -> msgspec.msgpack.Decoder:
    """A decoder of the first `n` fields of an array_like Struct (`types` replacing some of their types), that
    skips the rest of the array without building it."""
    fields = [(f.name, types.get(f.name, f.type), msgspec.field(default=f.default, default_factory=f.default_factory))
              for f in msgspec.structs.fields(cls)[:n]]
    head = msgspec.defstruct(cls.__name__ + "Head", fields, array_like=True, forbid_unknown_fields=False)
    return msgspec.msgpack.Decoder(head)
