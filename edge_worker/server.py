"""The edge worker process: drives `EdgeSession`s over one DEALER to the broker, and serves local clients.

  broker side  one zmq.asyncio DEALER (fixed identity, so a reconnect keeps the broker's session table
               valid). A receiver task hands each VERDICT / RESAMPLED / ERROR to the session waiting on it.
  client side  optional ROUTER on `EdgeConfig.listen`: GENERATE starts a generation task that streams TOKENS
               and ends with DONE (or ERROR); CANCEL cancels it, which CLOSEs the session in the cloud.

Sessions are numbered from a per-edge counter (1, 2, ...): a session id is unique per edge only, and the
broker and the workers scope it by this edge's identity, so ids stay small (1 byte in MessagePack below 128,
at most 3 below SID_WRAP) in every message.

Drafting runs in ONE worker thread (the draft model is shared by every session), so the event loop keeps
moving bytes while a block is drafted. Recovery never loses or repeats a committed token: a retry re-OPENs
with the whole committed context and redrafts; counter-based randomness makes the redraft identical.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Awaitable, Callable, Sequence

import structlog
import zmq
import zmq.asyncio

from ..common import protocol as P
from ..common.errors import FatalError, GenerationTimeout, InvalidRequest, Overloaded, RequestError, UnknownSession
from ..common.sampling import SamplingParams
from .batcher import DraftBatcher
from .drafter import Drafter, make_drafter
from .session import EdgeSession, SessionConfig
from .textstream import TextStream

log = structlog.get_logger("specrelay.edge")

SID_WRAP = 1 << 16  # session ids run 1 .. SID_WRAP - 1, then wrap (skipping ids in use): <= 3 bytes each

Emit = Callable[[P.Base], Awaitable[None]]
OnTokens = Callable[[list[int]], object]  # may return an awaitable


@dataclass
class EdgeConfig:
    """listen: ROUTER endpoint for local clients (None = library use only). request_timeout_s: wait for one
    cloud reply. max_retries: consecutive failed attempts (timeout, RESEND_CONTEXT, WORKER_LOST, UNAVAILABLE)
    tolerated per step before the generation fails."""

    listen: str | None = None
    request_timeout_s: float = 30.0
    max_retries: int = 3
    retry_backoff_s: float = 0.1      # doubled per consecutive failure, capped at max_backoff_s
    max_backoff_s: float = 2.0
    default_resample: str = "hr"
    default_draft_len: int | None = None  # None = auto
    linger_ms: int = 100
    heartbeat_s: float = 1.0          # ZMTP heartbeats on the broker connection (drop a dead TCP peer)

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be > 0")
        if self.max_retries < 0 or self.retry_backoff_s < 0:
            raise ValueError("max_retries and retry_backoff_s must be >= 0")
        if not 0 <= self.linger_ms <= 5000:
            raise ValueError("linger_ms must be in [0, 5000] so shutdown cannot hang")
        SessionConfig(resample=self.default_resample, draft_len=self.default_draft_len)  # validates both


class _Route:
    """Where the receiver puts replies for one session: the one request it waits on, by seq and type."""

    def __init__(self, session: EdgeSession) -> None:
        self.stats = session.stats
        self.seq = -1
        self.expect: type[P.Base] = P.Verdict
        self.waiter: asyncio.Future | None = None
        self.stash: P.Error | None = None  # an OPEN's ERROR (seq 0) that arrived while nothing waited

    def wait_for(self, seq: int, expect: type[P.Base]) -> asyncio.Future:
        self.seq, self.expect = seq, expect
        self.waiter = asyncio.get_running_loop().create_future()
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


class EdgeWorker:
    """`async with EdgeWorker(broker, drafter, tokenizer, EdgeConfig(...)) as edge:` then
    `await edge.generate(prompt_ids, SessionConfig(...))` from as many tasks as you like.
    `tokenizer` is the TARGET's: prompts become `tokenizer(prompt).input_ids`, output `tokenizer.decode(ids)`."""

    def __init__(self, broker: str, drafter: Drafter, tokenizer, config: EdgeConfig | None = None, *,
                 context: zmq.asyncio.Context | None = None, identity: bytes | None = None) -> None:
        self.broker, self.drafter, self.tokenizer = broker, drafter, tokenizer
        self.config = config or EdgeConfig()
        self.identity = identity or b"edge-" + os.urandom(8).hex().encode()
        self.endpoint: str | None = None  # the bound client endpoint after start()
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._routes: dict[int, _Route] = {}  # session id -> its route, while the session is in use
        self._next_sid = 1
        self._requests: dict[tuple[bytes, int], asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._pool: ThreadPoolExecutor | None = None
        self._batcher: DraftBatcher | None = None
        self._closed = asyncio.Event()
        self._log = log.bind(broker=broker)

    # ------------------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "EdgeWorker":
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect to the broker (and bind the client endpoint); start the receiver tasks."""
        if self._sock is not None:
            return
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specrelay-draft")
        self._batcher = DraftBatcher(self.drafter, self._pool)
        self._sock = self._socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, self.identity)
        self._sock.connect(self.broker)
        self._tasks.append(asyncio.create_task(self._receive(), name="edge-receive"))
        if self.config.listen:
            self._router = self._socket(zmq.ROUTER)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client -> EHOSTUNREACH, not silence
            try:
                self._router.bind(self.config.listen)
            except zmq.ZMQError as exc:
                await self.close()
                raise FatalError(f"edge worker cannot bind {self.config.listen}: {exc}") from exc
            self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tasks.append(asyncio.create_task(self._serve_clients(), name="edge-clients"))
        self._log.info("edge worker started", listen=self.endpoint, identity=self.identity.decode())

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, self.config.linger_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.config.heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.config.heartbeat_s * 3000))
        return sock

    async def close(self) -> None:
        """Cancel client generations (each CLOSEs its session), fail library callers, close the sockets."""
        requests = list(self._requests.values())
        for task in requests:
            task.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        for route in self._routes.values():
            route.fail(FatalError("the edge worker is closed"))
        await asyncio.sleep(0)  # let those callers run their `finally` (CLOSE) while the socket is open
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._batcher is not None:
            await self._batcher.close()
        self._tasks.clear()
        for sock in (self._router, self._sock):
            if sock is not None:
                sock.close()
        self._sock = self._router = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # ------------------------------------------------------------------------------ generation
    async def generate(self, prompt_ids: Sequence[int], config: SessionConfig,
                       on_tokens: OnTokens | None = None) -> tuple[list[int], dict[str, float]]:
        """Generate with the cloud's verification; returns (generated target ids, stats).
        `on_tokens(new_ids)` (sync or async) sees every committed chunk, in order, exactly once."""
        if self._sock is None:
            raise FatalError("the edge worker is not started")
        if len(prompt_ids) + config.max_new_tokens > P.MAX_CONTEXT:
            raise InvalidRequest(f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens exceeds the "
                                 f"{P.MAX_CONTEXT}-token context limit", field="prompt")
        session = EdgeSession(list(prompt_ids), config, self.drafter, sid=self._new_sid())
        route = self._routes[session.sid] = _Route(session)
        slog = self._log.bind(session=session.sid)
        t0, retries = time.perf_counter(), 0
        try:
            self._send(session, session.open_message())
            failures = 0
            while not session.done:
                try:
                    new = await self._step(session, route)
                except RequestError as exc:
                    failures += 1
                    if not self._retryable(exc) or failures > self.config.max_retries:
                        raise
                    retries += 1
                    await self._recover(session, route, exc, failures, slog)
                    continue
                failures = 0
                if new and on_tokens is not None:
                    result = on_tokens(new)
                    if inspect.isawaitable(result):
                        await result
        finally:
            self._routes.pop(session.sid, None)
            self._send(session, session.close_message())  # also on cancellation: free the cloud's KV
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
        """Draft (in the draft thread) or take the pending RESAMPLE, send it, apply the reply."""
        job = session.draft_job()  # None while a RESAMPLE is pending
        request = session.next_request() if job is None else session.request_for(await self._batcher.draft(job))
        if route.stash is not None:  # the OPEN already failed: do not send on top of it
            reply, route.stash = route.stash, None
            return session.apply(reply)
        expect = P.Verdict if isinstance(request, P.Verify) else P.Resampled
        waiter = route.wait_for(request.seq, expect)
        self._send(session, request)
        timeout = self.config.request_timeout_s
        try:
            reply = await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise GenerationTimeout(f"no reply from the cloud for session {session.sid} (seq {request.seq}) "
                                    f"within {timeout:g} s") from None
        return session.apply(reply)  # an ERROR reply raises its RequestError

    @staticmethod
    def _retryable(exc: RequestError) -> bool:
        return exc.retryable or isinstance(exc, GenerationTimeout)

    async def _recover(self, session: EdgeSession, route: _Route, exc: RequestError, failures: int,
                       slog) -> None:
        """Re-OPEN with the whole committed context; back off first unless the cloud just lost the session."""
        slog.warning("retrying", code=exc.code, reason=str(exc), attempt=failures,
                     committed=len(session.generated))
        if not isinstance(exc, UnknownSession):
            c = self.config
            await asyncio.sleep(min(c.retry_backoff_s * 2 ** (failures - 1), c.max_backoff_s))
        route.stash = None
        self._send(session, session.open_message())

    def _send(self, session: EdgeSession, msg: P.Base) -> None:
        """Queue a message to the broker without awaiting (safe in `finally` during cancellation)."""
        frames = P.encode(msg)
        session.stats.uplink_bytes += sum(map(len, frames))
        if self._sock is None:
            return
        try:
            self._sock.send_multipart(frames).add_done_callback(_log_send_failure)
        except zmq.ZMQError as exc:
            self._log.warning("send failed", session=session.sid, error=str(exc))

    async def _receive(self) -> None:
        """Broker -> the session waiting for it. Undecodable or unexpected replies are logged and dropped."""
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError as exc:
                self._log.error("broker socket failed", error=str(exc))
                for route in self._routes.values():
                    route.fail(FatalError(f"the broker connection failed: {exc}"))
                return
            try:
                msg = P.decode(frames)
            except InvalidRequest as exc:
                self._log.warning("bad reply from the broker", error=str(exc))
                continue
            route = self._routes.get(getattr(msg, "session", -1))
            if route is not None:
                route.deliver(msg, sum(map(len, frames)))

    # ------------------------------------------------------------------------------ local clients
    async def handle_generate(self, msg: P.Generate, emit: Emit) -> None:
        """One client request: TOKENS per committed chunk, then DONE; a failed request becomes one ERROR.
        Cancelling this coroutine closes the session in the cloud."""
        try:
            config = self._session_config(msg)
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(None, lambda: list(self.tokenizer(msg.prompt).input_ids))
            text = TextStream(self.tokenizer)

            async def on_tokens(new: list[int]) -> None:
                await emit(P.Tokens(msg.request, new, text.push(new)))

            _, stats = await self.generate(ids, config, on_tokens)
            tail = text.flush()
            if tail:
                await emit(P.Tokens(msg.request, [], tail))
            await emit(P.Done(msg.request, stats))
        except zmq.ZMQError:
            raise  # the client is gone: nobody to tell
        except (RequestError, FatalError) as exc:
            await emit(P.Error(msg.request, 0, getattr(exc, "code", "INTERNAL"), str(exc)))
        except Exception as exc:  # a bug fails this request, not the process
            self._log.exception("request failed", request=msg.request)
            await emit(P.Error(msg.request, 0, "INTERNAL", f"{type(exc).__name__}: {exc}"))

    def _session_config(self, msg: P.Generate) -> SessionConfig:
        draft_len = self.config.default_draft_len if msg.draft_len < 0 else msg.draft_len
        return SessionConfig(max_new_tokens=msg.max_new_tokens,
                             params=SamplingParams(msg.temperature, msg.top_k, msg.top_p),
                             mode=msg.mode, seed=msg.seed, draft_len=draft_len,
                             resample=msg.resample or self.config.default_resample)

    async def _serve_clients(self) -> None:
        """ROUTER loop: [client_id, header, body]. GENERATE / CANCEL; anything else gets an ERROR."""
        while True:
            frames = await self._router.recv_multipart()
            client, body = frames[0], frames[1:]
            try:
                msg = P.decode(body)
                if not isinstance(msg, (P.Generate, P.Cancel)):
                    raise InvalidRequest(f"the edge worker takes GENERATE or CANCEL, got {type(msg).__name__}",
                                         field="header.type")
            except InvalidRequest as exc:
                await self._refuse(client, _request_id(body), str(exc))
                continue
            if isinstance(msg, P.Cancel):
                task = self._requests.get((client, msg.request))
                if task is not None:
                    task.cancel()
            elif (client, msg.request) in self._requests:
                await self._refuse(client, msg.request, f"request id {msg.request} is already running")
            else:
                self._start_request(client, msg)

    def _start_request(self, client: bytes, msg: P.Generate) -> None:
        key = (client, msg.request)
        task = asyncio.create_task(self._client_request(client, msg), name=f"edge-request-{msg.request}")
        self._requests[key] = task
        task.add_done_callback(lambda _: self._requests.pop(key, None))

    async def _client_request(self, client: bytes, msg: P.Generate) -> None:
        try:
            await self.handle_generate(msg, lambda reply: self._to_client(client, reply))
        except zmq.ZMQError as exc:
            self._log.info("client gone; generation stopped", request=msg.request, error=str(exc))

    async def _to_client(self, client: bytes, msg: P.Base) -> None:
        await self._router.send_multipart([client, *P.encode(msg)])

    async def _refuse(self, client: bytes, request: int, reason: str) -> None:
        """BAD_REQUEST to a client; one that has already gone away is only logged."""
        try:
            await self._to_client(client, P.Error(request, 0, "BAD_REQUEST", reason))
        except zmq.ZMQError as exc:
            self._log.info("cannot refuse a request: client gone", request=request, error=str(exc))


def _request_id(body: list[bytes]) -> int:
    """The request id of an undecodable client message, when its first field is readable (else 0)."""
    try:
        return P.session_of(body[1]) if len(body) == 2 else 0
    except InvalidRequest:
        return 0


def _log_send_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("send to the broker failed", error=str(fut.exception()))


# ---------------------------------------------------------------------------------- process entry points

async def load_edge(broker: str, draft_model: str, target_tokenizer: str | None = None, *, device: str = "cpu",
                    dtype: str = "float32", target_vocab_size: int | None = None,
                    config: EdgeConfig | None = None, context: zmq.asyncio.Context | None = None) -> EdgeWorker:
    """Load the draft model (in a thread) and build an EdgeWorker (not started). The target tokenizer
    defaults to the draft model's; a different vocabulary gets the cross-vocabulary drafter."""
    drafter, tokenizer = await asyncio.to_thread(make_drafter, draft_model, target_tokenizer, device, dtype,
                                                 target_vocab_size)
    return EdgeWorker(broker, drafter, tokenizer, config, context=context)


async def serve(broker: str, draft_model: str, listen: str, target_tokenizer: str | None = None,
                device: str = "cpu", *, dtype: str = "float32", target_vocab_size: int | None = None,
                config: EdgeConfig | None = None) -> None:
    """`specrelay edge-worker`: load the draft model, connect to the broker, serve clients on `listen`
    until cancelled."""
    config = replace(config or EdgeConfig(), listen=listen)
    edge = await load_edge(broker, draft_model, target_tokenizer, device=device, dtype=dtype,
                           target_vocab_size=target_vocab_size, config=config)
    async with edge:
        log.info("edge worker serving", broker=broker, listen=edge.endpoint, draft_model=draft_model)
        await edge.wait_closed()
