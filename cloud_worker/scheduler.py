"""The cloud worker's scheduler: alone decides which VERIFYs and which prompt chunks go into the next forward pass.

Pure (no sockets, no asyncio; the clock is an argument), like vLLM's `Scheduler`. `CloudWorker` pushes every
decoded edge message here and asks `plan(now, control)` what to do next. The `Plan` says: run this `Step` (the
VERIFYs and the prefill chunks of one forward, handed whole to `Verifier.verify`); or give the event loop a turn;
or wait for a request, at most so long. OPEN / CLOSE / RESAMPLE (and ready-made ERROR replies) go to `control`
as they come up, so each is applied before the steps that follow it.

Rules:
- A session's messages are handled in arrival order. A second message of a session that is already in the step
  waits for the next one (it depends on the first one's outcome), and so does a VERIFY of a session that is not
  ready (below), with every later message of that session; other sessions' messages behind them go ahead. A
  CLOSE is the exception: it drops its session's held messages and goes at once, so a worker never keeps
  prefilling for an edge that gave up.
- At most `max_batch` VERIFYs and `max_step_tokens` of their new tokens per step (a tree's nodes count as tokens,
  like vLLM's max_num_batched_tokens), and at most MAX_CONTROL other messages handled per plan (then the
  plan yields to the event loop, so heartbeats and /healthz keep time under a flood of control messages).
- Fair across clients (a client: `protocol.client_of`, the broker's index and the client it named, an edge's
  CURVE key or else its connection): while several clients are active lately (heard within idle_after_s), each
  client's VERIFYs take at most max_step_tokens / (those clients) of a step, its first VERIFY always fits, and
  the rest wait for the next step, even if the others leave their part unused. So a step under one client's
  flood of trees holds its part only (one 64-node tree beside one other client), and another client's VERIFY
  waits at most for such a step to end before its own goes: on a CPU, where a step's time grows with its tokens,
  that bounds its round trip; a client alone gets the whole step. A step of clients past their share only is
  held back (at most as long as the last step took, or `max_wait_ms`) for a session of another client answered in
  the last step, while that client has run fewer tokens lately (`_ran`, differences only): its next VERIFY, drafted
  meanwhile, then goes alone first instead of arriving just after a flood's step began and waiting all of it (a
  legit chain beside a tree flood: about one short step a round, not a tree's step and its own; the flood still
  gets its part of the tokens).
- Chunked prefill: a session is ready when what of its context the KV store does not hold fits in
  `prefill_tokens`. Each step carries up to `prefill_tokens` of the contexts not ready: an equal part per
  client with a context pending (its oldest session first), the rest oldest first; each chunk leaves one token
  uncached, so the session's first VERIFY row computes the logits after its context. While a prompt is being
  prefilled a step goes at once, with the VERIFYs that are ready.
- Waiting for more VERIFYs is worth it only while some other recently active session may still send one; with a
  single active session a step goes at once. Never longer than `max_wait_ms` after the oldest VERIFY.
- Each request carries the broker connection it came in on (`Item.conn`): `drop(conns)` forgets the requests of
  connections that are gone and nothing of the others, so one worker may serve several.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..common import protocol as P
from ..common.protocol import SessionKey
from .attention import Row
from .config import SchedulerConfig

MAX_CONTROL = 64  # control messages handled per plan before the event loop gets a turn


@dataclass
class Item:
    """One edge message: its session key (peer, session), the decoded message, when, and on which broker
    connection. Every rule here that says "session" means the key: an edge's session id is unique per edge only."""

    key: SessionKey
    msg: P.Base          # Open | Verify | Close | Resample, or a ready-made Error reply
    arrived: float       # monotonic seconds
    conn: Hashable = 0   # the broker connection it came in on; its replies go back on that one only

    @property
    def peer(self) -> bytes:
        return self.key[0]

    @property
    def client(self) -> bytes:
        """Whose share it counts against: the broker and the client it named (protocol.client_of)."""
        return P.client_of(self.key[0])

    @property
    def is_verify(self) -> bool:
        return isinstance(self.msg, P.Verify)

    @property
    def tokens(self) -> int:
        """New tokens a VERIFY puts in a step: its tail, its draft (or tree nodes) and the row after them."""
        return len(self.msg.tail) + len(self.msg.draft) + 1


