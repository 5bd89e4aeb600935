"""An edge's brokers: one DEALER per broker (`BrokerLink`, with its own monitor and heartbeats), which broker a
session uses (`BrokerLinks.choose`, common/brokers.py's rendezvous hash over the brokers that are up), and the
replies of each broker handed to its sessions.

A link is `connecting` until its first handshake, `up` after it, `down` once lost: the connection dropped
(EVENT_DISCONNECTED: a killed broker, or ZMTP heartbeats unanswered for 3 intervals), nothing listens there
(EVENT_CONNECT_RETRIED), the first handshake has not come within `grace_s`, or, with a broker that answers the
edge's HEARTBEATs (broker/routing.py echoes them), nothing came from it while GRACE_BEATS heartbeats went
unanswered (counted in beats, not seconds, so an edge whose own loop stalled does not blame the broker). A handshake
(or, for a silent one, its next word) makes it `up` again. inproc:// endpoints (one process, `specrelay serve`)
have no monitor events: they are `up` from the start. A lost broker's sessions fail their request with a retryable
ConnectionLost at once; the EdgeWorker's recovery re-OPENs each on another broker.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import structlog
import zmq
import zmq.asyncio

from ...common import protocol as P
from ...common import transport
from ...common.brokers import choose
from ...common.errors import NO_LIVE_WORKER, ConnectionLost, InvalidRequest, Overloaded
from .route import Route

log = structlog.get_logger("specrelay.edge")

# A broker that answered "no live worker" gets no new sessions for this long (unless no other broker is up): long
# enough that a burst of sessions does not find it one by one, short enough that a worker joining it is soon used.
NO_WORKER_AVOID_S = 10.0

CONNECTING, UP, DOWN = "connecting", "up", "down"
GRACE_BEATS = P.HEARTBEAT_LIVENESS  # heartbeat intervals a broker may take to answer the first handshake, or stay silent


class BrokerLink:
    """One broker of an edge: its DEALER (the broker's ROUTER picks the routing id unless `identity`), the
    socket monitor that tells its state, and what came back from it."""

    def __init__(self, index: int, endpoint: str, ctx: zmq.asyncio.Context, *, linger_ms: int, heartbeat_s: float,
                 curve: transport.Curve | None, identity: bytes | None, clock: Callable[[], float]) -> None:
        self.index, self.endpoint = index, endpoint
        self._ctx, self._curve, self._identity, self._clock = ctx, curve, identity, clock
        self._linger_ms, self._heartbeat_s = linger_ms, heartbeat_s
        self.grace_s = GRACE_BEATS * heartbeat_s
        self.state, self.since = (UP if endpoint.startswith("inproc://") else CONNECTING), clock()
        self.heard: float | None = None  # when the broker last sent anything
        self.echoes = False              # the broker answers HEARTBEATs: its silence means it is lost
        self.unanswered = 0              # heartbeats sent since the broker last sent anything
        self.connected = False           # a handshake done and the connection not dropped since
        self.sock: zmq.asyncio.Socket | None = None
        self.monitor: transport.Monitor | None = None
        self.on_state: Callable[[BrokerLink, str], None] = lambda link, old: None
        self.on_refused: Callable[[BrokerLink], None] = lambda link: None  # a refused CURVE key
        self.stats = Counter()  # lost, stale_replies, no_worker
        self.no_worker_until = float("-inf")  # it said "no live worker": new sessions go elsewhere until then

    def open(self) -> None:
        self.sock = transport.make_socket(self._ctx, zmq.DEALER, linger_ms=self._linger_ms, identity=self._identity,
                                          curve=self._curve, heartbeat_s=self._heartbeat_s)
        self.monitor = transport.Monitor(self.sock, self.on_event)  # before connect: sees every event
        transport.connect(self.sock, self.endpoint, "edge worker")

    def close(self) -> None:
        if self.sock is not None:
            self.monitor.close()
            self.sock.close()
            self.sock = None

    def send(self, frames: list[bytes]) -> zmq.ZMQError | None:
        """Queue without awaiting; the error (a full queue) is returned, never raised."""
        if self.sock is None:
            return None
        return transport.send_nowait(self.sock, frames)

    def heard_now(self) -> None:
        self.heard, self.unanswered = self._clock(), 0
        if self.state == DOWN and self.echoes:  # silent, not disconnected: it speaks again
            self._set(UP)

    def on_event(self, event: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.heard, self.unanswered, self.connected = self._clock(), 0, True
            self._set(UP)
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.on_refused(self)
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self._set(DOWN)
        elif event == zmq.EVENT_CONNECT_RETRIED and self.state == CONNECTING:
            self._set(DOWN)  # nothing listens there

    def check(self, now: float) -> None:
        """Once per heartbeat, before sending it: a first handshake that does not come, or a broker that stopped
        answering (GRACE_BEATS heartbeats in a row without a word from it)."""
        if self.state == CONNECTING and now - self.since > self.grace_s:
            self._set(DOWN)
        elif self.state == UP and self.echoes and self.unanswered >= GRACE_BEATS:
            self._set(DOWN)

    @property
    def beating(self) -> bool:
        """Heartbeats go to a broker not known to be lost, and to one lost only by its silence (still connected:
        its answer brings it back); not into the queue of a dropped connection."""
        return self.state != DOWN or self.connected

    def _set(self, state: str) -> None:
        old = self.state
        if state == old:
            return
        self.state, self.since = state, self._clock()
        self.stats["lost"] += state == DOWN
        self.on_state(self, old)


class BrokerLinks:
    """Every broker of one edge, in `--broker`'s order; which broker each session is on (`routes`: the edge's
    session id -> its Route, whose `link` names the broker); replies handed to the session they are for if it is
    on the broker they came from; a lost broker's sessions failed with a retryable error at once."""

    def __init__(self, endpoints: Sequence[str], ctx: zmq.asyncio.Context, curves: Sequence[transport.Curve | None],
                 routes: Mapping[int, Route], metrics, *, linger_ms: int, heartbeat_s: float,
                 identity: bytes | None, clock: Callable[[], float]) -> None:
        self.links = [BrokerLink(i, endpoint, ctx, linger_ms=linger_ms, heartbeat_s=heartbeat_s, curve=curve,
                                 identity=identity, clock=clock)
                      for i, (endpoint, curve) in enumerate(zip(endpoints, curves))]
        for link in self.links:
            link.on_state = self._on_state
        self.routes, self.metrics, self._clock = routes, metrics, clock
        self.salt = os.urandom(8)  # this edge's own spread: edges numbering sessions alike still differ
        self.opened = False
        self._beat = P.encode(P.Heartbeat())

    def __getitem__(self, index: int) -> BrokerLink:
        return self.links[index]

    def __iter__(self):
        return iter(self.links)

    @property
    def up(self) -> list[BrokerLink]:
        return [link for link in self.links if link.state == UP]

    def open(self) -> None:
        for link in self.links:
            link.open()
        self.opened = True

    def close(self) -> None:
        for link in self.links:
            link.close()
        self.opened = False

    def loops(self) -> list:
        return [loop for link in self.links for loop in (self._receive(link), link.monitor.run())]

    def choose(self, session: int, avoid: int | None = None) -> int:
        """The broker for `session`: among those up that lately had a worker, else those up, else those not known
        to be lost, else all (a session then waits for its broker to come back); `avoid` (the broker a session
        leaves) only when there is another."""
        now = self._clock()
        for states, workerless in (((UP,), False), ((UP,), True), ((UP, CONNECTING), True),
                                   ((UP, CONNECTING, DOWN), True)):
            candidates = [link.index for link in self.links if link.state in states and link.index != avoid
                          and (workerless or link.no_worker_until <= now)]
            if candidates:
                return choose(session, candidates, self.salt)
        return avoid if avoid is not None else 0

    def move_after(self, route: Route, exc: BaseException) -> int | None:
        """After a failure of the session on `route`: the broker to re-OPEN it on when it should leave its own
        (lost, or it has no live worker: that one then gets no new sessions for NO_WORKER_AVOID_S); None = stay."""
        link = self.links[route.link]
        if isinstance(exc, Overloaded) and str(exc).startswith(NO_LIVE_WORKER):
            link.no_worker_until = self._clock() + NO_WORKER_AVOID_S
            link.stats["no_worker"] += 1
        elif link.state != DOWN:
            return None
        moved = self.choose(route.session.sid, avoid=route.link)
        return moved if moved != route.link else None

    def send(self, route: Route, frames: list[bytes]) -> zmq.ZMQError | None:
        return self.links[route.link].send(frames)

    def beat(self) -> None:
        """Once per heartbeat interval: check each broker's liveness, and tell those not known to be lost that this
        edge is alive (a broker closes the sessions of an edge silent past its edge TTL)."""
        now = self._clock()
        for link in self.links:
            link.check(now)
            if link.beating and link.send(self._beat) is None:
                link.unanswered += 1

    def _on_state(self, link: BrokerLink, old: str) -> None:
        """A broker lost: its sessions' requests fail with a retryable error now (they re-OPEN on another broker),
        not after their timeout. A broker up: sessions waiting on a lost one move to it."""
        if link.state == DOWN:
            log.warning("broker lost; its sessions move to another", broker=link.endpoint, was=old,
                        brokers_up=len(self.up))
            stranded = [route for route in self.routes.values() if route.link == link.index]
        elif link.state == UP:
            log.info("broker up", broker=link.endpoint, was=old)
            stranded = [route for route in self.routes.values() if self.links[route.link].state == DOWN]
        else:
            return
        for route in stranded:
            route.fail(ConnectionLost(f"the connection to the broker at {self.links[route.link].endpoint} is lost"))

    async def _receive(self, link: BrokerLink) -> None:
        """Broker -> the session waiting for it. Undecodable or unexpected replies are logged and dropped."""
        await transport.receive_forever(link.sock, lambda frames, n: self._on_reply(link, frames, n))

    def _on_reply(self, link: BrokerLink, frames: list[bytes], n_frames: int) -> None:
        link.heard_now()
        try:
            msg = P.decode(frames, n_frames)
        except InvalidRequest as exc:
            log.warning("bad reply from the broker", error=str(exc), broker=link.endpoint)
            return
        if isinstance(msg, P.Heartbeat):
            link.echoes = True
            return
        nbytes = sum(map(len, frames))
        self.metrics.downlink_bytes += nbytes
        route = self.routes.get(getattr(msg, "session", -1))
        if route is not None and route.link == link.index:
            route.deliver(msg, nbytes)
        else:  # a session that left this broker (or is gone): its replies no longer apply
            link.stats["stale_replies"] += 1

    def per_broker(self) -> dict:
        """For /metrics: brokers up, and per broker whether it is up, its sessions, times lost, stale replies."""
        on = Counter(route.link for route in self.routes.values())
        return {"brokers_up": len(self.up),
                "broker_up_per_broker": {link.endpoint: int(link.state == UP) for link in self.links},
                "broker_sessions_per_broker": {link.endpoint: on[link.index] for link in self.links},
                "broker_lost_per_broker": {link.endpoint: link.stats["lost"] for link in self.links},
                "stale_replies_per_broker": {link.endpoint: link.stats["stale_replies"] for link in self.links},
                "broker_no_worker_per_broker": {link.endpoint: link.stats["no_worker"] for link in self.links}}

    def states(self) -> dict[str, str]:
        return {link.endpoint: link.state for link in self.links}
