"""Goodput-driven draft length (`--draft-len auto`): pick d (0 allowed) to maximise expected committed tokens
per second, from what the edge measures. The model, in full, is in docs/draftlen.md:

    E(d) = sum_{k=0..d} P_k,   P_k = prod_{j<k} a_j                tokens one round commits
    T(d) = t*s*(d + L) - pre-drafting's net saving + R + Q + F(d)  seconds one round takes
    F(d) = f0 + f1 * (B * (d + 1 + x) + p)                         the forward pass if all B rows drafted d
    d*   = the longest d (fewest cloud calls) whose rate E(d) / T(d) is within the objective's tolerance of the
           best (speed: the shortest within TIE); the tolerance rises toward SATURATED as the cloud's
           utilisation (the load hint's `busy`) nears 1: the cloud sets the price of a call

A busy edge (several sessions in flight) drafts one d for all, per epoch, at the pooled acceptance, the model
corrected by what the edge measured at the lengths it ran (edge_worker/sharedlen.py); a lone session follows
its own. Pure: no clocks, no sockets. The edge shell feeds it what it measured (`observe_round`,
`observe_steps`) and the verdicts (`observe_block`); the estimates every session of an edge shares (link, cloud
load, draft speed, pooled acceptance) live in `EdgeEstimates`, each session's own acceptance in its
`GoodputController`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.protocol import MAX_DRAFT, LoadHint, Objective
from .estimators import (CLIP, CLIP_AFTER, AcceptanceCounts, EWLine, EWMean, ZeroProbes, conditional, reach_bound,
                         reachable)
from .ratecurve import (BUSY_FULL, BUSY_KNEE, SATURATED, TIE, TOLERANCE, best_length, cloud_length, pick,
                        rate_curve, tolerance)
from .sharedlen import WARM, SharedLength

__all__ = ["BUSY_FULL", "BUSY_KNEE", "SATURATED", "TIE", "TOLERANCE", "best_length", "tolerance"]  # re-exported

AUTO_MAX = 32                # longest block auto will draft
PRIOR_ACCEPT = 0.7           # acceptance assumed at a position nobody has measured yet
PRIOR_WEIGHT = 2.0           # ... worth this many rounds
SESSION_PRIOR_WEIGHT = 4.0   # a new session starts from the edge's pooled acceptance, worth this many rounds
SESSION_DECAY = 0.9          # per round: a session's own counts (memory ~10 rounds)
EDGE_DECAY = 0.995           # per round: the edge's pooled acceptance counts (memory ~200 rounds)
CLOUD_SLOPE_PRIOR = 0.02     # a forward pass's cost per token relative to its fixed cost, until measured
TIME_DECAY = 0.98            # per round: the edge's timings (memory ~50 rounds of all its sessions)
EXPLORE_AFTER = 16           # a cross-vocabulary edge's first probe interval at d = 0 (estimators.ZeroProbes)
EXPLORE_ROUNDS = 2           # an overdue probe drafts d = 1 for two rounds: the first catches the draft up on the
                             # stretch at d = 0 (not timed, EdgeSession._catchup), the second times a block
CAUTION = 1.0                # speed and balanced choose on a lower bound, CAUTION standard errors below the estimate,
                             # of the chance of reaching each draft position: a long block only on the evidence
PREDRAFT_SHARE = 0.7         # pre-drafting stops this far into the expected wait: the draft thread is idle (and
                             # the GIL free) when the VERDICT arrives, so its handling is not delayed
SHARED_EVERY = 8             # rounds (of all sessions) between two choices of a busy edge's shared length
PROBE_EVERY = 4              # at d = 0, the first probe interval: a round pre-drafts the guess for the next token
                             # (an acceptance sample); the draft's catch-up and steps are not free on an edge whose
                             # CPU is busy (a cross-vocabulary guess takes ~3 draft steps and a re-tokenisation:
                             # EXPLORE_AFTER then); the interval doubles while probes keep confirming d = 0
DRAFT_PRIOR = 0.25           # a draft step's cost relative to the forward pass's fixed cost, until one is timed
PENALTY_AFTER = 4            # hinted rounds of each kind (pre-drafting, not) before their difference is trusted
PREDRAFT_EXPLORE = 8         # while pre-drafting does not pay, one round in 8 pre-drafts anyway (is it still so?)


@dataclass
class EdgeEstimates:
    """What all sessions of an edge share: pooled acceptance, draft speed, link round trip, cloud load.
    With no timing observed (in-process use) the costs are unit-free defaults, so `auto` is deterministic."""

    predraft: bool = False
    predraft_window: str = "wait"  # pre-draft during the whole wait, or only while the VERIFY goes up ("uplink")
    acceptance: AcceptanceCounts = field(default_factory=lambda: AcceptanceCounts(EDGE_DECAY))
    step: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0, CLIP))  # draft thread s per step
    draft: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0, CLIP, 1))  # draft wait s per step
    # (clipped from its second observation: an edge's first rounds wait behind every session's prompt prefill)
    forward: EWLine = field(default_factory=lambda: EWLine(TIME_DECAY, CLOUD_SLOPE_PRIOR))  # s vs its tokens
    latency: EWLine = field(default_factory=lambda: EWLine(TIME_DECAY, CLOUD_SLOPE_PRIOR))  # without hints
    rtt: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0))     # link: latency - cloud time
    rtt_predraft: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0))  # ... of rounds that pre-drafted
    queue: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0))   # wait in the worker before a pass
    batch: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 1.0))   # rows per forward
    row_extra: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0))  # tokens per row besides d + 1
    prefill: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0))    # prompt tokens per pass
    busy: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0))       # the cloud's utilisation, 0..1
    steps_per_token: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 1.0))  # draft steps per target token
    lookahead: int = 0  # target tokens drafted past a block (1 for a cross-vocabulary draft: the last may grow)
    rounds: int = 0                                                           # rounds observed (all sessions)
    sessions: int = 1                                                         # sessions in flight (the shell's)
    zero: ZeroProbes = field(default_factory=ZeroProbes)                     # when d = 0 samples acceptance
    epochs: SharedLength = field(default_factory=SharedLength)               # a busy edge's shared length

    def shared(self, top: int, objective: Objective = Objective.BALANCED) -> int:
        """The length every session of a busy edge drafts (per objective), for an epoch of at least SHARED_EVERY
        rounds and 3 per session: the best at the pooled acceptance, the model's rate corrected by what was
        measured at the lengths run (edge_worker/sharedlen.py), or a shared probe of drafting from d = 0. One length,
        because a lockstep draft batch lasts as long as its longest job and a session drafting longer than the
        rest delays them all."""
        if self.epochs.due(objective, self.rounds, self.sessions, SHARED_EVERY):
            a, model = self.prior_rates(top + 1), self.round_model()
            curve = rate_curve(a, model, top)
            fix = self.epochs.measured.corrections(top)
            rates = [e / max(t, 1e-9) * c for (e, t), c in zip(curve, fix)]
            d = pick(rates, self.tolerance(Objective.BALANCED if objective == Objective.CLOUD else objective))
            if objective == Objective.CLOUD:
                d = max(d, cloud_length(a, self.row_share, top))
            warm = self.draft.count >= CLIP_AFTER and self.forward.known and self.rounds >= WARM * self.sessions
            self.epochs.begin(objective, d, curve, rates, self.rounds, warm)
        return self.epochs.current(objective).d

    def best_length(self, a: list[float], top: int, objective: Objective,
                    cautious: list[float] | None = None) -> int:
        """The objective's d at acceptance a_0..a_top: `speed` and `balanced` trade the session's rate for calls
        within their tolerance, at the `cautious` rates where given (a lower bound: their promise is a speed, and
        a length chosen where the estimate happens to be high is slower than it looked); `cloud` minimises the
        cloud's time per committed token at the estimate itself (cloud_length), and never makes more calls
        than `balanced` would."""
        if objective == Objective.CLOUD:
            return max(cloud_length(a, self.row_share, top), self.best_length(a, top, Objective.BALANCED, cautious))
        return best_length(cautious or a, self.round_model(), top, self.tolerance(objective))

    def probe_base(self) -> int:
        """ZeroProbes' first interval: a cross-vocabulary guess costs ~3 draft steps and a re-tokenisation."""
        return EXPLORE_AFTER if self.lookahead else PROBE_EVERY

    def row_share(self, d: int) -> float:
        """The cloud's time one row drafting d costs: its share F(d) / B of a forward pass (mean field), or,
        without load hints, the measured latency line."""
        if not self.forward.known:
            l0, l1 = self.latency.fit() if self.latency.known else (10.0, 10.0 * CLOUD_SLOPE_PRIOR)
            return l0 + l1 * (d + 1)
        return self.forward_time(d) / max(1.0, self.batch.value)

    def tolerance(self, objective: Objective) -> float:
        """The objective's tolerance at the cloud's measured utilisation."""
        return tolerance(objective, self.busy.value)

    def prior_rates(self, n: int) -> list[float]:
        """Pooled acceptance per position; past the last measured position, the last measured rate."""
        rates = self.acceptance.rates(min(n, len(self.acceptance.reached)), [PRIOR_ACCEPT] * n, PRIOR_WEIGHT)
        tail = rates[-1] if rates else PRIOR_ACCEPT
        return rates + [tail] * (n - len(rates))

    def prior_evidence(self, n: int) -> list[float]:
        """The observations behind prior_rates(n) per position (the prior's worth included); a position past the
        last measured one has the prior's only: its rate is a guess."""
        measured = min(n, len(self.acceptance.reached))
        return self.acceptance.evidence(measured, [PRIOR_WEIGHT] * n, PRIOR_WEIGHT) + [PRIOR_WEIGHT] * (n - measured)

    def observe_block_steps(self, steps: int, tokens: int, timed: bool = True) -> None:
        """A cross-vocabulary block of `tokens` target tokens took `steps` draft-model steps: the draft writes text
        in its own (finer) vocabulary, re-tokenised for the target (edge_worker/xdrafter.py), and drafts one
        target token past the block (the last may still grow): steps = s * (d + 1). `timed` False: the block
        first caught up on a stretch the draft had not seen (EdgeSession._catchup), its steps are not s's."""
        self.lookahead = 1
        if timed:
            self.steps_per_token.observe(steps / (tokens + 1))

    def observe_steps(self, steps: int, seconds: float) -> None:
        """The draft thread ran a lockstep batch of `steps` steps in `seconds` (pre-draft chunks included)."""
        if steps > 0:
            self.step.observe(seconds / steps)

    def observe_round(self, fresh: int, draft_s: float | None, latency_s: float, width: int, d: int,
                      hint: LoadHint | None, predrafted: bool = False, opened: bool = False) -> None:
        """One VERIFY round of `d` draft tokens: waited `draft_s` (None: not timed) for a draft of `fresh`
        forwards, then `latency_s` from sending the VERIFY to its VERDICT; `width` = our row (d + 1 + tail); the
        worker's hint; `predrafted`: the draft thread pre-drafted while this VERIFY was in flight; `opened`: it
        was the session's first after an OPEN, whose pass and wait held the session's own prompt (a cost paid
        once per session, whatever d: not a round's, so not in x, p or Q; the worker hints seq 1 always)."""
        self.rounds += 1
        if draft_s is not None and fresh > 0:
            self.draft.observe(draft_s / fresh)
        if hint is None or hint.batch < 1:
            if not self.forward.known:
                self.latency.observe(width, latency_s)
            return
        forward, queue = hint.forward_us * 1e-6, hint.queue_us * 1e-6
        tokens = hint.tokens or hint.batch * (hint.width or width)  # a worker older than `tokens`: padded rows
        self.forward.observe(tokens, forward)
        if not opened:
            self.row_extra.observe(max(0.0, (tokens - hint.prefill) / hint.batch - (d + 1)))
            self.prefill.observe(hint.prefill)
            self.queue.observe(queue)
        self.batch.observe(hint.batch)
        self.busy.observe(hint.busy / 1000)
        (self.rtt_predraft if predrafted else self.rtt).observe(max(0.0, latency_s - forward - queue))

    def predraft_penalty(self) -> float:
        """How much later a VERDICT is handled when the draft thread pre-drafted meanwhile (seconds, >= 0): on an
        edge whose event loop, ZeroMQ I/O thread and draft thread share a core, a pre-draft delays the round it
        is meant to shorten. 0 until both kinds of rounds were measured."""
        if min(self.rtt.count, self.rtt_predraft.count) < PENALTY_AFTER:
            return 0.0
        return max(0.0, self.rtt_predraft.value - self.rtt.value)

    def link_rtt(self) -> float:
        """R of a round that does not pre-draft (the other kind's while only it was measured)."""
        return self.rtt.value if self.rtt.count or not self.rtt_predraft.count else self.rtt_predraft.value

    def predraft_gain(self, d: int, p_next: float) -> float:
        """Seconds of drafting pre-drafting saves a round of d, net of its penalty: with probability p_next the
        whole block and the bonus guess are accepted and the next block starts with the chain (budget - 1 tokens
        past the guess). Positive: it pays."""
        if d <= 0:
            return 0.0
        saved = p_next * min(d, max(0, self.predraft_budget() - 1)) * self.steps_per_token.value  # forwards
        return self.draft_per_step() * saved - self.predraft_penalty()

    def draft_per_step(self) -> float:
        """t: the measured wait per lockstep step; before any, the draft thread's compute per step, or a guess
        from the forward pass (1 unit without any timing: the in-process reference)."""
        if self.draft.count:
            return self.draft.value
        if self.step.count:
            return self.step.value
        return DRAFT_PRIOR * self.forward.fit()[0] if self.forward.known else 1.0

    def forward_time(self, d: int, fit: tuple[float, float] | None = None) -> float:
        """F(d): the cloud's forward pass if every row of its batch drafted d (mean field), prefill included;
        `fit`: the forward line's (f0, f1), if the caller already has it."""
        f0, f1 = fit or self.forward.fit()
        return f0 + f1 * (self.batch.value * (d + 1 + self.row_extra.value) + self.prefill.value)

    def predraft_budget(self) -> int:
        """Tokens worth pre-drafting per round: what the draft thread does during the whole wait for the VERDICT
        (window "wait", the default: an edge device of its own), or only while the VERIFY is on its way up the
        link (R/2, window "uplink"), so that pre-drafting never slows a cloud worker sharing the machine's CPU.
        0 until the link and the draft speed are measured."""
        t = (self.step.value or self.draft.value) * self.steps_per_token.value
        if not (self.predraft and self.draft.count and self.forward.known) or t <= 0:
            return 0
        window = self.link_rtt() / 2
        if self.predraft_window == "wait":
            window = PREDRAFT_SHARE * (self.link_rtt() + self.queue.value + self.forward_time(0))
        return max(0, int(window / t))

    def round_time(self, d: int, p_next: float) -> float:
        """T(d) for a round drafting d tokens; p_next = P_{d+1}: the chance that the whole block and the bonus
        guess are accepted, so the pre-drafted chain (the guess, then budget - 1 tokens) starts the next block."""
        return self.round_model()(d, p_next)

    def round_model(self):
        """`round_time` with the fits done once: the function best_length evaluates for every candidate d (twice a
        round per session, so it is a line in d plus the pre-draft credit). A round pre-drafts only where that
        pays (`predraft_gain` > 0), so the model takes the better of the two."""
        t, s, penalty = self.draft_per_step(), self.steps_per_token.value, self.predraft_penalty()
        cap, lookahead = max(0, self.predraft_budget() - 1), self.lookahead
        if self.forward.known:  # R + Q + F(d) = base + slope * d
            f0, f1 = self.forward.fit()
            base = self.link_rtt() + self.queue.value + self.forward_time(0, (f0, f1))
            slope = f1 * self.batch.value
        else:  # no load hints: the measured latency line l0 + l1 * (d + 1)
            l0, l1 = self.latency.fit() if self.latency.known else (10.0, 10.0 * CLOUD_SLOPE_PRIOR)
            base, slope = l0 + l1, l1

        def model(d: int, p_next: float) -> float:
            if d <= 0:
                return base
            saved = t * s * p_next * min(d, cap)  # the next block's start, pre-drafted while this one is verified
            return t * s * (d + lookahead) - max(0.0, saved - penalty) + base + slope * d
        return model


