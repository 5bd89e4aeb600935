"""The edge worker process: drives `EdgeSession`s over one DEALER to the broker (and serves local clients
through `frontend.ClientFrontend` when `EdgeConfig.listen` is set).

One zmq.asyncio DEALER (CURVE when keys are configured). Its routing id is chosen by the broker's ROUTER, so no
other edge can claim it; a session belongs to this connection and its key. A receiver loop hands each VERDICT /
RESAMPLED / ERROR to the session waiting on it; a heartbeat loop tells the broker this edge is alive (it closes
the sessions of a silent edge); a monitor loop notices a refused key (fatal: AuthenticationFailed, the edge
stops, so /readyz goes with it and the CLI exits with one line) and a dropped
connection (the requests in flight are retried at once instead of after their timeout). Sessions are numbered
from a per-edge counter (1, 2, ...): the broker and the workers key them by (this edge's peer id, session), so
ids stay small (1 byte in MessagePack below 128, at most 3 below SID_WRAP) in every message.

Drafting runs in ONE worker thread (the draft model is shared by every session, `DraftBatcher`), so the event
loop keeps moving bytes while a block is drafted. Recovery never loses or repeats a committed token: a retry
re-OPENs with the whole committed context and redrafts; counter-based randomness makes the redraft identical.
Retries go on for `retry_budget_s` seconds of consecutive failures (a broker restart, a gap with no worker).

While a VERIFY is in flight the draft thread, when idle, pre-drafts the session's chain on (`predraft`); the
measured draft wait and round-trip latency of every round feed the auto draft length (edge_worker/draftlen.py,
one `EdgeEstimates` per edge). `metrics` (telemetry.py) counts what loading.EdgeHealth serves on /metrics.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import structlog
import zmq
import zmq.asyncio

from ..common import protocol as P
from ..common import transport
from ..common.errors import (AuthenticationFailed, ConnectionLost, FatalError, GenerationTimeout, InvalidRequest,
                             Overloaded, RequestError, UnknownSession)
from ..common.protocol import DEFAULT_OBJECTIVE, DEFAULT_SAMPLED_MODE, DEFAULT_STRATEGY, Mode, Objective, Strategy
from . import telemetry
from .batcher import DraftBatcher
from .draftlen import EdgeEstimates
from .drafter import Drafter
from .frontend import ClientFrontend
from .session import EdgeSession, SessionConfig

log = structlog.get_logger("specrelay.edge")

SID_WRAP = 1 << 16  # session ids run 1 .. SID_WRAP - 1, then wrap (skipping ids in use): <= 3 bytes each

OnTokens = Callable[[list[int]], object]  # may return an awaitable


@dataclass
class EdgeConfig:
    """listen: ROUTER endpoint for local clients (None = library use only). request_timeout_s: wait for one
    cloud reply. retry_budget_s: how long consecutive failures (timeout, UNKNOWN_SESSION, WORKER_LOST,
    UNAVAILABLE, INTERNAL) are retried before the generation fails."""

    listen: str | None = None
    insecure_listen: bool = False      # allow `listen` on a non-loopback address without client_keys
    client_keys: str | None = None     # a directory of public keys that may use `listen` (CURVE; edge's keys)
    request_timeout_s: float = 30.0
    # plus this many seconds per prompt token this edge's sessions wait to have prefilled (they queue for the
    # worker's prefill budget, --prefill-tokens per forward pass): a long prompt under load is not given up on
    prefill_s_per_token: float = 0.01
    retry_budget_s: float = 30.0
    retry_backoff_s: float = 0.1      # doubled per consecutive failure, capped at max_backoff_s
    max_backoff_s: float = 1.0
    default_resample: Strategy = DEFAULT_STRATEGY
    # the mode at temperature > 0 when a request names none: coupled sends the fewest bytes both ways, needs no
    # RESAMPLE round trips and is exact (its output is target-alone's with the same seed); docs/benchmarks-first.md
    sampling_mode: Mode = DEFAULT_SAMPLED_MODE
    default_draft_len: int | None = None  # None = auto
    default_objective: Objective = DEFAULT_OBJECTIVE  # what auto optimises when a request names none
    linger_ms: int = 100
    heartbeat_s: float = 1.0          # ZMTP heartbeats on the broker connection (drop a dead TCP peer)
    predraft: bool = True             # draft ahead while a VERIFY is in flight (edge_worker/predraft.py)
    predraft_window: str = "wait"     # the whole wait for the VERDICT, or only while it goes up ("uplink":
                                      # when a cloud worker shares this machine's CPU)
    max_context: int | None = None    # the target's context (prompt + max_new_tokens); None = unknown

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0 or self.prefill_s_per_token < 0:
            raise ValueError("request_timeout_s must be > 0, prefill_s_per_token >= 0")
        if self.retry_budget_s < 0 or self.retry_backoff_s < 0:
            raise ValueError("retry_budget_s and retry_backoff_s must be >= 0")
        if not 0 <= self.linger_ms <= 5000:
            raise ValueError("linger_ms must be in [0, 5000] so shutdown cannot hang")
        SessionConfig(resample=self.default_resample, draft_len=self.default_draft_len,
                      objective=self.default_objective)  # validates all three
        if self.sampling_mode == Mode.GREEDY:
            raise ValueError("sampling_mode is the mode at temperature > 0: sample or coupled")
        if self.predraft_window not in ("uplink", "wait"):
            raise ValueError("predraft_window must be 'uplink' or 'wait'")


class _Route:
    """Where the receiver puts replies for one session: the one request it waits on, by seq and type."""

    def __init__(self, session: EdgeSession) -> None:
        self.session, self.stats = session, session.stats
        self.seq = -1
        self.expect: type[P.Base] = P.Verdict
        self.waiter: asyncio.Future | None = None
        self.stash: P.Error | None = None  # an OPEN's ERROR (seq 0) that arrived while nothing waited
        self.failure: BaseException | None = None  # a link failure that came while nothing waited (drafting)

    def wait_for(self, seq: int, expect: type[P.Base]) -> asyncio.Future:
        self.seq, self.expect = seq, expect
        self.waiter = asyncio.get_running_loop().create_future()
        if self.failure is not None:
            self.waiter.set_exception(self.failure)
            self.failure = None
        return self.waiter

    def deliver(self, msg: P.Base, nbytes: int) -> None:
        self.stats.downlink_bytes += nbytes
        idle = self.waiter is None or self.waiter.done()
        if isinstance(msg, P.Error):
            if idle and msg.seq == 0:
                self.stash = msg
            elif not idle and msg.seq in (0, self.seq):
                self.waiter.set_result(msg)
        elif not idle and isinstance(msg, self.expect) and msg.seq == self.seq:
            self.waiter.set_result(msg)
        # anything else answers a request already given up on (timeout, retry): dropped

    def fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        else:
            self.failure = exc


class EdgeWorker(transport.Service):
    """`async with EdgeWorker(broker, drafter, tokenizer, EdgeConfig(...)) as edge:` then
    `await edge.generate(prompt_ids, SessionConfig(...))` from as many tasks as you like.
    `tokenizer` is the TARGET's: prompts become `tokenizer(prompt).input_ids`, output `tokenizer.decode(ids)`."""

    name = "edge-worker"

    def __init__(self, broker: str, drafter: Drafter, tokenizer, config: EdgeConfig | None = None, *,
                 context: zmq.asyncio.Context | None = None, identity: bytes | None = None,
                 curve: transport.Curve | None = None) -> None:
        super().__init__()
        self.broker, self.drafter, self.tokenizer = broker, drafter, tokenizer
        self.config = config or EdgeConfig()
        self.identity = identity  # None: the broker's ROUTER picks one (the safe default)
        self.connected = asyncio.Event()  # set while the broker connection is up (handshake done)
        self.auth_error: AuthenticationFailed | None = None
        self._refused = asyncio.Event()   # set with auth_error: the heartbeat loop ends the service
        self.ctx = context or zmq.asyncio.Context.instance()
        self.frontend = None  # frontend.ClientFrontend when config.listen is set
        self._curve = curve
        self._sock: zmq.asyncio.Socket | None = None
        self._routes: dict[int, _Route] = {}  # session id -> its route, while the session is in use
        self._next_sid = 1
        self._pool: ThreadPoolExecutor | None = None
        self._batcher: DraftBatcher | None = None
        self.estimates = EdgeEstimates(self.config.predraft, self.config.predraft_window)  # shared by sessions
        self.metrics = telemetry.EdgeMetrics()
        self._log = log.bind(broker=broker)

    @property
    def sessions_open(self) -> int:
        """Generations in progress on this edge."""
        return len(self._routes)

    @property
    def endpoint(self) -> str | None:
        """The bound client endpoint (after start), when serving local clients."""
        return self.frontend.endpoint if self.frontend is not None else None

    # ------------------------------------------------------------------------------ lifecycle
    async def _open(self) -> None:
        """Connect to the broker (and bind the client endpoint)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrelay-draft")
        self._batcher = DraftBatcher(self.drafter, self._pool, on_timing=self.estimates.observe_steps)
        self._sock = transport.make_socket(self.ctx, zmq.DEALER, linger_ms=self.config.linger_ms,
                                           identity=self.identity, curve=self._curve,
                                           heartbeat_s=self.config.heartbeat_s)
        self._monitor = transport.Monitor(self._sock, self._on_event)  # before connect: sees every event
        transport.connect(self._sock, self.broker, "edge worker")
        if self.config.listen:
            self.frontend = ClientFrontend(self, self.config.listen)
            self.frontend.open()
        self._log.info("edge worker started", listen=self.endpoint, curve=self._curve is not None)

    def _loops(self):
        loops = [self._receive(), self._heartbeat(), self._monitor.run()]
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
        if self._sock is not None:
            self._monitor.close()
            self._sock.close()
            self._sock = None
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

    async def generate(self, prompt_ids: Sequence[int], config: SessionConfig,
                       on_tokens: OnTokens | None = None) -> tuple[list[int], dict[str, float]]:
        """Generate with the cloud's verification; returns (generated target ids, stats).
        `on_tokens(new_ids)` (sync or async) sees every committed chunk, in order, exactly once; returning False
        ends the generation after that chunk (the session is CLOSEd as usual)."""
        if self._sock is None:
            raise FatalError("the edge worker is not started")
        if self.auth_error is not None:
            raise self.auth_error
        self.check_fits(len(prompt_ids), config.max_new_tokens)
        session = EdgeSession(list(prompt_ids), config, self.drafter, sid=self._new_sid(), estimates=self.estimates)
        route = self._routes[session.sid] = _Route(session)
        slog = self._log.bind(session=session.sid)
        t0, retries, error = time.perf_counter(), 0, None
        try:
            self._send(session, session.open_message())
            failing_since: float | None = None
            while not session.done:
                try:
                    new = await self._step(session, route)
                except RequestError as exc:
                    now = time.monotonic()
                    failing_since = failing_since if failing_since is not None else now
                    if not self._retryable(exc) or now - failing_since > self.config.retry_budget_s:
                        error = exc.code.name
                        raise
                    retries += 1
                    self.metrics.retries += 1
                    await self._recover(session, route, exc, retries, slog)
                    continue
                failing_since = None
                if new and on_tokens is not None:
                    result = on_tokens(new)
                    if inspect.isawaitable(result):
                        result = await result
                    if result is False:  # the caller has what it wants (a stop string): end here
                        break
        except BaseException as exc:
            error = error or ("CANCELLED" if isinstance(exc, asyncio.CancelledError) else type(exc).__name__)
            raise
        finally:
            self._routes.pop(session.sid, None)
            self._send(session, session.close_message())  # also on cancellation: free the cloud's KV
            self.metrics.on_generation(asdict(session.stats), error)
        stats = asdict(session.stats) | {"retries": retries, "wall_s": time.perf_counter() - t0}
        slog.debug("generation done", **stats)
        return list(session.generated), stats

    def _new_sid(self) -> int:
        """The next id of this edge's session counter, skipping ids still in use (wraps before SID_WRAP)."""
        for _ in range(SID_WRAP - 1):
            sid, self._next_sid = self._next_sid, self._next_sid % (SID_WRAP - 1) + 1
            if sid not in self._routes:
                return sid
        raise Overloaded(f"this edge already runs {len(self._routes)} sessions; retry later")

    async def _step(self, session: EdgeSession, route: _Route) -> list[int]:
        """Draft (in the draft thread) or take the pending RESAMPLE, send it (pre-drafting on while it is in
        flight), apply the reply, and report the round's timings to the session's draft-length policy."""
        job = session.draft_job()  # None while a RESAMPLE is pending
        draft_s = None
        if job is None:
            request = session.next_request()
        else:
            t0 = time.perf_counter()
            request = session.request_for(await self._batcher.draft(job))
            draft_s = time.perf_counter() - t0 if self._batcher.batches > 1 else None  # the first: warm-up
        if route.stash is not None:  # the OPEN already failed: do not send on top of it
            reply, route.stash = route.stash, None
            return session.apply(reply)
        expect = P.Verdict if isinstance(request, P.Verify) else P.Resampled
        waiter = route.wait_for(request.seq, expect)
        self._send(session, request)
        sent = time.perf_counter()
        pre = self._predraft(session) if expect is P.Verdict else None
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
            self.estimates.sessions = len(self._routes)
            session.record_timing(draft_s, latency)
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

    @staticmethod
    def _retryable(exc: RequestError) -> bool:
        return exc.retryable

    async def _recover(self, session: EdgeSession, route: _Route, exc: RequestError, attempt: int,
                       slog) -> None:
        """Re-OPEN with the whole committed context; back off first unless the cloud just lost the session."""
        slog.warning("retrying", code=exc.code.name, reason=str(exc), attempt=attempt,
                     committed=len(session.generated))
        if not isinstance(exc, UnknownSession):
            c = self.config
            await asyncio.sleep(min(c.retry_backoff_s * 2 ** min(attempt - 1, 16), c.max_backoff_s))
        route.stash = route.failure = None
        self._send(session, session.open_message())

    def _send(self, session: EdgeSession, msg: P.Base) -> None:
        """Queue a message to the broker without awaiting (safe in `finally` during cancellation)."""
        frames = P.encode(msg)
        nbytes = sum(map(len, frames))
        session.stats.uplink_bytes += nbytes
        self.metrics.uplink_bytes += nbytes
        if self._sock is None:
            return
        error = transport.send_nowait(self._sock, frames)
        if error is not None:
            self._log.warning("send to the broker failed", session=session.sid, error=str(error))

    async def _heartbeat(self) -> None:
        """Tell the broker this edge is alive (it closes the sessions of an edge silent past its edge TTL).
        Ends by raising the broker's refusal of this edge's key: the edge stops (the CLI prints one line)."""
        beat = P.encode(P.Heartbeat())
        while True:
            transport.send_nowait(self._sock, beat)
            try:
                await asyncio.wait_for(self._refused.wait(), self.config.heartbeat_s)
            except asyncio.TimeoutError:
                continue
            raise self.auth_error

    def _on_event(self, event: int) -> None:
        """Socket monitor: a refused key is fatal; a dropped connection fails the requests in flight with a
        retryable error, so they re-OPEN as soon as the link is back instead of waiting for their timeout."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected.set()
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.auth_error = AuthenticationFailed(
                f"authentication failed: the broker at {self.broker} refused this edge's CURVE key")
            self._log.warning("authentication failed; the edge stops", broker=self.broker)
            for route in self._routes.values():
                route.fail(self.auth_error)
            self._refused.set()
        elif event == zmq.EVENT_DISCONNECTED and self.connected.is_set():
            self.connected.clear()
            self._log.warning("broker connection lost; requests in flight are retried", broker=self.broker)
            for route in self._routes.values():
                route.fail(ConnectionLost(f"the connection to the broker at {self.broker} dropped"))

    async def _receive(self) -> None:
        """Broker -> the session waiting for it. Undecodable or unexpected replies are logged and dropped."""
        await transport.receive_forever(self._sock, self._on_reply)

    def _on_reply(self, frames: list[bytes], n_frames: int) -> None:
        try:
            msg = P.decode(frames, n_frames)
        except InvalidRequest as exc:
            self._log.warning("bad reply from the broker", error=str(exc))
            return
        nbytes = sum(map(len, frames))
        self.metrics.downlink_bytes += nbytes
        route = self._routes.get(getattr(msg, "session", -1))
        if route is not None:
            route.deliver(msg, nbytes)
