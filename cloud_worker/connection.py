"""A cloud worker's link to one broker (a worker has one per broker it is given), Paranoid Pirate style (ZeroMQ
RFC 6): one DEALER, READY on every (re)connect, heartbeats both ways, and a new socket when the broker is silent for
`heartbeat_liveness` intervals or says DISCONNECT.

    in : [client_id, header, body]   an edge's request; the broker prepends the edge's peer id
         [b"", header, body]         the broker's own HEARTBEAT / DISCONNECT
    out: [client_id, header, body]   a reply to that edge;  [b"", header, body]  READY, HEARTBEAT, DISCONNECT

Every (re)connect starts a new *generation*: what came in on an older one is stale (the broker has answered it
WORKER_LOST and forgotten its sessions), and `on_reset` tells the worker to forget it too. A socket monitor
sends a heartbeat the moment a dropped TCP connection comes back (a restarted broker answers an unknown worker
with DISCONNECT, so the worker registers again at once), and turns a refused CURVE key into a fatal error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio

from ..common import protocol as P
from ..common import transport
from ..common.errors import AuthenticationFailed, InvalidRequest
from ..common.ratelimit import LogLimiter
from .config import WorkerConfig, WorkerStats

log = structlog.get_logger("specrelay.cloud")


def broker_peer(index: int, client: bytes) -> bytes:
    """The peer part of a session key on a worker of several brokers: the broker's index, then the client id that
    broker gave the edge (ids of two brokers may be equal: the index keeps their sessions apart)."""
    return bytes([index]) + client


class BrokerConnection:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, config: WorkerConfig, stats: WorkerStats, *,
                 ready: Callable[[], P.Ready], beat: Callable[[], P.Heartbeat],
                 on_request: Callable[[list[bytes], int], None], on_reset: Callable[[], None],
                 clock: Callable[[], float], curve: transport.Curve | None = None) -> None:
        self.endpoint, self.config, self.stats = endpoint, config, stats
        self._ctx, self._curve, self._clock = ctx, curve, clock
        self._ready, self._beat, self._on_request, self._on_reset = ready, beat, on_request, on_reset
        self.sock: zmq.asyncio.Socket | None = None
        self.generation = 0       # connections so far; requests carry the one they came in on
        self.heard = clock()      # when the broker last sent anything
        self.answered = False     # the broker has sent something on this connection
        self._lost = asyncio.Event()
        self._lost_reason = ""
        self._quick = False       # the broker asked us to register again: reconnect at once
        self._monitor: transport.Monitor | None = None
        self._dropped = False     # the TCP connection dropped since the last handshake
        self._fatal: Exception | None = None
        self._log = log.bind(broker=endpoint)
        self._send_log = LogLimiter(self._log, clock=clock)  # a full socket under a flood: bounded lines

    @property
    def alive(self) -> bool:
        """Connected, and the broker heard from within the liveness window."""
        return (self.sock is not None and self.answered
                and self._clock() - self.heard < self.config.broker_ttl)

    def open(self) -> None:
        """A new DEALER, connected, and READY sent (a new generation)."""
        c = self.config
        sock = transport.make_socket(self._ctx, zmq.DEALER, linger_ms=c.linger_ms, identity=c.identity,
                                     curve=self._curve)
        self._monitor = transport.Monitor(sock, self._on_event)
        transport.connect(sock, self.endpoint, "cloud worker")
        self.sock, self.generation, self._dropped = sock, self.generation + 1, False
        self.heard, self.answered, self._lost_reason = self._clock(), False, ""
        self._lost.clear()
        self.send(b"", self._ready())

    async def keep_connected(self) -> None:
        """Receive until the broker is lost, then a new socket and READY after a back-off."""
        delay = self.config.heartbeat_interval / 2
        while True:
            receiver = asyncio.create_task(transport.receive_forever(self.sock, self._receive))
            monitor = asyncio.create_task(self._monitor.run())
            lost = asyncio.create_task(self._lost.wait())
            try:
                await asyncio.wait({receiver, monitor, lost}, return_when=asyncio.FIRST_COMPLETED)
                for task in (receiver, monitor):
                    if task.done():
                        task.result()  # these loops only end by raising
            finally:
                for task in (receiver, monitor, lost):
                    task.cancel()
                await asyncio.gather(receiver, monitor, lost, return_exceptions=True)
            if self._fatal is not None:
                raise self._fatal
            if self._quick:
                delay = 0.0
            elif self.answered:
                delay = self.config.heartbeat_interval
            else:
                delay = min(max(2 * delay, self.config.heartbeat_interval / 2), self.config.reconnect_max_s)
            if self.answered:
                self._log.warning("broker lost; reconnecting", reason=self._lost_reason, delay_s=delay)
            else:  # this socket never heard the broker: not a loss, it is not there (yet)
                self._log.info("waiting for the broker", endpoint=self.endpoint, retry_in_s=round(delay, 2))
            self._drop()
            await asyncio.sleep(delay)
            self.open()

    def _drop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            self._monitor.close()
            sock.close(linger=0)
        self.stats.reconnects += 1
        self._quick = False
        self._on_reset()

    def _on_event(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            self._dropped = True
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._dropped:
            self._dropped = False
            self.heartbeat()  # back on a (maybe restarted) broker: an unknown worker is told at once
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._fatal = AuthenticationFailed(
                f"authentication failed: the broker at {self.endpoint} refused this worker's CURVE key")
            self.lose("authentication failed")

    def lose(self, reason: str, *, quick: bool = False) -> None:
        if not self._lost.is_set():
            self._lost_reason, self._quick = reason, quick
            self._lost.set()

    def _receive(self, frames: list[bytes], n_frames: int) -> None:
        self.heard, self.answered = self._clock(), True
        if frames[0] == b"":
            self._from_broker(frames, n_frames)
        else:
            self._on_request(frames, n_frames)

    def _from_broker(self, frames: list[bytes], n_frames: int) -> None:
        msg, reason = None, ""
        try:
            if n_frames != 3:
                raise InvalidRequest(f"a broker message is 3 frames, got {n_frames}", field="frames")
            msg = P.decode(frames[1:])
        except InvalidRequest as exc:
            reason = str(exc)
        if isinstance(msg, P.Heartbeat):
            self.stats.heartbeats_received += 1
        elif isinstance(msg, P.Disconnect):
            self.lose(f"the broker sent DISCONNECT ({msg.reason})", quick=True)
        else:
            self.stats.bad_broker_messages += 1
            reason = reason or f"the broker may not send {type(msg).__name__} without a client id"
            self._log.warning("bad broker message dropped", reason=reason)

    def send(self, client: bytes, msg: P.Base) -> bool:
        """Send without blocking; a full or closed socket drops the message (logged), never the worker."""
        if self.sock is None:
            return False
        error = transport.send_nowait(self.sock, [client, *P.encode(msg)])
        if error is not None:
            self._send_log.warning("send failed; message dropped", type=type(msg).__name__, error=repr(error))
            return False
        return True

    def heartbeat(self) -> None:
        """Once per interval: declare the broker lost after `heartbeat_liveness` silent intervals, else beat."""
        if self.sock is None or self._lost.is_set():
            return
        if self._clock() - self.heard > self.config.broker_ttl and not self.sock.get(zmq.EVENTS) & zmq.POLLIN:
            # (a message waiting unread is the broker heard: the loop was busy, e.g. a machine under load)
            self.lose(f"the broker was silent for {self.config.heartbeat_liveness} heartbeat intervals")
        elif self.send(b"", self._beat()):
            self.stats.heartbeats_sent += 1

    def close(self, reason: str) -> None:
        """DISCONNECT (so the broker answers our queued requests WORKER_LOST at once) and close."""
        if self.sock is not None:
            self.send(b"", P.Disconnect(reason=reason))
            self._monitor.close()
            self.sock.close(linger=self.config.linger_ms)
            self.sock = None