class GoodputController:
    """One session's draft length: its own acceptance (starting from the edge's pooled rates), the edge's costs."""

    def __init__(self, edge: EdgeEstimates | None = None, max_len: int = AUTO_MAX,
                 objective: Objective = Objective.BALANCED) -> None:
        self.edge, self.objective = edge or EdgeEstimates(), objective
        self.max_len = min(max_len, MAX_DRAFT)
        self.own = AcceptanceCounts(SESSION_DECAY)
        self.exploring = False  # the block in flight drafts one token to sample acceptance (ZeroProbes)
        self.explore_left = 0  # exploring rounds still to go (EXPLORE_ROUNDS)
        self.unpaid = 0  # rounds whose pre-draft would not have paid (PREDRAFT_EXPLORE)
        self.committed, self.serial = 0, None  # the last VERDICT's committed tokens; the epoch of its round

    @property
    def probes(self) -> bool:
        """Whether the shell may pre-draft the next token at d = 0: the edge's probe is due (ZeroProbes)."""
        return self.edge.zero.due(self.edge.probe_base())

    def rates(self, n: int) -> list[float]:
        """This session's acceptance estimate a_0..a_{n-1}: its own counts shrunk toward the edge's."""
        return self.own.rates(n, self.edge.prior_rates(n), SESSION_PRIOR_WEIGHT)

    def cautious_rates(self, n: int) -> list[float]:
        """What speed and balanced choose on: per position k, the edge's pooled chance of reaching it, moved only
        as far as needed into this session's own confidence interval (CAUTION standard errors either side of its
        estimate, with the observations behind it). A session's luck or bad luck (a few fully accepted or
        rejected blocks) moves its blocks only once its own counts say it differs from the edge's."""
        pooled, evidence, own = self.edge.prior_rates(n), self.edge.prior_evidence(n), self.rates(n)
        counts = self.own.evidence(n, evidence, SESSION_PRIOR_WEIGHT)
        low, high = reach_bound(own, counts, CAUTION), reach_bound(own, counts, -CAUTION)
        edges = reach_bound(pooled, evidence, 0.0)
        return conditional([min(max(p, lo), hi) for p, lo, hi in zip(edges, low, high)])

    def predrafts(self, sent: int, d: int) -> bool:
        """Whether to pre-draft while a block of `sent` tokens is verified, for a next block of d: where it pays
        (EdgeEstimates.predraft_gain), and one round in PREDRAFT_EXPLORE where it does not (its penalty may have
        changed)."""
        p_next = 1.0
        for a in self.rates(sent + 1):  # P_{sent+1}: the block and the bonus guess all accepted
            p_next *= a
        if self.edge.predraft_gain(d, p_next) > 0:
            return True
        self.unpaid += 1
        return self.unpaid % PREDRAFT_EXPLORE == 0

    def choose(self, remaining: int) -> int:
        """The best d within 0 <= d <= min(max_len, remaining - 1): the edge's shared length while it runs several
        sessions, else this session's own; d = 1 for EXPLORE_ROUNDS rounds when the edge's probe at d = 0 is
        overdue (ZeroProbes)."""
        top = max(0, min(self.max_len, remaining - 1))
        busy = self.edge.sessions > 1  # a busy edge probes d = 0 with a shared epoch (sharedlen.py)
        if top and not busy and (self.explore_left or self.edge.zero.explore(self.edge.probe_base())):
            self.explore_left = self.explore_left or EXPLORE_ROUNDS
            self.exploring = True
            return 1
        return self.policy_length(top)

    def policy_length(self, top: int) -> int:
        """The objective's d in 0..top (no exploring)."""
        if self.edge.sessions > 1:
            return min(top, self.edge.shared(self.max_len, self.objective))
        rates = self.rates(top + 1)
        top = reachable(rates, top)  # this runs twice a round on the edge's critical path: no dead positions
        return self.edge.best_length(rates[:top + 1], top, self.objective, self.cautious_rates(top + 1))

    def observe_block(self, d: int, n_accepted: int, bonus_match: bool | None = None) -> None:
        sampled = d > 0 or bonus_match is not None
        if sampled:
            self.own.observe(d, n_accepted, bonus_match)
            self.edge.acceptance.observe(d, n_accepted, bonus_match)
        explored = self.exploring and d > 0  # (a pre-draft's choose may have set it during a round at d = 0)
        self.explore_left -= explored
        chosen, self.exploring = d > 0 and not explored, False
        still_zero = sampled and not chosen and self.policy_length(self.max_len) == 0
        self.edge.zero.observe(self.edge.probe_base(), d, sampled, chosen, still_zero)
        self.committed = n_accepted + 1

    def observe_round(self, fresh: int, draft_s: float | None, latency_s: float, width: int, d: int,
                      hint: LoadHint | None, predrafted: bool = False, opened: bool = False) -> None:
        """The edge's timings, and on a busy edge the round's tokens and wall time for its shared length: unless
        it is the session's first in this epoch (a catch-up, or chosen under the previous length) or its OPEN's."""
        self.edge.observe_round(fresh, draft_s, latency_s, width, d, hint, predrafted, opened)
        epoch = self.edge.epochs.current(self.objective) if self.edge.sessions > 1 else None
        serial, self.serial = self.serial, epoch.serial if epoch else None
        if epoch and serial == epoch.serial and not opened and (draft_s is not None or d == 0):
            self.edge.epochs.observe(epoch, d, self.committed, (draft_s or 0.0) + latency_s)


class FixedDraftLen:
    """`--draft-len N`: always N (0 = the target alone through the same path). What its rounds measure still
    feeds the edge's shared estimates, which are the edge's, not the policy's."""

    probes = False

    def __init__(self, d: int, edge: EdgeEstimates | None = None) -> None:
        self.d, self.edge = d, edge

    def choose(self, remaining: int) -> int:
        return max(0, min(self.d, remaining - 1))

    def predrafts(self, sent: int, d: int) -> bool:
        return True  # --draft-len N pre-drafts as the edge is configured to (--predraft)

    def observe_block(self, d: int, n_accepted: int, bonus_match: bool | None = None) -> None:
        if self.edge is not None and d > 0:
            self.edge.acceptance.observe(d, n_accepted, bonus_match)

    def observe_round(self, fresh: int, draft_s: float | None, latency_s: float, width: int, d: int,
                      hint: LoadHint | None, predrafted: bool = False, opened: bool = False) -> None:
        if self.edge is not None:
            self.edge.observe_round(fresh, draft_s, latency_s, width, d, hint, predrafted, opened)
