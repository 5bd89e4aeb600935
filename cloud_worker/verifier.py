"""The cloud's pure core: sessions with their KV caches, and batched verification (requests in, verdicts out).

No sockets here: `cloud_worker.server` moves bytes to and from a `Verifier`. One `verify` call runs ONE
forward pass of the target over every request in the batch (ragged lengths, see
`ModelRunner.forward_batch`), then applies each session's acceptance rule (common.verify).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from ..common import protocol as P
from ..common import resample
from ..common.errors import InvalidRequest, RequestError, UnknownSession
from ..common.rng import Purpose, gumbel, sample_index, uniform
from ..common.runner import KV, BatchRow, ModelRunner, append_kv
from ..common.sampling import MODES, SamplingParams, probs_from_logits
from ..common.verify import verify_coupled, verify_greedy, verify_sampled

log = structlog.get_logger("specrelay.cloud")


@dataclass
class VerifierConfig:
    max_batch: int = 32
    max_sessions: int = 1024
    max_cache_bytes: int = 2 << 30   # KV memory cap; least-recently-used sessions are evicted past it


@dataclass
class CloudSession:
    """What the cloud keeps per session: committed target ids, and K/V for the first `cached` of them."""

    sid: int
    tokens: list[int]
    mode: str
    params: SamplingParams
    seed: int
    resample: str
    shared: torch.Tensor | None  # [V_target] bool, None = same vocabulary
    kv: KV | None = None
    cached: int = 0
    last_seq: int = -1
    last_reply: P.Base | None = None
    pending: dict = field(default_factory=dict)  # rejection awaiting a RESAMPLE: position, p row

    @property
    def kv_bytes(self) -> int:
        return sum(k.nelement() * k.element_size() * 2 for k, _ in self.kv) if self.kv else 0


class Verifier:
    def __init__(self, runner: ModelRunner, config: VerifierConfig | None = None) -> None:
        self.runner = runner
        self.config = config or VerifierConfig()
        self.sessions: OrderedDict[int, CloudSession] = OrderedDict()  # LRU order: oldest first
        self.stats = {"forward_passes": 0, "verified_requests": 0, "evictions": 0, "bad_requests": 0}
        self._masks: dict[bytes, torch.Tensor] = {}

    # ------------------------------------------------------------------ session lifecycle
    def open(self, msg: P.Open) -> None:
        """Create (or re-prefill) a session. Raises InvalidRequest naming the field."""
        if msg.mode not in MODES:
            raise InvalidRequest(f"mode must be one of {MODES}, got {msg.mode!r}", field="mode")
        if msg.resample not in resample.STRATEGIES:
            raise InvalidRequest(f"resample must be one of {resample.STRATEGIES}, got {msg.resample!r}",
                                 field="resample")
        params = SamplingParams(msg.temperature, msg.top_k, msg.top_p)
        if params.greedy != (msg.mode == "greedy"):
            raise InvalidRequest("mode 'greedy' goes with temperature 0 and only with it", field="mode")
        if msg.vocab_size and msg.vocab_size != self.runner.vocab_size:
            raise InvalidRequest(f"vocab_size {msg.vocab_size} does not match the target model's "
                                 f"{self.runner.vocab_size}", field="vocab_size")
        self._check_ids(msg.tokens, "tokens")
        shared = self._shared_mask(msg.shared_vocab)  # validated before the old state is replaced
        self.sessions.pop(msg.session, None)
        self.sessions[msg.session] = CloudSession(msg.session, list(msg.tokens), msg.mode, params, msg.seed,
                                                  msg.resample, shared)
        while len(self.sessions) > self.config.max_sessions:
            self._evict_oldest()

    def close(self, sid: int) -> None:
        self.sessions.pop(sid, None)

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
        sid, _ = self.sessions.popitem(last=False)
        self.stats["evictions"] += 1
        log.info("session evicted", session=sid)

    def _enforce_memory_cap(self) -> None:
        total = sum(s.kv_bytes for s in self.sessions.values())
        while total > self.config.max_cache_bytes and len(self.sessions) > 1:
            oldest = next(iter(self.sessions.values()))
            total -= oldest.kv_bytes
            self._evict_oldest()

    # ------------------------------------------------------------------ verification
    def verify(self, requests: list[P.Verify]) -> list[P.Base]:
        """A batch of VERIFY requests -> one VERDICT or ERROR each, in order, from one forward pass."""
        replies: list[P.Base | None] = [None] * len(requests)
        work: list[tuple[int, CloudSession, P.Verify]] = []
        for i, req in enumerate(requests):
            try:
                session = self._admit(req)
            except RequestError as exc:
                replies[i] = P.Error(req.session, req.seq, exc.code, str(exc))
                self.stats["bad_requests"] += exc.code == "BAD_REQUEST"
                continue
            if session.last_seq == req.seq and session.last_reply is not None:
                replies[i] = session.last_reply  # a retried request: same answer, nothing re-run
            else:
                work.append((i, session, req))
        if work:
            assert len({s.sid for _, s, _ in work}) == len(work), "a session may appear once per batch (one KV)"
            rows = [BatchRow(s.kv, s.cached, s.tokens[s.cached:] + list(r.draft)) for _, s, r in work]
            outputs = self.runner.forward_batch(rows)
            self.stats["forward_passes"] += 1
            self.stats["verified_requests"] += len(work)
            for (i, session, req), (logits, new_kv) in zip(work, outputs):
                replies[i] = self._decide(session, req, logits[-(len(req.draft) + 1):], new_kv)
        self._enforce_memory_cap()
        return replies

    def _admit(self, req: P.Verify) -> CloudSession:
        session = self.sessions.get(req.session)
        if session is None:
            raise UnknownSession(f"session {req.session} is not held by this worker; resend the context",
                                 field="session")
        self.sessions.move_to_end(req.session)
        if req.seq == session.last_seq:
            return session
        if len(session.tokens) + len(req.tail) != req.pos:
            raise UnknownSession(f"pos {req.pos} does not match the worker's {len(session.tokens)} committed "
                                 f"tokens plus a tail of {len(req.tail)}; resend the context", field="pos")
        self._check_ids(req.tail, "tail")
        self._check_ids(req.draft, "draft")
        if session.mode == "sample":
            P.from_f32(req.q, len(req.draft), "q")  # length, finiteness, sign: fail before anything commits
        session.tokens.extend(req.tail)
        session.pending = {}
        return session

    def _decide(self, s: CloudSession, req: P.Verify, logits: torch.Tensor, new_kv: KV) -> P.Verdict:
        """logits [d+1, V]: target logits at the d+1 positions after pos-1. Commit and keep the valid K/V."""
        draft = torch.tensor(req.draft, dtype=torch.long)
        pos, d = req.pos, len(req.draft)
        verdict = P.Verdict(s.sid, req.seq, 0)
        if s.mode == "greedy":
            n, nxt = verify_greedy(draft, logits)
        elif s.mode == "coupled":
            logp = probs_from_logits(logits, s.params).log()
            noise = torch.stack([gumbel(s.seed, pos + j, logits.shape[-1]) for j in range(d + 1)])
            n, nxt = verify_coupled(draft, logp, noise)
        else:
            p = probs_from_logits(logits, s.params)  # [d+1, V]
            q_draft = P.from_f32(req.q, d, "q")
            u = torch.tensor([uniform(s.seed, pos + j, Purpose.ACCEPT) for j in range(d)], dtype=torch.float64)
            n = verify_sampled(draft, p, q_draft, u)
            if n == d:
                nxt = sample_index(p[d], uniform(s.seed, pos + d, Purpose.BONUS))
            else:  # rejected: the edge, which holds q, resolves it from what the strategy sends down
                nxt = -1
                verdict = resample.rejection_verdict(verdict, s, p[n], pos + n)
        uncached = len(s.tokens) - s.cached
        s.kv = append_kv(s.kv, new_kv, keep=uncached + n)  # last committed token + accepted drafts
        s.cached += uncached + n
        s.tokens.extend(req.draft[:n])
        if nxt >= 0:
            s.tokens.append(nxt)
        verdict.n_accepted, verdict.next_token = n, nxt
        s.last_seq, s.last_reply = req.seq, verdict
        return verdict

    def resample_request(self, req: P.Resample) -> P.Resampled:
        """HR server-only draw / SR-DV candidate round for the session's pending rejection."""
        s = self.sessions.get(req.session)
        if s is None:
            raise UnknownSession(f"session {req.session} is not held by this worker", field="session")
        if not s.pending or s.last_seq != req.seq:
            raise InvalidRequest(f"session {req.session} has no rejection pending at seq {req.seq}", field="seq")
        return resample.serve_resample(s, req)
