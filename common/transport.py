"""Every ZeroMQ socket specrelay opens is made, configured and read here, and the three process shells (broker,
cloud worker, edge worker) share one lifecycle, `Service`.

Socket rules (the ZeroMQ Guide; README "Security"):
  LINGER        bounded, so shutdown cannot hang on unsent frames
  MAXMSGSIZE    per frame; a message's frame count is capped by `recv_capped` (libzmq has no such limit)
  ROUTER_MANDATORY  a send to an unknown peer raises EHOSTUNREACH instead of vanishing
  ZMTP heartbeats   drop dead TCP peers (application heartbeats still catch a hung process)
  CURVE         every TCP socket when keys are configured (common/auth.py): a bound socket is a CURVE server
                checked by the ZAP handler; a connecting socket carries its key pair and the server's key
  routing ids   libzmq 4.3.5 gives a ROUTER peer that sends no id `0x00` + a 32-bit counter that starts at glibc
                rand() when the socket is made, and aborts if that id is already held by a peer that chose it.
                `seed_routing_ids` seeds rand() from the OS before every ROUTER, so the counter's start is secret
                (README, Security: "Routing ids, message memory and keys").
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio

from . import protocol as P
from .errors import FatalError

log = structlog.get_logger("specrelay.transport")

FRAME_CAP = P.MAX_FRAMES + 2  # routing id + client id + header + body: more frames is an attack or a bug
RECV_BURST = 64               # messages handled before a receive loop yields to the event loop


@dataclass(frozen=True)
class Curve:
    """CURVE keys of one socket. A server socket (server_key None) authenticates peers through ZAP with
    `domain`; a client socket presents its key pair and checks the server's public key."""

    public: bytes
    secret: bytes
    server_key: bytes | None = None
    domain: str = ""


def make_socket(ctx: zmq.asyncio.Context, kind: int, *, linger_ms: int, identity: bytes | None = None,
                curve: Curve | None = None, mandatory: bool = False, heartbeat_s: float | None = None,
                handover: bool = False) -> zmq.asyncio.Socket:
    """A socket with specrelay's limits. Options that must precede bind/connect are all set here."""
    if kind == zmq.ROUTER:
        seed_routing_ids()  # the ROUTER reads its counter's start from rand() as it is made, just below
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, int(mandatory))
        sock.setsockopt(zmq.ROUTER_HANDOVER, int(handover))
    if heartbeat_s:
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s * 3000))
    if curve is not None:
        _set_curve(sock, curve)
    return sock


def _libc() -> ctypes.CDLL | None:
    """The C library whose rand() libzmq calls (pyzmq's bundled libzmq links the process's libc)."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None)
    except OSError:
        return None
    return lib if hasattr(lib, "srand") else None


_LIBC = _libc()


def seed_routing_ids() -> None:
    """Seed the C library's rand() with 32 bits from os.urandom: the next ROUTER made starts its generated
    routing ids (`0x00` + uint32 counter) at a value no peer can know. Unseeded, every process starts at the
    same value, and a peer that holds the next ids aborts the process (libzmq asserts on the collision)."""
    if _LIBC is None:
        raise FatalError("cannot seed libzmq's routing-id counter: no C library with srand() found")
    _LIBC.srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "little")))


def _set_curve(sock: zmq.Socket, curve: Curve) -> None:
    if curve.server_key is None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, curve.domain)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: refuse, never accept
    else:
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)


def bind(sock: zmq.asyncio.Socket, endpoint: str, what: str) -> str:
    """Bind, or close the socket and raise FatalError naming the endpoint. Returns the bound endpoint."""
    _attach(sock.bind, sock, f"{what} cannot bind {endpoint}", endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.asyncio.Socket, endpoint: str, what: str) -> None:
    """Connect, or close the socket and raise FatalError naming the endpoint."""
    _attach(sock.connect, sock, f"{what} cannot connect to {endpoint!r}", endpoint)


def _attach(method, sock: zmq.asyncio.Socket, failure: str, endpoint: str) -> None:
    try:
        method(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise FatalError(f"{failure}: {exc}") from exc


async def recv_capped(sock: zmq.asyncio.Socket, cap: int = FRAME_CAP) -> tuple[list[bytes], int]:
    """One multipart message, keeping at most `cap` frames (MAXMSGSIZE bounds each frame, not their
    number). Returns the frames kept and the real frame count."""
    return await _recv_rest(sock, [await sock.recv()], cap)


async def recv_capped_user(sock: zmq.asyncio.Socket, cap: int = FRAME_CAP) -> tuple[list[bytes], int, str | None]:
    """`recv_capped` plus the peer's authenticated User-Id (the z85 CURVE key the ZAP handler accepted; None
    on a socket without CURVE)."""
    first = await sock.recv(copy=False)
    try:
        user = first.get("User-Id")
    except zmq.ZMQError:
        user = None
    frames, n_frames = await _recv_rest(sock, [first.bytes], cap)
    return frames, n_frames, user


async def _recv_rest(sock: zmq.asyncio.Socket, frames: list[bytes], cap: int) -> tuple[list[bytes], int]:
    n_frames = 1
    while sock.getsockopt(zmq.RCVMORE):
        frame = await sock.recv(flags=zmq.NOBLOCK)  # the rest of a message arrives with its first frame
        n_frames += 1
        if n_frames <= cap:
            frames.append(frame)
    return frames, n_frames


async def receive_forever(sock: zmq.asyncio.Socket, handle: Callable[..., Awaitable[None] | None], *,
                          cap: int = FRAME_CAP, burst: int = RECV_BURST, with_user: bool = False) -> None:
    """Read `sock` forever, `handle(frames, n_frames)` per message (`handle(frames, n_frames, user_id)` with
    `with_user`), awaited when it returns an awaitable. pyzmq returns a queued message without yielding, so the
    loop yields every `burst` messages: a flood can never starve heartbeats, timers or the health port."""
    n = 0
    while True:
        if with_user:
            result = handle(*await recv_capped_user(sock, cap))
        else:
            result = handle(*await recv_capped(sock, cap))
        if result is not None:
            await result
        n += 1
        if n % burst == 0:
            await asyncio.sleep(0)


class Monitor:
    """A socket's monitor events (zmq.EVENT_*) fed to `on_event`: how a client learns that the broker refused its
    key (EVENT_HANDSHAKE_FAILED_AUTH), or that a connection dropped or came back. Create it before connecting
    (so it sees every event), run `run()` as a loop, and `close()` it with its socket."""

    def __init__(self, sock: zmq.asyncio.Socket, on_event: Callable[[int], None],
                 events: int = zmq.EVENT_ALL) -> None:
        self._sock, self._on_event = sock, on_event
        self._monitor = sock.get_monitor_socket(events)

    async def run(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            self._on_event(parse_monitor_message(await self._monitor.recv_multipart())["event"])

    def close(self) -> None:
        """Before closing the monitored socket."""
        if self._monitor.closed:
            return
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is already closed
        self._monitor.close(linger=0)


def send_nowait(sock: zmq.asyncio.Socket, frames: list[bytes]) -> zmq.ZMQError | None:
    """Send without blocking; returns the error (full queue EAGAIN, unknown peer EHOSTUNREACH) instead of raising.
    With NOBLOCK, pyzmq's asyncio send resolves at once."""
    try:
        future = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    except zmq.ZMQError as exc:
        return exc
    exc = future.exception() if future.done() else None
    if exc is not None and not isinstance(exc, zmq.ZMQError):
        raise exc
    return exc


