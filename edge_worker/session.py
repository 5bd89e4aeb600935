"""The edge's pure core for one generation: draft a block, send VERIFY, apply the VERDICT, repeat.

No sockets and no model: the caller (an edge's step loop, the in-process reference) asks the edge scheduler
(edge_worker/scheduler.py) whether the session resamples or drafts, sends `resample_request()` or runs the draft
forwards of `draft_job()` and sends `request_for(block)`, and feeds the reply to `apply()`.
The session knows which committed tokens the cloud already holds (`cloud_len`), so a token the edge drew
itself after a rejection travels once, as the `tail` of the next VERIFY; on a retry
`open_message()` carries the whole history and the cloud re-prefills from it (after UNKNOWN_SESSION,
WORKER_LOST or a timeout).

The shape of each block comes from the draft policy (edge_worker/policy): fixed, or `auto` = the objective's
pick on the model of the acceptance and the timings the shell reports (`record_timing`). While a VERIFY
is in flight the shell may pre-draft the chain on (`predraft_job` / `take_predraft`, edge_worker/draft/predraft.py);
the next `draft_job` then starts from the part of it that the verdict confirmed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from ..common import logprobs as L
from ..common import protocol as P
from ..common.constraint import Constraint
from ..common.errors import ErrorCode, InternalError, InvalidRequest, from_wire
from ..common.packing import f32
from ..common.penalties import to_wire
from ..common.protocol import Mode
from ..common.resample import Rejection
from .config import SessionConfig
from .draft.drafter import DraftBlock, Drafter, DraftJob
from .policy import DraftPolicy, EdgeEstimates
from .draft.predraft import DraftChain
from .trees.drafter import TreeBlock
from .trees.rounds import TreeRounds, TreesRefused


def _refuses_trees(error: P.Error) -> bool:
    """The worker cannot verify token trees: CHAINS_ONLY. A worker from before that code answered BAD_REQUEST with
    "chains only" in its message; that text is still accepted for one release (drop it in the next)."""
    return error.code == ErrorCode.CHAINS_ONLY or (error.code == ErrorCode.BAD_REQUEST
                                                   and "chains only" in error.message)


class WorkerMisbehaved(InternalError):
    """A reply no honest worker sends (an id outside the vocabulary): counted, and the session re-OPENs."""


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
    context_full: int = 0          # 1: the generation ended at the target's context (finish_reason length)
    predraft_tokens: int = 0       # draft tokens taken from a pre-drafted chain instead of drafted anew
    predraft_rounds: int = 0       # tries whose next block started with pre-drafted tokens (hits)
    predraft_tries: int = 0        # verdicts (chain or tree) that came while a pre-draft of their outcome ran
    tree_rounds: int = 0           # VERIFY rounds that carried a tree (not a chain)
    tree_nodes: int = 0            # draft nodes of those rounds and of the tree engine's chains
    draft_s: float = 0.0           # waited for drafts (the critical path), seconds
    verify_s: float = 0.0          # waited for VERDICTs, seconds
    accepted_per_pos: list[int] = field(default_factory=list)    # accepted draft tokens by position (vLLM)
    reached_per_pos: list[int] = field(default_factory=list)     # rounds whose position j was drafted and tested
    rounds_by_draft_len: dict[int, int] = field(default_factory=dict)  # VERIFY rounds by draft length

    def record_block(self, d: int, n: int) -> None:
        """A VERIFY round of d draft tokens, n accepted: positions 0..n were tested (n only if n < d)."""
        for counts, upto in ((self.reached_per_pos, min(n + 1, d)), (self.accepted_per_pos, n)):
            counts.extend([0] * (d - len(counts)))
            for j in range(upto):
                counts[j] += 1
        self.rounds_by_draft_len[d] = self.rounds_by_draft_len.get(d, 0) + 1

    def record_tree(self, depth: int, n: int, tested: int) -> None:
        """A tree round of `depth` levels, its accepted path n deep; depths 1..tested were tested (the walk
        reached a node with children there): position j counts as a chain's position j does."""
        for counts, upto in ((self.reached_per_pos, tested), (self.accepted_per_pos, n)):
            counts.extend([0] * (max(depth, tested) - len(counts)))
            for j in range(upto):
                counts[j] += 1
        self.rounds_by_draft_len[depth] = self.rounds_by_draft_len.get(depth, 0) + 1


