"""The public async client: talk to an edge worker (`Client(endpoint)`) or embed one (`Client.local(...)`).

    async with Client() as c:                     # the edge worker's default --listen endpoint
        result = await c.generate("def add(a, b):", max_new_tokens=32)
        async for piece in c.stream("class Point:", temperature=0.8, seed=7):
            print(piece, end="")

One DEALER carries every concurrent request; a receiver task routes TOKENS / DONE / ERROR by request id.
Cancelling a call (or leaving a stream early) sends CANCEL, and the edge closes the session in the cloud.
Works on any asyncio loop; only the CLI installs uvloop.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import structlog
import zmq
import zmq.asyncio

from . import defaults
from .common import protocol as P
from .common import transport
from .common.packing import enum_value
from .common.errors import FatalError, GenerationTimeout, InvalidRequest, SpecRelayError, from_wire
from .common.ipc import ipc_listening
from .edge_worker.frontend import handle_generate

log = structlog.get_logger("specrelay.client")
LISTENER_POLL_S = 0.1  # how often start() looks for an edge on an ipc:// endpoint: well under a human's notice


@dataclass
class Result:
    """A completion. `stats`: the edge's numbers for it, typed as over HTTP (`speculative`): seconds (`*_s`) and
    rates (`*_rate`) are floats, every other value (tokens, calls, bytes) an int."""
    text: str
    token_ids: list[int]
    stats: dict[str, int | float] = field(default_factory=dict)


def typed_stats(stats: dict[str, float]) -> dict[str, int | float]:
    """DONE's stats travel as floats (protocol.Done): counts back to ints, seconds and rates stay floats."""
    return {k: float(v) if k.endswith(("_s", "_rate")) else int(v) for k, v in stats.items()}


class _Call:
    """One request in flight: its reply queue, the wait with a timeout, and CANCEL when left early."""

    def __init__(self, client: "Client", msg: P.Generate) -> None:
        self.client, self.request = client, msg.request
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        deadline = client.deadline
        self.deadline_at = None if deadline is None else asyncio.get_running_loop().time() + deadline
        client._calls[self.request] = self
        self.local_task = client._submit(msg, self)

    async def next(self) -> P.Tokens | P.Done:
        """The next TOKENS or DONE; ERROR raises its exception; GenerationTimeout when the edge is silent for
        `timeout` seconds or the call has run past its `deadline`."""
        timeout, loop = self.client.timeout, asyncio.get_running_loop()
        left = None if self.deadline_at is None else self.deadline_at - loop.time()
        try:
            msg = await asyncio.wait_for(self.queue.get(), timeout if left is None else max(0.0, min(timeout, left)))
        except asyncio.TimeoutError:
            if left is not None and left <= timeout:
                raise GenerationTimeout(f"request {self.request} to the edge worker at {self.client.endpoint} did "
                                        f"not finish within its deadline of {self.client.deadline:g} s") from None
            raise GenerationTimeout(f"no reply from the edge worker at {self.client.endpoint} for request "
                                    f"{self.request} within {timeout:g} s (the timeout: the longest gap between "
                                    "replies)") from None
        if isinstance(msg, BaseException):
            self.finished = True
            raise msg
        if isinstance(msg, P.Error):
            self.finished = True
            raise from_wire(msg.code, msg.message)
        self.finished = isinstance(msg, P.Done)
        return msg

    def finish(self) -> None:
        """Forget the call; if it did not finish, stop the generation (CANCEL, or cancel the local task)."""
        self.client._calls.pop(self.request, None)
        if self.finished:
            return
        if self.local_task is not None:
            self.local_task.cancel()
        else:
            self.client._post(P.Cancel(self.request))


class Client:
    """`async with Client(endpoint, timeout=60, deadline=None) as c:`. `timeout` (seconds) is the longest gap
    between two replies of one call (the edge sends a reply per committed chunk), not a limit on the whole call:
    a long generation that keeps replying never hits it. `deadline` (seconds, None = none) bounds each whole
    `generate` / `stream` call. Both raise GenerationTimeout. `endpoint` defaults to the edge worker's default
    `--listen` (specrelay.defaults.EDGE_ENDPOINT); on an ipc:// endpoint nothing listens on, `start` fails after
    `connect_timeout` seconds (time for an edge started beside the client to bind it)."""

    def __init__(self, endpoint: str = defaults.EDGE_ENDPOINT, timeout: float = 60.0, *,
                 deadline: float | None = None, connect_timeout: float = 10.0,
                 context: zmq.asyncio.Context | None = None, linger_ms: int = 0,
                 curve: transport.Curve | None = None) -> None:
        if not timeout > 0:
            raise ValueError("timeout must be > 0 seconds")
        if deadline is not None and not deadline > 0:
            raise ValueError("deadline must be > 0 seconds (or None)")
        self.endpoint, self.timeout, self.deadline = endpoint, timeout, deadline
        self.connect_timeout = connect_timeout
        self._ctx, self._linger_ms = context, linger_ms
        self._curve = curve  # auth.client(APP.key_secret, EDGE.key) for an edge started with --client-keys
        self._sock: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._edge = None           # an embedded EdgeWorker (Client.local)
        self._edge_factory = None

    @classmethod
    def local(cls, broker: str | Sequence[str], draft_model: str, target_tokenizer: str | None = None, *,
              timeout: float = 60.0, deadline: float | None = None, device: str = "cpu", dtype: str = "float32",
              config=None, context: zmq.asyncio.Context | None = None,
              curve: transport.Curve | Sequence[transport.Curve] | None = None) -> "Client":
        """A client with an EdgeWorker embedded in this process (no local socket): one-process apps. `broker`: an
        endpoint, a comma list or a sequence (several brokers: each session goes to one, a lost one's sessions move
        to another); `curve`: auth.client(SECRET, BROKER.key) for all of them, or one per broker. The draft model
        loads when the client starts; a bad broker list is a ValueError here."""
        from .common.brokers import broker_list
        from .edge_worker.server import load_edge

        brokers = broker_list(broker, "broker")
        client = cls(f"local edge worker (brokers {', '.join(brokers)})" if len(brokers) > 1 else
                     f"local edge worker (broker {brokers[0]})", timeout, deadline=deadline, context=context)

        async def factory():
            return await load_edge(brokers, draft_model, target_tokenizer, device=device, dtype=dtype,
                                   config=config, context=context, curve=curve)

        client._edge_factory = factory
        return client

    # ------------------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Client":
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def start(self) -> None:
        if self._edge_factory is not None:
            if self._edge is None:
                self._edge = await self._edge_factory()
                await self._edge.__aenter__()  # serves in a background task
            return
        if self._sock is None:
            await self._wait_for_listener()
            ctx = self._ctx or zmq.asyncio.Context.instance()
            self._sock = transport.make_socket(ctx, zmq.DEALER, linger_ms=self._linger_ms, curve=self._curve)
            transport.connect(self._sock, self.endpoint, "client")
            self._receiver = asyncio.create_task(self._receive(), name="client-receive")

    async def _wait_for_listener(self) -> None:
        """An ipc:// endpoint: wait up to connect_timeout for a process to listen on it (an edge starting beside
        this client), then fail in one line; ZeroMQ alone would wait silently and every call time out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        while ipc_listening(self.endpoint) is False:
            if loop.time() >= deadline:
                raise FatalError(f"no edge worker listens on {self.endpoint} (after {self.connect_timeout:g} s): "
                                 f"start `specrelay edge-worker --listen {self.endpoint}`, or pass its --listen")
            await asyncio.sleep(LISTENER_POLL_S)

    async def close(self) -> None:
        """Stop every call in flight (CANCEL), then close the socket / the embedded edge worker."""
        for call in list(self._calls.values()):
            call.queue.put_nowait(FatalError("the client is closed"))
            call.finish()
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
            self._receiver = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._edge is not None:
            await self._edge.stop()
            self._edge = None

    # ------------------------------------------------------------------------------ requests
    async def generate(self, prompt: str, *, max_new_tokens: int = P.DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int = 0, draft_len: int | None = None, mode: str | None = None,
                       resample: str | None = None, objective: str | None = None) -> Result:
        """The whole completion of `prompt`: its text, target token ids and the edge's stats. A failure raises
        (RequestError, GenerationTimeout, ...) with `.committed`: a Result of the text and ids committed before it
        (the target's own tokens; empty stats)."""
        call = self._start(prompt, max_new_tokens, temperature, top_k, top_p, seed, draft_len, mode, resample,
                           objective)
        pieces: list[str] = []
        ids: list[int] = []
        try:
            while True:
                msg = await call.next()
                if isinstance(msg, P.Done):
                    return Result("".join(pieces), ids, typed_stats(msg.stats))
                pieces.append(msg.text)
                ids.extend(msg.token_ids)
        except SpecRelayError as exc:  # what the edge committed before the failure: the target's own tokens
            exc.committed = Result("".join(pieces), ids)
            raise
        finally:
            call.finish()

    async def stream(self, prompt: str, *, max_new_tokens: int = P.DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0, top_k: int = 0,
                     top_p: float = 1.0, seed: int = 0, draft_len: int | None = None, mode: str | None = None,
                     resample: str | None = None, objective: str | None = None) -> AsyncIterator[str]:
        """Text pieces as tokens are committed, in order; their concatenation is the completion's text. A failure
        raises with `.committed` (a Result of what was committed), as `generate` does."""
        call = self._start(prompt, max_new_tokens, temperature, top_k, top_p, seed, draft_len, mode, resample,
                           objective)
        pieces: list[str] = []
        ids: list[int] = []
        try:
            while True:
                msg = await call.next()
                if isinstance(msg, P.Done):
                    return
                pieces.append(msg.text)
                ids.extend(msg.token_ids)
                if msg.text:
                    yield msg.text
        except SpecRelayError as exc:
            exc.committed = Result("".join(pieces), ids)
            raise
        finally:
            call.finish()

    def _start(self, prompt: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
               draft_len: int | None, mode: str | None, resample: str | None, objective: str | None = None) -> _Call:
        """mode: greedy | sample | coupled (None: greedy at temperature 0, else the edge's sampling mode, coupled
        by default); resample: full | hr | srdv (None: the edge's default); objective: what `draft_len=None` (auto)
        optimises, speed | balanced | cloud (None: the edge's --objective; docs/policy.md). The edge builds the
        session's settings from this GENERATE (edge_worker/config.py) and answers a refusal with an ERROR naming
        the field."""
        if self._sock is None and self._edge is None:
            raise FatalError("the client is not started (use `async with Client(...)` or `await start()`)")
        msg = P.Generate(next(self._ids), prompt, max_new_tokens, float(temperature), top_k, float(top_p), seed,
                         -1 if draft_len is None else draft_len, enum_value(P.Mode, mode, "mode"),
                         enum_value(P.Strategy, resample, "resample"), enum_value(P.Objective, objective, "objective"))
        P.decode(P.encode(msg))  # checks every field's range here, naming the field (InvalidRequest)
        return _Call(self, msg)

    def _submit(self, msg: P.Generate, call: _Call) -> asyncio.Task | None:
        """Send GENERATE, or run it on the embedded edge worker (returns that task)."""
        if self._edge is None:
            self._post(msg)
            return None

        async def emit(reply: P.Base) -> None:
            call.queue.put_nowait(reply)

        task = asyncio.create_task(handle_generate(self._edge, msg, emit), name=f"client-local-{msg.request}")
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                               or call.queue.put_nowait(t.exception()))
        return task

    def _post(self, msg: P.Base) -> None:
        """Queue a message to the edge without awaiting (safe in `finally` during cancellation)."""
        if self._sock is None:
            return
        error = transport.send_nowait(self._sock, P.encode(msg))
        if error is not None:
            log.warning("send to the edge worker failed", endpoint=self.endpoint, error=str(error))

    async def _receive(self) -> None:
        """Edge -> the call with that request id; replies to finished calls are dropped."""
        try:
            await transport.receive_forever(self._sock, self._on_reply)
        except zmq.ZMQError as exc:
            for call in self._calls.values():
                call.queue.put_nowait(FatalError(f"the connection to {self.endpoint} failed: {exc}"))

    def _on_reply(self, frames: list[bytes], n_frames: int) -> None:
        try:
            msg = P.decode(frames, n_frames)
        except InvalidRequest as exc:
            log.warning("bad reply from the edge worker", endpoint=self.endpoint, error=str(exc))
            return
        request = msg.session if isinstance(msg, P.Error) else getattr(msg, "request", None)
        call = self._calls.get(request)
        if call is not None:
            call.queue.put_nowait(msg)
