"""Hostile traffic for tests and `specrelay bench fuzz`: malformed frames and valid-but-abusive requests.

`Fuzzer(seed)` produces multipart messages (lists of frames, without the ROUTER's routing id) the way an
attacker with a raw ZeroMQ socket would send them: random bytes, wrong versions and types, bodies of the wrong
shape, out-of-range fields, too many frames, replies a worker never owes, OPEN floods, prompts longer than any
model's context. Deterministic for a seed.
"""

from __future__ import annotations

import random

import msgspec

from .common import protocol as P
from .common.protocol import MsgType

_ENCODE = msgspec.msgpack.encode


class Fuzzer:
    def __init__(self, seed: int = 0, vocab_size: int = 300) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab_size

    # ---- building blocks ---------------------------------------------------------------------------
    def _value(self, depth: int = 0):
        """A random MessagePack-able value: the wrong type in any field."""
        r = self.rng
        kinds = [lambda: r.randint(-2**63, 2**64 - 1), lambda: r.random() * 1e308 * r.choice((-1, 1)),
                 lambda: float("nan"), lambda: r.randbytes(r.randint(0, 24)), lambda: "x" * r.randint(0, 12),
                 lambda: None, lambda: r.choice((True, False)), lambda: r.randint(0, 300)]
        if depth < 2:
            kinds.append(lambda: [self._value(depth + 1) for _ in range(r.randint(0, 5))])
            kinds.append(lambda: {"k%d" % i: self._value(depth + 1) for i in range(r.randint(0, 3))})
        return r.choice(kinds)()

    def _header(self) -> bytes:
        r = self.rng
        if r.random() < 0.1:
            return r.randbytes(r.randint(0, 4))
        version = P.PROTOCOL_VERSION if r.random() < 0.9 else r.randint(0, 255)
        return bytes((version, r.choice([*map(int, MsgType), 0, 99, 255])))

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    # ---- messages ----------------------------------------------------------------------------------
    def malformed(self) -> list[bytes]:
        """One malformed message: random frames, or a header with a body of the wrong shape."""
        r = self.rng
        choice = r.randrange(6)
        if choice == 0:
            return [r.randbytes(r.randint(0, 40)) for _ in range(r.randint(1, 7))]
        if choice == 1:
            return [self._header(), _ENCODE([self._value() for _ in range(r.randint(0, 9))])]
        if choice == 2:  # a valid session head, then garbage: routed by the broker, refused by the worker
            return [self._header(), _ENCODE([r.randint(1, 50), r.randint(0, 5), *[self._value() for _ in range(3)]])]
        if choice == 3:
            return [self._header(), r.randbytes(r.randint(0, 30))]
        if choice == 4:  # too many frames
            return [self._header(), b"\x91\x01", *[b"x"] * r.randint(1, 9)]
        return [self._header(), _ENCODE(self._value())]

    def abusive(self, session_base: int = 10_000) -> list[bytes]:
        """One well-formed but abusive request: OPEN floods, unknown sessions, long prompts, bad token ids."""
        r = self.rng
        sid = session_base + r.randrange(100_000)
        choice = r.randrange(5)
        if choice == 0:
            return P.encode(P.Open(sid, self._ids(r.randint(1, 32))))
        if choice == 1:
            return P.encode(P.Open(sid, self._ids(r.choice((2048, 8192, P.MAX_CONTEXT)))))
        if choice == 2:
            return P.encode(P.Verify(sid, r.randint(1, 9), r.randint(0, 500), [], self._ids(r.randint(0, 8))))
        if choice == 3:
            return P.encode(P.Open(sid, [self.vocab + r.randrange(1000)]))  # token ids outside the vocabulary
        return P.encode(P.Close(sid))

    def worker_reply(self) -> list[bytes]:
        """What a rogue worker sends the broker (after the client-id frame): forged replies, garbage."""
        r = self.rng
        client = r.choice([b"", r.randbytes(5), b"\x00" + r.randbytes(4)])
        if r.random() < 0.5:
            sid = r.randint(1, 60)
            forged = r.choice([P.Verdict(sid, r.randint(0, 9), 0, r.randrange(self.vocab)),
                               P.Error(sid, 0, P.ErrorCode.BAD_REQUEST, "forged")])
            return [client, *P.encode(forged)]
        return [client, *self.malformed()]
