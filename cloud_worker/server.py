"""The cloud worker process: the pure `Verifier` behind one `BrokerConnection` per broker, the pure `Scheduler`
between.

Loops (common/transport.Service): each connection receives edge requests into the Scheduler and reconnects
Paranoid-Pirate style on its own (connection.py). The processor asks the Scheduler for the next step, waiting only
as its plan says, applies the OPEN / CLOSE / RESAMPLE it hands over, and runs ONE `Verifier.verify` per step in a
one-thread executor, so heartbeats flow and the next step fills while the model runs. The ticker sends heartbeats
and the systemd watchdog. Only the processor touches the Verifier (through the executor thread while it awaits
it), so there is no lock. Sessions are keyed by (peer, session): the peer is the broker's index (one byte) and the
client id that broker prepends to every edge request, so two brokers' ids never collide. Every request carries its
connection (index, generation): its replies go back on that connection only, and a connection lost (broker gone,
DISCONNECT, restart) drops that broker's sessions and queued requests, nothing of the others. All brokers share
the one KV store, and every heartbeat reports the worker's real totals (sessions, free KV) to each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.util
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog
import torch
import zmq
import zmq.asyncio

from ..common import health
from ..common import protocol as P
from ..common import transport
from ..common.brokers import broker_list, per_broker
from ..common.errors import ErrorCode, InvalidRequest, RequestError
from ..common.metrics import Utilisation
from ..common.ratelimit import LogLimiter
from ..common.runner import ModelRunner
from .config import WorkerConfig, WorkerStats
from .connection import BrokerConnection, broker_peer
from .scheduler import MAX_CONTROL, Item, Scheduler, Step
from .verifier import Verifier

log = structlog.get_logger("specrelay.cloud")

HEALTHY_TICKS = 3  # /healthz fails when the loop has not ticked for this many heartbeat intervals
GAUGES = ("sessions_open", "queued", "connected", "batch_size_mean", "kv_free_tokens", "kv_capacity_tokens",
          "broker_alive_per_broker", "broker_sessions_per_broker")


class CloudWorker(transport.Service):
    """Serves one target model to one or more brokers. `async with CloudWorker(...) as w:` (serves in a background
    task), or `await run()` (serves until `stop()` or cancellation). A worker is started once. `broker`: an
    endpoint, a comma list or a sequence (common/brokers.py); `curve`: one transport.Curve for all or one each."""

    name = "cloud-worker"

    def __init__(self, broker: str | Sequence[str], runner: ModelRunner, config: WorkerConfig | None = None, *,
                 context: zmq.asyncio.Context | None = None,
                 curve: transport.Curve | Sequence[transport.Curve] | None = None) -> None:
        super().__init__()
        clock = time.monotonic
        self.brokers = broker_list(broker, "broker")
        self.config = c = config or WorkerConfig()
        self.verifier = Verifier(runner, c, clock=clock)
        self.scheduler = Scheduler(c, self.verifier)
        self.verifier.brokers = len(self.brokers)  # each broker: 1 / brokers of the sessions and the KV store
        # each broker connection's requests waiting: twice its share of the sessions (a VERIFY and a CLOSE or an
        # OPEN each), so an honest broker never meets it and a flooding one holds at most this many
        self.queue_per_broker = max(MAX_CONTROL, 2 * c.max_sessions // len(self.brokers))
        self.health_port = c.health_port
        self._stats = WorkerStats()
        self._clock = clock
        self._utilisation = Utilisation(clock)  # the load hint's `busy`
        ctx = context or zmq.asyncio.Context.instance()
        self.connections = [
            BrokerConnection(ctx, endpoint, c, self._stats, ready=self._ready_message, beat=self._heartbeat_message,
                             on_request=functools.partial(self._on_request, i),
                             on_reset=functools.partial(self._on_reset, i), clock=clock, curve=keys)
            for i, (endpoint, keys) in enumerate(zip(self.brokers, per_broker(curve, len(self.brokers), "curve")))]
        self._gone: set[tuple[int, int]] = set()  # (broker, generation) lost: the processor forgets their state
        self._resets: Counter = Counter()  # broker index -> connections of it dropped with their state
        self._last_tick = clock()
        self._arrived = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: tuple[asyncio.Future, list[Item]] | None = None
        self._health: asyncio.Server | None = None
        self._log = log.bind(broker=",".join(self.brokers), model=runner.name)
        self._errors_log = LogLimiter(self._log, clock=clock)  # failures per event name, at a bounded rate

    @property
    def stats(self) -> dict:
        s = self._stats
        return {
            "requests": s.requests, "verify_requests": s.verify_requests, "batches": s.batches,
            "forward_passes": self.verifier.stats["forward_passes"],
            "forward_tokens": self.verifier.stats["forward_tokens"], "bad_requests": s.bad_requests,
            "internal_errors": s.internal_errors, "replies": s.replies, "replies_dropped": s.replies_dropped,
            "heartbeats_sent": s.heartbeats_sent, "heartbeats_received": s.heartbeats_received,
            "bad_broker_messages": s.bad_broker_messages, "reconnects": s.reconnects,
            "evictions": self.verifier.stats["evictions"], "sessions_open": len(self.verifier.sessions),
            "queue_refusals": s.queue_refusals, "budget_refusals": self.verifier.stats["budget_refusals"],
            "kv_free_tokens": self.verifier.kv_free_tokens, "kv_capacity_tokens": self.verifier.store.capacity,
            "kv_moves": self.verifier.store.stats["moves"], "prefill_tokens": self.verifier.stats["prefill_tokens"],
            "queued": len(self.scheduler), "connected": sum(conn.sock is not None for conn in self.connections),
            "batch_size_mean": s.verify_requests / s.batches if s.batches else 0.0,
            "batch_sizes": dict(s.batch_sizes), "errors": dict(s.errors),
            **s.spec.as_stats(), "forward_seconds": s.forward_seconds, **self._per_broker(),
        }

    def _per_broker(self) -> dict:
        """For /metrics, per broker: alive, its sessions here, its connections dropped with their state."""
        held = Counter(key[0][0] for key in self.verifier.sessions)
        return {"broker_alive_per_broker": {c.endpoint: int(c.alive) for c in self.connections},
                "broker_sessions_per_broker": {c.endpoint: held[i] for i, c in enumerate(self.connections)},
                "broker_resets_per_broker": {c.endpoint: self._resets[i] for i, c in enumerate(self.connections)}}

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def _open(self) -> None:
        """Open the health port, connect to every broker and send each READY."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="specrelay-verify")
        if importlib.util.find_spec("llguidance") is not None:  # structured outputs: seconds for a large vocabulary,
            self._executor.submit(self.verifier.grammar_vocab)  # off the loop, before the first step
        self._last_tick = self._clock()
        if self.config.health_port is not None:
            endpoints = health.Endpoints(self._healthz, self._readyz,
                                         health.registry_for("specrelay_cloud_", lambda: self.stats, GAUGES))
            self._health = await health.start_http(self.config.health_host, self.config.health_port, endpoints)
            self.health_port = self._health.sockets[0].getsockname()[1]
        for conn in self.connections:
            conn.open()
        health.sd_notify("READY=1")
        self._log.info("cloud worker started", vocab_size=self.verifier.runner.vocab_size,
                       max_batch=self.config.max_batch, health_port=self.health_port,
                       device=str(self.verifier.runner.device), attention=self.verifier.attention,
                       verify_us=dict(zip(P.CURVE_WIDTHS, self.verifier.curve_us)))  # its cost curve (load hints)

    def _loops(self):
        return [*(conn.keep_connected() for conn in self.connections), self._process(), self._tick()]

    def _ready_message(self) -> P.Ready:
        runner = self.verifier.runner
        return P.Ready(model=runner.name, vocab_size=runner.vocab_size, max_sessions=self.config.max_sessions,
                       max_batch=self.config.max_batch, kv_capacity=self.verifier.store.capacity)

    def _heartbeat_message(self) -> P.Heartbeat:
        return P.Heartbeat(load=len(self.verifier.sessions), kv_free=self.verifier.kv_free_tokens)

    async def _close(self) -> None:
        """Let the running batch finish (drain_timeout_s), send its replies and DISCONNECT, close."""
        try:
            await self._drain()
        finally:  # cancelled while draining: still say goodbye and close everything
            for conn in self.connections:
                conn.close("worker stopping")
            if self._health is not None:
                self._health.close()
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
            health.sd_notify("STOPPING=1")
            self._log.info("cloud worker stopped", **{k: v for k, v in self.stats.items() if isinstance(v, int)})

    # ---- requests in -------------------------------------------------------------------------------

    def _on_request(self, index: int, frames: list[bytes], n_frames: int) -> None:
        self._stats.requests += 1
        item = self._decode(index, frames, n_frames)
        if self.scheduler.queued[item.conn] >= self.queue_per_broker:  # this broker's share of the queue is full
            self._stats.queue_refusals += 1
            self._reply(item, P.Error(item.key[1], getattr(item.msg, "seq", 0), ErrorCode.UNAVAILABLE,
                                      "this broker's share of the worker's queue is full; retry later"))
            return
        if item.is_verify:
            self.verifier.touch(item.key)  # a session waiting in the queue is not idle
        self.scheduler.push(item)
        self._arrived.set()

    def _decode(self, index: int, frames: list[bytes], n_frames: int) -> Item:
        """An edge request from broker `index` -> Item (its header parsed once, its session keyed under that
        broker); anything malformed becomes a ready-made BAD_REQUEST reply."""
        peer, now = broker_peer(index, frames[0]), self._clock()
        conn = (index, self.connections[index].generation)
        try:
            if n_frames != 3:
                raise InvalidRequest(f"an edge message is 3 frames (client id, header, body), got {n_frames}",
                                     field="frames")
            msg_type = P.parse_header(frames[1])
            if msg_type not in P.EDGE_REQUESTS:
                raise InvalidRequest("a cloud worker takes OPEN, VERIFY, CLOSE or RESAMPLE", field="header.type")
            msg = P.decode_body(msg_type, frames[2])
        except InvalidRequest as exc:
            sid = P.session_or_zero(frames, 2)
            return Item((peer, sid), P.Error(sid, 0, exc.code, str(exc)), now, conn)
        return Item((peer, msg.session), msg, now, conn)

    def _on_reset(self, index: int) -> None:
        """Broker `index`'s connection was dropped: the processor forgets its sessions and requests (only its)."""
        self._gone.add((index, self.connections[index].generation))
        self._arrived.set()

    # ---- processing --------------------------------------------------------------------------------

    async def _process(self) -> None:
        while True:
            await self._run_step(await self._next_step())

    async def _next_step(self) -> Step:
        """Plan until the Scheduler hands over a step, waiting only as it says: for a request (so long), or one
        turn of the event loop under a flood of control messages."""
        while True:
            self._apply_reset()
            plan = self.scheduler.plan(self._clock(), self._control)
            if plan.step is not None:
                return plan.step
            if plan.yield_first:
                await asyncio.sleep(0)  # let heartbeats and /healthz run
                continue
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), plan.wait)
            except asyncio.TimeoutError:
                pass

    def _apply_reset(self) -> None:
        """After a connection is lost: forget the sessions and queued requests that came through it; every other
        broker's stay. (Never during a forward: the processor calls this between steps.)"""
        if self._gone:
            gone, self._gone = self._gone, set()
            lost = {index for index, _ in gone}
            dropped = [key for key in self.verifier.sessions if key[0][0] in lost]
            for key in dropped:
                self.verifier.close(key)
            stale = self.scheduler.drop(gone)
            self._resets.update(lost)
            self._log.info("state of a lost broker connection dropped", brokers=[self.brokers[i] for i in lost],
                           sessions=len(dropped), queued=len(stale), sessions_kept=len(self.verifier.sessions))

    def _control(self, item: Item) -> None:
        """OPEN / CLOSE / RESAMPLE, or a ready-made ERROR: handled at once, in arrival order."""
        msg = item.msg
        try:
            if isinstance(msg, P.Error):
                self._reply(item, msg)
            elif isinstance(msg, P.Open):
                self.verifier.open(item.key, msg)  # success is silent: the edge has pipelined its first VERIFY
            elif isinstance(msg, P.Close):
                self.verifier.close(item.key)
            else:
                self._reply(item, self.verifier.resample(item.key, msg))
        except RequestError as exc:
            self._reply(item, P.Error(msg.session, getattr(msg, "seq", 0), exc.code, str(exc)))
        except Exception as exc:  # a bug in the core fails this request, never the worker
            self._errors_log.log("exception", "request failed", peer=item.peer.hex(), session=msg.session,
                                 type=type(msg).__name__, exc_info=exc)
            self._reply(item, P.Error(msg.session, getattr(msg, "seq", 0), ErrorCode.INTERNAL,
                                      f"{type(msg).__name__} failed on the worker: {type(exc).__name__}"))

    async def _run_step(self, step: Step) -> None:
        """ONE Verifier.verify (one forward pass) for the whole step, in the executor thread."""
        batch = step.verifies
        loop, started = asyncio.get_running_loop(), self._clock()
        counts = self.verifier.stats["forward_tokens"], self.verifier.stats["prefill_tokens"]
        future = loop.run_in_executor(self._executor, self.verifier.verify, step.requests, step.prefill)
        self._inflight = (future, batch)
        try:
            replies = await asyncio.shield(future)  # cancelled: the batch runs on and shutdown drains it
        except Exception as exc:
            replies = self._batch_failed(batch, exc)
        self._inflight = None
        stats = self.verifier.stats
        self._finish_batch(batch, replies, started, stats["forward_tokens"] - counts[0],
                           stats["prefill_tokens"] - counts[1])

    def _batch_failed(self, batch: list[Item], exc: Exception) -> list[P.Error]:
        """INTERNAL for every request; their sessions are dropped, as their state is unknown (the edge
        re-OPENs)."""
        self._stats.internal_errors += 1
        self._log.error("verification failed; the batch's sessions are dropped", batch=len(batch),
                        sessions=[(item.peer.hex(), item.key[1]) for item in batch], error=repr(exc),
                        exc_info=exc)
        for item in batch:
            self.verifier.close(item.key)
        return [P.Error(item.msg.session, item.msg.seq, ErrorCode.INTERNAL,
                        f"the target model failed on this batch ({type(exc).__name__}); re-open the session")
                for item in batch]

    def _finish_batch(self, batch: list[Item], replies: list[P.Base], started: float | None = None,
                      tokens: int = 0, prefilled: int = 0) -> None:
        """Replies, counters, and the load hint: `tokens` the forward pass ran, `prefilled` of them prompt chunks."""
        if not batch:
            return  # a prefill-only step
        forward = self._clock() - started if started is not None else 0.0
        self._stats.forward_seconds.observe(forward)
        self._utilisation.add(forward)
        width = max(len(i.msg.tail) + len(i.msg.draft) + 1 for i in batch)  # new tokens per row, widest
        for item, reply in zip(batch, replies):  # spec-decode counters; the load hint for the edge's auto d
            if isinstance(reply, P.Verdict):
                self._stats.spec.record(len(item.msg.draft), reply.n_accepted)
                if reply.seq % P.HINT_EVERY == 1 and started is not None:
                    wait = max(0.0, started - item.arrived)
                    curve = self.verifier.curve_us if reply.seq % P.HINT_EVERY ** 2 == 1 else ()  # measured once: 1 in 16
                    reply.load = P.LoadHint(len(batch), width, int(forward * 1e6), int(wait * 1e6), tokens,
                                            prefilled, self._utilisation.per_mille(), self.verifier.token_us, curve)
        self._stats.batches += 1
        self._stats.batch_sizes[len(batch)] += 1
        self._stats.verify_requests += len(batch)
        for item, reply in zip(batch, replies):
            self._reply(item, reply)

    def _reply(self, item: Item, msg: P.Base) -> None:
        if isinstance(msg, P.Error):
            self._stats.errors[msg.code.name] += 1
            if msg.code in (ErrorCode.BAD_REQUEST, ErrorCode.CHAINS_ONLY):  # an InvalidRequest: say which, and why
                self._stats.bad_requests += 1
                self._errors_log.warning("bad request", peer=item.peer.hex(), session=msg.session, seq=msg.seq,
                                         code=msg.code.name, message=msg.message)
        index, generation = item.conn
        conn = self.connections[index]
        if generation == conn.generation and conn.send(item.peer[1:], msg):  # the broker's own client id
            self._stats.replies += 1
        else:
            self._stats.replies_dropped += 1

    async def _tick(self) -> None:
        """Every interval: heartbeat to every broker (the worker's totals: open sessions, free KV), each broker's
        liveness, systemd watchdog."""
        while True:
            self._last_tick = self._clock()
            health.sd_notify("WATCHDOG=1")
            for conn in self.connections:
                conn.heartbeat()
            await asyncio.sleep(self.config.heartbeat_interval)

    # ---- shutdown and health -----------------------------------------------------------------------

    async def _drain(self) -> None:
        """A batch whose forward was running when we were stopped: wait for it and send its replies.
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
                {"model": self.verifier.runner.name, "attention": self.verifier.attention, "last_tick_s": round(age, 3),
                 "sessions_open": len(self.verifier.sessions)})

    def _readyz(self) -> tuple[bool, dict]:
        """Readiness: at least one broker connected and heard from within the liveness window (the body: each)."""
        now = self._clock()
        brokers = {c.endpoint: {"alive": c.alive, "silent_s": round(now - c.heard, 3),
                                "queued": self.scheduler.queued[(i, c.generation)],
                                "queue_full": self.scheduler.queued[(i, c.generation)] >= self.queue_per_broker}
                   for i, c in enumerate(self.connections)}
        return any(c.alive for c in self.connections) and not self._closed, {"brokers": brokers}


async def serve(broker: str | Sequence[str], model: str, device: str = "cpu", dtype: str = "float32", *,
                curve: transport.Curve | Sequence[transport.Curve] | None = None, **options: object) -> None:
    """Load the target model and serve it until SIGTERM / SIGINT: the body of `specrelay cloud-worker`.
    options: WorkerConfig fields (max_batch, max_wait_ms, health_port, max_sessions, max_cache_bytes, ...), and
    kv_cache_fraction: on cuda, size the KV store as this share of the device memory free after loading."""
    fraction = float(options.pop("kv_cache_fraction", 0.0) or 0.0)
    if not 0.0 <= fraction < 1.0:
        raise ValueError("kv_cache_fraction must be in [0, 1)")
    config = WorkerConfig(**options)
    log.info("loading the target model", model=model, device=device, dtype=dtype)
    runner = await asyncio.to_thread(ModelRunner.load, model, device, dtype)
    if fraction:
        if runner.device.type != "cuda":
            raise ValueError("kv_cache_fraction needs a cuda device; use max_cache_bytes (--kv-cache-mb)")
        free, _ = torch.cuda.mem_get_info(runner.device)
        config = dataclasses.replace(config, max_cache_bytes=int(free * fraction))
    await transport.serve_until_signalled(CloudWorker(broker, runner, config, curve=curve))
