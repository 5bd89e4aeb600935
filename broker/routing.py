"""The broker's routing core: worker registry, session table and in-flight requests, with no sockets.

Events go in (frames from one side, a clock tick, a send that failed); actions come out as a list of
(socket_name, frames) for the shell to send. Time is passed in (`now`, seconds on a monotonic clock) so
tests drive heartbeats and expiry without sleeping.

Frames (the first frame is always the ROUTER's routing id of the peer):
  frontend in/out : [edge_id, header, body]
  backend out     : [worker_id, edge_id, header, body]    edge_id b"" for HEARTBEAT / DISCONNECT
  backend in      : [worker_id, client_id, header, body]  client_id b"" for READY / HEARTBEAT / DISCONNECT

Sessions are scoped by the edge: the edge numbers its own sessions, so the broker keys every table by
(edge_id, session id) and two edges may both hold a session 1.

Failure rule: the Majordomo reference broker silently loses the work held by a dead worker; we do not.
When a worker dies, every request in flight on it is answered with ERROR WORKER_LOST (with its seq), and
its sessions are forgotten so the edge's re-OPEN lands on a live worker.
"""

from __future__ import annotations

import itertools

import msgspec
import structlog

from specrelay.common import protocol
from specrelay.common.errors import ErrorCode, InvalidRequest
from specrelay.common.protocol import CLOUD_REPLIES, EDGE_REQUESTS, MsgType

from .table import Session, SessionKey, Stats, Worker

HEARTBEAT_INTERVAL = 1.0   # seconds between heartbeats to each worker
HEARTBEAT_LIVENESS = 3     # a worker silent for LIVENESS intervals is dead
MAX_IN_FLIGHT = 64         # requests one session may have outstanding on its worker

FRONTEND = "frontend"
BACKEND = "backend"

Action = tuple[str, list[bytes]]

_SEQ_TYPES = frozenset({MsgType.VERIFY, MsgType.RESAMPLE}) | CLOUD_REPLIES

log = structlog.get_logger("specrelay.broker")


class _Head(protocol.Base):
    """[session, seq]: the first two fields of VERIFY, RESAMPLE, VERDICT and RESAMPLED bodies."""

    session: protocol.U63
    seq: protocol.U63


class _ErrorHead(protocol.Base):
    session: protocol.U63
    seq: protocol.U63 = 0  # ERROR omits a zero seq


_head_decoders = {t: msgspec.msgpack.Decoder(_ErrorHead if t == MsgType.ERROR else _Head) for t in _SEQ_TYPES}


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


def _session_or_zero(body: bytes) -> int:
    try:
        return protocol.session_of(body)
    except InvalidRequest:
        return 0


