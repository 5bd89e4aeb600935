"""The edge's scheduler: alone decides which sessions draft, pre-draft, resample or wait in the next lockstep step.

Pure (no model, no sockets, no asyncio), beside the cloud's cloud_worker/scheduler.py. Its callers describe each
session as a `SessionView` and run the `Actions` that `EdgeScheduler.step` returns: the edge's draft thread
(edge_worker/draft/batcher.py) for the sessions of an `EdgeWorker`, and the in-process reference's lockstep loop
(specrelay/speculative.py). What to draft (the length or the tree shape) stays the draft policy's
(edge_worker/policy): a view only says whether a session has a draft job waiting, a RESAMPLE pending, a VERIFY in
flight (with a pre-draft that may go on) or is done.

Rules:
- A session with a RESAMPLE pending sends it and drafts nothing (the resample decides its next token first).
- The sessions ready to draft form one lockstep batch, in the order given, at most `max_batch` of them; the rest
  wait for the next step.
- Pre-drafts have the lowest priority: they run only in a step where no session waits to draft, one chunk each,
  at most `max_batch` of them, so a real draft waits for at most one chunk.
- A session in flight is never drafted (only its pre-draft advances, if it has one); done sessions are dropped
  (a finished pre-draft is shown as DONE).
- While a chain batch drafts, a session that becomes ready joins it at its next step (`join`), up to `max_batch`
  rows, if it can: its draft K/V are already held (not a prompt's first catch-up, which would widen every row's
  step to the prompt) and it drafts a chain. None joins while a ready session that cannot join waits: joins keep
  a batch going, and that session waits for the batch to end.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum


class Phase(Enum):
    READY = "ready"          # a draft job waits (its shape already chosen by the draft policy)
    RESAMPLE = "resample"    # a RESAMPLE is pending: it goes before any draft of this session
    IN_FLIGHT = "in_flight"  # a VERIFY is out: only a pre-draft of its outcome may run
    DONE = "done"            # the generation ended (or its draft request was given up)


@dataclass(frozen=True)
class SessionView:
    key: Hashable            # the caller's handle for the session (or for its queued job)
    phase: Phase
    predraft: bool = False   # IN_FLIGHT only: a pre-draft that may go on (budget left, not stopped)
    joinable: bool = False   # READY only: its job may join a chain batch under way (see `EdgeScheduler.join`)


@dataclass
class Actions:
    draft: list = field(default_factory=list)      # keys of one lockstep draft batch
    predraft: list = field(default_factory=list)   # keys whose pre-draft advances one chunk (one lockstep batch)
    resample: list = field(default_factory=list)   # keys that send their pending RESAMPLE
    wait: list = field(default_factory=list)       # keys left for a later step (in flight, or past the batch)
    dropped: list = field(default_factory=list)    # keys the caller forgets (done, or nothing left to pre-draft)


class EdgeScheduler:
    def __init__(self, max_batch: int | None = None) -> None:
        self.max_batch = max_batch  # None: every ready session in one batch (the in-process reference)

    def step(self, views: Sequence[SessionView]) -> Actions:
        """The next lockstep step for `views` (see the module's rules)."""
        out = Actions()
        limit = len(views) if self.max_batch is None else self.max_batch
        ready = [v.key for v in views if v.phase is Phase.READY]
        out.draft, late = ready[:limit], ready[limit:]
        for v in views:
            if v.phase is Phase.RESAMPLE:
                out.resample.append(v.key)
            elif v.phase is Phase.DONE:
                out.dropped.append(v.key)
            elif v.phase is Phase.IN_FLIGHT and not v.predraft:
                out.wait.append(v.key)  # its VERDICT is awaited
        flying = [v.key for v in views if v.phase is Phase.IN_FLIGHT and v.predraft]
        if not ready:
            out.predraft, flying = flying[:limit], flying[limit:]
        out.wait += late + flying
        return out

    def join(self, views: Sequence[SessionView], running: int) -> list:
        """Keys of the READY sessions that join a chain batch of `running` rows at its next step (the rules)."""
        ready = [v for v in views if v.phase is Phase.READY]
        if any(not v.joinable for v in ready):
            return []
        room = len(ready) if self.max_batch is None else self.max_batch - running
        return [v.key for v in ready[:max(0, room)]]
