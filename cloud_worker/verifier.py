"""The cloud's pure core: sessions with their KV caches, and batched verification (requests in, verdicts out).

No sockets here: `cloud_worker.server` moves bytes to and from a `Verifier`. Sessions are keyed by
`SessionKey` = (peer, session), so two edges may both number a session 1. One `verify` call runs ONE forward
pass of the target over every request in the batch (ragged lengths, see `ModelRunner.forward_batch`), then
applies each session's acceptance rule (common/verify.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from ..common import protocol as P
from ..common import resample, verify
from ..common.errors import InvalidRequest, RequestError, UnknownSession
from ..common.protocol import Mode, SessionKey, Strategy
from ..common.rng import Purpose, gumbel, uniform
from ..common.runner import KV, BatchRow, ModelRunner, append_kv
from ..common.sampling import SamplingParams, probs_from_logits

log = structlog.get_logger("specrelay.cloud")


@dataclass
class VerifierConfig:
    max_sessions: int = 1024
    max_cache_bytes: int = 2 << 30   # KV memory cap; least-recently-used sessions are evicted past it


@dataclass
class CloudSession:
    """What the cloud keeps per session: committed target ids, and K/V for the first `cached` of them."""

    key: SessionKey
    tokens: list[int]
    mode: Mode
    params: SamplingParams
    seed: int
    strategy: Strategy
    shared: torch.Tensor | None  # [V_target] bool, None = same vocabulary
    kv: KV | None = None
    cached: int = 0
    last_seq: int = -1
    last_draft: tuple[int, ...] = ()
    last_reply: P.Verdict | None = None
    pending: resample.Pending | None = None  # a sampled rejection awaiting RESAMPLE

    @property
    def sid(self) -> int:
        return self.key[1]

    @property
    def kv_bytes(self) -> int:
        return sum(k.nelement() * k.element_size() * 2 for k, _ in self.kv) if self.kv else 0


@dataclass
class _Work:
    """One admitted VERIFY: its slot in the reply list, its session, the request, and q parsed once."""

    slot: int
    session: CloudSession
    req: P.Verify
    q: torch.Tensor | None  # [d] q(x_i), sample mode only


class Verifier:
    def __init__(self, runner: ModelRunner, config: VerifierConfig | None = None) -> None:
        self.runner = runner
        self.config = config or VerifierConfig()
        self.sessions: OrderedDict[SessionKey, CloudSession] = OrderedDict()  # LRU order: oldest first
        self.stats = {"forward_passes": 0, "evictions": 0}
        self._masks: dict[bytes, torch.Tensor] = {}

    # ------------------------------------------------------------------ session lifecycle
    def open(self, key: SessionKey, msg: P.Open) -> None:
        """Create (or re-prefill) a session. Raises InvalidRequest naming the field."""
        params = SamplingParams(msg.temperature, msg.top_k, msg.top_p)
        if params.greedy != (msg.mode == Mode.GREEDY):
            raise InvalidRequest("mode GREEDY goes with temperature 0 and only with it", field="mode")
        if msg.vocab_size and msg.vocab_size != self.runner.vocab_size:
            raise InvalidRequest(f"vocab_size {msg.vocab_size} does not match the target model's "
                                 f"{self.runner.vocab_size}", field="vocab_size")
        self._check_ids(msg.tokens, "tokens")
        shared = self._shared_mask(msg.shared_vocab)  # validated before the old state is replaced
        self.sessions.pop(key, None)
        self.sessions[key] = CloudSession(key, list(msg.tokens), msg.mode, params, msg.seed, msg.resample, shared)
        while len(self.sessions) > self.config.max_sessions:
            self._evict_oldest()

    def close(self, key: SessionKey) -> None:
        self.sessions.pop(key, None)

    def _shared_mask(self, bitmap: bytes) -> torch.Tensor | None:
        if not bitmap:
            return None
        if bitmap not in self._masks:
            v = self.runner.vocab_size
            if len(bitmap) != (v + 7) // 8:
                raise InvalidRequest(f"shared_vocab bitmap must be {(v + 7) // 8} bytes for a {v}-token target",
                                     field="shared_vocab")
            bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")[:v]
            self._masks[bitmap] = torch.from_numpy(bits.astype(bool))
        return self._masks[bitmap]

    def _check_ids(self, ids: list[int], name: str) -> None:
        v = self.runner.vocab_size
        bad = next((t for t in ids if t >= v), None)
        if bad is not None:
            raise InvalidRequest(f"{name} holds token id {bad}, outside the target vocabulary [0, {v})", field=name)

    def _evict_oldest(self) -> None:
        key, _ = self.sessions.popitem(last=False)
        self.stats["evictions"] += 1
        log.info("session evicted", peer=key[0].hex(), session=key[1])

    def _enforce_memory_cap(self) -> None:
        total = sum(s.kv_bytes for s in self.sessions.values())
        while total > self.config.max_cache_bytes and len(self.sessions) > 1:
            total -= next(iter(self.sessions.values())).kv_bytes
            self._evict_oldest()

    # ------------------------------------------------------------------ verification
    def verify(self, requests: list[tuple[SessionKey, P.Verify]]) -> list[P.Verdict | P.Error]:
        """A batch of VERIFY requests -> one VERDICT or ERROR each, in order, from one forward pass.
        A session may appear once per batch (its K/V is one row)."""
        replies: list[P.Verdict | P.Error | None] = [None] * len(requests)
        work: list[_Work] = []
        for slot, (key, req) in enumerate(requests):
            try:
                item = self._admit(slot, key, req)
            except RequestError as exc:
                replies[slot] = P.Error(req.session, req.seq, exc.code, str(exc))
                continue
            if item is None:  # a retried request: the same answer, nothing re-run
                replies[slot] = self.sessions[key].last_reply
            else:
                work.append(item)
        if work:
            self._run(work, replies)
        self._enforce_memory_cap()
        return replies

    def _run(self, work: list[_Work], replies: list) -> None:
        rows = [BatchRow(w.session.kv, w.session.cached, w.session.tokens[w.session.cached:] + list(w.req.draft))
                for w in work]
        outputs = self.runner.forward_batch(rows)
        self.stats["forward_passes"] += 1
        for w, (logits, new_kv) in zip(work, outputs):
            replies[w.slot] = self._decide(w, logits[-(len(w.req.draft) + 1):], new_kv)

    def _admit(self, slot: int, key: SessionKey, req: P.Verify) -> _Work | None:
        """Check a VERIFY against its session before anything changes; None for a replay of the last one."""
        session = self.sessions.get(key)
        if session is None:
            raise UnknownSession(f"session {req.session} is not held by this worker; re-OPEN it", field="session")
        self.sessions.move_to_end(key)
        if req.seq == session.last_seq and session.last_reply is not None:
            if tuple(req.draft) != session.last_draft:
                raise InvalidRequest(f"seq {req.seq} was already verified with a different draft", field="seq")
            return None
        if len(session.tokens) + len(req.tail) != req.pos:
            raise UnknownSession(f"pos {req.pos} does not match the worker's {len(session.tokens)} committed "
                                 f"tokens plus a tail of {len(req.tail)}; re-OPEN the session", field="pos")
        self._check_ids(req.tail, "tail")
        self._check_ids(req.draft, "draft")
        if req.q and session.mode != Mode.SAMPLE:
            raise InvalidRequest(f"q travels only in SAMPLE mode; session {req.session} is {session.mode.name}",
                                 field="q")
        q = P.from_f32(req.q, len(req.draft), "q") if session.mode == Mode.SAMPLE else None
        session.tokens.extend(req.tail)
        session.pending = None
        return _Work(slot, session, req, q)

    def _decide(self, w: _Work, logits: torch.Tensor, new_kv: KV) -> P.Verdict:
        """logits [d+1, V]: target logits at the d+1 positions after pos-1. Commit and keep the valid K/V."""
        s, req = w.session, w.req
        outcome = self._outcome(s, req, w.q, logits)
        n = outcome.n_accepted
        uncached = len(s.tokens) - s.cached
        s.kv = append_kv(s.kv, new_kv, keep=uncached + n)  # last committed token + accepted drafts
        s.cached += uncached + n
        s.tokens.extend(req.draft[:n])
        if outcome.token is None:  # sampled rejection: the edge, holding q', finishes the draw
            verdict = resample.rejection_verdict(req.session, n, s.pending, s.strategy, s.shared, s.seed)
        else:
            s.tokens.append(outcome.token)
            verdict = P.Verdict(req.session, req.seq, n, outcome.token)
        s.last_seq, s.last_draft, s.last_reply = req.seq, tuple(req.draft), verdict
        return verdict

    def _outcome(self, s: CloudSession, req: P.Verify, q: torch.Tensor | None, logits: torch.Tensor) -> verify.Outcome:
        """The mode's acceptance rule on logits [d+1, V], with the counter-based draws at positions pos..pos+d."""
        draft = torch.tensor(req.draft, dtype=torch.long)  # [d]
        pos, d = req.pos, len(req.draft)
        if s.mode == Mode.GREEDY:
            return verify.greedy(draft, logits)
        if s.mode == Mode.COUPLED:
            logp = probs_from_logits(logits, s.params).log()  # [d+1, V]
            noise = torch.stack([gumbel(s.seed, pos + j, logits.shape[-1]) for j in range(d + 1)])  # [d+1, V]
            return verify.coupled(draft, logp, noise)
        p = probs_from_logits(logits, s.params)  # [d+1, V]
        u = torch.tensor([uniform(s.seed, pos + j, Purpose.ACCEPT) for j in range(d)], dtype=torch.float64)  # [d]
        outcome = verify.sampled(draft, p, q, u, uniform(s.seed, pos + d, Purpose.BONUS))
        if outcome.token is None:
            n = outcome.n_accepted
            s.pending = resample.Pending(req.seq, pos + n, p[n], req.draft[n])
        return outcome

    def resample(self, key: SessionKey, req: P.Resample) -> P.Resampled:
        """HR server-only draw / SR-DV candidate round for the session's pending rejection."""
        s = self.sessions.get(key)
        if s is None:
            raise UnknownSession(f"session {req.session} is not held by this worker", field="session")
        if s.pending is None or s.pending.seq != req.seq:
            raise InvalidRequest(f"session {req.session} has no rejection pending at seq {req.seq}", field="seq")
        return resample.serve_resample(req, s.pending, s.shared, s.seed)
