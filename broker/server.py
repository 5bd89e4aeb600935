"""The broker process: two ZeroMQ ROUTER sockets around the pure `Router`.

    edge DEALERs -> frontend ROUTER ── Router ── backend ROUTER <- worker DEALERs

One reader task per socket hands each message to the Router; a timer task ticks heartbeats and expiry.
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

from specrelay.common import protocol
from specrelay.common.errors import FatalError

from .health import start_health_server
from .routing import BACKEND, FRONTEND, HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS, Action, Router

FRAME_CAP = protocol.MAX_FRAMES + 2  # routing id + client id + a message: more frames is an attack or a bug
DEFAULT_LINGER_MS = 200

log = structlog.get_logger("specrelay.broker")


class Broker:
    """Binds the frontend (edges) and backend (workers) ROUTERs and moves frames through a `Router`.

    Use `async with Broker(...) as broker:` (serves in a background task), or `await start()` then
    `await run()` (serves until `stop()` or cancellation). After start(), `frontend`/`backend` hold the
    bound endpoints, so `tcp://127.0.0.1:0` (or `:*`) gets a free port.
    """

    def __init__(self, frontend: str, backend: str, *, heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 liveness: int = HEARTBEAT_LIVENESS, linger_ms: int = DEFAULT_LINGER_MS,
                 health_port: int | None = None, health_host: str = "127.0.0.1",
                 context: zmq.asyncio.Context | None = None, clock: Callable[[], float] = time.monotonic) -> None:
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
        self._stopping = asyncio.Event()
        self._finished = asyncio.Event()
        self._running = False
        self._serve_task: asyncio.Task | None = None
        self._log = log

    @property
    def stats(self) -> dict[str, int]:
        return self.router.stats.as_dict()

    async def start(self) -> tuple[str, str]:
        """Bind both sockets (and the health port); returns the bound (frontend, backend) endpoints."""
        if self._sockets:
            return self.frontend, self.backend
        for name, endpoint in ((FRONTEND, self.frontend), (BACKEND, self.backend)):
            try:
                self._sockets[name] = self._bind(endpoint)
            except zmq.ZMQError as exc:
                self._close_sockets()
                raise FatalError(f"broker cannot bind its {name} to {endpoint}: {exc}") from exc
        self.frontend = self._sockets[FRONTEND].getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend = self._sockets[BACKEND].getsockopt_string(zmq.LAST_ENDPOINT)
        self._log = log.bind(frontend=self.frontend, backend=self.backend)
        if self.health_port is not None:
            self._health = await start_health_server(self.health_host, self.health_port, lambda: self.stats)
            self.health_port = self._health.sockets[0].getsockname()[1]
        self._log.info("broker listening", health_port=self.health_port,
                       heartbeat_interval=self.router.heartbeat_interval)
        return self.frontend, self.backend

    def _bind(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)    # unknown peer -> EHOSTUNREACH, not a silent drop
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME)  # per frame; FRAME_CAP bounds the count
        # ZMTP heartbeats drop dead TCP peers; application heartbeats (Router.tick) catch hung workers
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.router.heartbeat_interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.router.ttl * 1000))
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    async def run(self) -> None:
        """Serve until `stop()`; cancellation propagates after the sockets are closed."""
        await self.start()
        self._running = True
        tasks = [asyncio.create_task(self._pump(FRONTEND), name="broker-frontend"),
                 asyncio.create_task(self._pump(BACKEND), name="broker-backend"),
                 asyncio.create_task(self._ticker(), name="broker-ticker")]
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a reader that died (e.g. the context was terminated) raises here
        finally:
            for task in (*tasks, stopping):
                task.cancel()
            await asyncio.gather(*tasks, stopping, return_exceptions=True)
            await self._shutdown()
            self._finished.set()

    async def stop(self) -> None:
        """Stop serving and close the sockets (LINGER bounds how long queued frames may delay this)."""
        self._stopping.set()
        task, self._serve_task = self._serve_task, None
        if task is not None:
            await task
        elif self._running:
            await self._finished.wait()
        await self._shutdown()

    async def __aenter__(self) -> Broker:
        await self.start()
        self._serve_task = asyncio.create_task(self.run(), name="broker")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ---- the three tasks -------------------------------------------------------------------------

    async def _pump(self, name: str) -> None:
        """Read one socket forever; each message becomes Router actions, sent at once."""
        sock = self._sockets[name]
        handle = self.router.from_edge if name == FRONTEND else self.router.from_worker
        while True:
            frames, n_frames = await _recv_capped(sock, FRAME_CAP)
            await self._send(self._route(handle, frames, self._clock(), n_frames))

    async def _ticker(self) -> None:
        """Heartbeats and expiry: sleep until the Router's next deadline (at most one interval)."""
        interval = self.router.heartbeat_interval
        while True:
            await self._send(self._route(self.router.tick, self._clock()))
            deadline = self.router.next_deadline()
            delay = interval if deadline is None else deadline - self._clock()
            await asyncio.sleep(min(max(delay, 0.001), interval))

    async def _send(self, actions: list[Action]) -> None:
        """Send non-blocking; failures go back to the Router, whose answers join the queue."""
        pending = deque(actions)
        while pending:
            name, frames = pending.popleft()
            try:
                await self._sockets[name].send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as exc:
                if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                    raise
                pending.extend(self._route(self.router.undeliverable, name, frames, self._clock(),
                                           peer_gone=exc.errno == zmq.EHOSTUNREACH))

    def _route(self, handler: Callable[..., list[Action]], *args: object, **kwargs: object) -> list[Action]:
        """Call the Router; a bug there drops this one message, never the broker."""
        try:
            return handler(*args, **kwargs)
        except Exception:
            self.router.stats.internal_errors += 1
            self._log.exception("routing error; message dropped", handler=handler.__name__)
            return []

    # ---- shutdown --------------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        if self._health is not None:
            health, self._health = self._health, None
            health.close()
            await health.wait_closed()
        if self._sockets:
            self._close_sockets()
            self._log.info("broker stopped", **self.stats)

    def _close_sockets(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=self._linger_ms)
        self._sockets.clear()


async def _recv_capped(sock: zmq.asyncio.Socket, cap: int) -> tuple[list[bytes], int]:
    """One multipart message, keeping at most `cap` frames (MAXMSGSIZE bounds each frame, not their
    number). Returns the frames kept and the real frame count."""
    frames = [await sock.recv()]
    n_frames = 1
    while sock.getsockopt(zmq.RCVMORE):
        frame = await sock.recv(flags=zmq.NOBLOCK)  # the rest of a message arrives with its first frame
        n_frames += 1
        if n_frames <= cap:
            frames.append(frame)
    return frames, n_frames


async def serve(frontend: str, backend: str, *, health_port: int | None = None, **options: object) -> None:
    """Run a broker until cancelled: the body of `specrelay broker --frontend ... --backend ...`.
    options: the other keyword arguments of `Broker` (heartbeat_interval, liveness, linger_ms, ...)."""
    broker = Broker(frontend, backend, health_port=health_port, **options)
    try:
        await broker.run()
    finally:
        await broker.stop()