class Router:
    """Assigns sessions to workers, keeps affinity, and answers for dead workers. Single-threaded."""

    def __init__(self, *, heartbeat_interval: float = HEARTBEAT_INTERVAL, liveness: int = HEARTBEAT_LIVENESS,
                 max_in_flight: int = MAX_IN_FLIGHT) -> None:
        if heartbeat_interval <= 0 or liveness < 1 or max_in_flight < 1:
            raise ValueError("heartbeat_interval must be > 0, liveness and max_in_flight >= 1")
        self.heartbeat_interval = heartbeat_interval
        self.ttl = heartbeat_interval * liveness
        self.max_in_flight = max_in_flight
        self.workers: dict[bytes, Worker] = {}
        self.sessions: dict[SessionKey, Session] = {}  # (edge_id, the edge's session id) -> session
        self.stats = Stats()
        self._serials = itertools.count()
        self._next_heartbeat: float | None = None

    # ---- edge side -------------------------------------------------------------------------------

    def from_edge(self, frames: list[bytes], now: float, n_frames: int | None = None) -> list[Action]:
        """One message from the frontend ROUTER: [edge_id, header, body]. n_frames: the real count when
        the shell kept only the first few frames of an oversized message."""
        self.stats.frontend_in += 1
        edge, n = frames[0], len(frames) if n_frames is None else n_frames
        try:
            if n != 3:
                raise InvalidRequest(f"a request is 2 frames (header, body), got {n - 1}", field="frames")
            msg_type = protocol.parse_header(frames[1])
            if msg_type not in EDGE_REQUESTS:
                raise InvalidRequest(f"an edge may not send {msg_type.name}; it sends OPEN, VERIFY, RESAMPLE "
                                     "or CLOSE", field="header.type")
            session_id, seq = read_head(msg_type, frames[2])
        except InvalidRequest as exc:
            return [self._bad_request(edge, _session_or_zero(frames[2]) if n == 3 else 0, 0, str(exc))]
        if msg_type == MsgType.OPEN:
            return self._open(edge, session_id, frames)
        key = (edge, session_id)
        session = self.sessions.get(key)
        if session is None:
            if msg_type == MsgType.CLOSE:
                return []  # closing a session nobody holds: already done
            self.stats.unknown_session_sent += 1
            return [self._error(edge, session_id, seq, ErrorCode.UNKNOWN_SESSION,
                                f"session {session_id} is not open on any worker; re-OPEN it with the full context")]
        if msg_type == MsgType.CLOSE:
            self._forget(key)
            return [self._to_worker(session.worker, edge, frames[1:])]
        return self._forward(session_id, session, msg_type, seq, frames)

    def _open(self, edge: bytes, session_id: int, frames: list[bytes]) -> list[Action]:
        """New session -> least-loaded live worker; re-OPEN of a known one -> the worker that holds it."""
        key = (edge, session_id)
        session = self.sessions.get(key)
        if session is None:
            worker = self._least_loaded()
            if worker is None:
                self.stats.unavailable_sent += 1
                return [self._error(edge, session_id, 0, ErrorCode.UNAVAILABLE,
                                    "no live worker has room for a new session; retry later")]
            session = Session(edge=edge, worker=worker.identity)
            self.sessions[key] = session
            worker.sessions.add(key)
            self._gauges()
        return self._forward(session_id, session, MsgType.OPEN, 0, frames)

    def _least_loaded(self) -> Worker | None:
        """Fewest broker-assigned sessions; ties go to the earliest registered worker."""
        return min((w for w in self.workers.values() if not w.full),
                   key=lambda w: (len(w.sessions), w.serial), default=None)

    def _forward(self, session_id: int, session: Session, msg_type: MsgType, seq: int,
                 frames: list[bytes]) -> list[Action]:
        if len(session.in_flight) >= self.max_in_flight:
            self.stats.unavailable_sent += 1
            return [self._error(session.edge, session_id, seq, ErrorCode.UNAVAILABLE,
                                f"session {session_id} already has {self.max_in_flight} requests in flight")]
        session.in_flight.append((msg_type, seq))
        return [self._to_worker(session.worker, session.edge, frames[1:])]

    # ---- worker side -----------------------------------------------------------------------------

    def from_worker(self, frames: list[bytes], now: float, n_frames: int | None = None) -> list[Action]:
        """One message from the backend ROUTER: [worker_id, client_id, header, body]."""
        self.stats.backend_in += 1
        worker_id, n = frames[0], len(frames) if n_frames is None else n_frames
        try:
            if n != 4:
                raise InvalidRequest(f"a worker message is 3 frames (client_id, header, body), got {n - 1}",
                                     field="frames")
            msg_type = protocol.parse_header(frames[2])
        except InvalidRequest as exc:
            return self._bad_worker(worker_id, str(exc))
        if msg_type == MsgType.READY:
            return self._ready(worker_id, frames, now)
        worker = self.workers.get(worker_id)
        if worker is None:
            return self._unknown_worker(worker_id, msg_type)
        worker.expires = now + self.ttl  # any message proves liveness
        if msg_type == MsgType.HEARTBEAT:
            return self._heartbeat(worker, frames)
        if msg_type == MsgType.DISCONNECT:
            return self._lose_worker(worker_id, "the worker disconnected", tell_worker=False)
        if msg_type in CLOUD_REPLIES:
            return self._reply(worker, msg_type, frames)
        return self._bad_worker(worker_id, f"a worker may not send {msg_type.name}")

    def _ready(self, worker_id: bytes, frames: list[bytes], now: float) -> list[Action]:
        """Register a worker. A second READY from a known identity means it restarted and lost its state."""
        try:
            ready = protocol.decode(frames[2:])
        except InvalidRequest as exc:
            return self._bad_worker(worker_id, str(exc))
        actions = []
        if worker_id in self.workers:
            actions = self._lose_worker(worker_id, "the worker re-registered", tell_worker=False)
        self.workers[worker_id] = Worker(identity=worker_id, max_sessions=ready.max_sessions,
                                         expires=now + self.ttl, serial=next(self._serials), model=ready.model)
        self._gauges()
        log.info("worker ready", worker=worker_id.hex(), model=ready.model, max_sessions=ready.max_sessions)
        return actions

    def _heartbeat(self, worker: Worker, frames: list[bytes]) -> list[Action]:
        try:
            protocol.decode(frames[2:])
        except InvalidRequest as exc:
            return self._bad_worker(worker.identity, str(exc))
        return []

    def _unknown_worker(self, worker_id: bytes, msg_type: MsgType) -> list[Action]:
        """A worker we never registered or already declared dead: drop its message (its edges were told
        WORKER_LOST) and tell it to start over with READY, as Majordomo does."""
        self.stats.unknown_worker_messages += 1
        if msg_type == MsgType.DISCONNECT:
            return []
        log.info("message from unknown worker dropped", worker=worker_id.hex(), type=msg_type.name)
        return [self._disconnect(worker_id, "unknown worker: send READY to register")]

    def _reply(self, worker: Worker, msg_type: MsgType, frames: list[bytes]) -> list[Action]:
        """VERDICT / RESAMPLED / ERROR: settle the request it answers and pass the frames to the edge."""
        client = frames[1]
        if not client:
            return self._bad_worker(worker.identity, f"{msg_type.name} without the edge's id in frame 1")
        try:
            session_id, seq = read_head(msg_type, frames[3])
        except InvalidRequest as exc:
            return self._bad_worker(worker.identity, str(exc))
        session = self.sessions.get((client, session_id))
        if session is not None and session.worker == worker.identity:
            session.settle(msg_type, seq)
        return [self._to_edge(client, frames[2:])]

    def _bad_worker(self, worker_id: bytes, reason: str) -> list[Action]:
        self.stats.bad_worker_messages += 1
        log.warning("bad worker message dropped", worker=worker_id.hex(), reason=reason)
        return []

    # ---- time and failures -----------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        """Expire silent workers (WORKER_LOST for their in-flight requests) and, once per interval,
        heartbeat every live worker; the heartbeat's load is the sessions the broker assigned to it."""
        actions: list[Action] = []
        for worker_id in [w.identity for w in self.workers.values() if now >= w.expires]:
            actions += self._lose_worker(worker_id, "heartbeat expired", tell_worker=True)
        if self._next_heartbeat is None or now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval
            actions += [self._to_worker(w.identity, b"", protocol.encode(protocol.Heartbeat(load=len(w.sessions))))
                        for w in self.workers.values()]
        return actions

    def next_deadline(self) -> float | None:
        """When `tick` next has work: the next heartbeat or the earliest worker expiry."""
        times = [w.expires for w in self.workers.values()]
        if self._next_heartbeat is not None:
            times.append(self._next_heartbeat)
        return min(times, default=None)

    def undeliverable(self, socket_name: str, frames: list[bytes], now: float, *, peer_gone: bool) -> list[Action]:
        """A send failed. peer_gone (EHOSTUNREACH): the worker is lost / the edge's sessions are closed.
        Otherwise the peer's queue is full (EAGAIN): a request to a worker is answered UNAVAILABLE."""
        self.stats.unroutable += 1
        peer = frames[0]
        log.warning("send failed", socket=socket_name, peer=peer.hex(), peer_gone=peer_gone)
        if socket_name == FRONTEND:
            return self._edge_gone(peer) if peer_gone else []
        if peer_gone:
            if peer in self.workers:
                return self._lose_worker(peer, "the worker is unreachable", tell_worker=False)
            return []
        return self._worker_full(frames)

    def _worker_full(self, frames: list[bytes]) -> list[Action]:
        edge, msg_type = frames[1], protocol.parse_header(frames[2])
        if not edge or msg_type == MsgType.CLOSE:
            return []  # a heartbeat or a CLOSE: nobody waits for an answer
        session_id, seq = read_head(msg_type, frames[3])
        session = self.sessions.get((edge, session_id))
        if session is not None:
            session.unsettle(msg_type, seq)
        self.stats.unavailable_sent += 1
        return [self._error(edge, session_id, seq, ErrorCode.UNAVAILABLE, "the worker's queue is full; retry later")]

    def _edge_gone(self, edge: bytes) -> list[Action]:
        """The edge disconnected: close its sessions on their workers so they free the memory."""
        gone = [key for key in self.sessions if key[0] == edge]
        actions = []
        for key in gone:
            session, session_id = self._forget(key), key[1]
            actions.append(self._to_worker(session.worker, edge, protocol.encode(protocol.Close(session=session_id))))
        return actions

    def _lose_worker(self, worker_id: bytes, reason: str, *, tell_worker: bool) -> list[Action]:
        """Remove a worker; every request in flight on it gets WORKER_LOST, never silence."""
        worker = self.workers.pop(worker_id)
        n_sessions, lost = len(worker.sessions), []
        for key in sorted(worker.sessions):
            session, session_id = self._forget(key), key[1]
            for seq in session.lost_seqs():
                lost.append(self._error(session.edge, session_id, seq, ErrorCode.WORKER_LOST,
                                        f"the worker holding session {session_id} was lost ({reason}); "
                                        "re-OPEN it with the full context"))
        self.stats.worker_lost_sent += len(lost)
        self.stats.workers_lost += 1
        self._gauges()
        log.warning("worker lost", worker=worker_id.hex(), reason=reason, sessions=n_sessions,
                    requests_lost=len(lost))
        return lost + [self._disconnect(worker_id, reason)] if tell_worker else lost

    # ---- helpers ---------------------------------------------------------------------------------

    def _forget(self, key: SessionKey) -> Session:
        session = self.sessions.pop(key)
        worker = self.workers.get(session.worker)
        if worker is not None:
            worker.sessions.discard(key)
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
        return BACKEND, [worker_id, edge, *message]

    def _disconnect(self, worker_id: bytes, reason: str) -> Action:
        return self._to_worker(worker_id, b"", protocol.encode(protocol.Disconnect(reason=reason)))

    def _error(self, edge: bytes, session_id: int, seq: int, code: ErrorCode, message: str) -> Action:
        return self._to_edge(edge, protocol.encode(protocol.Error(session=session_id, seq=seq, code=code,
                                                                  message=message)))

    def _bad_request(self, edge: bytes, session_id: int, seq: int, message: str) -> Action:
        self.stats.bad_requests += 1
        log.info("bad request", edge=edge.hex(), session=session_id, reason=message)
        return self._error(edge, session_id, seq, ErrorCode.BAD_REQUEST, message)
