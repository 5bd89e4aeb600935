"""The broker's routing core: worker registry, edges, session table and in-flight requests, with no sockets.

Events go in (frames from one side, a clock tick, a send that failed); actions come out as a list of
(socket_name, frames) for the shell to send. Time is passed in (`now`, seconds on a monotonic clock) so
tests drive heartbeats and expiry without sleeping.

Frames (the first frame is always the ROUTER's routing id of the peer):
  frontend in/out : [edge_id, header, body]               edges send OPEN VERIFY RESAMPLE CLOSE HEARTBEAT
  backend out     : [worker_id, handle, header, body]     handle b"" for HEARTBEAT / DISCONNECT
  backend in      : [worker_id, handle, header, body]     handle b"" for READY / HEARTBEAT / DISCONNECT
An edge's routing id never leaves the broker: workers see an opaque `handle` (a keyed hash of it, the key drawn
at start), so no worker learns the ids the frontend generates (README, Security: routing ids).

Rules:
- A session is (edge_id, the edge's session id) and belongs to that connection and the key it authenticated
  with: nobody else can reach it. A routing id reused by another key ends the old connection's sessions.
- A new session goes to the least-loaded live worker, later requests to the worker holding it (affinity).
  It is *booked* when the worker accepts it (its first VERDICT); an ERROR for its OPEN frees it again.
- A worker's reply is delivered only for a session that worker holds (no injection into other sessions).
- Per-client quotas (sessions, requests in flight, prompt tokens; `Limits`) answer UNAVAILABLE past them.
- Failure rule: the Majordomo reference broker silently loses the work held by a dead worker; we do not.
  When a worker dies, every request in flight on it is answered WORKER_LOST (with its seq) and its sessions
  are forgotten so the edge's re-OPEN lands on a live worker. An edge silent past `edge_ttl` (edges heartbeat)
  or unreachable has its sessions closed on their workers.
"""

from __future__ import annotations

import itertools

import structlog

from specrelay.common import protocol
from specrelay.common.errors import ErrorCode, InvalidRequest
from specrelay.common.protocol import CLOUD_REPLIES, EDGE_REQUESTS, MsgType
from specrelay.common.ratelimit import LogLimiter, TokenBucket

from .heads import open_tokens, read_head
from .table import EdgeHandles, Limits, Peer, Session, SessionKey, Stats, Usage, Worker

HEARTBEAT_INTERVAL = 1.0   # seconds between heartbeats to each worker
HEARTBEAT_LIVENESS = 3     # a worker silent for LIVENESS intervals is dead
MAX_SHARE, SHARE_SLACK = 1.5, 4  # no worker's claims draw it more than 1.5x the mean sessions (+4)

FRONTEND = "frontend"
BACKEND = "backend"

Action = tuple[str, list[bytes]]

log = structlog.get_logger("specrelay.broker")
limited = LogLimiter(log)  # bad input is counted exactly but logged at a bounded rate
_FORGET_ON = frozenset({ErrorCode.UNKNOWN_SESSION, ErrorCode.INTERNAL})  # the worker no longer holds it


