"""The guards of the edge's HTTP API (edge_worker/http/server.py): every HTTP client of an edge is assumed hostile.

    API keys         `Authorization: Bearer K` on /v1/* (as vLLM and OpenAI); none configured = open
    connections      at most max_connections open (and half the open-file limit); past it the oldest idle one
                     (no request in progress) is closed, so slow or idle clients cannot use up the process's
                     descriptors or keep a newcomer out
    request head     must be complete within header_timeout_s of the connection (or of the previous response);
                     a client sending its headers a byte at a time is closed at that deadline (slowloris)
    body             read as it arrives, at most max_body_bytes (413 at once past it, never read whole first),
                     complete within body_timeout_s (408); all bodies being read together hold at most
                     max_body_bytes_in_flight (429 past it), so many large bodies at once cannot exhaust memory;
                     a body past LARGE_BODY_BYTES is read only while no other large one is (one that comes
                     meanwhile is dropped unparsed as it arrives, answered 429 and its connection closed), so
                     large bodies cannot fill the event loop with parsing and decoding beside everyone else's
    concurrency      at most max_concurrent generations in flight (429 with Retry-After)
    fair share       with N API keys, one key holds at most 1/N of the edge's budget of requests and prompt tokens
                     in flight (the edge's share of its broker quota), so one key cannot exhaust it for everyone;
                     a request is admitted (its slot) before its prompt is tokenised, its tokens counted after
"""

from __future__ import annotations

import asyncio
import hmac
import resource
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ...common.errors import ConfigError
from .api import APIError
from ..config import HttpLimits

RETRY_AFTER_S = 1
# a body past this is "large" and read only while no other large one is (one at a time): no prompt that fits
# protocol.MAX_CONTEXT (32,768 tokens) needs more unless its tokens average 32 JSON bytes, so large bodies are attacks
# or refusals, and reading and decoding each costs the event loop ~25 ms per 8 MiB. A large body that comes while
# another is read is dropped below HTTP parsing as it arrives (GuardedH11Protocol.discard_body: through h11 and ASGI
# 7.5 MB costs the loop ~20 ms of copying, dropped ~3 ms) and answered 429. With one more waiting its turn (read and
# decoded next), a legit request beside 8 such bodies took 1.25-2.05x its latency at rest; without, 1.26-1.90x
LARGE_BODY_BYTES = 1 << 20
OPEN = ""  # the key of every request when no API keys are configured
DISCARD_BODY = "specrelay.discard_body"  # scope extension: GuardedH11Protocol.discard_body


def load_api_keys(keys: list[str] | str | None, key_file: str | None) -> tuple[str, ...]:
    """--api-key (repeatable; SPECRELAY_API_KEY gives one) and --api-key-file (one key a line, # comments)."""
    found = [keys] if isinstance(keys, str) else list(keys or [])
    if key_file:
        lines = Path(key_file).read_text().splitlines()
        found += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return tuple(dict.fromkeys(k.strip() for k in found))


