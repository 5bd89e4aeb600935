"""The broker process: two ZeroMQ ROUTER sockets around the pure `Router`.

    edge DEALERs -> frontend ROUTER ── Router ── backend ROUTER <- worker DEALERs

One reader loop per socket hands each message to the Router; a timer loop ticks heartbeats and expiry.
Every action is sent non-blocking: a send that fails because the peer is gone (EHOSTUNREACH, thanks to
ROUTER_MANDATORY) or its queue is full (EAGAIN) goes back to the Router as an event, never a crash, and
one slow peer never stalls the others.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio

from specrelay.common import health, transport

from .routing import BACKEND, FRONTEND, HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS, Action, Router

DEFAULT_LINGER_MS = 200
GAUGES = ("sessions_open", "live_workers")

log = structlog.get_logger("specrelay.broker")


class Broker(transport.Service):
    """Binds the frontend (edges) and backend (workers) ROUTERs and moves frames through a `Router`.

    Use `async with Broker(...) as broker:` (serves in a background task), or `await start()` then
    `await run()` (serves until `stop()` or cancellation). After start(), `frontend`/`backend` hold the
    bound endpoints, so `tcp://127.0.0.1:0` (or `:*`) gets a free port.
    """

    name = "broker"

    def __init__(self, frontend: str, backend: str, *, heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 liveness: int = HEARTBEAT_LIVENESS, linger_ms: int = DEFAULT_LINGER_MS,
                 health_port: int | None = None, health_host: str = "127.0.0.1",
                 context: zmq.asyncio.Context | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not 0 <= linger_ms <= 5000:
            raise ValueError(f"linger_ms must be in [0, 5000] so shutdown cannot hang, got {linger_ms}")
        self.router = Router(heartbeat_interval=heartbeat_interval, liveness=liveness)
        self.frontend, self.backend = frontend, backend
        self.health_port, self.health_host = health_port, health_host
        self._linger_ms = linger_ms
        self._ctx = context or zmq.asyncio.Context.instance()
        self._clock = clock
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._health: asyncio.Server | None = None
        self._log = log

    @property
    def stats(self) -> dict[str, int]:
        return self.router.stats.as_dict()

    async def _open(self) -> None:
        """Bind both sockets (and the health port)."""
        for name, endpoint in ((FRONTEND, self.frontend), (BACKEND, self.backend)):
            sock = transport.make_socket(self._ctx, zmq.ROUTER, linger_ms=self._linger_ms, mandatory=True,
                                         heartbeat_s=self.router.heartbeat_interval)
            self._sockets[name] = sock
            setattr(self, name, transport.bind(sock, endpoint, f"broker {name}"))
        self._log = log.bind(frontend=self.frontend, backend=self.backend)
        if self.health_port is not None:
            endpoints = health.Endpoints(self._healthz, self._readyz,
                                         health.registry_for("specrelay_broker_", lambda: self.stats, GAUGES))
            self._health = await health.start_http(self.health_host, self.health_port, endpoints)
            self.health_port = self._health.sockets[0].getsockname()[1]
        self._log.info("broker listening", health_port=self.health_port,
                       heartbeat_interval=self.router.heartbeat_interval)

    def _loops(self):
        return [self._pump(FRONTEND), self._pump(BACKEND), self._ticker()]

    async def _close(self) -> None:
        if self._health is not None:
            self._health.close()
        for sock in self._sockets.values():
            sock.close(linger=self._linger_ms)
        if self._sockets:
            self._log.info("broker stopped", **self.stats)
        self._sockets.clear()

    # ---- the three loops ---------------------------------------------------------------------------

    async def _pump(self, name: str) -> None:
        """Read one socket forever; each message becomes Router actions, sent at once."""
        handle = self.router.from_edge if name == FRONTEND else self.router.from_worker

        def on_message(frames: list[bytes], n_frames: int) -> None:
            self._send(self._route(handle, frames, self._clock(), n_frames))

        await transport.receive_forever(self._sockets[name], on_message)

    async def _ticker(self) -> None:
        """Heartbeats and expiry: sleep until the Router's next deadline (at most one interval)."""
        interval = self.router.heartbeat_interval
        while True:
            self._send(self._route(self.router.tick, self._clock()))
            deadline = self.router.next_deadline()
            delay = interval if deadline is None else deadline - self._clock()
            await asyncio.sleep(min(max(delay, 0.001), interval))

    def _send(self, actions: list[Action]) -> None:
        """Send non-blocking; failures go back to the Router, whose answers join the queue."""
        pending = deque(actions)
        while pending:
            name, frames = pending.popleft()
            error = transport.send_nowait(self._sockets[name], frames)
            if error is None:
                continue
            if error.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise error
            pending.extend(self._route(self.router.undeliverable, name, frames, self._clock(),
                                       peer_gone=error.errno == zmq.EHOSTUNREACH))

    def _route(self, handler: Callable[..., list[Action]], *args: object, **kwargs: object) -> list[Action]:
        """Call the Router; a bug there drops this one message, never the broker."""
        try:
            return handler(*args, **kwargs)
        except Exception:
            self.router.stats.internal_errors += 1
            self._log.exception("routing error; message dropped", handler=handler.__name__)
            return []

    # ---- health ------------------------------------------------------------------------------------

    def _healthz(self) -> tuple[bool, dict]:
        return True, self._summary()

    def _readyz(self) -> tuple[bool, dict]:
        return self.router.stats.live_workers > 0, self._summary()

    def _summary(self) -> dict:
        return {"live_workers": self.router.stats.live_workers, "sessions_open": self.router.stats.sessions_open}


async def serve(frontend: str, backend: str, **options: object) -> None:
    """Run a broker until SIGTERM / SIGINT: the body of `specrelay broker --frontend ... --backend ...`.
    options: the other keyword arguments of `Broker` (health_port, heartbeat_interval, liveness, ...)."""
    await transport.serve_until_signalled(Broker(frontend, backend, **options))