class Router:
    """Assigns sessions to workers, keeps affinity, enforces ownership and quotas, answers for dead workers.
    Single-threaded."""

    def __init__(self, *, heartbeat_interval: float = HEARTBEAT_INTERVAL, liveness: int = HEARTBEAT_LIVENESS,
                 limits: Limits | None = None) -> None:
        if heartbeat_interval <= 0 or liveness < 1:
            raise ValueError("heartbeat_interval must be > 0 and liveness >= 1")
        self.heartbeat_interval = heartbeat_interval
        self.ttl = heartbeat_interval * liveness
        self.limits = limits or Limits()
        self.workers: dict[bytes, Worker] = {}
        self.peers: dict[bytes, Peer] = {}
        self.sessions: dict[SessionKey, Session] = {}  # (edge_id, the edge's session id) -> session
        self.usage: dict[object, Usage] = {}           # Peer.client -> what it holds
        self.stats = Stats()
        self._serials = itertools.count()
        self.handles = EdgeHandles()  # what workers see for each edge in `peers`
        self._next_heartbeat: float | None = None

    # ---- edge side -------------------------------------------------------------------------------

    def from_edge(self, frames: list[bytes], now: float, n_frames: int | None = None,
                  user: str | None = None) -> list[Action]:
        """One message from the frontend ROUTER: [edge_id, header, body]. n_frames: the real count when the
        shell kept only the first few frames; user: the CURVE key the edge authenticated with (None without)."""
        self.stats.frontend_in += 1
        peer, actions = self._peer(frames[0], user, now)
        n = len(frames) if n_frames is None else n_frames
        try:
            if n != 3:
                raise InvalidRequest(f"a request is 2 frames (header, body), got {n - 1}", field="frames")
            msg_type = protocol.parse_header(frames[1])
            if msg_type == MsgType.HEARTBEAT:
                return actions  # liveness only (Peer.expires was just renewed)
            if msg_type not in EDGE_REQUESTS:
                raise InvalidRequest(f"an edge may not send {msg_type.name}; it sends OPEN, VERIFY, RESAMPLE, "
                                     "CLOSE or HEARTBEAT", field="header.type")
            session_id, seq = read_head(msg_type, frames[2])
            tokens = open_tokens(frames[2]) if msg_type == MsgType.OPEN else 0
        except InvalidRequest as exc:
            return actions + self._bad_request(peer, protocol.session_or_zero(frames, 2) if n == 3 else 0, str(exc), now)
        if msg_type == MsgType.OPEN:
            return actions + self._open(peer, session_id, tokens, frames)
        key = (peer.edge, session_id)
        session = self.sessions.get(key)
        if session is None:
            if msg_type == MsgType.CLOSE:
                return actions  # closing a session nobody holds: already done
            self.stats.unknown_session_sent += 1
            return actions + [self._error(peer.edge, session_id, seq, ErrorCode.UNKNOWN_SESSION,
                                          f"session {session_id} is not open on any worker; re-OPEN it with "
                                          "the full context")]
        if msg_type == MsgType.CLOSE:
            self._forget(key)
            return actions + [self._to_worker(session.worker, peer.edge, frames[1:])]
        return actions + self._forward(session_id, session, msg_type, seq, frames)

    def _peer(self, edge: bytes, user: str | None, now: float) -> tuple[Peer, list[Action]]:
        """The edge connection's record, renewed. A routing id now used with another key is a new connection:
        the old one's sessions are closed first."""
        actions: list[Action] = []
        peer = self.peers.get(edge)
        if peer is not None and peer.user != user:
            log.warning("routing id reused by another key; its sessions are closed", edge=edge.hex())
            actions = self._edge_gone(edge)
            peer = None
        if peer is None:
            burst = max(1.0, self.limits.bad_replies_per_s)
            peer = self.peers[edge] = Peer(edge, user, now, TokenBucket(self.limits.bad_replies_per_s, burst))
            self.handles.add(edge)
            self.stats.live_edges = len(self.peers)
        peer.expires = now + self.limits.edge_ttl
        return peer, actions

    def _open(self, peer: Peer, session_id: int, tokens: int, frames: list[bytes]) -> list[Action]:
        """New session -> least-loaded live worker (within the client's quotas); re-OPEN of a known one -> the
        worker that holds it."""
        key = (peer.edge, session_id)
        session = self.sessions.get(key)
        usage = self.usage.get(peer.client) or Usage()  # kept only once the client holds a session
        extra_tokens = tokens - (session.tokens if session else 0)
        refusal = self._quota(usage, new_session=session is None, extra_tokens=extra_tokens)
        if refusal is None and session is None:
            worker = self._least_loaded()
            if worker is None:
                refusal = "no live worker has room for a new session; retry later"
            else:
                session = self.sessions[key] = Session(edge=peer.edge, worker=worker.identity, client=peer.client)
                worker.sessions.add(key)
                peer.sessions.add(key)
                self.usage[peer.client] = usage
                usage.sessions += 1
                self._gauges()
        if refusal is not None:
            self.stats.unavailable_sent += 1
            return [self._error(peer.edge, session_id, 0, ErrorCode.UNAVAILABLE, refusal)]
        usage.tokens += extra_tokens
        session.tokens = tokens
        actions = self._forward(session_id, session, MsgType.OPEN, 0, frames)
        if not session.in_flight and not session.booked:  # its OPEN was refused: nothing holds it
            self._forget(key)
        return actions

    def _quota(self, usage: Usage, *, new_session: bool, extra_tokens: int) -> str | None:
        """Why this client may not open (or grow) a session now, or None."""
        reason = usage.refusal(self.limits, new_session=new_session, extra_tokens=extra_tokens)
        self.stats.quota_refusals += reason is not None
        return reason

    def _least_loaded(self) -> Worker | None:
        """The most free KV memory (estimated, `Worker.free_fraction`), then the fewest broker-assigned
        sessions; ties go to the earliest registered worker. Load reports are only a worker's claims, so a
        worker past MAX_SHARE times the mean session count (+ SHARE_SLACK) takes a new one only if all are."""
        room = [w for w in self.workers.values() if not w.full]
        bound = MAX_SHARE * len(self.sessions) / max(1, len(self.workers)) + SHARE_SLACK
        return min([w for w in room if len(w.sessions) < bound] or room,
                   key=lambda w: (-round(w.free_fraction, 3), len(w.sessions), w.serial), default=None)

    def _forward(self, session_id: int, session: Session, msg_type: MsgType, seq: int,
                 frames: list[bytes]) -> list[Action]:
        usage = self.usage[session.client]
        if len(session.in_flight) >= self.limits.max_in_flight_per_session:
            reason = f"session {session_id} already has {len(session.in_flight)} requests in flight"
        elif usage.in_flight >= self.limits.max_in_flight_per_client:
            self.stats.quota_refusals += 1
            reason = f"this client already has {usage.in_flight} requests in flight"
        else:
            session.in_flight.append((msg_type, seq))
            usage.in_flight += 1
            return [self._to_worker(session.worker, session.edge, frames[1:])]
        self.stats.unavailable_sent += 1
        return [self._error(session.edge, session_id, seq, ErrorCode.UNAVAILABLE, reason + "; retry later")]

    # ---- worker side -----------------------------------------------------------------------------

    def from_worker(self, frames: list[bytes], now: float, n_frames: int | None = None,
                    user: str | None = None) -> list[Action]:
        """One message from the backend ROUTER: [worker_id, client_id, header, body]. user: the CURVE key the
        worker authenticated with (None without keys); only the key a worker registered with speaks for it."""
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
            return self._ready(worker_id, frames, now, user)
        worker = self.workers.get(worker_id)
        if worker is None or worker.user != user:  # another key under a worker's routing id is not that worker
            return self._unknown_worker(worker_id, msg_type)
        worker.expires = now + self.ttl  # any message proves liveness
        if msg_type == MsgType.HEARTBEAT:
            return self._heartbeat(worker, frames)
        if msg_type == MsgType.DISCONNECT:
            return self._lose_worker(worker_id, "the worker disconnected", tell_worker=False)
        if msg_type in CLOUD_REPLIES:
            return self._reply(worker, msg_type, frames)
        return self._bad_worker(worker_id, f"a worker may not send {msg_type.name}")

    def _ready(self, worker_id: bytes, frames: list[bytes], now: float, user: str | None) -> list[Action]:
        """Register a worker. A second READY from a known identity means it restarted and lost its state (or,
        under another key, that another worker took the routing id: it inherits nothing either way)."""
        try:
            ready = protocol.decode(frames[2:])
        except InvalidRequest as exc:
            return self._bad_worker(worker_id, str(exc))
        actions = []
        if worker_id in self.workers:
            actions = self._lose_worker(worker_id, "the worker re-registered", tell_worker=False)
        self.workers[worker_id] = Worker(identity=worker_id, max_sessions=ready.max_sessions,
                                         expires=now + self.ttl, serial=next(self._serials), model=ready.model,
                                         kv_capacity=ready.kv_capacity, kv_free=ready.kv_capacity, user=user)
        self._gauges()
        log.info("worker ready", worker=worker_id.hex(), model=ready.model, max_sessions=ready.max_sessions)
        return actions

    def _heartbeat(self, worker: Worker, frames: list[bytes]) -> list[Action]:
        try:
            beat = protocol.decode(frames[2:])
        except InvalidRequest as exc:
            return self._bad_worker(worker.identity, str(exc))
        worker.heard(beat)
        return []

    def _unknown_worker(self, worker_id: bytes, msg_type: MsgType) -> list[Action]:
        """A worker we never registered or already declared dead: drop its message (its edges were told
        WORKER_LOST) and tell it to start over with READY, as Majordomo does."""
        self.stats.unknown_worker_messages += 1
        if msg_type == MsgType.DISCONNECT:
            return []
        limited.info("message from unknown worker dropped", worker=worker_id.hex(), type=msg_type.name)
        return [self._disconnect(worker_id, "unknown worker: send READY to register")]

    def _reply(self, worker: Worker, msg_type: MsgType, frames: list[bytes]) -> list[Action]:
        """VERDICT / RESAMPLED / ERROR for a session this worker holds: settle the request it answers, book or
        free the session, pass the frames to the edge. Anything else is dropped."""
        client = self.handles.edge(frames[1])
        if not frames[1]:
            return self._bad_worker(worker.identity, f"{msg_type.name} without the edge's id in frame 1")
        try:
            session_id, seq = read_head(msg_type, frames[3])
            code = protocol.decode(frames[2:]).code if msg_type == MsgType.ERROR else None
        except InvalidRequest as exc:
            return self._bad_worker(worker.identity, str(exc))
        key = (client, session_id)
        session = self.sessions.get(key)
        if session is None or session.worker != worker.identity:
            self.stats.foreign_replies += 1
            limited.warning("reply for a session this worker does not hold dropped", worker=worker.identity.hex(),
                            session=session_id, type=msg_type.name)
            return []
        before = len(session.in_flight)
        session.settle(msg_type, seq)
        self.usage[session.client].in_flight -= before - len(session.in_flight)
        if code is None:
            session.booked = True
        elif seq == 0 or code in _FORGET_ON:  # it refused the OPEN, or no longer holds the session
            self.stats.rejected_opens += not session.booked
            self._forget(key)
        return [self._to_edge(client, frames[2:])]

    def _bad_worker(self, worker_id: bytes, reason: str) -> list[Action]:
        self.stats.bad_worker_messages += 1
        limited.warning("bad worker message dropped", worker=worker_id.hex(), reason=reason)
        return []

    # ---- time and failures -----------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        """Expire silent workers (WORKER_LOST for their in-flight requests) and silent edges (CLOSE their
        sessions), and, once per interval, heartbeat every live worker (load: the sessions assigned to it)."""
        actions: list[Action] = []
        for worker_id in [w.identity for w in self.workers.values() if now >= w.expires]:
            actions += self._lose_worker(worker_id, "heartbeat expired", tell_worker=True)
        for edge in [p.edge for p in self.peers.values() if now >= p.expires]:
            self.stats.edges_expired += 1
            actions += self._edge_gone(edge)
        if self._next_heartbeat is None or now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval
            actions += [self._to_worker(w.identity, b"", protocol.encode(protocol.Heartbeat(load=len(w.sessions))))
                        for w in self.workers.values()]
        return actions

    def next_deadline(self) -> float | None:
        """When `tick` next has work: the next heartbeat or the earliest worker or edge expiry."""
        times = [w.expires for w in self.workers.values()] + [p.expires for p in self.peers.values()]
        if self._next_heartbeat is not None:
            times.append(self._next_heartbeat)
        return min(times, default=None)

    def undeliverable(self, socket_name: str, frames: list[bytes], now: float, *, peer_gone: bool) -> list[Action]:
        """A send failed. peer_gone (EHOSTUNREACH): the worker is lost / the edge's sessions are closed.
        Otherwise the peer's queue is full (EAGAIN): a request to a worker is answered UNAVAILABLE."""
        self.stats.unroutable += 1
        peer = frames[0]
        limited.warning("send failed", socket=socket_name, peer=peer.hex(), peer_gone=peer_gone)
        if socket_name == FRONTEND:
            return self._edge_gone(peer) if peer_gone else []
        if peer_gone:
            if peer in self.workers:
                return self._lose_worker(peer, "the worker is unreachable", tell_worker=False)
            return []
        return self._worker_full(frames)

    def _worker_full(self, frames: list[bytes]) -> list[Action]:
        edge, msg_type = self.handles.edge(frames[1]), protocol.parse_header(frames[2])
        if not edge or msg_type == MsgType.CLOSE:
            return []  # a heartbeat or a CLOSE: nobody waits for an answer
        session_id, seq = read_head(msg_type, frames[3])
        session = self.sessions.get((edge, session_id))
        if session is not None and session.unsettle(msg_type, seq):
            self.usage[session.client].in_flight -= 1
        self.stats.unavailable_sent += 1
        return [self._error(edge, session_id, seq, ErrorCode.UNAVAILABLE, "the worker's queue is full; retry later")]

    def _edge_gone(self, edge: bytes) -> list[Action]:
        """The edge disconnected or went silent: close its sessions on their workers so they free the memory."""
        peer = self.peers.pop(edge, None)
        self.handles.remove(edge)
        self.stats.live_edges = len(self.peers)
        actions = []
        for key in sorted(peer.sessions) if peer is not None else []:
            session = self._forget(key)
            actions.append(self._to_worker(session.worker, edge, protocol.encode(protocol.Close(session=key[1]))))
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
        """Drop a session and give its quota back."""
        session = self.sessions.pop(key)
        worker = self.workers.get(session.worker)
        if worker is not None:
            worker.sessions.discard(key)
        peer = self.peers.get(key[0])
        if peer is not None:
            peer.sessions.discard(key)
        usage = self.usage[session.client]
        usage.sessions -= 1
        usage.tokens -= session.tokens
        usage.in_flight -= len(session.in_flight)
        if usage.sessions == 0:
            del self.usage[session.client]
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

    def _bad_request(self, peer: Peer, session_id: int, message: str, now: float) -> list[Action]:
        """BAD_REQUEST, counted always, answered while the edge's budget lasts (a flood gets silence)."""
        self.stats.bad_requests += 1
        limited.info("bad request", edge=peer.edge.hex(), session=session_id, reason=message)
        if not peer.bad_replies.take(now):
            self.stats.bad_requests_unanswered += 1
            return []
        return [self._error(peer.edge, session_id, 0, ErrorCode.BAD_REQUEST, message)]
