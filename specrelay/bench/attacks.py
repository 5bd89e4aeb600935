"""Hostile traffic for tests and `specrelay bench fuzz`: malformed frames and valid-but-abusive requests.

`Fuzzer(seed)` produces multipart messages (lists of frames, without the ROUTER's routing id) the way an
attacker with a raw ZeroMQ socket would send them: random bytes, wrong versions and types, bodies of the wrong
shape, out-of-range fields, too many frames, replies a worker never owes, OPEN floods, prompts longer than any
model's context. Deterministic for a seed.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import msgspec

from ..common import protocol as P
from ..common.protocol import MsgType

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


# ---- routing-id squatting (libzmq 4.3.5) ------------------------------------------------------------

def glibc_rand() -> Iterator[int]:
    """glibc's rand() in a process that never called srand() (seed 1): the TYPE_3 additive feedback generator
    r[i] = r[i-31] + r[i-3] (mod 2^32), outputs r[i] >> 1 from i = 344 on."""
    r = [1]
    for i in range(1, 31):
        r.append(16807 * r[i - 1] % 2147483647)
    r += r[:3]
    i = 34
    while True:
        r.append((r[i - 31] + r[i - 3]) & 0xFFFFFFFF)
        if i >= 344:
            yield r[i] >> 1
        i += 1


def predicted_routing_ids(count: int = 32, sockets: int = 4) -> list[bytes]:
    """The ids unseeded ROUTERs generate for peers that send none: `0x00` + big-endian uint32 counter, starting
    at libzmq's generate_random() = rand() | rand() << 31, read when the socket is made. The k-th ROUTER (or REP:
    the ZAP handler's socket) a process makes starts at its k-th pair of rand() outputs; this covers the first
    `sockets` of them, count // sockets consecutive ids each."""
    outputs = list(itertools.islice(glibc_rand(), 2 * sockets))
    starts = [(outputs[2 * k] | outputs[2 * k + 1] << 31) & 0xFFFFFFFF for k in range(sockets)]
    return [b"\x00" + ((start + i) & 0xFFFFFFFF).to_bytes(4, "big") for start in starts
            for i in range(count // sockets)]


def squat(endpoint: str, ids: list[bytes], *, curve=None, anonymous: int = 5, timeout: float = 20.0) -> list:
    """The attack of issue 18 item 1: one DEALER per id in `ids` (ids the peer chooses itself), each connected
    and handshaken, then `anonymous` DEALERs without an id, one after the other. Against a ROUTER whose next
    generated id is squatted, libzmq 4.3.5 asserts and aborts. Returns (context, sockets) for the caller to
    close. Blocking (plain zmq): run it in a thread from asyncio."""
    import zmq

    from ..common import transport

    ctx = zmq.Context()
    socks = []
    try:
        for identity in [*ids, *[None] * anonymous]:
            sock = transport.make_socket(ctx, zmq.DEALER, linger_ms=0, identity=identity, curve=curve)
            socks.append(sock)
            connect_and_handshake(sock, endpoint, timeout)
    except BaseException:
        _close_all(ctx, socks)
        raise
    return [ctx, socks]


def connect_and_handshake(sock, endpoint: str, timeout: float) -> None:
    """Connect and wait for the ZMTP handshake (EVENT_HANDSHAKE_SUCCEEDED); a refused key fails at once."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    try:
        sock.connect(endpoint)
        if not monitor.poll(int(timeout * 1000)):
            raise TimeoutError(f"no handshake with {endpoint} in {timeout:.0f}s")
        event = recv_monitor_message(monitor)["event"]
        if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
            raise ConnectionRefusedError(f"{endpoint} refused the handshake (event {event})")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def _close_all(ctx, socks) -> None:
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


def end_squat(squatted) -> None:
    _close_all(*squatted)
