"""The draft policy's estimators (edge_worker/policy/__init__.py states the model): one set per edge, shared by
chains and trees. Pure: numbers in, numbers out; no clocks, no sockets."""

from __future__ import annotations

from ...common.protocol import LoadHint
from ..trees.tree import BUCKETS, MAX_BRANCH

PRIOR_ACCEPT = 0.7     # acceptance assumed where nothing was measured (a demo pair's typical first-position rate);
                       # a later sibling of a tree node gets half of it (its elder siblings were rejected)
PRIOR_WEIGHT = 4.0     # the prior, and a session's pull toward the edge's pooled rates, are worth this many rounds
ACCEPT_DECAY = 0.995   # per verdict: acceptance counts (memory ~200 blocks of all sessions: deep positions are
                       # reached rarely, and their rates must not fall back to the prior between two visits)
DECAY = 0.98           # per observation: timings (memory ~50: follows a load change within seconds)
CLIP = 3.0             # a timing over CLIP x its estimate counts as CLIP x (one stall is not a trend)
DRAFT_PRIOR = 0.25     # a draft forward's cost relative to the cloud's fixed cost, until one is timed (a demo
                       # draft has ~1/4 of its target's layers)


class EWMean:
    """Exponentially weighted mean; from the second observation on, one over CLIP x the mean counts as that."""

    def __init__(self, default: float = 0.0, decay: float = DECAY) -> None:
        self.decay, self.value, self.weight, self.count = decay, default, 0.0, 0

    def observe(self, x: float) -> None:
        if self.count:
            x = min(x, CLIP * self.value)
        self.count += 1
        self.weight = self.decay * self.weight + 1
        self.value += (x - self.value) / self.weight


class EWLine:
    """y = c + s * x by exponentially weighted least squares, shrunk toward the flat line through the first
    observation (x1, y1) where it was measured (pseudo-observations at x1 and x1 + 1, not at x = 0: a first
    observation of a wide row, a prompt's prefill, must not set the cost of a row of 1): a slope is learnt only
    once x varies."""

    def __init__(self) -> None:
        self.count, self.prior, self.x1 = 0, 0.0, 0.0
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, x: float, y: float) -> None:
        if not self.count:
            self.prior, self.x1 = y, x
        elif self.count:
            c, s = self.fit()
            y = min(y, CLIP * (c + s * x))
        self.count += 1
        g = DECAY
        self.sw, self.sx, self.sy = g * self.sw + 1, g * self.sx + x, g * self.sy + y
        self.sxx, self.sxy = g * self.sxx + x * x, g * self.sxy + x * y

    @property
    def known(self) -> bool:
        return self.count > 0

    def fit(self) -> tuple[float, float]:
        """(c, s): the weighted normal equations plus the prior line as pseudo-observations at x1 and x1 + 1."""
        c0, x0 = self.prior, self.x1
        a11, a12, a22 = self.sw + 2, self.sx + 2 * x0 + 1, self.sxx + x0 * x0 + (x0 + 1) ** 2
        b1, b2 = self.sy + 2 * c0, self.sxy + c0 * (2 * x0 + 1)
        det = a11 * a22 - a12 * a12
        return max(0.0, (b1 * a22 - a12 * b2) / det), max(0.0, (a11 * b2 - a12 * b1) / det)

    def at(self, x: float) -> float:
        c, s = self.fit()
        return c + s * x


