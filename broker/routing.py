"""The broker's routing core: which worker serves a session, and who may speak for it; no sockets.

Events go in (frames from one side, a clock tick, a send that failed); actions come out as a list of
(socket_name, frames) for the shell to send. Time is passed in (`now`, seconds on a monotonic clock) so
tests drive heartbeats and expiry without sleeping.

Frames (the first frame is always the ROUTER's routing id of the peer):
  frontend in/out : [edge_id, header, body]               edges send OPEN VERIFY RESAMPLE CLOSE HEARTBEAT (echoed)
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
- Per-client quotas (sessions, requests in flight, prompt tokens; quotas.py) answer UNAVAILABLE past them.
- Failure rule (liveness.py, which the Router builds on): a dead worker's requests in flight are answered
  WORKER_LOST, never lost; a silent or unreachable edge has its sessions closed on their workers.
"""

from __future__ import annotations

import structlog

from specrelay.common import protocol
from specrelay.common.errors import NO_LIVE_WORKER, ErrorCode, InvalidRequest
from specrelay.common.protocol import CLOUD_REPLIES, EDGE_REQUESTS, MsgType
from specrelay.common.ratelimit import LogLimiter, TokenBucket

from .liveness import Liveness
from .table import Action, Peer, Session, Worker

MAX_SHARE, SHARE_SLACK = 1.5, 4  # no worker's claims draw it more than 1.5x the mean sessions (+4)

log = structlog.get_logger("specrelay.broker")
limited = LogLimiter(log)  # bad input is counted exactly but logged at a bounded rate
HEARTBEAT_ECHO = protocol.encode(protocol.Heartbeat())  # the broker's answer to an edge's HEARTBEAT, encoded once
_FORGET_ON = frozenset({ErrorCode.UNKNOWN_SESSION, ErrorCode.INTERNAL})  # the worker no longer holds it


class Router(Liveness):
    """Assigns sessions to workers, keeps affinity, enforces ownership and quotas; answers for dead workers
    (Liveness). Single-threaded."""

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
            if msg_type == MsgType.HEARTBEAT:  # Peer.expires was just renewed; the echo tells the edge this broker
                return actions + [self._to_edge(frames[0], HEARTBEAT_ECHO)]  # answers (several brokers: links.py)
            if msg_type not in EDGE_REQUESTS:
                raise InvalidRequest(f"an edge may not send {msg_type.name}; it sends OPEN, VERIFY, RESAMPLE, "
                                     "CLOSE or HEARTBEAT", field="header.type")
            if msg_type == MsgType.OPEN:  # its session and prompt length, read once
                (session_id, tokens), seq = protocol.read_open(frames[2]), 0
            else:
                session_id, seq = protocol.read_head(msg_type, frames[2])
        except InvalidRequest as exc:
            session_id = protocol.session_or_zero(frames, 2) if n == 3 else 0
            return actions + self._bad_request(peer, session_id, str(exc), now)
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
            self.handles.add(edge, user)
            self.stats.live_edges = len(self.peers)
        peer.expires = now + self.limits.edge_ttl
        return peer, actions

    def _open(self, peer: Peer, session_id: int, tokens: int, frames: list[bytes]) -> list[Action]:
        """New session -> least-loaded live worker (within the client's quotas); re-OPEN of a known one -> the
        worker that holds it."""
        key = (peer.edge, session_id)
        session = self.sessions.get(key)
        extra_tokens = tokens - (session.tokens if session else 0)
        refusal = self.quotas.refuse_open(peer.client, new_session=session is None, extra_tokens=extra_tokens,
                                          kv_capacity=sum(w.kv_capacity for w in self.workers.values()))
        self.stats.quota_refusals += refusal is not None
        if refusal is None and session is None:
            worker = self._least_loaded()
            if worker is None:
                refusal = (f"{NO_LIVE_WORKER} has room for a new session; retry later" if self.workers else
                           f"{NO_LIVE_WORKER} behind this broker (start `specrelay cloud-worker --broker BACKEND`)")
            else:
                session = self.sessions[key] = Session(edge=peer.edge, worker=worker.identity, client=peer.client)
                worker.sessions.add(key)
                peer.sessions.add(key)
                self.quotas.opened(peer.client)
                self._gauges()
        if refusal is not None:
            self.stats.unavailable_sent += 1
            return [self._error(peer.edge, session_id, 0, ErrorCode.UNAVAILABLE, refusal)]
        self.quotas.add_tokens(peer.client, extra_tokens)
        session.tokens = tokens
        actions = self._forward(session_id, session, MsgType.OPEN, 0, frames)
        if not session.in_flight and not session.booked:  # its OPEN was refused: nothing holds it
            self._forget(key)
        return actions

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
        refusal = self.quotas.take_request(session.client, session_id, len(session.in_flight))
        if refusal is None:
            session.in_flight.append((msg_type, seq))
            return [self._to_worker(session.worker, session.edge, frames[1:])]
        self.stats.quota_refusals += 1
        self.stats.unavailable_sent += 1
        return [self._error(session.edge, session_id, seq, ErrorCode.UNAVAILABLE, refusal)]

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
            return self._lose_worker(worker_id, "the worker disconnected", tell_worker=False, goodbye=True)
        if msg_type in CLOUD_REPLIES:
            return self._reply(worker, msg_type, frames)
        return self._bad_worker(worker_id, f"a worker may not send {msg_type.name}")

    def _ready(self, worker_id: bytes, frames: list[bytes], now: float, user: str | None) -> list[Action]:
        """Register a worker. A second READY from a known identity means it restarted and lost its state (or,
        under another key, that another worker took the routing id: it inherits nothing either way)."""
        try:
            ready = protocol.decode_body(MsgType.READY, frames[3])
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
            beat = protocol.decode_body(MsgType.HEARTBEAT, frames[3])
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
            if msg_type == MsgType.ERROR:  # its code decides what becomes of the session: decoded once, whole
                error = protocol.decode_body(msg_type, frames[3])
                session_id, seq, code = error.session, error.seq, error.code
            else:
                (session_id, seq), code = protocol.read_head(msg_type, frames[3]), None
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
        self.quotas.settled(session.client, before - len(session.in_flight))
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

    def _bad_request(self, peer: Peer, session_id: int, message: str, now: float) -> list[Action]:
        """BAD_REQUEST, counted always, answered while the edge's budget lasts (a flood gets silence)."""
        self.stats.bad_requests += 1
        limited.info("bad request", edge=peer.edge.hex(), session=session_id, reason=message)
        if not peer.bad_replies.take(now):
            self.stats.bad_requests_unanswered += 1
            return []
        return [self._error(peer.edge, session_id, 0, ErrorCode.BAD_REQUEST, message)]
