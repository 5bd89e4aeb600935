"""The edge worker's OpenAI-compatible HTTP front end (`specrelay edge-worker --http HOST:PORT`, `specrelay serve`).

Starlette routes on uvicorn, in the edge worker's own event loop, over `EdgeWorker.generate` (edge_worker/http/api.py
is the pure part: requests, stop strings, response shapes). A client that goes away cancels its generation, in a
stream (the disconnect or the failed write) and in a plain request (a watcher on the connection); cancelling
`generate` CLOSEs the session, so the cloud worker frees its KV at once.

    GET  /v1/models   POST /v1/completions   POST /v1/chat/completions   GET /health

Every request passes the guards of edge_worker/http/guards.py (API key, body size and time, request-head deadline,
connection cap, concurrency and per-key fair share). An error the client did not cause is logged with its
request id (the `x-request-id` header) and answered with a generic message naming that id, never exception text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, nullcontext
from dataclasses import dataclass

import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ...common import logprobs as L
from ...common import transport
from ...common.errors import FatalError, InvalidRequest, RequestError
from . import api, guards
from .. import config as config_mod
from ..config import HttpLimits, SessionConfig
from .textstream import TextStream

log = structlog.get_logger("specrelay.http")

GRACE_S = 5.0  # on stop: requests in flight get this long, then they are cancelled (their sessions CLOSEd)
TOKENISE_AT_ONCE = 2  # prompts tokenised at once, each in its own thread (a prompt's work is bounded by the context)
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


@dataclass
class HttpStats:
    """Counters of the HTTP front end (exported with the edge's metrics)."""

    http_requests: int = 0
    http_errors: int = 0           # answered with an error object (4xx / 5xx)
    http_disconnects: int = 0      # clients gone before the end: their generations were cancelled
    http_in_flight: int = 0
    http_unauthorized: int = 0     # 401: no or a wrong API key
    http_throttled: int = 0        # 429: the concurrency limit or the key's fair share
    http_too_large: int = 0        # 413: a body past the limit (refused while it arrived)
    http_timeouts: int = 0         # request heads or bodies not complete in time (closed, or 408)
    http_connections_dropped: int = 0  # connections closed to stay under the connection cap
    http_large_body_refusals: int = 0  # bodies past guards.LARGE_BODY_BYTES refused (429) while another was read
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def count(self, status: int) -> None:
        self.http_errors += 1
        counter = {401: "http_unauthorized", 429: "http_throttled", 413: "http_too_large", 408: "http_timeouts"}
        if status in counter:
            setattr(self, counter[status], getattr(self, counter[status]) + 1)


# ------------------------------------------------------------------------------------------ one generation

@dataclass
class Choice:
    """One generation of a response: its prompt, settings and place (`index`). echo: the prompt's text (and, with
    logprobs, its logprobs) come first; zero: max_tokens 0, the one generated token is left out (prompt scoring)."""

    index: int
    prompt_ids: list[int]
    config: SessionConfig
    stops: list[str]
    echo: bool = False
    zero: bool = False
    chat: bool = False


async def run_generation(edge, choice: Choice, on_text: Callable[..., Awaitable[None]] | None = None,
                         table: list[bytes] | None = None) -> api.Outcome:
    """Generate; `on_text(piece, logprobs)` gets each piece of committed text that is safe to show (stop strings
    held back) with the logprobs of the tokens committed with it (None unless asked; then a piece may be empty).
    EOS ends the generation and is not part of the text (nor is anything with ignore_eos); a stop string ends it
    after the chunk holding it; a stop token id ends it and stays in the text. `table`: the target's token bytes."""
    config = choice.config
    text, cut, eos = TextStream(edge.tokenizer), api.StopStrings(choice.stops), edge.drafter.eos_ids
    ends = set(() if config.ignore_eos else eos) | set(config.stop_token_ids)
    saw_end, sessions, offset, saw_any = False, [], [0], []

    async def on_tokens(new: list[int]) -> bool:
        nonlocal saw_end
        if on_text is not None and choice.echo and not saw_any:  # a stream starts with the echoed prompt
            saw_any.append(True)
            await on_text(edge.tokenizer.decode(choice.prompt_ids), _echoed(choice, sessions[0], table, offset))
        ids = [t for t in new if t not in eos]
        saw_end |= any(t in ends for t in new)
        piece = cut.push(text.push(ids))
        rows = sessions[0].token_rows[-1] if config.logprobs is not None and sessions else None
        if on_text is not None and not choice.zero and (piece or rows is not None):
            await on_text(piece, None if rows is None else _shaped(choice, rows, new, table, offset))
        return not cut.hit  # False: stop generating

    generated, stats = await edge.generate(choice.prompt_ids, config, on_tokens, on_session=sessions.append)
    tail = "" if cut.hit or choice.zero else cut.push(text.flush()) + cut.flush()
    if tail and on_text is not None:
        await on_text(tail, None)
    out = api.Outcome("" if choice.zero else cut.text, len(choice.prompt_ids), 0 if choice.zero else len(generated),
                      "length" if choice.zero else "stop" if cut.hit or saw_end else "length", stats, generated)
    if config.logprobs is not None:
        out.logprobs = _full_logprobs(choice, sessions[0].scores(), generated, table)
    if choice.echo:
        out.text = edge.tokenizer.decode(choice.prompt_ids) + out.text
    return out


def _shaped(choice: Choice, rows, ids: list[int], table, offset: list[int]) -> dict:
    """OpenAI's logprobs object of `ids` (Rows `rows`); offset: the completions' text_offset so far (advanced)."""
    if choice.chat:
        return L.chat_logprobs(rows, ids, table)
    shaped = L.completion_logprobs(rows, ids, table, offset[0])
    offset[0] += sum(len(t) for t in shaped["tokens"])
    return shaped


def _echoed(choice: Choice, session, table, offset: list[int]) -> dict | None:
    """The logprobs of the echoed prompt (None without logprobs)."""
    if choice.config.logprobs is None or session.prompt_rows is None:
        return None
    return _shaped(choice, session.prompt_rows, list(choice.prompt_ids), table, offset)


def _full_logprobs(choice: Choice, scores: dict, generated: list[int], table) -> dict:
    rows, ids = scores["logprobs"], list(generated)
    if choice.zero:  # the token drawn to end the round is not part of the answer
        rows, ids = L.Rows(*(x[:0] for x in rows)), []
    if choice.echo and scores["prompt_logprobs"] is not None:
        rows, ids = L.concat([scores["prompt_logprobs"], rows]), list(choice.prompt_ids) + ids
    return _shaped(choice, rows, ids, table, [0])


def api_error(exc: BaseException, request_id: str = "") -> api.APIError:
    """Any failure of a request -> an OpenAI-style error with its HTTP status. Text the client did not cause
    (exceptions, template errors, a stopped edge) is logged under the request id and never sent."""
    if isinstance(exc, api.TemplateRefused):
        log.warning("chat template refused the messages", request_id=request_id, error=repr(exc.cause))
        return exc
    if isinstance(exc, api.APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return api.as_api_error(exc)
    if isinstance(exc, RequestError):  # the cloud: no worker, timeouts, lost workers (after the edge's retries)
        return api.APIError(503, f"the cloud could not serve the request: {exc}", kind="server_error",
                            code=exc.code.name.lower())
    if isinstance(exc, FatalError):
        log.error("request failed: the edge cannot serve", request_id=request_id, error=str(exc))
        return api.APIError(503, f"the server is unavailable (request id {request_id})", kind="server_error",
                            code="unavailable")
    log.error("request failed", request_id=request_id, exc_info=exc)
    return api.APIError(500, f"internal error (request id {request_id})", kind="server_error")


# ------------------------------------------------------------------------------------------ the ASGI app

class OpenAIApp:
    """The routes over one EdgeWorker."""

    def __init__(self, edge, served_model: str, stats: HttpStats | None = None,
                 limits: HttpLimits | None = None) -> None:
        self.edge, self.served_model = edge, served_model
        self.stats = stats or HttpStats()
        self.limits = limits or HttpLimits()
        self.share = guards.FairShare(self.limits)
        self.bodies = guards.BodyBudget(self.limits.max_body_bytes_in_flight)
        self.tokenising = asyncio.Semaphore(TOKENISE_AT_ONCE)
        self._table: list[bytes] | None = None  # the target's token bytes (logprobs), made on first use

    def asgi(self) -> Starlette:
        routes = [Route("/v1/models", self.models), Route("/health", self.health),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: self._http_exception})

    async def models(self, request: Request) -> JSONResponse:
        try:
            guards.authorize(self.limits, request.headers.get("authorization"))
        except api.APIError as exc:
            return self._error(exc)
        return JSONResponse({"object": "list", "data": [{"id": self.served_model, "object": "model", "created": 0,
                                                          "owned_by": "specrelay"}]})

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "sessions_open": self.edge.sessions_open})

    async def completions(self, request: Request):
        return await self._serve(request, api.CompletionRequest, api.completion_prompts, api.completion_max_tokens)

    async def chat(self, request: Request):
        return await self._serve(request, api.ChatRequest, lambda *a: [api.chat_prompt_ids(*a)], api.chat_max_tokens)

    async def _serve(self, request: Request, kind, prompts, max_tokens):
        """Key, body, request, prompt, context, admission: each refused before any generation starts."""
        self.stats.http_requests += 1
        request_id = "req-" + uuid.uuid4().hex[:16]
        try:
            key = guards.authorize(self.limits, request.headers.get("authorization"))
            req = await guards.read_body(request, self.limits, self.bodies, self.stats, lambda b: api.parse(b, kind))
            api.check(req, self.served_model)
            ticket = self.share.admit(key)  # the concurrency limit and the key's share, before any tokenising
        except Exception as exc:
            return self._error(api_error(exc, request_id), request_id)
        try:
            async with self.tokenising:  # bounded work (api.bounded_encode) on a bounded number of threads
                all_ids = await asyncio.to_thread(prompts, self.edge.tokenizer, req,
                                                  self.edge.context_limit - max(1, max_tokens(req, 1)))
            ticket.add(sum(map(len, all_ids)))  # the key's share of prompt tokens in flight
            choices = await self._choices(req, all_ids, max_tokens, kind is api.ChatRequest)
        except Exception as exc:
            ticket.release()
            return self._error(api_error(exc, request_id), request_id)
        shape = api.Shape(chat=kind is api.ChatRequest, model=self.served_model, tool_call=api.forced_tool(req))
        stream_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            events = self._events(shape, choices, stream_usage, ticket, request_id)
            return EventStream(events, self, ticket, request_id)
        return await self._complete(request, shape, choices, ticket, request_id)

    async def _choices(self, req, all_ids: list[list[int]], max_tokens, chat: bool) -> list[Choice]:
        """Every prompt's n choices (seeds seed, seed + 1, ...), each checked against the context."""
        choices, drafter = [], self.edge.drafter
        for ids in all_ids:
            room = self.edge.context_limit - len(ids)  # the chat default is "up to the context"
            wanted = max_tokens(req, room)
            config = api.session_config(req, wanted, self.edge.config, drafter.target_vocab_size, drafter.eos_ids)
            self.edge.check_fits(len(ids), config.max_new_tokens)
            if config.constraint is not None and not choices:  # compiled once at the door: a bad spec is a 400
                await asyncio.to_thread(api.check_constraint, drafter, req, config)
            for j in range(req.n or 1):
                seeded = dataclasses.replace(config, seed=(config.seed + j) % config_mod.SEED_LIMIT)
                choices.append(Choice(len(choices), ids, seeded, api.stops(req), bool(getattr(req, "echo", False)),
                                      wanted == 0, chat))
        if any(c.config.logprobs is not None for c in choices) and self._table is None:
            self._table = await asyncio.to_thread(L.token_byte_table, self.edge.tokenizer, drafter.target_vocab_size)
        return choices

    async def _complete(self, request: Request, shape: api.Shape, choices: list[Choice], ticket, request_id):
        """A plain request; a watcher cancels the generation if the client disconnects first."""
        work = asyncio.create_task(self._generate(choices, ticket, request_id=request_id))
        work.add_done_callback(lambda _: ticket.release())  # also when cancelled before it ever ran
        gone = asyncio.create_task(_disconnected(request.receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                self.stats.http_disconnects += 1
                await asyncio.gather(work, return_exceptions=True)  # until its session is CLOSEd
        if work.cancelled():
            return JSONResponse({}, status_code=499)  # nobody is listening
        if work.exception() is not None:
            return self._error(api_error(work.exception(), request_id), request_id)
        return JSONResponse(shape.full(work.result()), headers={"x-request-id": request_id})

    async def _generate(self, choices: list[Choice], ticket: guards.Ticket, on_text=None, *,
                        request_id: str = "") -> list[api.Outcome]:
        """The choices one after another (a choice after the first of its prompt counts no prompt tokens)."""
        self.stats.http_in_flight += 1
        t0 = time.perf_counter()
        outs: list[api.Outcome] = []
        try:
            for choice in choices:
                emit = None if on_text is None else functools.partial(on_text, choice)
                out = await run_generation(self.edge, choice, emit, self._table)
                if outs and choice.prompt_ids is choices[choice.index - 1].prompt_ids:
                    out.prompt_tokens = 0  # n > 1: the prompt is counted once, as OpenAI counts it
                outs.append(out)
                if on_text is not None:
                    await on_text(choice, None, None, out)
        finally:
            self.stats.http_in_flight -= 1
            ticket.release()
        self.stats.prompt_tokens += sum(o.prompt_tokens for o in outs)
        self.stats.completion_tokens += sum(o.completion_tokens for o in outs)
        log.info("request", request_id=request_id, stream=on_text is not None, choices=len(outs),
                 prompt_tokens=sum(o.prompt_tokens for o in outs),
                 completion_tokens=sum(o.completion_tokens for o in outs), finish_reason=outs[-1].finish_reason,
                 cloud_calls=sum(o.stats.get("cloud_calls", 0) for o in outs), wall_s=round(time.perf_counter() - t0, 3))
        return outs

    async def _events(self, shape: api.Shape, choices: list[Choice], include_usage: bool, ticket: guards.Ticket,
                      request_id: str) -> AsyncIterator[bytes]:
        """Server-sent events: per choice (one after another, each with its index) the echoed prompt if asked, a
        chunk per committed piece of text (with its tokens' logprobs if asked), its last chunk (finish_reason,
        speculative stats); then the usage chunk if asked, [DONE]. Leaving early cancels the generation (its
        finally CLOSEs)."""
        events: asyncio.Queue = asyncio.Queue()

        async def on_text(choice: Choice, piece, logprobs, out: api.Outcome | None = None) -> None:
            await events.put((choice, piece, logprobs, out))

        work = asyncio.create_task(self._generate(choices, ticket, on_text, request_id=request_id))
        work.add_done_callback(lambda _: events.put_nowait(None))
        started: set[int] = set()
        try:
            held: dict[int, list[str]] = {}  # a tool call's text is held back: it goes out as one tool_calls delta
            while (event := await events.get()) is not None:
                choice, piece, logprobs, out = event
                if shape.chat and choice.index not in started:
                    started.add(choice.index)
                    yield _sse(shape.chunk(role=True, index=choice.index))
                if out is not None:
                    for obj in shape.ending(out, "".join(held.pop(choice.index, [])), choice.index):
                        yield _sse(obj)
                elif shape.tool_call:
                    held.setdefault(choice.index, []).append(piece)
                else:
                    yield _sse(shape.chunk(piece, index=choice.index, logprobs=logprobs))
            if work.exception() is not None:
                error = api_error(work.exception(), request_id)
                self.stats.count(error.status)
                yield _sse(error.body())
            elif include_usage:
                yield _sse(shape.usage_chunk(work.result()))
            yield b"data: [DONE]\n\n"
        finally:
            if not work.done():
                work.cancel()
                self.stats.http_disconnects += 1

    def _error(self, error: api.APIError, request_id: str | None = None) -> JSONResponse:
        self.stats.count(error.status)
        headers = error.headers | ({"x-request-id": request_id} if request_id else {})
        if error.status in (408, 413, 429):  # the rest of the body is not wanted: end the connection
            headers["connection"] = "close"
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def _http_exception(self, request: Request, exc: HTTPException) -> JSONResponse:
        return self._error(api.APIError(exc.status_code, exc.detail or "error", code=str(exc.status_code)))


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _disconnected(receive) -> None:
    """Returns when the client has gone (the body was read already, so the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """An SSE response that owns its event iterator: the client disconnecting (or a write failing) closes the
    iterator at once, whose `finally` cancels the generation."""

    def __init__(self, events: AsyncIterator[bytes], app: OpenAIApp, ticket: guards.Ticket,
                 request_id: str) -> None:
        self.events, self.app, self.ticket = events, app, ticket
        self.headers = SSE_HEADERS + [(b"x-request-id", request_id.encode())]

    async def __call__(self, scope, receive, send) -> None:
        async with aclosing(self.events):
            pump = asyncio.create_task(self._pump(send))
            gone = asyncio.create_task(_disconnected(receive))
            try:
                await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, gone):
                    task.cancel()
                await asyncio.gather(pump, gone, return_exceptions=True)
                self.ticket.release()  # also when the stream never started its generation

    async def _pump(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the connection is gone
            pass


# ------------------------------------------------------------------------------------------ the server

class _Server(uvicorn.Server):
    def capture_signals(self):  # the process's own Service lifecycle handles SIGTERM / SIGINT
        return nullcontext()


class HttpFrontend(transport.Service):
    """uvicorn serving `OpenAIApp` on host:port inside the running event loop. `port` 0 = any free port (read
    `self.port` after start). A bind error is a FatalError naming the address."""

    name = "http"

    def __init__(self, edge, host: str, port: int, served_model: str, stats: HttpStats | None = None,
                 limits: HttpLimits | None = None) -> None:
        super().__init__()
        self.edge, self.host, self.port = edge, host, port
        self.app = OpenAIApp(edge, served_model, stats, limits)
        self._sock: socket.socket | None = None
        self._server: _Server | None = None

    async def _open(self) -> None:
        self._sock = _listen(self.host, self.port)
        self.port = self._sock.getsockname()[1]
        protocol = guards.guarded_protocol(self.app.limits, self.app.stats)
        config = uvicorn.Config(self.app.asgi(), http=protocol, lifespan="off", log_config=None, access_log=False,
                                timeout_graceful_shutdown=GRACE_S)
        config.load()
        self._server = _Server(config)
        self._server.lifespan = config.lifespan_class(config)
        await self._server.startup(sockets=[self._sock])
        log.info("HTTP API listening", url=f"http://{self.host}:{self.port}/v1", model=self.app.served_model,
                 api_keys=len(self.app.limits.api_keys))
        if not self.app.limits.api_keys and self.host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("the HTTP API takes requests without an API key on a non-loopback address: pass --api-key")

    def _loops(self):
        return [self._serve(), self._watch_edge()]

    async def _serve(self) -> None:
        await self._server.main_loop()
        raise FatalError("the HTTP server stopped")

    async def _watch_edge(self) -> None:
        await self.edge.wait_closed()
        raise FatalError("the edge worker stopped")

    async def _close(self) -> None:
        if self._server is not None and self._server.started:
            self._server.should_exit = True
            await self._server.shutdown(sockets=[self._sock])
        elif self._sock is not None:
            self._sock.close()

    async def wait_closed(self) -> None:
        await self._stopped.wait()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise FatalError(f"the HTTP API cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock

