"""The edge worker process: drives `EdgeSession`s over one DEALER per broker (and serves local clients
through `frontend.ClientFrontend` when `EdgeConfig.listen` is set); `serve` is the body of `specrelay
edge-worker`, `EdgeHealth` its health port.

One zmq.asyncio DEALER per broker (edge_worker/routing/links.py; CURVE when keys are configured). Its routing id is chosen
by the broker's ROUTER, so no other edge can claim it; a session belongs to one broker's connection and this key
at a time (its `route.Route.link`, chosen by a stable hash over the brokers that are up). A receiver loop per
broker hands each VERDICT / RESAMPLED / ERROR to the session waiting on it, if that session is on that broker; a
heartbeat loop tells every broker this edge is alive (a broker closes the sessions of a silent edge); a monitor
per broker notices a refused key (fatal: AuthenticationFailed, the edge stops, so /readyz goes with it and the CLI
exits with one line) and a lost broker: its requests in flight are retried at once instead of after their
timeout, re-OPENed on another broker with the whole committed context. Sessions are numbered from a per-edge
counter (1, 2, ...): the broker and the workers key them by (this edge's peer id, session), so ids stay small
(1 byte in MessagePack below 128, at most 3 below SID_WRAP) in every message.

Drafting runs in ONE worker thread (the draft model is shared by every session, `DraftBatcher`), so the event
loop keeps moving bytes while a block is drafted; which queued jobs draft together and when pre-drafts run is the
edge scheduler's decision (edge_worker/scheduler.py), the same one the in-process reference follows. A failed round is retried by re-OPENing with the whole
committed context, under the policy of `route.Retries` (`retry_budget_s` seconds of consecutive failures: a
broker restart, a gap with no worker).

While a VERIFY is in flight the draft thread, when idle, pre-drafts the session's chain on (`predraft`); the
draft thread's timings and the round-trip latency of every round feed the draft policy (edge_worker/policy,
one `EdgeEstimates` per edge). `metrics` (telemetry.py) counts what EdgeHealth serves on /metrics.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from typing import Callable, Sequence

import structlog
import zmq
import zmq.asyncio

from ..common import health, transport
from ..common import protocol as P
from ..common.brokers import broker_list, per_broker
from ..common.errors import (AuthenticationFailed, FatalError, GenerationTimeout, InvalidRequest,
                             Overloaded, RequestError, SpecRelayError)
from . import telemetry
from .draft.batcher import DraftBatcher
from .config import SERVED_MODEL_NAME, EdgeConfig, SessionConfig
from .draft.drafter import Drafter
from .frontend import ClientFrontend
from .routing.links import BrokerLink, BrokerLinks
from .loading import load_drafter, target_context
from .policy import EdgeEstimates
from .routing.route import Retries, Route
from .session import EdgeSession

log = structlog.get_logger("specrelay.edge")

SID_WRAP = 1 << 16  # session ids run 1 .. SID_WRAP - 1, then wrap (skipping ids in use): <= 3 bytes each
# An edge-worker process hands the GIL between its event loop and its draft thread every 0.5 ms (Python's default
# is 5 ms): a VERDICT that arrives while the draft thread runs (pre-drafting) is handled without waiting 5 ms.
GIL_SWITCH_S = 0.0005

OnTokens = Callable[[list[int]], object]  # may return an awaitable


class EdgeWorker(transport.Service):
    """`async with EdgeWorker(broker, drafter, tokenizer, EdgeConfig(...)) as edge:` then
    `await edge.generate(prompt_ids, SessionConfig(...))` from as many tasks as you like.
    `broker`: an endpoint, a comma list or a sequence of them (several brokers: common/brokers.py); `curve`: one
    transport.Curve for all of them or one per broker. `tokenizer` is the TARGET's: prompts become
    `tokenizer(prompt).input_ids`, output `tokenizer.decode(ids)`."""

    name = "edge-worker"

    def __init__(self, broker: str | Sequence[str], drafter: Drafter, tokenizer, config: EdgeConfig | None = None,
                 *, context: zmq.asyncio.Context | None = None, identity: bytes | None = None,
                 curve: transport.Curve | Sequence[transport.Curve] | None = None) -> None:
        super().__init__()
        self.brokers = broker_list(broker, "broker")
        self.drafter, self.tokenizer = drafter, tokenizer
        self.config = config or EdgeConfig()
        self.identity = identity  # None: the broker's ROUTER picks one (the safe default)
        self.auth_error: AuthenticationFailed | None = None
        self._refused = asyncio.Event()   # set with auth_error: the heartbeat loop ends the service
        self.ctx = context or zmq.asyncio.Context.instance()
        self.frontend = None  # frontend.ClientFrontend when config.listen is set
        self._routes: dict[int, Route] = {}  # session id -> its route, while the session is in use
        self.metrics = telemetry.EdgeMetrics()
        curves = per_broker(curve, len(self.brokers), "curve")
        self._curve = curves[0]  # this edge's own key pair (the frontend's CURVE server uses it)
        self.links = BrokerLinks(self.brokers, self.ctx, curves, self._routes, self.metrics,
                                 linger_ms=self.config.linger_ms, heartbeat_s=self.config.heartbeat_s,
                                 identity=identity, clock=time.monotonic)
        for link in self.links:
            link.on_refused = self._on_refused
        self._next_sid = 1
        self._pool: ThreadPoolExecutor | None = None
        self._batcher: DraftBatcher | None = None
        self.estimates = EdgeEstimates(self.config.predraft)  # the draft policy's (edge_worker/policy), shared
        self._log = log.bind(broker=",".join(self.brokers))

    @property
    def sessions_open(self) -> int:
        """Generations in progress on this edge."""
        return len(self._routes)

    @property
    def endpoint(self) -> str | None:
        """The bound client endpoint (after start), when serving local clients."""
        return self.frontend.endpoint if self.frontend is not None else None

    @property
    def ready(self) -> bool:
        """At least one broker is up."""
        return bool(self.links.up)

    # ------------------------------------------------------------------------------ lifecycle
    async def _open(self) -> None:
        """Connect to every broker (and bind the client endpoint)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrelay-draft")
        self._batcher = DraftBatcher(self.drafter, self._pool, on_timing=self.estimates.observe_draft)
        self.links.open()
        if self.config.listen:
            self.frontend = ClientFrontend(self, self.config.listen)
            self.frontend.open()
        self._log.info("edge worker started", listen=self.endpoint, curve=self._curve is not None,
                       brokers=len(self.brokers))
        if self.config.default_trees != "off" and not self.drafter.trees:
            self._log.warning("token trees need the draft and the target to share a vocabulary: chains only")

    def _loops(self):
        loops = [self._heartbeat(), *self.links.loops()]
        return loops + ([self.frontend.serve()] if self.frontend is not None else [])

    async def _close(self) -> None:
        """Cancel client generations (each CLOSEs its session), fail library callers, close the sockets."""
        if self.frontend is not None:
            await self.frontend.cancel_all()
        for route in self._routes.values():
            route.fail(FatalError("the edge worker is closed"))
        await asyncio.sleep(0)  # let those callers run their `finally` (CLOSE) while the socket is open
        if self._batcher is not None:  # a generation still drafting ends with the reason too
            await self._batcher.close(self.auth_error or FatalError("the edge worker is closed"))
        if self.frontend is not None:
            self.frontend.close()
        self.links.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def wait_closed(self) -> None:
        await self._stopped.wait()

    # ------------------------------------------------------------------------------ generation
    @property
    def context_limit(self) -> int:
        return min(self.config.max_context or P.MAX_CONTEXT, P.MAX_CONTEXT)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse before any work a request the target's context cannot hold (never an error after generating)."""
        if prompt_tokens + max_new_tokens > self.context_limit:
            raise InvalidRequest(f"the prompt has {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
                                 f"together past the target's context of {self.context_limit} tokens",
                                 field="max_new_tokens")

    async def generate(self, prompt_ids: Sequence[int], config: SessionConfig, on_tokens: OnTokens | None = None,
                       on_session: Callable[[EdgeSession], None] | None = None) -> tuple[list[int], dict[str, float]]:
        """Generate with the cloud's verification; returns (generated target ids, stats).
        `on_tokens(new_ids)` (sync or async) sees every committed chunk, in order, exactly once; returning False
        ends the generation after that chunk (the session is CLOSEd as usual). `on_session` sees the session once,
        before it starts (the HTTP API reads its logprobs rows: `token_rows`, `scores()`)."""
        if not self.links.opened:
            raise FatalError("the edge worker is not started")
        if self.auth_error is not None:
            raise self.auth_error
        self.check_fits(len(prompt_ids), config.max_new_tokens)
        session = EdgeSession(list(prompt_ids), config, self.drafter, sid=self._new_sid(), estimates=self.estimates)
        route = self._routes[session.sid] = Route(session, self.links.choose(session.sid))
        if on_session is not None:
            on_session(session)
        slog = self._log.bind(session=session.sid)
        t0, retries, error = time.perf_counter(), Retries(self.config), None
        try:
            self._send(route, session.open_message())
            while not session.done:
                try:
                    new = await self._step(session, route)
                except RequestError as exc:
                    if retries.give_up(exc, time.monotonic()):
                        error = exc.code.name
                        raise
                    self.metrics.retries += 1
                    await self._recover(session, route, exc, retries, slog)
                    continue
                retries.succeeded()
                if new and on_tokens is not None:
                    result = on_tokens(new)
                    if inspect.isawaitable(result):
                        result = await result
                    if result is False:  # the caller has what it wants (a stop string): end here
                        break
        except BaseException as exc:
            error = error or ("CANCELLED" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__)
            if isinstance(exc, SpecRelayError):  # the caller keeps what was committed (the CLI prints it)
                exc.committed = list(session.generated)
            raise
        finally:
            self._routes.pop(session.sid, None)
            self._send(route, session.close_message())  # also on cancellation: free the cloud's KV
            self.metrics.on_generation(asdict(session.stats), error)
        stats = asdict(session.stats) | {"retries": retries.count, "wall_s": time.perf_counter() - t0}
        slog.debug("generation done", **stats)
        return list(session.generated), stats

    def _new_sid(self) -> int:
        """The next id of this edge's session counter, skipping ids still in use (wraps before SID_WRAP)."""
        for _ in range(SID_WRAP - 1):
            sid, self._next_sid = self._next_sid, self._next_sid % (SID_WRAP - 1) + 1
            if sid not in self._routes:
                return sid
        raise Overloaded(f"this edge already runs {len(self._routes)} sessions; retry later")

    async def _step(self, session: EdgeSession, route: Route) -> list[int]:
        """Draft (in the draft thread) or take the pending RESAMPLE, send it (pre-drafting on while it is in
        flight), apply the reply, and report the round's timings to the session's draft-length policy."""
        start, waited = time.perf_counter(), 0.0
        request, draft_s = session.resample_request(), None  # a pending RESAMPLE goes before any draft
        if request is None:  # the job waits in the draft thread's queue until the edge scheduler batches it
            request = session.request_for(await self._batcher.draft(session.draft_job()))
            waited = time.perf_counter() - start
            draft_s = waited if self._batcher.batches > 1 else None  # the first: warm-up
        if route.stash is not None:  # the OPEN already failed: do not send on top of it
            reply, route.stash = route.stash, None
            return session.apply(reply)
        expect = P.Verdict if isinstance(request, P.Verify) else P.Resampled
        waiter = route.wait_for(request.seq, expect)
        self._send(route, request)
        sent = time.perf_counter()
        pre = None
        if expect is P.Verdict:  # while this round is in flight: the next one's pre-draft, and its tree or chain
            pre = self._predraft(session)
            session.plan()  # (`--trees auto`)
        try:
            reply = await self._wait(session, waiter, request.seq)
            latency = time.perf_counter() - sent
            if pre is not None:
                session.take_predraft(await self._batcher.collect(pre))
        finally:
            if pre is not None:
                self._batcher.cancel(pre)
        new = session.apply(reply)  # an ERROR reply raises its RequestError
        if isinstance(reply, P.Verdict):
            session.record_timing(draft_s, latency, time.perf_counter() - start - waited - latency, len(new))
            self.metrics.on_round(len(request.draft), reply.n_accepted, draft_s, latency)
        return new

    def _predraft(self, session: EdgeSession):
        job = session.predraft_job() if self.config.predraft else None
        return self._batcher.predraft(job) if job is not None else None

    async def _wait(self, session: EdgeSession, waiter: asyncio.Future, seq: int) -> P.Base:
        """The reply, within request_timeout_s plus prefill_s_per_token for every prompt token of this edge's
        sessions the cloud has yet to prefill (this one's included: they share the worker's prefill budget)."""
        backlog = sum(route.session.prefill_due for route in self._routes.values()) if session.prefill_due else 0
        timeout = self.config.request_timeout_s + self.config.prefill_s_per_token * backlog
        try:
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise GenerationTimeout(f"no reply from the cloud for session {session.sid} (seq {seq}) "
                                    f"within {timeout:g} s") from None

    async def _recover(self, session: EdgeSession, route: Route, exc: RequestError, retries: Retries,
                       slog) -> None:
        """Re-OPEN with the whole committed context, after the policy's back-off: on the session's broker, or on
        another when that one is lost (the old one is told CLOSE, for when it is only silent or comes back)."""
        say = slog.warning if retries.streak == 1 else slog.debug  # once per run of failures, not per attempt
        say("retrying", code=exc.code.name, reason=str(exc), attempt=retries.count, committed=len(session.generated),
            broker=self.brokers[route.link], for_up_to_s=self.config.retry_budget_s)
        delay = retries.backoff_s(exc)
        if delay is not None:
            await asyncio.sleep(delay)
        moved = self.links.move_after(route, exc)  # the broker is lost or has no live worker
        if moved is not None:
            self._send(route, session.close_message())
            slog.info("session moves to another broker", left=self.brokers[route.link], to=self.brokers[moved])
            route.link = moved
            self.metrics.failovers += 1
        route.reopened()
        self._send(route, session.open_message())

    def _send(self, route: Route, msg: P.Base) -> None:
        """Queue a message to the session's broker without awaiting (safe in `finally` during cancellation)."""
        frames = P.encode(msg)
        nbytes = sum(map(len, frames))
        route.stats.uplink_bytes += nbytes
        self.metrics.uplink_bytes += nbytes
        error = self.links.send(route, frames)
        if error is not None:
            self._log.warning("send to the broker failed", session=route.session.sid, error=str(error),
                              broker=self.brokers[route.link])

    async def _heartbeat(self) -> None:
        """Heartbeats to the brokers and their liveness (links.BrokerLinks.beat). Ends by raising a broker's
        refusal of this edge's key: the edge stops (the CLI prints one line)."""
        while True:
            self.links.beat()
            try:
                await asyncio.wait_for(self._refused.wait(), self.config.heartbeat_s)
            except asyncio.TimeoutError:
                continue
            raise self.auth_error

    def _on_refused(self, link: BrokerLink) -> None:
        """A broker refused this edge's key: fatal (the same key goes to every broker; fix the allowlist)."""
        self.auth_error = AuthenticationFailed(
            f"authentication failed: the broker at {link.endpoint} refused this edge's CURVE key")
        self._log.warning("authentication failed; the edge stops", broker=link.endpoint)
        for route in self._routes.values():
            route.fail(self.auth_error)
        self._refused.set()


