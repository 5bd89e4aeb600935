"""The edge's pure core for one generation: draft a block, send VERIFY, apply the VERDICT, repeat.

No sockets: the caller sends whatever `next_request()` returns and feeds the reply to `apply()`.
The session knows which committed tokens the cloud already holds (`cloud_len`), so a token the edge drew
itself after a rejection travels once, as the `tail` of the next VERIFY; on a retry
`open_message()` carries the whole history and the cloud re-prefills from it (after UNKNOWN_SESSION,
WORKER_LOST or a timeout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common import protocol as P
from ..common.errors import ErrorCode, InvalidRequest, from_wire
from ..common.protocol import DEFAULT_SAMPLED_MODE, DEFAULT_STRATEGY, Mode, Strategy
from ..common.resample import Rejection
from ..common.sampling import SamplingParams
from .drafter import DraftBlock, Drafter, DraftJob

AUTO_START, AUTO_MIN, AUTO_MAX = 6, 1, 16  # auto draft length: +2 after a fully accepted block, -1 otherwise


@dataclass(frozen=True)
class SessionConfig:
    max_new_tokens: int = 64
    params: SamplingParams = SamplingParams()
    mode: Mode | None = None      # None = GREEDY at temperature 0, else DEFAULT_SAMPLED_MODE (names accepted)
    seed: int = 0
    draft_len: int | None = None  # None = auto
    resample: Strategy = DEFAULT_STRATEGY

    def resolved_mode(self) -> Mode:
        if self.params.greedy:
            if self.mode not in (None, Mode.GREEDY):
                raise InvalidRequest(f"mode {self.mode.name} needs temperature > 0", field="mode")
            return Mode.GREEDY
        if self.mode == Mode.GREEDY:
            raise InvalidRequest("mode GREEDY needs temperature 0", field="mode")
        return self.mode or DEFAULT_SAMPLED_MODE

    def __post_init__(self) -> None:
        object.__setattr__(self, "resample", P.enum_value(Strategy, self.resample, "resample"))
        object.__setattr__(self, "mode", P.enum_value(Mode, self.mode, "mode"))
        if self.draft_len is not None and not 0 <= self.draft_len <= P.MAX_DRAFT:
            raise InvalidRequest(f"draft_len must be in [0, {P.MAX_DRAFT}] or auto", field="draft_len")
        if self.max_new_tokens < 1:
            raise InvalidRequest("max_new_tokens must be >= 1", field="max_new_tokens")


@dataclass
class SessionStats:
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    cloud_calls: int = 0
    resample_calls: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    reopens: int = 0


@dataclass
class EdgeSession:
    prompt_ids: list[int]
    config: SessionConfig
    drafter: Drafter
    sid: int = 1
    stats: SessionStats = field(default_factory=SessionStats)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise InvalidRequest("the prompt must hold at least one token", field="prompt")
        self.mode = self.config.resolved_mode()
        self.tokens = list(self.prompt_ids)      # committed: prompt + generated (target ids)
        self.generated: list[int] = []
        self.cloud_len = 0                       # how many of self.tokens the cloud holds
        self.seq = 0
        self.done = False
        self.draft_len = self.config.draft_len if self.config.draft_len is not None else AUTO_START
        self.state = self.drafter.new_state(self.prompt_ids)
        self._block = None
        self._rejection: Rejection | None = None
        self._pending: P.Resample | None = None

    # ---------------------------------------------------------------------------- requests
    def open_message(self) -> P.Open:
        """OPEN with the whole committed context (also the re-prefill on a retry)."""
        c = self.config
        self.cloud_len = len(self.tokens)
        self._rejection = self._pending = None
        return P.Open(self.sid, list(self.tokens), self.mode, c.params.temperature, c.params.top_k,
                      c.params.top_p, c.seed, c.resample, self.drafter.shared_bitmap(),
                      self.drafter.target_vocab_size)

    def next_request(self) -> P.Verify | P.Resample:
        """The next message to send: a pending RESAMPLE, or a VERIFY for a freshly drafted block."""
        job = self.draft_job()
        return self._pending if job is None else self.request_for(self.drafter.draft_batch([job])[0])

    def draft_job(self) -> DraftJob | None:
        """What to draft next (None while a RESAMPLE is pending); an edge batches these across sessions."""
        if self._pending is not None:
            return None
        remaining = self.config.max_new_tokens - len(self.generated)
        d = max(0, min(self.draft_len, remaining - 1))
        c = self.config
        context = self.drafter.draft_context(self.state, self.tokens)
        return DraftJob(self.state, context, len(self.tokens), d, self.mode, c.params, c.seed)

    def request_for(self, block: DraftBlock) -> P.Verify:
        self._block = block
        self.seq += 1
        self.stats.draft_tokens += len(self._block.ids)
        return P.Verify(self.sid, self.seq, len(self.tokens), self.tokens[self.cloud_len:], self._block.ids,
                        P.f32(self._block.q_tok) if self.mode == Mode.SAMPLE else b"")

    # ---------------------------------------------------------------------------- replies
    def apply(self, reply: P.Base) -> list[int]:
        """Apply a VERDICT / RESAMPLED / ERROR; returns the newly committed generated tokens."""
        if isinstance(reply, P.Error):
            if reply.code == ErrorCode.UNKNOWN_SESSION:
                self.stats.reopens += 1
            raise from_wire(reply.code, reply.message)
        if isinstance(reply, P.Resampled):
            return self._resolve(self._rejection.step(reply))
        if not isinstance(reply, P.Verdict) or reply.seq != self.seq:
            raise InvalidRequest(f"unexpected reply {type(reply).__name__} (seq {getattr(reply, 'seq', '?')}, "
                                 f"waiting for {self.seq})", field="seq")
        return self._apply_verdict(reply)

    def _apply_verdict(self, v: P.Verdict) -> list[int]:
        block, n = self._block, v.n_accepted
        if n > len(block.ids):
            raise InvalidRequest(f"n_accepted {n} exceeds the draft length {len(block.ids)}", field="n_accepted")
        self.stats.cloud_calls += 1
        self.stats.accepted_tokens += n
        if self.config.draft_len is None:
            self.draft_len = min(AUTO_MAX, self.draft_len + 2) if n == len(block.ids) else max(AUTO_MIN, self.draft_len - 1)
        start = len(self.generated)
        self._commit(block.ids[:n])
        if v.next_token >= 0:
            self._commit([v.next_token])
            self.cloud_len = len(self.tokens) if not self.done else self.cloud_len
        elif not self.done:  # sample-mode rejection: the edge, holding q', finishes the draw
            self.cloud_len = len(self.tokens)
            self._rejection = Rejection(block.q_rows[n], self.drafter.shared_mask, self.config.seed,
                                        len(self.tokens), v.seq, self.sid, self.config.resample)
            self._resolve(self._rejection.step(v))
        return self.generated[start:]

    def _resolve(self, outcome) -> list[int]:
        if isinstance(outcome, P.Resample):
            self._pending = outcome
            self.stats.resample_calls += 1
            return []
        self._pending = self._rejection = None
        start = len(self.generated)
        self._commit([outcome])
        return self.generated[start:]

    def _commit(self, ids: list[int]) -> None:
        for t in ids:
            if self.done:
                return
            self.tokens.append(t)
            self.generated.append(t)
            self.stats.generated_tokens += 1
            if t in self.drafter.eos_ids or len(self.generated) >= self.config.max_new_tokens:
                self.done = True

    def close_message(self) -> P.Close:
        return P.Close(self.sid)
