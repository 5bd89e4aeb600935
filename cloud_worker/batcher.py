"""The cloud worker's request queue: session messages in arrival order, and the rules that form a VERIFY batch.

Pure (no sockets, no asyncio): `CloudWorker` pushes every decoded edge message here and asks for batches.

Rules:
- A session's messages are handled in arrival order. OPEN / CLOSE / RESAMPLE (and ready-made ERROR replies)
  are handed to the caller as they come up; VERIFYs join the batch. A second message of a session that is
  already in the batch waits for the next batch (it depends on the first one's outcome), and so does a VERIFY
  of a session that is not `ready` (its prompt is still being prefilled) — with every later message of that
  session; other sessions' messages behind them go ahead. A CLOSE is the exception: it drops its session's
  held messages and goes at once, so a worker never keeps prefilling for an edge that gave up.
- At most `max_batch` VERIFYs per batch, and at most `max_control` other messages handled per `take` (then
  `stopped_early` is set and the caller yields to the event loop, so heartbeats and /healthz keep time under a
  flood of control messages).
- Waiting for more requests is worth it only while some other recently active session may still send one;
  with a single active session a batch goes at once. Never longer than `max_wait` after the oldest request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass

from ..common import protocol as P
from ..common.protocol import SessionKey


@dataclass
class Item:
    """One edge message: its session key (peer, session), the decoded message, when, on which connection.
    Every rule here that says "session" means the key: an edge's session id is unique per edge only."""

    key: SessionKey
    msg: P.Base          # Open | Verify | Close | Resample, or a ready-made Error reply
    arrived: float       # monotonic seconds
    generation: int = 0  # the broker connection it came in on

    @property
    def peer(self) -> bytes:
        return self.key[0]

    @property
    def is_verify(self) -> bool:
        return isinstance(self.msg, P.Verify)


class Batcher:
    def __init__(self, max_batch: int, max_wait_s: float, idle_after_s: float, max_control: int = 64) -> None:
        self.max_batch, self.max_wait_s, self.idle_after_s = max_batch, max_wait_s, idle_after_s
        self.max_control = max_control
        self.stopped_early = False  # the last `take` left messages queued after max_control control messages
        self.queue: deque[Item] = deque()
        self.last_seen: dict[SessionKey, float] = {}  # session -> arrival of its latest message

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, item: Item) -> None:
        self.queue.append(item)
        if not isinstance(item.msg, P.Error):  # a malformed message proves nothing about a session
            self.last_seen[item.key] = item.arrived

    def take(self, batch: list[Item], control: Callable[[Item], None],
             ready: Callable[[SessionKey], bool] = lambda key: True) -> bool:
        """Move queued VERIFYs into `batch` and pass every other message to `control`, in arrival order per
        session. Messages of a session whose earlier message must wait stay queued, in order. Returns True
        when a queued message waits for this batch (its session is already in it)."""
        in_batch = {item.key for item in batch}
        held: set[SessionKey] = set()
        kept: deque[Item] = deque()
        waits_for_batch = False
        handled = 0
        while self.queue and len(batch) < self.max_batch and handled < self.max_control:
            item = self.queue.popleft()
            if isinstance(item.msg, P.Close) and item.key in held and item.key not in in_batch:
                kept = deque(i for i in kept if i.key != item.key)  # the edge gave up: its held work goes
                held.discard(item.key)
            if item.key in in_batch or item.key in held or (item.is_verify and not ready(item.key)):
                waits_for_batch = waits_for_batch or item.key in in_batch
                held.add(item.key)
                kept.append(item)
            elif item.is_verify:
                batch.append(item)
                in_batch.add(item.key)
            else:
                control(item)
                handled += 1
        self.stopped_early = handled >= self.max_control and bool(self.queue)
        self.queue.extendleft(reversed(kept))
        return waits_for_batch

    def wait_budget(self, batch: list[Item], now: float, is_open: Container[SessionKey]) -> float:
        """Seconds worth waiting for more VERIFYs before running `batch` (0: run it now)."""
        if not batch or len(batch) >= self.max_batch:
            return 0.0
        left = batch[0].arrived + self.max_wait_s - now
        if left <= 0:
            return 0.0
        self._prune(now, is_open)
        in_batch = {item.key for item in batch}
        # sessions that could plausibly send a VERIFY soon: open here, recently active, not already batched
        others = sum(1 for sid in self.last_seen if sid not in in_batch)
        return left if others else 0.0

    def _prune(self, now: float, is_open: Container[SessionKey]) -> None:
        for sid in [s for s, t in self.last_seen.items() if now - t > self.idle_after_s or s not in is_open]:
            del self.last_seen[sid]

    def forget(self, key: SessionKey) -> None:
        self.last_seen.pop(key, None)

    def drop_before(self, generation: int) -> list[Item]:
        """Remove (and return) messages that came in on an older broker connection."""
        stale = [item for item in self.queue if item.generation < generation]
        if stale:
            self.queue = deque(item for item in self.queue if item.generation >= generation)
        self.last_seen.clear()
        return stale