class AcceptanceCounts:
    """Decayed counts per draft position: how often position j was reached and accepted."""

    def __init__(self) -> None:
        self.reached: list[float] = []
        self.accepted: list[float] = []

    def observe(self, d: int, n: int, bonus_match: bool | None = None) -> None:
        """A block of d drafts, n accepted; bonus_match: whether the pre-drafted guess for the token after a fully
        accepted block (position d) was the target's (None: no guess)."""
        top = d + 1 if n == d and bonus_match is not None else d
        grow = max(0, top - len(self.reached))
        self.reached = [r * ACCEPT_DECAY for r in self.reached] + [0.0] * grow
        self.accepted = [a * ACCEPT_DECAY for a in self.accepted] + [0.0] * grow
        for j in range(min(n + 1, top)):  # positions 0..n reached, 0..n-1 accepted (n too if the guess matched)
            self.reached[j] += 1.0
            self.accepted[j] += float(j < n or bool(bonus_match))

    def rates(self, n: int, prior: list[float] | None = None) -> list[float]:
        """a_0..a_{n-1}: counts shrunk toward `prior` (worth PRIOR_WEIGHT rounds); without one, each position
        toward the rate of the one before (the first toward PRIOR_ACCEPT): past the positions measured, the last
        measured rate."""
        out, before = [], PRIOR_ACCEPT
        for j in range(n):
            r, a = (self.reached[j], self.accepted[j]) if j < len(self.reached) else (0.0, 0.0)
            before = (a + PRIOR_WEIGHT * (prior[j] if prior else before)) / (r + PRIOR_WEIGHT)
            out.append(before)
        return out


class RankAcceptance:
    """Decayed counts per (confidence class, rank) of tree nodes: how often a node's r-th child was tested and
    accepted, and how often the accepted path met each class (`seen`)."""

    def __init__(self) -> None:
        b = len(BUCKETS) + 1
        self.reached = [[0.0] * MAX_BRANCH for _ in range(b)]
        self.accepted = [[0.0] * MAX_BRANCH for _ in range(b)]
        self.seen = [0.0] * b

    def decay(self) -> None:
        for rows in (self.reached, self.accepted):
            for row in rows:
                row[:] = [x * ACCEPT_DECAY for x in row]
        self.seen = [x * ACCEPT_DECAY for x in self.seen]

    def observe(self, bucket: int, children: int, accepted: int | None) -> None:
        """A node of class `bucket` the verdict's walk reached with `children` sent; `accepted`: the rank the path
        followed (None: all rejected)."""
        self.seen[bucket] += 1.0
        for r in range(min(children if accepted is None else accepted + 1, MAX_BRANCH)):
            self.reached[bucket][r] += 1.0
        if accepted is not None and accepted < MAX_BRANCH:
            self.accepted[bucket][accepted] += 1.0

    def p_rank(self, bucket: int, n: int = MAX_BRANCH) -> list[float]:
        """P_0..P_{n-1}: the chance the target's token is a class-`bucket` node's r-th candidate (past the counted
        ranks, the last one's acceptance)."""
        prior = [PRIOR_ACCEPT] + [PRIOR_ACCEPT / 2] * (MAX_BRANCH - 1)
        rates = [(a + PRIOR_WEIGHT * p) / (r + PRIOR_WEIGHT)
                 for a, r, p in zip(self.accepted[bucket], self.reached[bucket], prior)]
        out, miss = [], 1.0
        for a in rates + rates[-1:] * (n - len(rates)):
            out.append(miss * a)
            miss *= 1.0 - a
        return out

    def mean_p_rank(self) -> list[float]:
        """P_r averaged over the classes the accepted path met (uniform before any verdict)."""
        total = sum(self.seen)
        weights = [s / total if total else 1 / len(self.seen) for s in self.seen]
        ranks = [self.p_rank(b) for b in range(len(self.seen))]
        return [sum(w * p[r] for w, p in zip(weights, ranks)) for r in range(MAX_BRANCH)]