def limits_from_args(args) -> HttpLimits:
    """The CLI's --api-key / --api-key-file / SPECRELAY_API_KEY and limit flags; a bad one is a ConfigError."""
    try:
        return HttpLimits(api_keys=load_api_keys(args.api_key, args.api_key_file),
                          max_concurrent=args.max_concurrent_requests,
                          max_prompt_tokens=args.max_prompt_tokens_in_flight,
                          header_timeout_s=args.http_read_timeout, body_timeout_s=3 * args.http_read_timeout)
    except OSError as exc:
        raise ConfigError(f"--api-key-file: cannot read {args.api_key_file}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"--api-key: {exc}") from None


# ------------------------------------------------------------------------------------------ per request

def authorize(limits: HttpLimits, authorization: str | None) -> str:
    """The caller's API key (OPEN without configured keys), or a 401. Compared in constant time."""
    if not limits.api_keys:
        return OPEN
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() == "bearer":
        for key in limits.api_keys:
            if hmac.compare_digest(given.strip().encode(), key.encode()):
                return key
    raise APIError(401, "a valid API key is required: send `Authorization: Bearer <key>`", code="invalid_api_key")


@dataclass
class BodyBudget:
    """Bytes of request bodies being read, over all connections (at most `limit`), and whether a large one is."""

    limit: int
    used: int = 0
    large: bool = False  # a large body is being read and decoded


class _LargeBusy(Exception):
    """A large body came while another was read: it is drained and refused."""


async def read_body(request, limits: HttpLimits, budget: BodyBudget, stats, parse):
    """`parse` of the body as it arrives: 413 past max_body_bytes (a larger Content-Length is refused before
    reading), 429 while the bodies being read hold the whole budget, 408 if it is not complete within body_timeout_s.
    A body past LARGE_BODY_BYTES (declared, or once it grows past it) is read and parsed only while no other large
    one is: else it is drained and 429 (counted in `stats.http_large_body_refusals`)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise _too_large(limits)
    chunks, size, large, stream = [], 0, [False], request.stream()

    def take_large() -> None:
        if budget.large:
            stats.http_large_body_refusals += 1
            raise _LargeBusy
        budget.large = large[0] = True

    async def pull() -> None:
        nonlocal size
        if declared.isdigit() and int(declared) > LARGE_BODY_BYTES:
            take_large()
        async for chunk in stream:
            if size + len(chunk) > limits.max_body_bytes:
                raise _too_large(limits)
            if budget.used + len(chunk) > budget.limit:
                raise _busy("too many request bodies are being read at once")
            if size + len(chunk) > LARGE_BODY_BYTES and not large[0]:
                take_large()
            size += len(chunk)
            budget.used += len(chunk)
            chunks.append(chunk)

    try:
        async with asyncio.timeout(limits.body_timeout_s):
            try:
                await pull()
            except _LargeBusy:
                await _drain(request, stream, size, limits)
                raise _busy("other large request bodies are being read") from None
        return parse(b"".join(chunks))  # under a large body's turn: decoding 7.5 MB costs about what reading it does
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                       code="request_timeout") from None
    finally:
        budget.used -= size
        if large[0]:
            budget.large = False


async def _drain(request, stream, seen: int, limits: HttpLimits) -> None:
    """The rest of a refused large body (`seen` bytes of it read), so that its client reads the 429."""
    discard = request.scope.get("extensions", {}).get(DISCARD_BODY)  # None outside GuardedH11Protocol
    if discard is not None and await discard(seen):  # below HTTP parsing, then the connection is closed
        return
    async for chunk in stream:
        seen += len(chunk)
        if seen > limits.max_body_bytes:
            raise _too_large(limits)


def _too_large(limits: HttpLimits) -> APIError:
    return APIError(413, f"the request body is larger than {limits.max_body_bytes} bytes", code="body_too_large")


@dataclass
class Ticket:
    """One admitted generation's hold on the budget; `release` is idempotent."""

    share: FairShare
    key: str
    tokens: int
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.share.release(self)

    def add(self, tokens: int) -> None:
        """The prompt's tokens, once counted (after admission): a 429 past the key's share (the ticket is then
        released by the caller)."""
        self.share.add(self, tokens)


@dataclass
class FairShare:
    """Generations and prompt tokens in flight, in total and per API key. A key's share is 1/N of each budget
    (N = configured keys, at least one request's worth): the shares add up to the budget, so no key can keep
    another out. Refusals are 429s with Retry-After."""

    limits: HttpLimits
    requests: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def admit(self, key: str, prompt_tokens: int = 0) -> Ticket:
        lim, n_keys = self.limits, max(1, len(self.limits.api_keys))
        if sum(self.requests.values()) >= lim.max_concurrent:
            raise _busy(f"the server is at its limit of {lim.max_concurrent} requests in flight")
        if self.requests[key] >= max(1, lim.max_concurrent // n_keys):
            raise _busy("this API key is at its share of requests in flight")
        if self.requests[key] and self.tokens[key] + prompt_tokens > lim.max_prompt_tokens // n_keys:
            raise _busy("this API key is at its share of prompt tokens in flight")
        self.requests[key] += 1
        self.tokens[key] += prompt_tokens
        return Ticket(self, key, prompt_tokens)

    def add(self, ticket: Ticket, tokens: int) -> None:
        key, share = ticket.key, self.limits.max_prompt_tokens // max(1, len(self.limits.api_keys))
        if self.requests[key] > 1 and self.tokens[key] + tokens > share:  # a key's only request may take it all
            raise _busy("this API key is at its share of prompt tokens in flight")
        self.tokens[key] += tokens
        ticket.tokens += tokens

    def release(self, ticket: Ticket) -> None:
        self.requests[ticket.key] -= 1
        self.tokens[ticket.key] -= ticket.tokens


def _busy(message: str) -> APIError:
    return APIError(429, message + "; retry later", kind="rate_limit_error", code="rate_limit_exceeded",
                    headers={"retry-after": str(RETRY_AFTER_S)})


# ------------------------------------------------------------------------------------------ per connection

def connection_cap(limits: HttpLimits) -> int:
    """max_connections, and at most half the process's open-file limit (the rest: ZeroMQ, models, health)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return limits.max_connections if soft == resource.RLIM_INFINITY else min(limits.max_connections,
                                                                             max(16, soft // 2))


def guarded_protocol(limits: HttpLimits, stats) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the connection cap and the request-head deadline (one class per server:
    `open_conns` is that server's, oldest first)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"limits": limits, "stats": stats, "open_conns": {}, "cap": connection_cap(limits)})


class GuardedH11Protocol(H11Protocol):
    """guarded_protocol's base: its subclass per server holds the server's limits, stats and connections."""

    limits: HttpLimits
    stats: object
    open_conns: dict[GuardedH11Protocol, None]
    cap: int
    head_timer: asyncio.TimerHandle | None = None
    body_left: int | None = None  # bytes of a refused body still to drop (None: h11 reads what comes)
    body_done: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.open_conns) >= self.cap:
            idle = next((c for c in self.open_conns if c.cycle is None or c.cycle.response_complete), None)
            self.stats.http_connections_dropped += 1
            if idle is None:  # every connection is serving a request: the newcomer waits its turn elsewhere
                transport.abort()
                return
            self.open_conns.pop(idle)
            idle.transport.abort()
        self.open_conns[self] = None
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_deadline)

    def _head_deadline(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # head still incomplete
            self.stats.http_timeouts += 1
            self.transport.abort()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None:  # a new request's task has not started yet: it finds the hook
            self.cycle.scope.setdefault("extensions", {})[DISCARD_BODY] = self.discard_body

    async def discard_body(self, seen: int) -> bool:
        """Read the rest of this request's body (`seen` bytes of it came through ASGI) and drop it as it
        arrives, below the HTTP parser; the connection is closed after the response. Through h11 and ASGI 8
        bodies of 7.5 MB cost the loop 0.155 s of copying, dropped 0.022 s. False for a body of no declared
        length (chunked: only h11 knows where it ends)."""
        cycle = self.cycle
        declared = dict(cycle.scope["headers"]).get(b"content-length", b"")
        if not declared.isdigit():
            return False
        left = int(declared) - seen - len(cycle.body) if self.conn.their_state is h11.SEND_BODY else 0
        cycle.body, cycle.keep_alive = bytearray(), False
        cycle.scope["headers"].append((b"connection", b"close"))  # uvicorn says so in the response
        self.body_left = left
        if left > 0:
            self.body_done = self.loop.create_future()
            self.flow.resume_reading()
            await self.body_done
        return True

    def data_received(self, data: bytes) -> None:
        if self.body_left is None:
            super().data_received(data)
            return
        self.body_left -= len(data)  # anything past the body (a pipelined request) is dropped too: we close
        if self.body_left <= 0 and self.body_done is not None and not self.body_done.done():
            self.body_done.set_result(None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()  # the next request on a kept-alive connection gets the same deadline

    def connection_lost(self, exc) -> None:
        self.open_conns.pop(self, None)
        if self.body_done is not None and not self.body_done.done():
            self.body_done.set_result(None)  # the client left: the response goes nowhere
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)
