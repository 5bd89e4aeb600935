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

from specrelay.common import auth, health, transport
from specrelay.common.pump import Pump, wake_sent
from specrelay.common.errors import FatalError, SettingError
from specrelay.common.membudget import MemoryBudget
from specrelay.common.protocol import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS

from .quotas import Limits
from .routing import Router
from .table import BACKEND, FRONTEND, Action

DEFAULT_LINGER_MS = 200
GAUGES = ("sessions_open", "live_workers", "live_edges", "loop_lag_s")
MAX_LOOP_LAG_S = 1.0  # /readyz fails while the event loop runs this late (a flood it cannot keep up with)

log = structlog.get_logger("specrelay.broker")


class Broker(transport.Service):
    """Binds the frontend (edges) and backend (workers) ROUTERs and moves frames through a `Router`.

    Use `async with Broker(...) as broker:` (serves in a background task), or `await start()` then
    `await run()` (serves until `stop()` or cancellation). After start(), `frontend`/`backend` hold the
    bound endpoints, so `tcp://127.0.0.1:0` (or `:*`) gets a free port.

    With `curve_secret`, both sockets are CURVE servers: edges must present a key listed in `edge_keys`, workers
    one listed in `worker_keys` (directories of NAME.key files, re-read by `reload_keys()` / SIGHUP). Without
    keys, binding anything but loopback needs `insecure=True`. With `max_rss_mb` the process exits
    (common/membudget.py) once its resident memory passes that many MiB, for its supervisor to restart it.
    """

    name = "broker"

    def __init__(self, frontend: str, backend: str, *, heartbeat_interval: float = HEARTBEAT_INTERVAL,
                 liveness: int = HEARTBEAT_LIVENESS, linger_ms: int = DEFAULT_LINGER_MS,
                 health_port: int | None = None, health_host: str = "127.0.0.1", limits: Limits | None = None,
                 curve_secret: str | None = None, edge_keys: str | None = None, worker_keys: str | None = None,
                 insecure: bool = False, max_rss_mb: float | None = None, context: zmq.asyncio.Context | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not 0 <= linger_ms <= 5000:
            raise SettingError(f"linger_ms must be in [0, 5000] so shutdown cannot hang, got {linger_ms}")
        if curve_secret is not None and (edge_keys is None or worker_keys is None):
            raise FatalError("--curve-secret needs both --edge-keys DIR and --worker-keys DIR")
        if curve_secret is None and (edge_keys is not None or worker_keys is not None):
            raise FatalError("--edge-keys / --worker-keys need --curve-secret (the broker's key pair): without "
                             "it the broker would run without CURVE")
        self.router = Router(heartbeat_interval=heartbeat_interval, liveness=liveness, limits=limits)
        self._keys = (curve_secret, edge_keys, worker_keys) if curve_secret is not None else None
        self._insecure = insecure
        self._allowlists: auth.Allowlists | None = None
        self._memory = MemoryBudget(max_rss_mb) if max_rss_mb else None
        self.loop_lag_s = 0.0
        self.frontend, self.backend = frontend, backend
        self.health_port, self.health_host = health_port, health_host
        self._linger_ms = linger_ms
        self._ctx = context or zmq.asyncio.Context.instance()
        self._clock = clock
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._pumps: dict[str, Pump] = {}
        self._pump_group: list[Pump] = []  # a send on one socket may hide input from the other's reader
        self._health: asyncio.Server | None = None
        self._log = log

    @property
    def stats(self) -> dict[str, int]:
        return self.router.stats.as_dict() | {"loop_lag_s": round(self.loop_lag_s, 4)}

    async def _open(self) -> None:
        """Start the ZAP authenticator (keys) before binding both sockets, then the health port."""
        if self._memory is not None:
            self._memory.start()
        auth.check_insecure_bind([self.frontend, self.backend], keys=self._keys is not None, insecure=self._insecure)
        curves = {FRONTEND: None, BACKEND: None}
        if self._keys is not None:
            secret, edge_keys, worker_keys = self._keys
            curves = {FRONTEND: auth.server(secret, auth.EDGE_DOMAIN), BACKEND: auth.server(secret, auth.WORKER_DOMAIN)}
            self._allowlists = auth.Allowlists(self._ctx, edge_keys, worker_keys)
            self._allowlists.start()
        for name, endpoint in ((FRONTEND, self.frontend), (BACKEND, self.backend)):
            sock = transport.make_socket(self._ctx, zmq.ROUTER, linger_ms=self._linger_ms, mandatory=True,
                                         heartbeat_s=self.router.heartbeat_interval, curve=curves[name])
            self._sockets[name] = sock
            self._pumps[name] = Pump(sock, self._pump_group)
            setattr(self, name, transport.bind(sock, endpoint, f"broker {name}"))
        self._log = log.bind(frontend=self.frontend, backend=self.backend)
        if self.health_port is not None:
            endpoints = health.Endpoints(self._healthz, self._readyz,
                                         health.registry_for("specrelay_broker_", lambda: self.stats, GAUGES))
            self._health = await health.start_http(self.health_host, self.health_port, endpoints)
            self.health_port = self._health.sockets[0].getsockname()[1]
        self._log.info("broker listening", health_port=self.health_port, curve=self._keys is not None,
                       heartbeat_interval=self.router.heartbeat_interval)

    def reload_keys(self) -> None:
        """Re-read the edge and worker key directories (SIGHUP)."""
        if self._allowlists is not None:
            self._allowlists.reload()

    def _loops(self):
        return [self._pump(FRONTEND), self._pump(BACKEND), self._ticker()]

    async def _close(self) -> None:
        if self._memory is not None:
            self._memory.stop()
        if self._health is not None:
            self._health.close()
        if self._allowlists is not None:
            self._allowlists.stop()
        for sock in self._sockets.values():
            sock.close(linger=self._linger_ms)
        if self._sockets:
            self._log.info("broker stopped", **self.stats)
        self._sockets.clear()
        self._pumps.clear()
        self._pump_group.clear()

    # ---- the three loops ---------------------------------------------------------------------------

    async def _pump(self, name: str) -> None:
        """Read one socket forever; each message becomes Router actions, sent at once. With keys, each message
        carries the peer's authenticated key (its User-Id)."""
        handler = self.router.from_edge if name == FRONTEND else self.router.from_worker

        def on_message(frames: list[bytes], n_frames: int, user: str | None = None) -> None:
            self._send(self._route(handler, frames, self._clock(), n_frames, user))
        await self._pumps[name].receive_forever(on_message, with_user=self._keys is not None)

    async def _ticker(self) -> None:
        """Heartbeats and expiry: sleep until the Router's next deadline (at most a tenth of an interval, so
        the loop's lag is measured often)."""
        step = self.router.heartbeat_interval / 10
        while True:
            self._send(self._route(self.router.tick, self._clock()))
            wake_sent(self._pump_group)
            deadline = self.router.next_deadline()
            delay = min(max(step if deadline is None else deadline - self._clock(), 0.001), step)
            due = self._clock() + delay
            await asyncio.sleep(delay)
            self.loop_lag_s = max(0.0, self._clock() - due)

    def _send(self, actions: list[Action]) -> None:
        """Send non-blocking; failures go back to the Router, whose answers join the queue."""
        pending = deque(actions)
        while pending:
            name, frames = pending.popleft()
            error = self._pumps[name].send_nowait(frames)
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
        """Ready while a worker is registered and the loop keeps time."""
        return self.router.stats.live_workers > 0 and self.loop_lag_s < MAX_LOOP_LAG_S, self._summary()

    def _summary(self) -> dict:
        return {"live_workers": self.router.stats.live_workers, "sessions_open": self.router.stats.sessions_open,
                "loop_lag_s": round(self.loop_lag_s, 4)}


async def serve(frontend: str, backend: str, **options: object) -> None:
    """Run a broker until SIGTERM / SIGINT (SIGHUP re-reads the key directories): the body of
    `specrelay broker`. options: the other keyword arguments of `Broker` (health_port, keys, limits, ...)."""
    import signal

    broker = Broker(frontend, backend, **options)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, broker.reload_keys)
    try:
        await transport.serve_until_signalled(broker)
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
