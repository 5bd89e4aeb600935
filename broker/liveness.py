"""The broker's failure rule: who is alive, and what becomes of the work of a peer that is not.

Any message proves a peer alive; the broker heartbeats every worker once per interval, and edges heartbeat too.
The Majordomo reference broker silently loses the work held by a dead worker; we do not. When a worker dies
(silent past `ttl`, unreachable, DISCONNECT, or registering again), every request in flight on it is answered
WORKER_LOST (with its seq) and its sessions are forgotten, so the edge's re-OPEN lands on a live worker. An edge
silent past `edge_ttl` or unreachable has its sessions closed on their workers. A request a worker's full queue
refused (EAGAIN) is answered UNAVAILABLE. Time is passed in (`now`), so tests drive expiry without sleeping.
"""

from __future__ import annotations

import structlog

from specrelay.common import protocol
from specrelay.common.errors import ErrorCode, SettingError
from specrelay.common.protocol import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS, MsgType
from specrelay.common.ratelimit import LogLimiter

from .quotas import Limits
from .table import FRONTEND, Action, Tables


log = structlog.get_logger("specrelay.broker")
limited = LogLimiter(log)  # failed sends are counted exactly but logged at a bounded rate


class Liveness(Tables):
    """Heartbeats, expiry and the answers for lost peers, over the broker's tables. Single-threaded."""

    def __init__(self, *, heartbeat_interval: float = HEARTBEAT_INTERVAL, liveness: int = HEARTBEAT_LIVENESS,
                 limits: Limits | None = None) -> None:
        if heartbeat_interval <= 0 or liveness < 1:
            raise SettingError("heartbeat_interval must be > 0 and liveness >= 1")
        super().__init__(limits)
        self.heartbeat_interval = heartbeat_interval
        self.ttl = heartbeat_interval * liveness
        self._next_heartbeat: float | None = None

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
        session_id, seq = protocol.read_head(msg_type, frames[3])
        session = self.sessions.get((edge, session_id))
        if session is not None and session.unsettle(msg_type, seq):
            self.quotas.settled(session.client, 1)
        self.stats.unavailable_sent += 1
        return [self._error(edge, session_id, seq, ErrorCode.UNAVAILABLE, "the worker's queue is full; retry later")]

    def _edge_gone(self, edge: bytes) -> list[Action]:
        """The edge disconnected or went silent: close its sessions on their workers so they free the memory."""
        peer = self.peers.pop(edge, None)
        self.stats.live_edges = len(self.peers)
        actions = []
        for key in sorted(peer.sessions) if peer is not None else []:
            session = self._forget(key)
            actions.append(self._to_worker(session.worker, edge, protocol.encode(protocol.Close(session=key[1]))))
        self.handles.remove(edge)  # after the CLOSEs: they carry its handle, which names its client
        return actions

    def _lose_worker(self, worker_id: bytes, reason: str, *, tell_worker: bool,
                     goodbye: bool = False) -> list[Action]:
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
        if goodbye and not n_sessions:  # a clean shutdown (DISCONNECT, nothing held): not a warning
            log.info("worker left", worker=worker_id.hex(), reason=reason)
        else:
            log.warning("worker lost", worker=worker_id.hex(), reason=reason, sessions=n_sessions,
                        requests_lost=len(lost))
        return lost + [self._disconnect(worker_id, reason)] if tell_worker else lost
