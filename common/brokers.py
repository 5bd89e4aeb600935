"""Several brokers: the endpoint list a process is given, the CURVE key of each, and which broker a session uses.

Pure (no sockets). Edges and cloud workers take `--broker` repeated or as a comma list (and from SPECRELAY_BROKER);
`broker_list` reads either into a tuple, refusing a bad list in one sentence. A worker registers with every broker
of its list; an edge sends each session to one broker, `choose`: rendezvous hashing of (edge salt, session id)
over the brokers that are up, so a session keeps its broker while that broker stays up, only a lost broker's
sessions move, and a broker that comes back takes new sessions again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TypeVar

MAX_BROKERS = 16  # a cloud worker's session keys carry the broker's index in one byte; 16 is far past any tier
SCHEMES = ("tcp://", "ipc://", "inproc://")

T = TypeVar("T")


def broker_list(value: str | Iterable[str], flag: str = "--broker") -> tuple[str, ...]:
    """"tcp://a:5555,tcp://b:5555" or ["tcp://a:5555", "tcp://b:5555"] (items may be comma lists) -> the endpoints,
    in order. ValueError, one sentence naming `flag`, for an empty item, a missing scheme, a repeat, too many."""
    items = [value] if isinstance(value, str) else list(value)
    endpoints = [part.strip() for item in items for part in str(item).split(",")]
    if not endpoints or any(not e for e in endpoints):
        raise ValueError(f"{flag}: an empty endpoint in {','.join(endpoints)!r}")
    for endpoint in endpoints:
        if not endpoint.startswith(SCHEMES):
            raise ValueError(f"{flag}: {endpoint!r} is not an endpoint (tcp://HOST:PORT, ipc://PATH or inproc://NAME)")
    repeated = sorted({e for e in endpoints if endpoints.count(e) > 1})
    if repeated:
        raise ValueError(f"{flag}: {repeated[0]} is given twice")
    if len(endpoints) > MAX_BROKERS:
        raise ValueError(f"{flag}: {len(endpoints)} brokers; at most {MAX_BROKERS}")
    return tuple(endpoints)


def per_broker(values: T | Sequence[T] | None, n_brokers: int, what: str = "--broker-key") -> list[T | None]:
    """One value for every broker (a single value, or a sequence of one), or one per broker in `--broker`'s
    order -> a list of `n_brokers`; any other count is a ValueError in one sentence."""
    if values is None or not isinstance(values, (list, tuple)):
        return [values] * n_brokers
    if len(values) == 1:
        return list(values) * n_brokers
    if len(values) != n_brokers:
        raise ValueError(f"{what}: {len(values)} given for {n_brokers} brokers; give one for all of them, or one "
                         "per --broker in the same order")
    return list(values)


def choose(session: int, candidates: Sequence[int], salt: bytes = b"") -> int:
    """The broker (an index of `candidates`' values) for `session`: the highest hash of (salt, session, broker).
    Stable while `candidates` holds it; removing another broker never moves it. `salt` differs per edge, so edges
    numbering their sessions alike still spread them."""
    if not candidates:
        raise ValueError("no broker to choose from")
    key = salt + session.to_bytes(8, "little")
    return max(candidates, key=lambda index: hashlib.blake2b(key + bytes([index]), digest_size=8).digest())