class Service:
    """Lifecycle of a process shell: `start()` opens sockets, `run()` serves its loops in one TaskGroup until
    `stop()` (or a loop raises, or cancellation), and `_close()` drains and closes exactly once.

    `async with service:` serves in a background task; `await serve_until_signalled(service)` is a process's
    main: SIGTERM / SIGINT drain and stop it. Subclasses implement `_open`, `_loops` and `_close`.
    """

    name = "service"

    def __init__(self) -> None:
        self._stop_requested = asyncio.Event()
        self._stopped = asyncio.Event()
        self._started = self._closed = False
        self._running = False
        self._task: asyncio.Task | None = None

    async def _open(self) -> None:
        """Bind / connect sockets and open the health port."""

    def _loops(self) -> list[Coroutine]:
        """The long-running coroutines; each ends only by raising."""
        return []

    async def _close(self) -> None:
        """Drain and close everything; called once, also after a failed start."""

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError(f"a stopped {self.name} cannot be started again")
        if not self._started:
            self._started = True
            try:
                await self._open()
            except BaseException:
                await self._shutdown()
                raise

    async def run(self) -> None:
        """Serve until `stop()`; a loop that raises stops the others and the error propagates."""
        await self.start()
        self._running = True
        try:
            async with asyncio.TaskGroup() as group:
                for coro in self._loops():
                    group.create_task(coro)
                group.create_task(self._stop_when_asked())
        except BaseExceptionGroup as failed:  # a loop raised: the first real error, unwrapped
            errors = [e for e in failed.exceptions if not isinstance(e, _StopRequested)]
            if errors:
                raise errors[0] from None
        finally:
            self._running = False
            await asyncio.shield(self._shutdown())

    async def _stop_when_asked(self) -> None:
        await self._stop_requested.wait()
        raise _StopRequested

    def request_stop(self) -> None:
        """Ask `run()` to drain and return (safe from a signal handler)."""
        self._stop_requested.set()

    async def stop(self) -> None:
        """Stop serving and close everything (drain first)."""
        self.request_stop()
        task, self._task = self._task, None
        if task is not None:
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        elif self._running:
            await self._stopped.wait()
        await self._shutdown()

    async def _shutdown(self) -> None:
        if self._closed:
            await self._stopped.wait()
            return
        self._closed = True
        try:
            if self._started:
                await self._close()
        finally:
            self._stopped.set()

    async def __aenter__(self):
        await self.start()
        self._task = asyncio.create_task(self.run(), name=self.name)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


class _StopRequested(Exception):
    pass


async def serve_until_signalled(service: Service) -> None:
    """A process's main: run `service`; SIGTERM / SIGINT ask it to drain and stop."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, service.request_stop)
    try:
        await service.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def serve_all(*services, on_started=None) -> None:
    """Start `services` in order (common.transport.Service), serve until SIGTERM / SIGINT or until any of them
    stops, then stop them in reverse order (a front end before the edge it uses, the edge before the broker).
    `on_started()` runs once all are up."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with AsyncExitStack() as stack:
            for service in services:
                await stack.enter_async_context(service)
            if on_started is not None:
                on_started()
            waits = [asyncio.create_task(stop.wait())]
            waits += [asyncio.create_task(s._stopped.wait()) for s in services]  # Service's "closed" event
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