async def load_edge(broker: str | Sequence[str], draft_model: str, target_tokenizer: str | None = None, *,
                    device: str = "cpu", dtype: str = "float32", target_vocab_size: int | None = None,
                    config: EdgeConfig | None = None, **options) -> EdgeWorker:
    """Load the draft model (in a thread, edge_worker/loading.py) and build an EdgeWorker (not started). Every
    edge (the CLI's edge-worker and generate, `Client.local`, the demo, the benchmarks) is built here. options:
    EdgeWorker's keyword arguments (context, identity, curve)."""
    drafter, tokenizer = await asyncio.to_thread(load_drafter, draft_model, target_tokenizer, device, dtype,
                                                 target_vocab_size)
    config = config or EdgeConfig()
    if config.max_context is None:  # requests past it are refused before any work (EdgeWorker.check_fits)
        config = replace(config, max_context=await asyncio.to_thread(target_context, target_tokenizer))
    return EdgeWorker(broker, drafter, tokenizer, config, **options)


async def serve(broker: str | Sequence[str], draft_model: str, listen: str | None,
                target_tokenizer: str | None = None, *, device: str = "cpu", dtype: str = "float32",
                config: EdgeConfig | None = None, http: tuple[str, int] | None = None, http_limits=None,
                served_model_name: str = SERVED_MODEL_NAME,
                health_port: int | None = None, health_host: str = "127.0.0.1", **options) -> None:
    """`specrelay edge-worker`: load the draft model, connect to the brokers and serve clients on `listen`
    (ZeroMQ), on `http` (the OpenAI-compatible API) and health / metrics on `health_port`, until SIGTERM / SIGINT."""
    from .http.server import HttpFrontend, HttpStats

    sys.setswitchinterval(GIL_SWITCH_S)
    config = replace(config or EdgeConfig(), listen=listen)
    edge = await load_edge(broker, draft_model, target_tokenizer, device=device, dtype=dtype, config=config,
                           **options)
    if edge.config.max_context is None:
        log.warning("the target's context is unknown (no config next to --target-tokenizer, no --max-model-len): a "
                    "request past it is not refused up front; it ends with finish_reason length where the context "
                    "ends")
    stats = HttpStats()
    services = [edge] + ([EdgeHealth(edge, stats, health_host, health_port)] if health_port is not None else [])
    services += [HttpFrontend(edge, *http, served_model_name, stats, http_limits)] if http else []  # after health
    await transport.serve_all(*services)


