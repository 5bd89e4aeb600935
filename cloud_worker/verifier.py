"""The cloud's pure core: sessions with their KV, and batched verification (requests in, verdicts out).

No sockets here: `cloud_worker.server` moves bytes to and from a `Verifier`. Sessions are keyed by
`SessionKey` = (peer, session), so two edges may both number a session 1. One `verify` call runs one step that
cloud_worker/scheduler.py chose: ONE forward pass of the target over every VERIFY in it and the prompt chunks of
sessions still being prefilled (`attention.forward_packed`: the new tokens of all sessions packed into one row,
attention reading each session's K/V in place in the `KVStore`), then each session's acceptance rule
(common/verify.py).

Limits: an OPEN longer than the model's context (`max_position_embeddings`) is a BAD_REQUEST naming it; one
that does not fit in the KV store, even after evicting sessions idle for `evict_idle_s`, is UNAVAILABLE
(retry later, or on another worker). A draft that would run past the model's context is verified up to it.
Budgets at OPEN (`_budgets`): a broker (the key's first byte) holds at most 1/brokers of the sessions and KV
slots, a client (the key's peer) client_kv_share of the KV; past one, its own sessions idle for evict_idle_s are
evicted (only idle ones ever are), else UNAVAILABLE. A queued VERIFY keeps its session from idling (`touch`).

Structured outputs (OPEN.constraint): a `Constraint` per session in the target's token space, advanced over
everything the session commits. Every verified row's logits are masked before the acceptance rule (before
temperature / top-k / top-p: an HF logits processor before its warpers), the mask at drafted position i being
the grammar's state after the drafted tokens before it (`masks_along`; a tree: `masks_tree`); the grammar then
rolls back to the accepted prefix and advances over the recovered or bonus token. The target's tokenizer as the
grammar engine sees it (`TokenVocab`) is built once per worker (`grammar_vocab`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog
import torch

from ..common import protocol as P
from ..common import resample, selfcheck, verify
from ..common.constraint import Constraint, TokenVocab, mask_logits
from ..common.errors import ContextFull, FatalError, InvalidRequest, Overloaded, RequestError, UnknownSession
from ..common.packing import from_f32
from ..common.protocol import Mode, SessionKey, Strategy
from ..common.ratelimit import TokenBucket
from ..common.rng import Purpose, gumbel, uniform
from ..common.runner import ModelRunner
from ..common.sampling import SamplingParams, probs_from_logits
from ..common.tree import TreeDraft
from . import treeverify
from .attention import Row, forward_packed, install, self_check
from .bitmaps import BitmapCache
from .config import VerifierConfig
from .kvcache import KVFull, KVStore
from .owncache import OwnCacheStore, announce_fallback, forward_own_cache
from .scoring import Scoring

log = structlog.get_logger("specrelay.cloud")

OPEN_HEADROOM = 64  # token slots reserved beyond the prompt, so the first steps need no move
# RESAMPLEs per session: an honest edge sends at most SRDV_MAX_ROUNDS + 1 per rejected VERIFY (Pending.admit)
RESAMPLE_RATE, RESAMPLE_BURST = 200.0, 4 * (resample.SRDV_MAX_ROUNDS + 1)


@dataclass
class CloudSession:
    """What the cloud keeps per session: committed target ids (its K/V is in the KVStore under `key`)."""

    key: SessionKey
    tokens: list[int]
    mode: Mode
    params: SamplingParams
    seed: int
    strategy: Strategy
    shared: torch.Tensor | None  # [V_target] bool, None = same vocabulary
    used: float = 0.0            # clock time of its last request
    last_seq: int = -1
    last_draft: tuple = ()       # (draft, parents) of the last VERIFY
    last_reply: P.Verdict | None = None
    pending: resample.Pending | None = None  # a sampled rejection awaiting RESAMPLE
    resamples: TokenBucket = field(default_factory=lambda: TokenBucket(RESAMPLE_RATE, RESAMPLE_BURST))
    grammar: Constraint | None = None  # structured outputs: consumed every committed token after the prompt
    scoring: Scoring | None = None  # logprobs / penalties (cloud_worker/scoring.py); None: neither

    @property
    def sid(self) -> int:
        return self.key[1]


@dataclass
class _Work:
    """One admitted VERIFY: its slot in the reply list, its session, the request, the draft that fits the
    model's context (a tree's nodes), q parsed once, and the token tree (None: a chain)."""

    slot: int
    session: CloudSession
    req: P.Verify
    draft: list[int]
    q: torch.Tensor | None  # [d] q(x_i), sample mode only
    tree: TreeDraft | None = None


def use_batched(attention: str, device: torch.device) -> bool:
    """VerifierConfig.attention -> whether the packed forward makes one attention call per layer for the batch."""
    return attention == "batched" or (attention == "auto" and device.type == "cuda")


def check_deterministic_device(deterministic: bool, device: torch.device) -> None:
    """Deterministic numerics are batch-invariant by construction on the CPU, where they are tested; on another
    device nothing has shown it (its kernels pick algorithms of their own): refuse in one line."""
    if deterministic and device.type != "cpu":
        raise FatalError(f"--deterministic runs on the cpu only (its batch invariance is not verified on "
                         f"{device.type}); serve on {device.type} without --deterministic")


class Verifier:
    def __init__(self, runner: ModelRunner, config: VerifierConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.config = c = config or VerifierConfig()
        self.clock = clock
        self.max_context = runner.max_context or P.MAX_CONTEXT
        shape = runner.kv_shape
        budget = min(c.max_cache_bytes, c.max_sessions * (self.max_context + OPEN_HEADROOM) * shape.bytes_per_token)
        # deterministic attention reads key blocks of `block` tokens: fewer, larger blocks cost less
        packed = install(runner.model)  # False: no AttentionInterface; the model's own cache serves (owncache.py)
        if not packed:
            announce_fallback(runner.model, c.deterministic)
        store, self._forward = (KVStore, forward_packed) if packed else (OwnCacheStore, forward_own_cache)
        block = 128 if c.deterministic else 32
        check_deterministic_device(c.deterministic, runner.device)
        batched = packed and use_batched(c.attention, runner.device)
        self._path = {"batched": True} if batched else {}  # forward_packed's attention path
        self.attention = "batched" if batched else "per-session" if packed else "own cache"
        # before READY: an attention feature the path does not reproduce fails here, in one line
        self_check(runner.model, store(shape, 256, runner.device, block), c.deterministic, self._forward,
                   batched=batched)
        self.store = store.from_budget(shape, budget, runner.device, block=block)
        self.store.zero_reserved = c.deterministic  # only deterministic attention reads past a span's length
        self.sessions: OrderedDict[SessionKey, CloudSession] = OrderedDict()  # LRU order: oldest first
        self.stats = {"forward_passes": 0, "evictions": 0, "prefill_tokens": 0, "forward_tokens": 0,
                      "budget_refusals": 0}
        self.brokers = 1  # broker connections sharing this worker (the shell sets it): each gets 1 / brokers
        self.bitmaps = BitmapCache(runner.vocab_size, clock)  # shared-vocabulary masks by hash (bitmaps.py)
        self._grammar_vocab: TokenVocab | None = None  # `grammar_vocab`: about 1 s per 100k tokens, built once
        self._grammar_lock = threading.Lock()
        curve = self.cost_curve()
        self.curve_us = [round(1e6 * t) for t in curve]  # the load hint's curve and slope (edge_worker/policy)
        w = P.CURVE_WIDTHS
        self.token_us = round(1e6 * max(0.0, (curve[1] - curve[0]) / (w[1] - w[0]))) if curve else 0

    def cost_curve(self, repeats: int = 3) -> list[float]:
        """Seconds of a VERIFY of each of P.CURVE_WIDTHS tokens on a scratch session (the packed forward, the output
        head and the acceptance rule of each row), the fastest of `repeats` after one (a shape's first forward is
        slow; load from other processes only adds). Measured once, before READY: the edge's rows keep a few widths,
        and on a CPU the cost is not a line in the tokens (docs/policy.md). [] where the store cannot hold it."""
        key, probe, top = (b"", -1), selfcheck.probe(self.runner.vocab_size)[0], max(P.CURVE_WIDTHS)
        ids = (probe * (1 + top // len(probe)))[:top + 8]
        if top + 8 > self.max_context:
            return []
        seq = 0

        def timed(n: int) -> float:  # the scratch session reopened on 8 tokens: each VERIFY after the same context
            nonlocal seq
            self.open(key, P.Open(0, ids[:8]))
            seq += 1
            t0 = time.perf_counter()
            self.verify([(key, P.Verify(0, seq, 8, [], ids[8:8 + n - 1]))])
            return time.perf_counter() - t0

        try:
            return [min(timed(n) for _ in range(1 + repeats)) for n in P.CURVE_WIDTHS]
        except RequestError:  # a KV store too small for the scratch session: no curve to send (the edge's is a line)
            return []
        finally:
            self.close(key)
            self.stats.update(forward_passes=0, prefill_tokens=0, forward_tokens=0)

    # ------------------------------------------------------------------ session lifecycle
    def open(self, key: SessionKey, msg: P.Open) -> None:
        """Create (or re-prefill) a session: checked, then admitted if its context fits in the KV store.
        Raises InvalidRequest naming the field, or KVFull (UNAVAILABLE)."""
        params = SamplingParams(msg.temperature, msg.top_k, msg.top_p)
        if params.greedy != (msg.mode == Mode.GREEDY):
            raise InvalidRequest("mode GREEDY goes with temperature 0 and only with it", field="mode")
        if msg.vocab_size and msg.vocab_size != self.runner.vocab_size:
            raise InvalidRequest(f"vocab_size {msg.vocab_size} does not match the target model's "
                                 f"{self.runner.vocab_size}: the draft has another tokenizer; start the edge with "
                                 "--target-tokenizer TARGET_DIR (the target model's directory)", field="vocab_size")
        if len(msg.tokens) > self.max_context:
            raise InvalidRequest(f"the context has {len(msg.tokens)} tokens; the target model {self.runner.name} "
                                 f"takes at most {self.max_context} (max_position_embeddings)", field="tokens")
        self._check_ids(msg.tokens, "tokens")
        shared = self.bitmaps.mask(msg.shared_vocab, msg.shared_vocab_hash)
        scoring = Scoring.of(msg, self.runner.vocab_size)
        need = self.store.round_up(len(msg.tokens) + OPEN_HEADROOM)
        if need > self.store.capacity:
            raise InvalidRequest(f"the context has {len(msg.tokens)} tokens; this worker's KV store holds "
                                 f"{self.store.capacity}", field="tokens")
        grammar = self._grammar(msg)
        self._budgets(key, need)
        scored = scoring is not None and scoring.prompt_rows is not None  # echo: every prompt row is computed
        if scored or not self._keep_prefix(key, msg.tokens, need):  # validated before the old state is replaced
            self._make_room(need)
            self.store.reserve(key, need)
        self.sessions[key] = CloudSession(key, list(msg.tokens), msg.mode, params, msg.seed, msg.resample,
                                          shared, used=self.clock(), grammar=grammar, scoring=scoring)

    def _grammar(self, msg: P.Open) -> Constraint | None:
        """OPEN.constraint compiled against the target's tokenizer, advanced over the generated history (a
        re-OPEN's last `generated` tokens); a spec or history the grammar refuses is an InvalidRequest naming it."""
        if msg.constraint is None:
            return None
        if self._grammar_vocab is None and self._grammar_lock.locked():  # the shell is building it off the loop
            raise Overloaded("the worker is still building its grammar vocabulary; retry in a moment")
        grammar = Constraint(self.grammar_vocab(), msg.constraint)
        history = msg.tokens[len(msg.tokens) - msg.generated:] if msg.generated else []
        if grammar.advance(history) != len(history):
            raise InvalidRequest("the generated tokens are not allowed by the constraint", field="generated")
        return grammar

    def grammar_vocab(self) -> TokenVocab:
        """The target tokenizer as the grammar engine sees it, built once (the shell builds it at start, in its
        executor; in-process users at the first constrained OPEN). InvalidRequest without the engine."""
        with self._grammar_lock:
            if self._grammar_vocab is None:
                self._grammar_vocab = TokenVocab(self.runner.tokenizer, self.runner.vocab_size)
            return self._grammar_vocab

    def _budgets(self, key: SessionKey, need: int) -> None:
        """The budgets of `key`'s broker and client (module docstring); O(sessions) only when a share is contended."""
        broker, client, c = key[0][:1], P.client_of(key[0]), self.config
        of_broker = lambda k: k[0][:1] == broker and k != key  # noqa: E731
        of_client = lambda k: P.client_of(k[0]) == client and k != key  # noqa: E731
        # each share is summed over the sessions only when everyone's holdings together would not fit in it, so
        # an uncontended OPEN costs O(1) (a batch of n OPENs is not O(n^2))
        used = lambda: self.store.capacity - self.store.free_tokens  # noqa: E731
        held = lambda match: sum(self.store.span(k).capacity for k in self.sessions if match(k))  # noqa: E731
        within = lambda match, limit: used() + need <= limit or held(match) + need <= limit  # noqa: E731
        checks = [(of_client, lambda: within(of_client, int(self.store.capacity * c.client_kv_share)),
                   "this client holds its share of the worker's KV store")] * (c.client_kv_share < 1)
        checks += [(of_broker, lambda: within(of_broker, self.store.capacity // self.brokers),
                    "this broker's sessions hold its share of the worker's KV store")] * (self.brokers > 1)
        if key not in self.sessions:
            share = c.max_sessions // self.brokers
            checks += [(of_broker, lambda: len(self.sessions) < share or sum(map(of_broker, self.sessions)) < share,
                        "this broker holds its share of the worker's sessions"),
                       (lambda k: True, lambda: len(self.sessions) < c.max_sessions,
                        "the worker holds its maximum of sessions")]
        for match, fits, refusal in checks:
            if not self._evict_idle(match, fits):
                self.stats["budget_refusals"] += 1
                raise Overloaded(f"{refusal}; retry later")

    def _evict_idle(self, match: Callable[[SessionKey], bool], enough: Callable[[], bool]) -> bool:
        """Evict sessions `match` accepts idle for evict_idle_s, least recently used first, until `enough()`."""
        if enough():  # the common case: nothing to evict, no O(sessions) scan
            return True
        idle = [k for k, s in self.sessions.items() if match(k) and self.idle(s)]
        while idle and not enough():
            self._evict(idle.pop(0))
        return enough()

    def idle(self, session: CloudSession) -> bool:
        return self.clock() - session.used >= self.config.evict_idle_s

    def touch(self, key: SessionKey) -> None:
        if (session := self.sessions.get(key)) is not None:
            session.used = self.clock()

    def _keep_prefix(self, key: SessionKey, tokens: list[int], need: int) -> bool:
        """A re-OPEN (the edge timed out or retried) keeps the K/V its session already holds for the common
        prefix of the old and new contexts, so a finished or half-done prefill is never redone; K/V depends on
        the tokens alone. At least one token stays uncached (the first VERIFY row computes the logits after
        the context). False (and the session closed) when nothing can be kept."""
        old = self.sessions.get(key)
        kept = 0
        if old is not None:
            limit = min(self.cached(key), len(tokens) - 1)
            while kept < limit and old.tokens[kept] == tokens[kept]:
                kept += 1
        if not kept:
            self.close(key)
            return False
        self.sessions.pop(key)
        self.store.truncate(key, kept)
        try:
            self._make_room(max(0, need - self.store.span(key).capacity), busy=frozenset([key]))
            self.store.ensure(key, need)
        except BaseException:
            self.store.free(key)
            raise
        return True

    def close(self, key: SessionKey) -> None:
        self.sessions.pop(key, None)
        self.store.free(key)

    def reset(self) -> None:
        """Forget every session (the broker connection they came on is gone)."""
        self.sessions.clear()
        self.store.clear()

    @property
    def kv_free_tokens(self) -> int:
        return self.store.free_tokens

    def cached(self, key: SessionKey) -> int:
        return self.store.span(key).length

    def _check_ids(self, ids: list[int], name: str) -> None:
        v = self.runner.vocab_size
        bad = next((t for t in ids if t >= v), None)
        if bad is not None:
            raise InvalidRequest(f"{name} holds token id {bad}, outside the target vocabulary [0, {v})", field=name)

    def _evict(self, key: SessionKey) -> None:
        self.close(key)
        self.stats["evictions"] += 1
        log.info("session evicted", peer=key[0].hex(), session=key[1])

    def _make_room(self, tokens: int, busy: frozenset = frozenset()) -> None:
        """Free `tokens` KV slots by evicting sessions idle for evict_idle_s (least recently used first).
        Raises KVFull when that is not enough."""
        if not self._evict_idle(lambda key: key not in busy, lambda: self.store.free_tokens >= tokens):
            raise KVFull(f"the worker's KV memory is full ({self.store.free_tokens} free token slots, {tokens} "
                         "needed); retry later")

    # ------------------------------------------------------------------ verification
    def verify(self, requests: list[tuple[SessionKey, P.Verify]],
               prefill: Sequence[Row] = ()) -> list[P.Verdict | P.Error]:
        """One step: VERIFY requests -> one VERDICT or ERROR each, in order, from one forward pass that also runs
        `prefill`, chunks of contexts still being prefilled (scheduler.ChunkedPrefill). A session appears at most
        once per step, in `requests` or in `prefill`."""
        replies: list[P.Verdict | P.Error | None] = [None] * len(requests)
        work: list[_Work] = []
        busy = frozenset(key for key, _ in requests) | {row.key for row in prefill}  # not evicted while they run
        for slot, (key, req) in enumerate(requests):
            try:
                item = self._admit(slot, key, req, busy)
            except RequestError as exc:
                replies[slot] = P.Error(req.session, req.seq, exc.code, str(exc))
                continue
            if item is None:  # a retried request: the same answer, nothing re-run
                replies[slot] = self.sessions[key].last_reply
            else:
                work.append(item)
        self.stats["prefill_tokens"] += sum(len(row.ids) for row in prefill)
        if work or prefill:
            self._run(work, [self._scored(row) for row in prefill], replies)
        return replies

    def _scored(self, row: Row) -> Row:
        """A prefill chunk of a session scoring its prompt keeps every position's logits."""
        scoring = self.sessions[row.key].scoring if row.key in self.sessions else None
        if scoring is None:
            return row
        return Row(row.key, row.ids, scoring.keep(self.cached(row.key), len(row.ids), row.keep), row.parents)

    def _run(self, work: list[_Work], prefill: list[Row], replies: list) -> None:
        rows = [self._scored(Row(w.session.key, w.session.tokens[self.cached(w.session.key):] + w.draft,
                                 keep=len(w.draft) + 1, parents=w.tree.tree.parents if w.tree else ()))
                for w in work]
        starts = [self.cached(row.key) for row in rows + prefill]  # before the forward appends
        try:
            outputs = self._forward(self.runner.model, self.store, rows + prefill,
                                    deterministic=self.config.deterministic, **self._path)
        except Exception:
            for row in prefill:  # their state is unknown too; the caller drops the batch's sessions
                self.close(row.key)
            raise
        self.stats["forward_passes"] += 1
        self.stats["forward_tokens"] += sum(len(row.ids) for row in rows + prefill)
        for row, start, logits in zip(rows + prefill, starts, outputs):
            if (scoring := self.sessions[row.key].scoring) is not None:
                scoring.take_prompt(self.sessions[row.key].tokens, start, logits)
        for w, logits in zip(work, outputs):
            replies[w.slot] = self._decide(w, logits[-(len(w.draft) + 1):])

    def _admit(self, slot: int, key: SessionKey, req: P.Verify, busy: frozenset) -> _Work | None:
        """Check a VERIFY against its session before anything changes; None for a replay of the last one."""
        session = self.sessions.get(key)
        if session is None:
            raise UnknownSession(f"session {req.session} is not held by this worker; re-OPEN it", field="session")
        self.sessions.move_to_end(key)
        session.used = self.clock()
        if req.seq == session.last_seq and session.last_reply is not None:
            if (tuple(req.draft), tuple(req.parents)) != session.last_draft:
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
        q = from_f32(req.q, len(req.draft), "q") if session.mode == Mode.SAMPLE else None
        room = self.max_context - req.pos  # draft tokens that fit: positions pos-1+d <= max_context-1
        if room < 0:
            raise ContextFull(f"session {req.session} has {req.pos} tokens, past the target model's context "
                              f"of {self.max_context} (max_position_embeddings)", field="pos")
        tree = treeverify.admit(req, session.mode, self.runner.vocab_size, room, self._forward is forward_packed)
        if tree is not None and session.scoring is not None:
            raise InvalidRequest("token trees are not verified for a session with logprobs or penalties: send "
                                 "parents = []", field="parents")
        draft = list(req.draft[:room]) if tree is None else list(tree.tree.tokens)
        if q is not None:
            q = q[:len(draft)] if tree is None else q[tree.kept]
        span = self.store.span(key)
        need = req.pos + len(draft)
        if need > span.capacity:
            self._make_room(self.store.round_up(need) - span.capacity, busy=busy)
            self.store.ensure(key, need)
        if session.grammar is not None and not session.grammar.is_terminated():
            if (got := session.grammar.advance(req.tail)) != len(req.tail):
                session.grammar.rollback(got)
                raise InvalidRequest("the tail holds a token the session's constraint does not allow", field="tail")
        session.tokens.extend(req.tail)
        session.pending = None
        return _Work(slot, session, req, draft, q, tree)

    def _decide(self, w: _Work, logits: torch.Tensor) -> P.Verdict:
        """logits [d+1, V]: target logits at the d+1 positions after pos-1 (a tree: after the last committed
        token and each node). Commit; roll the rest back."""
        s, req = w.session, w.req
        rows = s.scoring.penalise(logits, s.tokens, w.draft) if s.scoring is not None else logits
        allowed = 0
        if s.grammar is not None:  # after the penalties (vLLM's order); logprobs stay the raw logits'
            rows, allowed = self._masked(s.grammar, w, rows)
        outcome = self._outcome(s, req, w.draft, w.q, rows, w.tree)
        n = outcome.n_accepted
        path = range(n) if w.tree is None else w.tree.tree.path(outcome.node)  # accepted drafts
        if s.grammar is not None:
            self._advance_grammar(s.grammar, [w.draft[i] for i in path], allowed - n if w.tree is None else None,
                                  outcome.token)
        self.store.keep(s.key, len(s.tokens), path)  # last committed token + the path stay cached; the rest goes
        s.tokens.extend(w.draft[i] for i in path)
        if outcome.token is None:  # sampled rejection: the edge, holding q', finishes the draw
            verdict = resample.rejection_verdict(req.session, n, s.pending, s.strategy, s.shared, s.seed)
        else:
            s.tokens.append(outcome.token)
            verdict = P.Verdict(req.session, req.seq, n, outcome.token)
        if w.tree is not None:
            verdict.node = w.tree.original(outcome.node)
        if s.scoring is not None:
            s.scoring.fill(verdict, logits, [w.draft[i] for i in path] + [outcome.token] * (outcome.token is not None))
        s.last_seq, s.last_draft, s.last_reply = req.seq, (tuple(req.draft), tuple(req.parents)), verdict
        return verdict

    @staticmethod
    def _masked(grammar: Constraint, w: _Work, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
        """logits [d+1, V] -> float32 logits with what the grammar refuses at each row at -inf, and how many
        drafted tokens (a chain's) the grammar allowed: it is left advanced over them (a tree's: at the root)."""
        if w.tree is not None:
            masks, _ = grammar.masks_tree(w.tree.tree.tokens, w.tree.tree.parents)  # [n+1, V]
            return mask_logits(logits, masks), 0
        masks, m = grammar.masks_along(w.draft)  # [m+1, V]; rows past m are never reached: x_m is refused
        masks = torch.cat([masks, masks[-1:].expand(logits.shape[0] - masks.shape[0], -1)])
        return mask_logits(logits, masks), m

    @staticmethod
    def _advance_grammar(grammar: Constraint, path: list[int], extra: int | None, token: int | None) -> None:
        """After the verdict: the grammar holds the accepted drafts and the recovered or bonus token. extra: the
        allowed drafts past the accepted ones a chain's masks consumed (None: a tree's masks left it at the root)."""
        if extra is None:  # a refused node has p = 0 and is never accepted; past an accepted EOS nothing counts
            if grammar.advance(path) != len(path) and not grammar.is_terminated():
                raise RuntimeError("an accepted draft token is refused by the constraint")
        else:  # extra < 0: drafts past an accepted EOS (only a hostile edge sends them), nothing to undo
            grammar.rollback(max(0, extra))
        if token is not None and not grammar.is_terminated() and grammar.advance([token]) != 1:
            raise RuntimeError("the verified token is refused by the constraint")

    def _outcome(self, s: CloudSession, req: P.Verify, draft_ids: list[int], q: torch.Tensor | None,
                 logits: torch.Tensor, tree: TreeDraft | None = None) -> verify.Outcome | verify.TreeOutcome:
        """The mode's acceptance rule on logits [d+1, V], with the counter-based draws at positions pos..pos+d."""
        if tree is not None:
            outcome, s.pending = treeverify.decide(s, req.seq, req.pos, tree, q, logits)
            return outcome
        draft = torch.tensor(draft_ids, dtype=torch.long)  # [d]
        pos, d = req.pos, len(draft_ids)
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
            s.pending = resample.Pending(req.seq, pos + n, p[n], draft_ids[n])
        return outcome

    def resample(self, key: SessionKey, req: P.Resample) -> P.Resampled:
        """HR server-only draw / SR-DV candidate round for the session's pending rejection."""
        s = self.sessions.get(key)
        if s is None:
            raise UnknownSession(f"session {req.session} is not held by this worker", field="session")
        if not s.resamples.take(self.clock()):
            raise Overloaded(f"session {req.session} sends RESAMPLE faster than {RESAMPLE_RATE:g}/s; slow down")
        if s.pending is None or s.pending.seq != req.seq:
            raise InvalidRequest(f"session {req.session} has no rejection pending at seq {req.seq}", field="seq")
        reply = resample.serve_resample(req, s.pending, s.shared, s.seed)
        if s.pending.finished:
            s.pending = None  # resolved: a replay finds nothing to serve
        return reply