@dataclass
class Step:
    """One forward pass: VERIFYs (at most one per session) and prompt chunks of sessions not ready yet."""

    verifies: list[Item] = field(default_factory=list)
    prefill: list[Row] = field(default_factory=list)

    @property
    def requests(self) -> list[tuple[SessionKey, P.Verify]]:
        return [(item.key, item.msg) for item in self.verifies]


@dataclass
class Plan:
    """What the shell does next: run `step`; else, if `yield_first`, give the event loop one turn and plan again;
    else wait until a request arrives, at most `wait` seconds (None: no limit), and plan again."""

    step: Step | None = None
    wait: float | None = None
    yield_first: bool = False


class Contexts(Protocol):
    """What the scheduler reads of the Verifier: the open sessions, least recently used first, each with its
    context `tokens`; and how many tokens of a session's context the KV store holds."""

    sessions: Mapping[SessionKey, Any]

    def cached(self, key: SessionKey) -> int: ...


class ChunkedPrefill:
    """Which contexts are still being prefilled, `tokens` per forward pass, and their next chunks."""

    def __init__(self, contexts: Contexts, tokens: int) -> None:
        self.contexts, self.tokens = contexts, tokens

    def ready(self, key: SessionKey) -> bool:
        """A VERIFY of this session may join a step: what is not cached yet fits in one chunk."""
        s = self.contexts.sessions.get(key)
        return s is None or len(s.tokens) - self.contexts.cached(key) <= self.tokens

    @property
    def pending(self) -> bool:
        return any(not self.ready(key) for key in self.contexts.sessions)

    def rows(self, exclude: Collection[SessionKey] = ()) -> list[Row]:
        """Chunks of the contexts not ready, `tokens` in all: first an equal part per client (its oldest sessions
        first), then what is left oldest session first; each leaves at least one token uncached, so the
        session's first VERIFY row computes the logits after its context."""
        pending = [(key, s) for key, s in self.contexts.sessions.items() if key not in exclude and not self.ready(key)]
        if not pending:
            return []
        need = {key: len(s.tokens) - 1 - self.contexts.cached(key) for key, s in pending}
        given: dict[SessionKey, int] = defaultdict(int)
        budget = self.tokens
        share = max(1, budget // len({P.client_of(key[0]) for key, _ in pending}))
        left: dict[bytes, int] = defaultdict(lambda: share)
        for rounds in (left, None):  # per client's share, then the rest
            for key, _ in pending:
                client = P.client_of(key[0])
                n = min(budget, need[key] - given[key], left[client] if rounds is not None else budget)
                if n > 0:
                    given[key] += n
                    budget -= n
                    if rounds is not None:
                        left[client] -= n
        rows = []
        for key, s in pending:
            if given[key]:
                start = self.contexts.cached(key)
                rows.append(Row(key, s.tokens[start:start + given[key]]))
        return rows


class Scheduler:
    def __init__(self, config: SchedulerConfig, contexts: Contexts) -> None:
        self.max_batch, self.max_wait_s = config.max_batch, config.max_wait_ms / 1000
        self.max_step_tokens = config.max_step_tokens
        self.idle_after_s = config.idle_after_s
        self.contexts = contexts
        self.prefill = ChunkedPrefill(contexts, config.prefill_tokens)
        self.queue: deque[Item] = deque()
        self.batch: list[Item] = []                    # the VERIFYs of the step being formed
        self.last_seen: dict[SessionKey, float] = {}   # session -> arrival of its latest message
        self._step_tokens = 0                          # new tokens of the forming step's VERIFYs
        self.queued: Counter = Counter()               # broker connection -> its requests waiting (queue + batch)
        self._client_tokens: dict[bytes, int] = defaultdict(int)  # ... per client (Item.client)
        self._capped_now: set[bytes] = set()   # clients with VERIFYs held by their share from the forming step
        self._capped_last: set[bytes] = set()  # ... from the last step: they sit out a step another client wants
        self._answered: set[SessionKey] = set()  # the sessions of the last step's VERIFYs
        self._since: float | None = None         # the first plan after the last step (about when it ended)
        self._step_at = 0.0                      # when the last step was handed over
        self._ran: dict[bytes, int] = {}         # tokens each active client's VERIFYs ran, less the least of them

    def __len__(self) -> int:
        """Requests waiting: queued, or in the step being formed."""
        return len(self.queue) + len(self.batch)

    def push(self, item: Item) -> None:
        self.queue.append(item)
        self.queued[item.conn] += 1
        if not isinstance(item.msg, P.Error):  # a malformed message proves nothing about a session
            self.last_seen[item.key] = item.arrived
            if len(self.last_seen) > 2 * len(self.contexts.sessions) + 1024:  # keys a peer chose: bounded
                self._prune(item.arrived)

    def plan(self, now: float, control: Callable[[Item], None]) -> Plan:
        """Take queued messages (control ones to `control`), then: the step, a turn for the loop, or a wait."""
        if self._since is None:
            self._since = now
        waits_for_step, flooded = self._take(control)
        if waits_for_step:  # the next message depends on this step's outcome, or is held by its client's share
            hold = self._hold_for_others(now)
            return Plan(wait=hold) if hold > 0 else self._step(now)
        if flooded:
            return Plan(yield_first=True)
        if self.prefill.pending:
            return self._step(now)  # a prompt is being prefilled: a step now, with the VERIFYs that are ready
        if not self.batch:
            return Plan()
        budget = self._wait_budget(now)
        return Plan(wait=budget) if budget > 0 else self._step(now)

    def drop(self, conns: Collection[Hashable]) -> list[Item]:
        """Remove (and return) the requests, queued or in the forming step, that came in on `conns`: broker
        connections that are gone. Requests of other connections stay."""
        stale = [item for item in (*self.batch, *self.queue) if item.conn in conns]
        if stale:
            self.queue = deque(item for item in self.queue if item.conn not in conns)
            self.batch = [item for item in self.batch if item.conn not in conns]
            self._step_tokens = sum(map(self._cost, self.batch))
            self._client_tokens = defaultdict(int)
            for item in self.batch:
                self._client_tokens[item.client] += self._cost(item)
        for item in stale:
            self.last_seen.pop(item.key, None)
        for conn in conns:
            self.queued.pop(conn, None)
        return stale

    def _step(self, now: float) -> Plan:
        batch, self.batch = self.batch, []
        active = {P.client_of(key[0]) for key in self.last_seen}
        ran = {client: self._ran.get(client, 0) + self._client_tokens.get(client, 0) for client in active}
        least = min(ran.values(), default=0)
        self._ran = {client: tokens - least for client, tokens in ran.items()}
        self._step_tokens, self._client_tokens = 0, defaultdict(int)
        self._capped_last, self._capped_now = self._capped_now, set()
        self._answered, self._since, self._step_at = {item.key for item in batch}, None, now
        for item in batch:
            self.queued[item.conn] -= 1
        return Plan(Step(batch, self.prefill.rows(exclude={item.key for item in batch})))

    def _take(self, control: Callable[[Item], None]) -> tuple[bool, bool]:
        """Move queued VERIFYs into the forming step and pass every other message to `control`, in arrival order
        per session; messages of a session whose earlier message must wait stay queued, in order. Returns
        (a queued message waits for this step, MAX_CONTROL messages were handled with more queued)."""
        in_batch = {item.key for item in self.batch}
        held: set[SessionKey] = set()
        kept: deque[Item] = deque()
        capped: list[Item] = []  # VERIFYs past their client's share: they wait for the next step
        deferred: list[Item] = []  # VERIFYs of clients capped in the last step: only if no other client's is ready
        share = self._client_share()
        waits_for_step = False
        handled = 0
        while self.queue and not self._full() and handled < MAX_CONTROL:
            item = self.queue.popleft()
            if isinstance(item.msg, P.Close) and item.key in held and item.key not in in_batch:
                self.queued[item.conn] -= sum(i.key == item.key for i in kept)
                kept = deque(i for i in kept if i.key != item.key)  # the edge gave up: its held work goes
                capped = [i for i in capped if i.key != item.key]
                deferred = [i for i in deferred if i.key != item.key]
                held.discard(item.key)
            if item.key in in_batch or item.key in held or (item.is_verify and not self.prefill.ready(item.key)):
                waits_for_step = waits_for_step or item.key in in_batch
                held.add(item.key)
                kept.append(item)
            elif item.is_verify and (item.client in self._capped_last or not self._fits(item, share)):
                held.add(item.key)
                kept.append(item)
                (deferred if item.client in self._capped_last else capped).append(item)
            elif item.is_verify:
                self._add(item, in_batch)
            else:
                self.queued[item.conn] -= 1
                control(item)
                handled += 1
                if isinstance(item.msg, P.Close):
                    self.last_seen.pop(item.key, None)
        for item in deferred if not self.batch else ():  # no other client's VERIFY is ready: theirs go after all
            if self._fits(item, share):
                self._add(item, in_batch)
                kept.remove(item)
            else:
                capped.append(item)
        self._capped_now.update(item.client for item in capped)
        waits_for_step = waits_for_step or bool(capped or deferred)  # ready, held for the next step: run this one
        flooded = handled >= MAX_CONTROL and bool(self.queue)
        self.queue.extendleft(reversed(kept))
        return waits_for_step, flooded

    def _add(self, item: Item, in_batch: set[SessionKey]) -> None:
        self.batch.append(item)
        in_batch.add(item.key)
        self._step_tokens += self._cost(item)
        self._client_tokens[item.client] += self._cost(item)

    def _cost(self, item: Item) -> int:
        """The tokens a VERIFY's row runs: its own (Item.tokens) and what of its context the KV store lacks past
        the one token every prefill chunk leaves (a session's first VERIFY after its prefill carries up to
        prefill_tokens of context)."""
        s = self.contexts.sessions.get(item.key)
        return item.tokens + (max(0, len(s.tokens) - self.contexts.cached(item.key) - 1) if s is not None else 0)

    def _full(self) -> bool:
        return len(self.batch) >= self.max_batch or self._step_tokens >= self.max_step_tokens

    def _fits(self, item: Item, share: int) -> bool:
        """Within the step's token budget (a first VERIFY always fits) and within its client's share of the step
        (a client's first VERIFY always does)."""
        cost = self._cost(item)
        if self.batch and self._step_tokens + cost > self.max_step_tokens:
            return False
        used = self._client_tokens[item.client]
        return not used or used + cost <= share

    def _client_share(self) -> int:
        """max_step_tokens over the clients active lately (sessions heard within idle_after_s, and this queue's)."""
        clients = {P.client_of(key[0]) for key in self.last_seen} | {item.client for item in self.batch}
        return max(1, self.max_step_tokens // max(1, len(clients)))

    def _wait_budget(self, now: float) -> float:
        """Seconds worth waiting for more VERIFYs before running the forming step (0: run it now)."""
        if not self.batch or self._full():
            return 0.0
        left = self.batch[0].arrived + self.max_wait_s - now
        if left <= 0:
            return 0.0
        self._prune(now)
        in_batch = {item.key for item in self.batch}
        # sessions that could plausibly send a VERIFY soon: open here, recently active, not already batched
        others = sum(1 for key in self.last_seen if key not in in_batch)
        return left if others else 0.0

    def _hold_for_others(self, now: float) -> float:
        """Seconds to hold back a forming step whose clients all have VERIFYs held by their share, for a session
        of another client answered in the last step, not back yet, whose client has run fewer tokens lately than
        each of them (0: run the step now). Held: the step's VERIFYs go back to the queue and their clients sit
        out the step the coming VERIFY forms."""
        clients = {item.client for item in self.batch}
        if not self.batch or not clients <= self._capped_now:
            return 0.0
        left = self._since + max(self.max_wait_s, self._since - self._step_at) - now
        if left <= 0:
            return 0.0
        back = {item.key for item in self.batch} | {item.key for item in self.queue}
        fewest = min(self._ran.get(client, 0) for client in clients)
        if not any(key not in back and key in self.contexts.sessions and P.client_of(key[0]) not in clients
                   and self._ran.get(P.client_of(key[0]), 0) < fewest for key in self._answered):
            return 0.0
        self.queue.extendleft(reversed(self.batch))
        self.batch, self._step_tokens, self._client_tokens = [], 0, defaultdict(int)
        self._capped_last |= clients
        return left

    def _prune(self, now: float) -> None:
        is_open = self.contexts.sessions
        for key in [k for k, t in self.last_seen.items() if now - t > self.idle_after_s or k not in is_open]:
            del self.last_seen[key]
