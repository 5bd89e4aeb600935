"""The broker's tables: live workers, edge connections, open sessions with their requests in flight, counters,
and `Tables`, which holds them with the edits that keep them consistent and addresses every action.

Records carry the few rules that belong to one record. The failure rule builds on `Tables` in
`liveness.Liveness`, the routing decisions on that in `routing.Router`; quotas are `quotas.Quotas`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from dataclasses import dataclass, field

from specrelay.common import protocol
from specrelay.common.errors import ErrorCode
from specrelay.common.protocol import MsgType, SessionKey
from specrelay.common.ratelimit import TokenBucket

from .quotas import Limits, Quotas

FRONTEND = "frontend"
BACKEND = "backend"
Action = tuple[str, list[bytes]]  # (socket name, frames) for the shell to send


NOMINAL_SESSIONS = 1024  # a worker's session count for load estimates when it declares none (or more)

# which requests a reply can answer (ERROR answers any of them)
_ANSWERS = {MsgType.VERDICT: {MsgType.VERIFY, MsgType.OPEN}, MsgType.RESAMPLED: {MsgType.RESAMPLE}}


@dataclass
class Worker:
    identity: bytes
    max_sessions: int        # <= 0: the worker declared no limit
    expires: float           # dead when `now` reaches this without a message from it
    serial: int              # registration order: the deterministic tie-break between equal loads
    model: str = ""
    sessions: set[SessionKey] = field(default_factory=set)
    kv_capacity: int = 0     # KV token slots (READY); 0: the worker does not report KV memory
    kv_free: int = 0         # free KV token slots at its last heartbeat
    kv_load: int = 0         # its open sessions at that heartbeat
    user: str | None = None  # the CURVE key it registered with: only that key may speak under its routing id

    @property
    def full(self) -> bool:
        return 0 < self.max_sessions <= len(self.sessions)

    def heard(self, beat) -> None:
        """A HEARTBEAT from the worker: its free KV memory and open sessions, clamped to what it declared in
        READY and to the sessions the broker gave it (a worker cannot claim more room than it has)."""
        self.kv_free = min(max(beat.kv_free, 0), self.kv_capacity)
        self.kv_load = min(max(beat.load, 0), len(self.sessions))

    @property
    def nominal_sessions(self) -> int:
        return min(self.max_sessions, NOMINAL_SESSIONS) if self.max_sessions > 0 else NOMINAL_SESSIONS

    @property
    def free_fraction(self) -> float:
        """Estimated share of its KV memory still free: the last report, less what the sessions assigned since
        then are likely to take (its average per session). Without KV reports: its free session slots."""
        if self.kv_capacity <= 0:
            return 1.0 - len(self.sessions) / self.nominal_sessions
        used = self.kv_capacity - self.kv_free
        per_session = used / self.kv_load if self.kv_load else self.kv_capacity / self.nominal_sessions
        pending = max(0, len(self.sessions) - self.kv_load)
        return (self.kv_free - pending * per_session) / self.kv_capacity


@dataclass
class Session:
    """One open session, keyed in `Router.sessions` by (edge, the edge's session id). `booked` once its
    worker has accepted it (its first VERDICT); until then an ERROR for it frees it again."""

    edge: bytes
    worker: bytes
    client: object                 # whose quota it counts against (`Peer.client`)
    tokens: int = 0                # prompt tokens of its OPEN, counted against the client's token quota
    booked: bool = False
    in_flight: list[tuple[MsgType, int]] = field(default_factory=list)  # (request type, seq), oldest first

    def settle(self, reply: MsgType, seq: int) -> None:
        """A reply settles the oldest request in flight with its seq and a type it can answer, and every
        OPEN sent before it (a worker handles a session's messages in order). No match: only the OPENs."""
        kinds = _ANSWERS.get(reply)
        match = next((i for i, (kind, s) in enumerate(self.in_flight)
                      if s == seq and (kinds is None or kind in kinds)), None)
        end = len(self.in_flight) if match is None else match
        earlier = [r for r in self.in_flight[:end] if r[0] != MsgType.OPEN]
        self.in_flight = earlier + (self.in_flight[end + 1:] if match is not None else [])

    def unsettle(self, msg_type: MsgType, seq: int) -> bool:
        """Forget the newest record of a request that never reached its worker (False: there was none)."""
        for i in range(len(self.in_flight) - 1, -1, -1):
            if self.in_flight[i] == (msg_type, seq):
                del self.in_flight[i]
                return True
        return False

    def lost_seqs(self) -> list[int]:
        """The seqs to answer WORKER_LOST: each VERIFY/RESAMPLE in flight, else 0 for an unanswered OPEN
        (an OPEN's loss is implied by the loss of the requests sent after it, so it is not repeated)."""
        seqs = [seq for kind, seq in self.in_flight if kind != MsgType.OPEN]
        if seqs or not self.in_flight:
            return seqs
        return [0]


@dataclass
class Peer:
    """An edge connection on the frontend: its routing id, the key it authenticated with (None without CURVE),
    when it expires without a message, and a token bucket for answering its bad requests."""

    edge: bytes
    user: str | None
    expires: float
    bad_replies: TokenBucket
    sessions: set[SessionKey] = field(default_factory=set)

    @property
    def client(self) -> object:
        """Quota owner: the key with CURVE (all connections of one key share it), else this connection."""
        return self.user if self.user is not None else self.edge


@dataclass
class Stats:
    """Counters since start, plus three gauges (sessions_open, live_workers, live_edges)."""

    frontend_in: int = 0
    frontend_out: int = 0
    backend_in: int = 0
    backend_out: int = 0
    bad_requests: int = 0             # BAD_REQUEST sent to edges
    bad_worker_messages: int = 0      # malformed or unexpected worker messages, dropped
    unknown_worker_messages: int = 0  # from a worker not (or no longer) registered, dropped
    worker_lost_sent: int = 0
    unknown_session_sent: int = 0
    unavailable_sent: int = 0
    unroutable: int = 0               # sends that failed: peer gone or its queue full
    workers_lost: int = 0
    foreign_replies: int = 0          # worker replies for sessions that worker does not hold, dropped
    rejected_opens: int = 0           # OPENs a worker refused: the session was never booked, freed again
    quota_refusals: int = 0           # requests refused by a quota (quotas.Limits; UNAVAILABLE)
    edges_expired: int = 0            # edges silent past edge_ttl: their sessions closed for them
    bad_requests_unanswered: int = 0  # past an edge's BAD_REQUEST budget: counted, not answered
    internal_errors: int = 0          # bugs caught by the shell; the message was dropped
    sessions_open: int = 0
    live_workers: int = 0
    live_edges: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class EdgeHandles:
    """What workers see instead of an edge's routing id: keyed hashes (the key drawn at start) of its client
    (`protocol.CLIENT_TAG` bytes: the CURVE key, else the routing id; a worker shares its budgets per client by
    them) and of its routing id (16 bytes), so no worker learns the ids the frontend generates (`0x00` + a counter
    no peer may know) or the keys. Maps a handle back to the routing id for the edges added and not yet removed,
    and keeps their handles (a keyed hash costs about a microsecond, more than the rest of a request's routing)."""

    def __init__(self) -> None:
        self._key = os.urandom(32)
        self._edges: dict[bytes, bytes] = {}    # handle -> routing id, for the live edges
        self._handles: dict[bytes, bytes] = {}  # routing id -> handle, the same edges

    def of(self, edge: bytes) -> bytes:
        handle = self._handles.get(edge)
        return handle if handle is not None else self._handle(edge, edge)

    def add(self, edge: bytes, client: object = None) -> None:
        """A live edge connection; `client`: its CURVE key (None: the connection is its own client)."""
        handle = self._handles[edge] = self._handle(edge, edge if client is None else str(client).encode())
        self._edges[handle] = edge

    def remove(self, edge: bytes) -> None:
        self._edges.pop(self._handles.pop(edge, None) or self._handle(edge, edge), None)

    def edge(self, handle: bytes) -> bytes:
        """The routing id behind `handle`; b"" for a handle of no live edge."""
        return self._edges.get(handle, b"")

    def _handle(self, edge: bytes, client: bytes) -> bytes:
        tag = hashlib.blake2b(b"client:" + client, key=self._key, digest_size=protocol.CLIENT_TAG).digest()
        return tag + hashlib.blake2b(edge, key=self._key, digest_size=16).digest()


class Tables:
    """The broker's state: live workers, edge connections and open sessions, each client's quota, counters. Its
    edits keep the tables agreeing with each other; every action leaves through `_to_edge` / `_to_worker`."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.workers: dict[bytes, Worker] = {}
        self.peers: dict[bytes, Peer] = {}
        self.sessions: dict[SessionKey, Session] = {}  # (edge_id, the edge's session id) -> session
        self.quotas = Quotas(limits)
        self.limits = self.quotas.limits
        self.stats = Stats()
        self.handles = EdgeHandles()  # what workers see for each edge in `peers`
        self._serials = itertools.count()  # workers' registration order

    def _forget(self, key: SessionKey) -> Session:
        """Drop a session and give its quota back."""
        session = self.sessions.pop(key)
        worker = self.workers.get(session.worker)
        if worker is not None:
            worker.sessions.discard(key)
        peer = self.peers.get(key[0])
        if peer is not None:
            peer.sessions.discard(key)
        self.quotas.closed(session.client, session.tokens, len(session.in_flight))
        self._gauges()
        return session

    def _gauges(self) -> None:
        self.stats.sessions_open = len(self.sessions)
        self.stats.live_workers = len(self.workers)

    def _to_edge(self, edge: bytes, message: list[bytes]) -> Action:
        self.stats.frontend_out += 1
        return FRONTEND, [edge, *message]

    def _to_worker(self, worker_id: bytes, edge: bytes, message: list[bytes]) -> Action:
        self.stats.backend_out += 1
        return BACKEND, [worker_id, self.handles.of(edge) if edge else b"", *message]

    def _disconnect(self, worker_id: bytes, reason: str) -> Action:
        return self._to_worker(worker_id, b"", protocol.encode(protocol.Disconnect(reason=reason)))

    def _error(self, edge: bytes, session_id: int, seq: int, code: ErrorCode, message: str) -> Action:
        return self._to_edge(edge, protocol.encode(protocol.Error(session=session_id, seq=seq, code=code,
                                                                  message=message)))