class EdgeHealth(transport.Service):
    """The edge worker's /healthz (200 while it serves), /readyz (200 while at least one broker is up; the body
    says which) and /metrics: the edge's speculation counters (telemetry.EdgeMetrics), sessions and brokers (per
    broker: up, sessions, times lost, replies that came after their session left), and, with the HTTP front end,
    its counters."""

    name = "edge-health"
    GAUGES = ("sessions_open", "draft_queue_depth", "http_in_flight", "brokers_up", "broker_up_per_broker",
              "broker_sessions_per_broker")

    def __init__(self, edge: EdgeWorker, stats, host: str, port: int) -> None:
        super().__init__()
        self.edge, self.stats, self.host, self.port = edge, stats, host, port
        self._server = None

    def snapshot(self) -> dict:
        http = asdict(self.stats) if self.stats is not None else {}
        return {**self.edge.metrics.stats(self.edge), "sessions_open": self.edge.sessions_open,
                **self.edge.links.per_broker(), **http}

    def _ready(self) -> tuple[bool, dict]:
        return self.edge.ready, {"brokers": self.edge.links.states(), "sessions_open": self.edge.sessions_open}

    async def _open(self) -> None:
        live = lambda: (True, {"sessions_open": self.edge.sessions_open})  # noqa: E731  answers = the loop runs
        endpoints = health.Endpoints(live, self._ready, health.registry_for("specrelay_edge_", self.snapshot,
                                                                             self.GAUGES))
        self._server = await health.start_http(self.host, self.port, endpoints)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("health port listening", url=f"http://{self.host}:{self.port}", paths="/healthz /readyz /metrics")

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
