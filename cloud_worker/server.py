"""The cloud worker process: a zmq.asyncio DEALER around the pure `Verifier`, with the `Batcher` queue between.

    broker backend ROUTER  <-  DEALER (this process)
    in : [client_id, header, body]   OPEN, VERIFY, CLOSE, RESAMPLE, the edge's id prepended by the broker
         [b"", header, body]         the broker's HEARTBEAT / DISCONNECT
    out: [client_id, header, body]   VERDICT, RESAMPLED, ERROR (OPEN and CLOSE are not answered unless they fail)
         [b"", header, body]         READY, HEARTBEAT, DISCONNECT

Three tasks. The connection task receives into the Batcher and reconnects Paranoid-Pirate style (new socket,
READY again) when the broker is silent for `heartbeat_liveness` intervals or says DISCONNECT. The processor
applies OPEN/CLOSE/RESAMPLE in arrival order and runs ONE `Verifier.verify` per batch in a one-thread
executor, so heartbeats flow and the next batch fills while the model runs. The ticker sends heartbeats and
the systemd watchdog. Only the processor touches the Verifier (through the executor thread while it awaits
it), so there is no lock.

Session ids are unique per edge only (two edges may both send session 1), while the Verifier and the Batcher
key sessions by one int. So every edge message's session is rewritten on arrival to a scoped key,
`edge index << 64 | session` (an edge's index: a number given to its client id on first sight, never reused),
and every reply carries the edge's own session id again on its way out.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import structlog
import zmq
import zmq.asyncio

from ..common import protocol as P
from ..common.errors import FatalError, InvalidRequest, RequestError
from ..common.protocol import MsgType
from ..common.runner import ModelRunner
from .batcher import Batcher, Item
from ..common.health import sd_notify
from .health import start_health_server
from .verifier import Verifier, VerifierConfig

log = structlog.get_logger("specrelay.cloud")

EDGE_TYPES = frozenset({MsgType.OPEN, MsgType.VERIFY, MsgType.CLOSE, MsgType.RESAMPLE})
FRAME_CAP = P.MAX_FRAMES + 1  # client id + a message; frames past this are counted, not kept
HEALTHY_TICKS = 3             # /healthz fails when the loop has not ticked for this many heartbeat intervals
RECV_BURST = 64               # messages received before yielding to the other tasks
SESSION_BITS = 64             # an edge's session id is a U63, so it fits below the edge index in a scoped key
SESSION_MASK = (1 << SESSION_BITS) - 1


@dataclass
class WorkerConfig:
    """How a cloud worker batches, heartbeats and reports; validated here, once."""

    max_batch: int = 32
    max_wait_ms: float = 5.0             # longest wait to fill a batch, and only while others may still send
    max_sessions: int = 1024
    max_cache_bytes: int = 2 << 30       # KV memory cap; least-recently-used sessions are evicted past it
    heartbeat_interval: float = 1.0
    heartbeat_liveness: int = 3          # broker silent this many intervals = dead: reconnect
    health_port: int | None = None       # HTTP /healthz /readyz /metrics (0 = any free port)
    health_host: str = "127.0.0.1"
    identity: bytes | None = None        # explicit DEALER identity (default: chosen by the broker's ROUTER)
    linger_ms: int = 200                 # bounded, so shutdown cannot hang on unsent frames
    idle_after_s: float = 5.0            # a session silent this long is not waited for when batching
    reconnect_max_s: float = 32.0        # reconnect back-off doubles from heartbeat_interval up to this
    drain_timeout_s: float = 30.0        # on stop, how long the running batch may take to finish

    def __post_init__(self) -> None:
        checks = [
            (self.max_batch >= 1, "max_batch must be >= 1"),
            (0 <= self.max_wait_ms <= 1000, "max_wait_ms must be in [0, 1000]"),
            (self.max_sessions >= 1, "max_sessions must be >= 1"),
            (self.max_cache_bytes > 0, "max_cache_bytes must be > 0"),
            (self.heartbeat_interval > 0, "heartbeat_interval must be > 0"),
            (self.heartbeat_liveness >= 1, "heartbeat_liveness must be >= 1"),
            (0 <= self.linger_ms <= 5000, "linger_ms must be in [0, 5000] so shutdown cannot hang"),
            (self.identity is None or (0 < len(self.identity) <= 255 and self.identity[0] != 0),
             "identity must be 1-255 bytes and not start with a zero byte (reserved by ZeroMQ)"),
            (self.idle_after_s > 0 and self.reconnect_max_s > 0 and self.drain_timeout_s >= 0,
             "idle_after_s and reconnect_max_s must be > 0, drain_timeout_s >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class WorkerStats:
    requests: int = 0               # edge messages received (malformed ones included)
    verify_requests: int = 0        # VERIFYs run through the model
    batches: int = 0
    batch_sizes: Counter = field(default_factory=Counter)  # batch size -> batches of that size
    bad_requests: int = 0
    internal_errors: int = 0        # batches the model failed on
    errors: Counter = field(default_factory=Counter)       # ERROR replies by code
    replies: int = 0
    replies_dropped: int = 0        # stale (older broker connection) or refused by the socket
    heartbeats_sent: int = 0
    heartbeats_received: int = 0
    bad_broker_messages: int = 0
    reconnects: int = 0


class CloudWorker:
    """Serves one target model to a broker. `async with CloudWorker(...) as w:` (serves in a background
    task), or `await run()` (serves until `stop()` or cancellation). A worker is started once."""

    def __init__(self, broker: str, runner: ModelRunner, config: WorkerConfig | None = None, *,
                 context: zmq.asyncio.Context | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.broker = broker
        self.config = c = config or WorkerConfig()
        self.verifier = Verifier(runner, VerifierConfig(c.max_batch, c.max_sessions, c.max_cache_bytes))
        self.batcher = Batcher(c.max_batch, c.max_wait_ms / 1000, c.idle_after_s)
        self.health_port = c.health_port
        self._stats = WorkerStats()
        self._ctx = context or zmq.asyncio.Context.instance()
        self._clock = clock
        self._sock: zmq.asyncio.Socket | None = None
        self._generation = 0      # broker connections so far; items carry the one they came in on
        self._reset_to = 0        # the processor forgets sessions and messages of connections before this
        self._reset_done = 0
        self._heard = self._last_tick = clock()
        self._answered = False    # the broker has sent something on this connection
        self._lost = asyncio.Event()
        self._lost_reason = ""
        self._arrived = asyncio.Event()
        self._stopping = asyncio.Event()
        self._finished = asyncio.Event()
        self._shutdown_lock = asyncio.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: tuple[asyncio.Future, list[Item]] | None = None
        self._edges: dict[bytes, int] = {}  # client id -> its index in scoped session keys
        self._edge_serials = itertools.count(1)  # index 0 is never given out: keys of unknown clients
        self._health: asyncio.Server | None = None
        self._run_task: asyncio.Task | None = None
        self._started = self._running = self._closed = False
        self._log = log.bind(broker=broker, model=runner.name)

    @property
    def stats(self) -> dict:
        s, v = self._stats, self.verifier.stats
        return {
            "requests": s.requests, "verify_requests": s.verify_requests, "batches": s.batches,
            "forward_passes": v["forward_passes"], "bad_requests": s.bad_requests,
            "internal_errors": s.internal_errors, "replies": s.replies, "replies_dropped": s.replies_dropped,
            "heartbeats_sent": s.heartbeats_sent, "heartbeats_received": s.heartbeats_received,
            "bad_broker_messages": s.bad_broker_messages, "reconnects": s.reconnects, "evictions": v["evictions"],
            "sessions_open": len(self.verifier.sessions), "queued": len(self.batcher),
            "connected": int(self._sock is not None),
            "batch_size_mean": s.verify_requests / s.batches if s.batches else 0.0,
            "batch_sizes": dict(s.batch_sizes), "errors": dict(s.errors),
        }

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the health port, connect to the broker and send READY (idempotent)."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("a stopped CloudWorker cannot be started again")
        self._started = True
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="specrelay-verify")
        self._last_tick = self._clock()
        if self.config.health_port is not None:
            self._health = await start_health_server(self.config.health_host, self.config.health_port,
                                                     healthz=self._healthz, readyz=self._readyz,
                                                     stats=lambda: self.stats)
            self.health_port = self._health.sockets[0].getsockname()[1]
        self._connect()
        sd_notify("READY=1")
        self._log.info("cloud worker started", vocab_size=self.verifier.runner.vocab_size,
                       max_batch=self.config.max_batch, health_port=self.health_port)

    async def run(self) -> None:
        """Serve until `stop()`; on cancellation too, the running batch is drained and DISCONNECT sent."""
        await self.start()
        self._running = True
        tasks = [asyncio.create_task(self._keep_connected(), name="cloud-connection"),
                 asyncio.create_task(self._process(), name="cloud-processor"),
                 asyncio.create_task(self._tick(), name="cloud-ticker")]
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # the three tasks only end by raising
        finally:
            for task in (*tasks, stopping):
                task.cancel()
            await asyncio.gather(*tasks, stopping, return_exceptions=True)
            await self._shutdown()
            self._finished.set()

    async def stop(self) -> None:
        """Stop serving: let the running batch finish (drain_timeout_s), send DISCONNECT, close the socket."""
        self._stopping.set()
        task, self._run_task = self._run_task, None
        if task is not None:
            await asyncio.wait({task})  # our own cancellation propagates; the run task's does not
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        elif self._running:
            await self._finished.wait()
        await self._shutdown()

    async def __aenter__(self) -> CloudWorker:
        await self.start()
        self._run_task = asyncio.create_task(self.run(), name="cloud-worker")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ---- connection (Paranoid Pirate) --------------------------------------------------------------

    def _connect(self) -> None:
        c = self.config
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, c.linger_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME)  # per frame; FRAME_CAP bounds the count
        if c.identity:
            sock.setsockopt(zmq.IDENTITY, c.identity)
        try:
            sock.connect(self.broker)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise FatalError(f"cloud worker cannot connect to {self.broker!r}: {exc}") from exc
        self._sock, self._generation = sock, self._generation + 1
        self._heard, self._answered, self._lost_reason = self._clock(), False, ""
        self._lost.clear()
        runner = self.verifier.runner
        self._send(b"", P.Ready(model=runner.name, vocab_size=runner.vocab_size,
                                max_sessions=self.config.max_sessions, max_batch=self.config.max_batch))

    async def _keep_connected(self) -> None:
        """Receive until the broker is lost, then a new socket and READY after a back-off."""
        delay = self.config.heartbeat_interval / 2
        while True:
            receiver = asyncio.create_task(self._receive(self._sock))
            lost = asyncio.create_task(self._lost.wait())
            try:
                await asyncio.wait({receiver, lost}, return_when=asyncio.FIRST_COMPLETED)
                if receiver.done():
                    receiver.result()  # a receive loop only ends by raising
            finally:
                for task in (receiver, lost):
                    task.cancel()
                await asyncio.gather(receiver, lost, return_exceptions=True)
            delay = self.config.heartbeat_interval if self._answered else min(2 * delay, self.config.reconnect_max_s)
            self._log.warning("broker lost; reconnecting", reason=self._lost_reason, delay_s=delay)
            self._drop_connection()
            await asyncio.sleep(delay)
            self._connect()

    def _drop_connection(self) -> None:
        """Close the socket. The broker answers (or has answered) this connection's requests with
        WORKER_LOST and forgets its sessions, so the processor drops them too."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(linger=0)
        self._stats.reconnects += 1
        self._reset_to = self._generation + 1
        self._arrived.set()

    def _lose(self, reason: str) -> None:
        if not self._lost.is_set():
            self._lost_reason = reason
            self._lost.set()

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        n = 0
        while True:
            frames, n_frames = await _recv_capped(sock, FRAME_CAP)
            self._heard, self._answered = self._clock(), True
            if frames[0] == b"":
                self._from_broker(frames, n_frames)
            else:
                self._stats.requests += 1
                self.batcher.push(self._decode(frames, n_frames))
                self._arrived.set()
            n += 1
            if n % RECV_BURST == 0:  # a ready message is returned without yielding: let the others run
                await asyncio.sleep(0)

    def _from_broker(self, frames: list[bytes], n_frames: int) -> None:
        msg, reason = None, ""
        try:
            if n_frames != 3:
                raise InvalidRequest(f"a broker message is 3 frames, got {n_frames}", field="frames")
            msg = P.decode(frames[1:])
        except InvalidRequest as exc:
            reason = str(exc)
        if isinstance(msg, P.Heartbeat):
            self._stats.heartbeats_received += 1
        elif isinstance(msg, P.Disconnect):
            self._lose(f"the broker sent DISCONNECT ({msg.reason})")
        else:
            self._stats.bad_broker_messages += 1
            reason = reason or f"the broker may not send {type(msg).__name__} without a client id"
            self._log.warning("bad broker message dropped", reason=reason)

    def _decode(self, frames: list[bytes], n_frames: int) -> Item:
        """An edge message -> Item; anything malformed becomes a ready-made BAD_REQUEST reply."""
        client, now = frames[0], self._clock()
        sid, seq = _session_or_zero(frames), 0
        try:
            if n_frames != 3:
                raise InvalidRequest(f"an edge message is 3 frames (client id, header, body), got {n_frames}",
                                     field="frames")
            msg_type = P.parse_header(frames[1])
            if msg_type not in EDGE_TYPES:
                raise InvalidRequest(f"a cloud worker does not accept {msg_type.name} messages", field="header.type")
            msg = P.decode(frames[1:])
            if isinstance(msg, P.Verify):
                seq = msg.seq
                if msg.q:  # checked here: a bad q must fail its request, not the batch it would join
                    P.from_f32(msg.q, field="q")
        except InvalidRequest as exc:
            return Item(client, P.Error(sid, seq, exc.code, str(exc)), self._scope(client, sid, create=False), now,
                        self._generation)
        msg.session = key = self._scope(client, msg.session)
        return Item(client, msg, key, now, self._generation)

    # ---- session keys scoped by the edge -----------------------------------------------------------

    def _scope(self, client: bytes, session: int, *, create: bool = True) -> int:
        """(edge's client id, its session id) -> the int key the Verifier and Batcher use. Indices are never
        reused, so a key cannot collide with one still held by a forgotten edge's queued message.
        create=False: an unknown client gets index 0 (its malformed message opens nothing)."""
        index = self._edges.get(client)
        if index is None:
            if not create:
                return session
            index = self._edges[client] = next(self._edge_serials)
        return index << SESSION_BITS | session

    def _for_edge(self, item: Item, msg: P.Base) -> P.Base:
        """A reply as its edge must see it: with the edge's own session id instead of the scoped key."""
        sid = item.session & SESSION_MASK
        if not hasattr(msg, "session") or msg.session == sid:
            return msg
        changes: dict = {"session": sid}
        if isinstance(msg, P.Error) and msg.message:
            changes["message"] = msg.message.replace(str(msg.session), str(sid))
        return msgspec.structs.replace(msg, **changes)  # a copy: the Verifier may keep the original

    def _prune_edges(self) -> None:
        """Forget the index of every edge that holds no session here and has no message queued (a later
        message gets a fresh index). Called from the processor only, after CLOSE and after a reconnect."""
        live = {key >> SESSION_BITS for key in self.verifier.sessions}
        live.update(item.session >> SESSION_BITS for item in self.batcher.queue)
        live.discard(0)  # the index of clients never given one
        if len(live) < len(self._edges):
            self._edges = {client: index for client, index in self._edges.items() if index in live}

    # ---- processing --------------------------------------------------------------------------------

    async def _process(self) -> None:
        while True:
            await self._run_batch(await self._next_batch())

    async def _next_batch(self) -> list[Item]:
        """Apply control messages and gather VERIFYs; wait for more only while other sessions may send one."""
        batch: list[Item] = []
        while True:
            batch = self._apply_reset(batch)
            if self.batcher.take(batch, self._control):
                return batch  # the next message waits for this batch's outcome
            budget = self.batcher.wait_budget(batch, self._clock(), self.verifier.sessions)
            if batch and budget <= 0:
                return batch
            self._arrived.clear()
            if not batch:
                await self._arrived.wait()
                continue
            try:
                await asyncio.wait_for(self._arrived.wait(), budget)
            except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
                return batch

    def _apply_reset(self, batch: list[Item]) -> list[Item]:
        """After a reconnect: forget the sessions and queued messages of older connections."""
        if self._reset_done < self._reset_to:
            self._reset_done = self._reset_to
            sessions = list(self.verifier.sessions)
            for sid in sessions:
                self.verifier.close(sid)
            stale = self.batcher.drop_before(self._reset_to)
            self._prune_edges()
            self._log.info("state of the previous broker connection dropped", sessions=len(sessions),
                           queued=len(stale))
        return [item for item in batch if item.generation >= self._reset_to]

    def _control(self, item: Item) -> None:
        """OPEN / CLOSE / RESAMPLE, or a ready-made ERROR: handled at once, in arrival order."""
        msg = item.msg
        try:
            if isinstance(msg, P.Error):
                self._reply(item, msg)
            elif isinstance(msg, P.Open):
                self.verifier.open(msg)  # success is silent: the edge has pipelined its first VERIFY
            elif isinstance(msg, P.Close):
                self.verifier.close(msg.session)
                self.batcher.forget(msg.session)
                self._prune_edges()
            else:
                self._reply(item, self.verifier.resample_request(msg))
        except RequestError as exc:
            self._reply(item, P.Error(item.session, getattr(msg, "seq", 0), exc.code, str(exc)))
        except Exception as exc:  # a bug in the core fails this request, never the worker
            self._log.exception("request failed", edge=item.client.hex(), session=item.session & SESSION_MASK,
                                type=type(msg).__name__)
            self._reply(item, P.Error(item.session, getattr(msg, "seq", 0), "INTERNAL",
                                      f"{type(msg).__name__} failed on the worker: {type(exc).__name__}"))

    async def _run_batch(self, batch: list[Item]) -> None:
        """ONE Verifier.verify (one forward pass) for the whole batch, in the executor thread."""
        batch = self._apply_reset(batch)
        if not batch:
            return
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self.verifier.verify, [item.msg for item in batch])
        self._inflight = (future, batch)
        try:
            replies = await asyncio.shield(future)  # cancelled: the batch runs on and shutdown drains it
        except Exception as exc:
            replies = self._batch_failed(batch, exc)
        self._inflight = None
        self._finish_batch(batch, replies)

    def _batch_failed(self, batch: list[Item], exc: Exception) -> list[P.Base]:
        """INTERNAL for every request; their sessions are dropped, as their state is unknown (a retry gets
        RESEND_CONTEXT and re-prefills)."""
        self._stats.internal_errors += 1
        self._log.error("verification failed; the batch's sessions are dropped", batch=len(batch),
                        sessions=[(item.client.hex(), item.session & SESSION_MASK) for item in batch],
                        error=repr(exc), exc_info=exc)
        for item in batch:
            self.verifier.close(item.session)
        return [P.Error(item.session, item.msg.seq, "INTERNAL",
                        f"the target model failed on this batch ({type(exc).__name__}); re-open the session")
                for item in batch]

    def _finish_batch(self, batch: list[Item], replies: list[P.Base]) -> None:
        self._stats.batches += 1
        self._stats.batch_sizes[len(batch)] += 1
        self._stats.verify_requests += len(batch)
        for item, reply in zip(batch, replies):
            self._reply(item, reply)

    # ---- sending -----------------------------------------------------------------------------------

    def _reply(self, item: Item, msg: P.Base) -> None:
        msg = self._for_edge(item, msg)
        if isinstance(msg, P.Error):
            self._stats.errors[msg.code] += 1
            self._stats.bad_requests += msg.code == "BAD_REQUEST"
        if item.generation == self._generation and self._send(item.client, msg):
            self._stats.replies += 1
        else:
            self._stats.replies_dropped += 1

    def _send(self, client: bytes, msg: P.Base) -> bool:
        """Send without blocking; a full or closed socket drops the message (logged), never the worker."""
        if self._sock is None:
            return False
        # with NOBLOCK, pyzmq's asyncio send resolves at once: the future is already done
        future = self._sock.send_multipart([client, *P.encode(msg)], flags=zmq.NOBLOCK)
        exc = future.exception() if future.done() else None
        if exc is not None:
            self._log.warning("send failed; message dropped", type=type(msg).__name__, error=repr(exc))
            return False
        return True

    async def _tick(self) -> None:
        """Every interval: heartbeat (load = open sessions), broker liveness, systemd watchdog."""
        c = self.config
        while True:
            now = self._last_tick = self._clock()
            sd_notify("WATCHDOG=1")
            if self._sock is not None and not self._lost.is_set():
                if now - self._heard > c.heartbeat_interval * c.heartbeat_liveness:
                    self._lose(f"the broker was silent for {c.heartbeat_liveness} heartbeat intervals")
                elif self._send(b"", P.Heartbeat(load=len(self.verifier.sessions))):
                    self._stats.heartbeats_sent += 1
            await asyncio.sleep(c.heartbeat_interval)

    # ---- shutdown and health -----------------------------------------------------------------------

    async def _shutdown(self) -> None:
        async with self._shutdown_lock:
            if self._closed or not self._started:
                self._closed = True
                return
            self._closed = True
            try:
                await self._drain()
            finally:  # cancelled while draining: still say goodbye and close everything
                if self._sock is not None:
                    self._send(b"", P.Disconnect(reason="worker stopping"))
                    self._sock.close(linger=self.config.linger_ms)
                    self._sock = None
                if self._health is not None:
                    self._health.close()
                self._executor.shutdown(wait=False, cancel_futures=True)
                sd_notify("STOPPING=1")
                self._log.info("cloud worker stopped", **{k: v for k, v in self.stats.items() if isinstance(v, int)})

    async def _drain(self) -> None:
        """A batch whose forward was running when we were cancelled: wait for it and send its replies.
        Requests still queued are left to the broker, which answers them WORKER_LOST on DISCONNECT."""
        if self._inflight is None:
            return
        (future, batch), self._inflight = self._inflight, None
        done, _ = await asyncio.wait({future}, timeout=self.config.drain_timeout_s)
        if not done:
            self._log.warning("running batch not finished at shutdown; left unanswered", batch=len(batch))
            return
        try:
            replies = future.result()
        except Exception as exc:
            replies = self._batch_failed(batch, exc)
        self._finish_batch(batch, replies)

    def _healthz(self) -> tuple[bool, dict]:
        """Liveness: the model is loaded (it is, once a worker exists) and the event loop ticks."""
        age = self._clock() - self._last_tick
        return (age < HEALTHY_TICKS * self.config.heartbeat_interval and not self._closed,
                {"model": self.verifier.runner.name, "last_tick_s": round(age, 3),
                 "sessions_open": len(self.verifier.sessions)})

    def _readyz(self) -> tuple[bool, dict]:
        """Readiness: connected, and the broker heard from within the liveness window."""
        silent = self._clock() - self._heard
        ttl = self.config.heartbeat_interval * self.config.heartbeat_liveness
        ok = self._sock is not None and self._answered and silent < ttl and not self._closed
        return ok, {"broker": self.broker, "broker_silent_s": round(silent, 3)}


def _session_or_zero(frames: list[bytes]) -> int:
    try:
        return P.session_of(frames[2]) if len(frames) > 2 else 0
    except InvalidRequest:
        return 0


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


async def serve(broker: str, model: str, device: str = "cpu", dtype: str = "float32", max_batch: int = 32,
                max_wait_ms: float = 5.0, health_port: int | None = None, **options: object) -> None:
    """Load the target model and serve it until cancelled: the body of `specrelay cloud-worker`.
    options: the other WorkerConfig fields (max_sessions, max_cache_bytes, heartbeat_interval, identity, ...)."""
    config = WorkerConfig(max_batch=max_batch, max_wait_ms=max_wait_ms, health_port=health_port, **options)
    log.info("loading the target model", model=model, device=device, dtype=dtype)
    runner = await asyncio.to_thread(ModelRunner.load, model, device, dtype)
    await CloudWorker(broker, runner, config).run()