@dataclass
class EdgeSession:
    prompt_ids: list[int]
    config: SessionConfig
    drafter: Drafter
    sid: int = 1
    stats: SessionStats = field(default_factory=SessionStats)
    estimates: EdgeEstimates | None = None  # shared by an edge's sessions (edge_worker/policy)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise InvalidRequest("the prompt must hold at least one token", field="prompt")
        self.mode = self.config.mode  # resolved by SessionConfig
        self.tokens = list(self.prompt_ids)      # committed: prompt + generated (target ids)
        self.generated: list[int] = []
        self.cloud_len = 0                       # how many of self.tokens the cloud holds
        self.prefill_due = 0                     # tokens the cloud prefills before its next VERDICT (after OPEN)
        self.seq = 0
        self.done = False
        self.estimates = self.estimates or EdgeEstimates()
        self.policy = DraftPolicy(self.estimates, self.config.objective, self.config.draft_len,
                                  guesses=self.mode != Mode.SAMPLE)
        self.state = self.drafter.new_state(self.prompt_ids)
        self._block: DraftBlock | None = None
        self._job: DraftJob | None = None          # the job that drafted the block in flight
        self._reused = DraftBlock()                # the start of the next block, taken from the chain
        self._chain: DraftChain | None = None      # the block in flight and its pre-drafted continuation
        self._width = self._steps = 0              # the last block's cloud row width, fresh draft forwards
        self._catchup = False                      # its draft first caught up on a stretch the draft never saw
        self._prefilled = False                    # the worker ran the prompt before verifying it
        self._after_tree = False                   # the chain round in flight follows a tree round (a switch)
        self._seen = 0                             # committed tokens the draft had when it last drafted
        self._hint: P.LoadHint | None = None
        self._predrafted = False                   # a pre-draft of the verdict in flight was handed out (a try)
        self._tried = False                        # the last verdict was a try: the next block may be its hit
        self._guessed = False                      # a pre-draft guessed after a round at d = 0 (caught the draft up)
        self._rejection: Rejection | None = None
        self._resend_vocab = False                 # a worker lacked the bitmap the last OPEN named by hash
        self._pending: P.Resample | None = None
        # structured outputs: the drafter's own copy of the constraint, or None (a cross-vocabulary drafter
        # drafts nothing for a constrained session); a constrained session drafts chains
        self.grammar = self._grammar()
        trees = "off" if self.config.constraint is not None else self.config.trees
        self.trees = TreeRounds(self, trees, self.config.tree_nodes)  # (edge_worker/trees/rounds.py)
        self.token_rows: list[L.Rows] = []       # logprobs of the generated tokens, in order (config.logprobs)
        self.prompt_rows: L.Rows | None = None   # the prompt's (config.prompt_logprobs), once the cloud sent them
        self.ends = set(() if self.config.ignore_eos else self.drafter.eos_ids) | set(self.config.stop_token_ids)

    def _grammar(self) -> Constraint | None:
        spec = self.config.constraint
        if spec is None or not getattr(self.drafter, "masks_grammar", False):
            return None
        return Constraint(self.drafter.grammar_vocab(), spec)  # a spec the engine refuses: InvalidRequest

    # ---------------------------------------------------------------------------- requests
    def open_message(self, resend_vocab: bool = False) -> P.Open:
        """OPEN with the whole committed context (also the re-prefill on a retry); with the shared-vocabulary
        bitmap itself when `resend_vocab` or the worker lacked it (UNKNOWN_VOCAB), else maybe by hash only."""
        c = self.config
        self.cloud_len = self.prefill_due = len(self.tokens)
        self._rejection = self._pending = None
        vocab, vocab_hash = self.drafter.open_vocab(resend_vocab or self._resend_vocab)
        self._resend_vocab = False
        msg = P.Open(self.sid, list(self.tokens), self.mode, c.params.temperature, c.params.top_k,
                     c.params.top_p, c.seed, c.resample, vocab, self.drafter.target_vocab_size, vocab_hash)
        if c.scored:  # trailing fields: a plain session's OPEN is unchanged
            msg.logprobs, msg.prompt_logprobs = c.logprobs, c.prompt_logprobs and self.prompt_rows is None
            msg.penalties = to_wire(c.penalties) if c.penalties is not None else None
        if c.scored or c.constraint is not None:
            msg.generated = len(self.generated)  # a re-OPEN's history: counted apart from the prompt
        msg.constraint = c.constraint
        return msg

    def resample_request(self) -> P.Resample | None:
        """The pending RESAMPLE, which goes before any draft of this session (None when there is none)."""
        return self._pending

    def draft_job(self) -> DraftJob | None:
        """What to draft next (None while a RESAMPLE is pending); an edge batches these across sessions.
        Tokens a pre-drafted chain already holds are taken from it: the job drafts only the rest (maybe 0)."""
        if self._pending is not None:
            return None
        if self.trees.on and (job := self.trees.job()) is not None:
            return job
        d = self.policy.choose(self.config.max_new_tokens - len(self.generated), stretch=len(self.tokens) - self._seen,
                               opening=self.prefill_due > 0)
        c = self.config
        if c.constraint is not None and self.grammar is None:
            d = 0  # a drafter that cannot apply the grammar drafts nothing
        if d:
            self._seen = len(self.tokens)
        context = list(self.drafter.draft_context(self.state, self.tokens))
        chain, self._chain, last = self._chain, None, self._job  # `last` drafted the chain's block
        after = partial(self.drafter.extend_context, last)
        self._reused = chain.reusable(self.tokens, context, d, after) if chain and last else DraftBlock()
        n = len(self._reused.ids)
        if n and self._reused.ids[-1] in self.drafter.eos_ids:
            d = n  # the chain ended the generation: draft nothing past it
        grammar = None if self.grammar is None else (self.grammar, tuple(self.generated))
        pen = c.penalties if self.drafter.penalises else None
        self._job = DraftJob(self.state, context, len(self.tokens), d, self.mode, c.params, c.seed, grammar=grammar,
                             penalties=pen, prompt_len=len(self.prompt_ids), ranks=self.trees.on)
        rest = self.drafter.continue_job(self._job, self._reused.ids, d - n) if n else None
        if rest is None:  # nothing reused, or the draft cannot continue after the chain's tokens
            self._reused = DraftBlock()
        return rest or self._job

    def request_for(self, block: DraftBlock | TreeBlock) -> P.Verify:
        """The VERIFY for the freshly drafted `block` (after whatever the chain provided)."""
        # a block drafted after the session's OPEN or a round at d = 0 (unless it guessed) first feeds the draft the
        # whole stretch it has not seen (the prompt, every token the target alone committed): a one-off cost that is
        # not what a block of d (or a tree) costs while drafting goes on, so its steps do not teach s (edge_worker/
        # policy); nor do a chain block's that waited behind tree work: they timed what trees cost the edge, not a
        # chain (docs/policy.md). A tree round is timed by its own steps (trees.last_steps).
        self._catchup = self.prefill_due > 0 or self._block is None or not (self._block.ids or self._guessed)
        self._guessed = False
        if isinstance(block, TreeBlock):
            self._steps = 0
            return self.trees.request(block)
        self._after_tree = self.trees.last_tree  # its pre-draft grew trees: this chain starts fresh
        self.trees.block, self.trees.last_steps, self.trees.last_tree = None, 0, False
        self._catchup = self._catchup or block.behind_trees
        self._prefilled = self.prefill_due > 0
        self._block, reused = self._reused + block, len(self._reused.ids)
        self._reused, self._steps = DraftBlock(), block.steps  # draft forwards waited for
        self._width = len(self.tokens) - self.cloud_len + len(self._block.ids) + 1  # the row the cloud runs
        self.seq += 1
        self.stats.draft_tokens += len(self._block.ids)
        if block.drafted:  # a cross-vocabulary block: its forwards against the target tokens its text formed, up
            # to the tokens asked for (a block that ended the text: the tokens it holds)
            asked = len(block.ids) if block.ids[-1:] and block.ids[-1] in self.drafter.eos_ids else self._job.d - reused
            self.estimates.observe_block_steps(self.drafter.forwards_by_tokens(block, asked), not self._catchup)
        self.stats.predraft_tokens += reused
        self.stats.predraft_rounds += self._hit(reused)
        job = self._job
        self._chain = DraftChain(len(self.tokens), job.context, self._block, len(self._block.ids)) if job else None
        return P.Verify(self.sid, self.seq, len(self.tokens), self.tokens[self.cloud_len:], self._block.ids,
                        f32(self._block.q_tok) if self.mode == Mode.SAMPLE else b"")

    # ---------------------------------------------------------------------------- pre-drafting
    def predraft_job(self) -> DraftJob | None:
        """While the VERIFY is in flight: a job drafting the chain on (the bonus guess, then the next block as
        long as the policy would draft now). None when there is nothing worth drafting."""
        job = self.trees.predraft_job() if self.trees.block is not None else self._chain_predraft()
        self._predrafted = job is not None
        return job

    def plan(self) -> None:
        """While a chain's VERIFY is in flight (after its pre-draft is queued): with `--trees auto`, weigh whether
        the next round drafts a tree, off the critical path (TreeRounds.plan)."""
        if self._block is not None and self.trees.block is None and not self.done and self._pending is None:
            self.trees.plan(self.config.max_new_tokens - len(self.generated) - len(self._block.ids) - 1)

    def _chain_predraft(self) -> DraftJob | None:
        chain, job = self._chain, self._job
        guess, self.policy.guessing = self.policy.guessing, False  # exploring: the guess alone, a sample
        if chain is None or job is None or self._pending is not None or self.done or \
                (self.config.constraint is not None and self.grammar is None):
            return None
        if chain.block.ids and chain.block.ids[-1] in self.drafter.eos_ids:
            return None
        remaining = self.config.max_new_tokens - len(self.generated) - len(chain.block.ids)
        d_next = self.policy.choose(remaining - 1, explore=False)  # if the block and the bonus guess are accepted
        k = min(1 + d_next, remaining - 1, max(guess, self.estimates.predraft_budget(len(chain.block.ids))))
        # on the idle draft thread a pre-draft is free; at d = 0 nothing is (the next round drafts nothing)
        if k <= 0 or (d_next <= 0 and not guess):
            return None
        return self.drafter.continue_job(job, chain.block.ids, k)

    def take_predraft(self, more: DraftBlock) -> None:
        """The pre-drafted continuation of the block in flight (call before `apply` of its VERDICT)."""
        if self._chain is not None and isinstance(more, DraftBlock):
            if more.ids and not self._chain.block.ids:  # a guess after a round at d = 0: the draft caught up
                self._guessed, self._seen = True, len(self.tokens)
            self._chain.extend(more)

    def record_timing(self, draft_s: float | None, latency_s: float, handled_s: float | None = None,
                      committed: int = 0) -> None:
        """What the shell measured for the last VERIFY round: seconds waited for its draft (None: not timed), from
        sending it to its VERDICT, and the edge's own besides (taking the pre-draft back, applying the VERDICT).
        Feeds the auto draft length."""
        self.stats.draft_s += draft_s or 0.0
        self.stats.verify_s += latency_s
        tree = self.trees.shape if self.trees.last_tree else None  # a tree engine's round (0 steps: all grown)
        steps = self.trees.last_steps if tree is not None else self._steps
        self.policy.observe_round(self._width, latency_s, self._hint, draft_s, steps, self._catchup, self._prefilled,
                                  tree=tree, handled_s=handled_s, committed=committed * self._weighs,
                                  after_tree=tree is None and self._after_tree)

    @property
    def _weighs(self) -> bool:
        """Whether the round's tokens teach its kind's rate (only `--trees auto` reads them: its guard): not the last
        round's, which commits what was left, and what was left picked its kind (a chain); a chain after a tree is the
        tree's exit."""
        return self.trees.trees == "auto" and not self.done

    # ---------------------------------------------------------------------------- replies
    def apply(self, reply: P.Base) -> list[int]:
        """Apply a VERDICT / RESAMPLED / ERROR; returns the newly committed generated tokens."""
        if isinstance(reply, P.Error):
            if reply.code == ErrorCode.CONTEXT_FULL:  # the target's context is full: the generation ends here
                self.done, self.stats.context_full = True, 1
                return []
            if reply.code == ErrorCode.UNKNOWN_SESSION:
                self.stats.reopens += 1
            self._resend_vocab = reply.code == ErrorCode.UNKNOWN_VOCAB  # its re-OPEN carries the bitmap
            if self.trees.block is not None and _refuses_trees(reply):
                self.trees.refused()
                raise TreesRefused(f"the worker verifies chains only: {reply.message}")
            raise from_wire(reply.code, reply.message)
        if isinstance(reply, P.Resampled):
            self._check_ids(reply)
            return self._resolve(self._rejection.step(reply))
        if not isinstance(reply, P.Verdict) or reply.seq != self.seq:
            raise InvalidRequest(f"unexpected reply {type(reply).__name__} (seq {getattr(reply, 'seq', '?')}, "
                                 f"waiting for {self.seq})", field="seq")
        self._check_ids(reply)
        predrafted, self._predrafted = self._predrafted, False
        new = self._apply_verdict(reply)
        # a try: a verdict that came while a pre-draft of its outcome ran (chain or tree) and a next block follows
        self._tried = predrafted and not self.done
        self.stats.predraft_tries += self._tried
        return new

    def _hit(self, reused: int) -> bool:
        """Whether the block being sent starts from the last verdict's pre-draft (a hit of that try): hits and
        tries count over the same rounds, so hits <= tries."""
        hit, self._tried = self._tried and reused > 0, False
        return hit

    def _apply_verdict(self, v: P.Verdict) -> list[int]:
        if self.trees.block is not None:
            return self.trees.apply(v)
        block, n = self._block, v.n_accepted
        if n > len(block.ids):
            raise InvalidRequest(f"n_accepted {n} exceeds the draft length {len(block.ids)}", field="n_accepted")
        if v.next_token < 0 and (self.mode != Mode.SAMPLE or n >= len(block.q_rows)):  # no q' row to finish from
            raise WorkerMisbehaved(f"the worker sent no next token for session {self.sid} outside a sample-mode "
                                   "rejection")
        self.stats.cloud_calls += 1
        self.stats.accepted_tokens += n
        self.prefill_due = 0
        self.stats.record_block(len(block.ids), n)
        self._hint = v.load
        match = self._bonus_match(n, v.next_token)
        if not block.ids and not match:  # a guess at d = 0 that missed: the draft rolls it back and realigns, so
            self._guessed = False        # the next block catches up first (not a clean round: not timed)
        self.policy.observe_block(len(block.ids), n, match, opening=self._prefilled)
        if len(block.ranked) == len(block.ids) > 0 and v.next_token >= 0 and self.mode == Mode.GREEDY:
            self.policy.edge.ranks.observe_chain(block.ranked[:n + 1], n, v.next_token)
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
        if self.config.scored:
            self._take_rows(v, n + (v.next_token >= 0), len(self.generated) - start)
        return self.generated[start:]

    def _take_rows(self, v: P.Verdict, sent: int, kept: int) -> None:
        """The VERDICT's logprobs of its `sent` committed tokens (the first `kept` of them stay: the generation may
        end inside the block) and, on the first, the prompt's; missing or malformed ones are a worker's fault."""
        c = self.config
        try:
            if c.prompt_logprobs and self.prompt_rows is None:
                if v.prompt_logprobs is None:
                    raise InvalidRequest("no prompt_logprobs on the first VERDICT", field="prompt_logprobs")
                rows = L.unpack(v.prompt_logprobs, len(self.prompt_ids) - 1)
                if len(rows.chosen) != len(self.prompt_ids) - 1 or rows.top_ids.shape[1] != c.logprobs:
                    raise InvalidRequest("prompt_logprobs do not cover the prompt", field="prompt_logprobs")
                self.prompt_rows = L.concat([L.no_row(c.logprobs), rows])  # the first token has none
            if c.logprobs is not None:
                rows = L.unpack(v.logprobs or L.LogprobsWire(c.logprobs, b"", b"", b""), sent)
                if len(rows.chosen) != sent or rows.top_ids.shape[1] != c.logprobs:
                    raise InvalidRequest(f"{len(rows.chosen)} logprobs rows for {sent} tokens", field="logprobs")
                self.token_rows.append(L.Rows(*(x[:kept] for x in rows)))
            for rows in [self.prompt_rows] * (self.prompt_rows is not None) + self.token_rows[-1:]:
                ids = rows.top_ids[rows.top_ids >= 0]
                if ids.numel() and int(ids.max()) >= self.drafter.target_vocab_size:
                    raise InvalidRequest("a logprobs token id outside the target vocabulary", field="logprobs")
        except InvalidRequest as exc:
            raise WorkerMisbehaved(f"session {self.sid}: {exc}") from None

    def _bonus_match(self, n: int, token: int) -> bool | None:
        """After a fully accepted block: did the chain's guess for the bonus token match? (None: no guess, or
        SAMPLE mode, where the bonus is drawn from p and a match is not an acceptance.)"""
        chain = self._chain
        if chain is None or n < chain.sent or token < 0 or self.mode == Mode.SAMPLE:
            return None
        guess = chain.guess(n)
        return None if guess is None else guess == token

    def _check_ids(self, reply: P.Verdict | P.Resampled) -> None:
        """Every id a worker sends must index the target vocabulary (an out-of-range id would fault a CUDA
        gather on q'); -1 means "no token". A bad worker fails the request (retried), never the edge."""
        v = self.drafter.target_vocab_size
        token = reply.next_token if isinstance(reply, P.Verdict) else reply.token
        ids = [*reply.candidates, *([token] if token != -1 else [])]
        bad = next((t for t in ids if not 0 <= t < v), None)
        if bad is not None:
            raise WorkerMisbehaved(f"the worker sent token id {bad} for session {self.sid}, outside the target "
                                   f"vocabulary [0, {v})")

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
            if t in self.ends or len(self.generated) >= self.config.max_new_tokens:
                self.done = True

    def scores(self) -> dict:
        """What a scored session returns beside its tokens: `logprobs` (Rows of the generated tokens, None when not
        asked) and `prompt_logprobs` (Rows of the prompt, the first token's NaN; None when not asked)."""
        rows = L.concat(self.token_rows) if self.token_rows else None
        if rows is None and self.config.logprobs is not None:
            rows = L.Rows(*(x[:0] for x in L.no_row(self.config.logprobs)))
        return {"logprobs": rows, "prompt_logprobs": self.prompt_rows}

    def close_message(self) -> P.Close:
        return P.Close(self.sid)