class EdgeEstimates:
    """What every session of an edge shares: pooled acceptance per position and per rank, the draft's cost per
    forward against its columns, the cloud's cost per verify against its tokens, the link's round trip. With
    nothing timed (the in-process reference) the costs are unit-free defaults, so choices are deterministic."""

    def __init__(self, predraft: bool = False) -> None:
        self.predraft = predraft
        self.acceptance, self.ranks = AcceptanceCounts(), RankAcceptance()
        self.draft = EWLine()              # seconds per draft forward vs its columns (sessions, tree nodes)
        self.cloud = EWLine()      # the worker's forward, seconds vs its tokens (load hints)
        self.latency = EWLine()    # without load hints: seconds from VERIFY to VERDICT vs our row
        self.rtt = EWMean()                   # the link and the worker's queue: latency - the worker's forward
        self.batch = EWMean(1.0)              # rows per worker forward
        self.steps_per_token = EWMean(1.0)    # draft forwards per target token (a cross-vocabulary draft: > 1)
        self.waited = EWMean()                # a chain round's wait for its draft per fresh forward (the critical
                                              # path: the loop, queueing behind other sessions' batches included)
        self.explore_s = EWMean()             # the draft wait of a round exploring from d = 0 (its catch-up)
        self.tree_saved = EWMean()            # tree levels a pre-draft had drafted when the VERDICT came
        self.lookahead = 0                    # target tokens drafted past a block (1 across vocabularies)
        self.sessions = 1                     # sessions in flight (set by the edge shell)

    # ---------------------------------------------------------------- what the shell measured
    def observe_steps(self, rows: int, steps: int, seconds: float) -> None:
        """The draft thread ran a lockstep batch of `rows` jobs, `steps` forwards, in `seconds`."""
        if steps > 0:
            self.draft.observe(rows, seconds / steps)

    def observe_forward(self, columns: int, seconds: float) -> None:
        """One draft forward of a tree job over `columns` fed tokens."""
        self.draft.observe(columns, seconds)

    def observe_block_steps(self, steps: int, tokens: int, timed: bool = True) -> None:
        """A cross-vocabulary block of `tokens` target tokens took `steps` draft steps (it drafts one target token
        past the block); `timed` False: the block first caught up on a stretch the draft had not seen."""
        self.lookahead = 1
        if timed:
            self.steps_per_token.observe(steps / (tokens + 1))

    def observe_round(self, width: int, latency_s: float, hint: LoadHint | None) -> None:
        """One VERIFY round: `width` = our row's tokens, `latency_s` from sending it to its VERDICT, the hint."""
        if hint is None or hint.batch < 1:
            self.latency.observe(width, latency_s)
            return
        forward = hint.forward_us * 1e-6
        self.cloud.observe(hint.tokens or hint.batch * (hint.width or width), forward)
        self.batch.observe(hint.batch)
        self.rtt.observe(max(0.0, latency_s - forward))

    # ---------------------------------------------------------------- the cost model
    def step(self, columns: float | None = None) -> float:
        """t: seconds per draft forward at `columns` (default: one per session in flight); before any timing a
        guess from the cloud's cost (1 unit in-process)."""
        if self.draft.known:
            return self.draft.at(self.sessions if columns is None else columns)
        base = self.cloud.fit()[0] if self.cloud.known else self.latency.fit()[0] if self.latency.known else 0.0
        return DRAFT_PRIOR * base if base > 0 else 1.0

    def per_token(self) -> float:
        """A chain's draft token on the critical path: the measured wait per forward (else t) x forwards per token."""
        return (self.waited.value if self.waited.count else self.step()) * self.steps_per_token.value

    def wait_line(self) -> tuple[float, float]:
        """(w0, w1): R + V = w0 + w1 (tokens + 1), seconds from sending a row of `tokens` draft tokens to its
        VERDICT. V = c0 + c1 B (tokens + 1): the worker's forward if every row of its batch drafted as we do."""
        if self.cloud.known:
            c0, c1 = self.cloud.fit()
            return self.rtt.value + c0, c1 * self.batch.value
        if self.latency.known:
            return self.latency.fit()
        return 1.0 / DRAFT_PRIOR, 0.0  # in-process: in units of one draft forward

    def wait(self, tokens: int) -> float:
        w0, w1 = self.wait_line()
        return w0 + w1 * (tokens + 1)

    def predraft_budget(self, tokens: int) -> int:
        """Draft tokens the idle draft thread can pre-draft while a row of `tokens` is verified (0 without
        --predraft, or before the draft is timed: a guess must not delay the VERDICT's handling)."""
        if not (self.predraft and self.draft.known):
            return 0
        return int(PREDRAFT_SHARE * self.wait(tokens) / max(self.per_token(), 1e-9))


PREDRAFT_SHARE = 0.8   # pre-drafting stops this far into the expected wait, so the draft thread is idle (and the
                       # GIL free) when the VERDICT arrives and its handling is not delayed
