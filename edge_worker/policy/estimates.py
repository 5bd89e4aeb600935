"""The draft policy's estimators (edge_worker/policy/__init__.py states the model): one set per edge, shared by
chains and trees. Pure: numbers in, numbers out; no clocks, no sockets."""

from __future__ import annotations

from bisect import bisect_left

from ...common.protocol import CURVE_WIDTHS, LoadHint

from ..trees.tree import BUCKETS, MAX_BRANCH

PRIOR_ACCEPT = 0.7     # acceptance assumed where nothing was measured (a demo pair's typical first-position rate);
                       # a later sibling of a tree node gets half of it (its elder siblings were rejected)
PRIOR_WEIGHT = 4.0     # the prior, and a session's pull toward the edge's pooled rates, are worth this many rounds
ACCEPT_DECAY = 0.995   # per verdict: acceptance counts (memory ~200 blocks of all sessions: deep positions are
                       # reached rarely, and their rates must not fall back to the prior between two visits)
DECAY = 0.98           # per observation: timings (memory ~50: follows a load change within seconds)
CLIP = 3.0             # a timing over CLIP x its estimate counts as CLIP x (one stall is not a trend)
PREDRAFT_SHARE = 0.8   # pre-drafting stops this far into the expected wait, so the draft thread is idle (and the
                       # GIL free) when the VERDICT arrives and its handling is not delayed
DRAFT_PRIOR = 0.25     # a draft forward over a verify, until timed (a demo draft has ~1/4 of its target's layers)


class EWMean:
    """Exponentially weighted mean; from the second observation on, at most `clip` x the mean (unless it is 0)."""

    def __init__(self, default: float = 0.0, decay: float = DECAY, clip: float = CLIP) -> None:
        self.decay, self.value, self.weight, self.count, self.clip = decay, default, 0.0, 0, clip

    def observe(self, x: float) -> None:
        x = min(x, self.clip * self.value) if self.count and self.value > 0 else x
        self.count, self.weight = self.count + 1, self.decay * self.weight + 1
        self.value += (x - self.value) / self.weight


class EWLine:
    """y = c + s * x by exponentially weighted least squares, its slope shrunk toward `slope` (a prior worth one unit
    of x's variance); y at most `first`, then CLIP x the line; an observation of n points weighs 1 / n each."""

    def __init__(self, slope: float = 0.0) -> None:
        self.slope, self.count, self._fit = slope, 0, (None, (0.0, 0.0))  # fit()'s at (count, slope): read often
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, x: float, y: float, first: float = float("inf")) -> None:
        self.observe_points([(x, y)], first)

    def observe_points(self, points: list[tuple[float, float]], first: float = float("inf")) -> None:
        w, g, xs = 1 / len(points), DECAY, [x for x, _ in points]
        ys = [min(y, CLIP * self.at(x) if self.count else first) for x, y in points]
        self.count, self.sw = self.count + 1, g * self.sw + 1
        self.sx, self.sy = g * self.sx + w * sum(xs), g * self.sy + w * sum(ys)
        self.sxx = g * self.sxx + w * sum(x * x for x in xs)
        self.sxy = g * self.sxy + w * sum(x * y for x, y in zip(xs, ys))

    @property
    def known(self) -> bool:
        return self.count > 0

    @property
    def spread(self) -> float:
        """S_xx, the weighted sum of x's squared deviations: below the prior's 1 / 2, the slope is mostly the prior."""
        return max(0.0, self.sxx - self.sx * self.sx / self.sw) if self.count else 0.0

    def fit(self) -> tuple[float, float]:
        """(c, s): s = (S_xy + s0 / 2) / (S_xx + 1 / 2), centred sums, through the means; if c < 0: c = 0, raw sums."""
        if not self.count:
            return 0.0, self.slope
        if self._fit[0] != (key := (self.count, self.slope)):
            mx, my = self.sx / self.sw, self.sy / self.sw
            s = max(0.0, (self.sxy - self.sw * mx * my + self.slope / 2) / (self.spread + 0.5))
            self._fit = key, (my - s * mx, s) if my >= s * mx else (0.0, (self.sxy + self.slope / 2) / (self.sxx + .5))
        return self._fit[1]

    def at(self, x: float) -> float:
        return (line := self.fit())[0] + line[1] * x


class AcceptanceCounts:
    """Decayed counts per draft position: how often position j was reached and accepted."""

    def __init__(self) -> None:
        self.reached, self.accepted, self._rates = [], [], {}  # decayed counts (floats) per position; rates(n)'s

    def observe(self, d: int, n: int, bonus_match: bool | None = None) -> None:
        """A block of d drafts, n accepted; bonus_match: the guess past a full block matched (None: no guess)."""
        top = d + 1 if n == d and bonus_match is not None else d
        grow, self._rates = max(0, top - len(self.reached)), {}
        self.reached = [r * ACCEPT_DECAY for r in self.reached] + [0.0] * grow
        self.accepted = [a * ACCEPT_DECAY for a in self.accepted] + [0.0] * grow
        for j in range(min(n + 1, top)):  # positions 0..n reached, 0..n-1 accepted (n too if the guess matched)
            self.reached[j] += 1.0
            self.accepted[j] += float(j < n or bool(bonus_match))

    def rates(self, n: int, prior: list[float] | None = None) -> list[float]:
        """a_0..a_{n-1}: each position's counts shrunk (worth PRIOR_WEIGHT rounds) toward the one before's (the first
        toward PRIOR_ACCEPT), or toward the `prior`'s less the share the last measured position fell short of it."""
        if prior is None and n in self._rates:  # read by every session's choices between two verdicts
            return self._rates[n]
        out, before, scale = [], PRIOR_ACCEPT, 1.0
        for j in range(n):
            r, a = (self.reached[j], self.accepted[j]) if j < len(self.reached) else (0.0, 0.0)
            before = (a + PRIOR_WEIGHT * (prior[j] * scale if prior else before)) / (r + PRIOR_WEIGHT)
            scale = min(1.0, before / max(prior[j], 1e-9)) if prior else 1.0
            out.append(before)
        return out if prior else self._rates.setdefault(n, out)


class RankAcceptance:
    """Decayed counts per (confidence class, rank) of tree nodes: how often a node's r-th child was tested and
    accepted, and how often the accepted path met each class (`seen`)."""

    def __init__(self) -> None:
        b = len(BUCKETS) + 1
        self.reached = [[0.0] * MAX_BRANCH for _ in range(b)]
        self.accepted = [[0.0] * MAX_BRANCH for _ in range(b)]
        self.seen, self._mean = [0.0] * b, None  # mean_p_rank's (read every round)
        self._key: tuple[float, ...] | None = None  # key()'s

    def decay(self) -> None:
        for rows in (self.reached, self.accepted):
            rows[:] = [[x * ACCEPT_DECAY for x in row] for row in rows]
        self.seen, self._mean = [x * ACCEPT_DECAY for x in self.seen], None

    def observe(self, bucket: int, children: int, accepted: int | None) -> None:
        """A node of class `bucket` the verdict's walk reached with `children` sent; `accepted`: the rank the path
        followed (None: all rejected)."""
        self.seen[bucket], self._mean = self.seen[bucket] + 1.0, None
        for r in range(min(children if accepted is None else accepted + 1, MAX_BRANCH)):
            self.reached[bucket][r] += 1.0
        if accepted is not None and accepted < MAX_BRANCH:
            self.accepted[bucket][accepted] += 1.0

    def observe_chain(self, ranked: list[tuple[list[int], int]], n: int, target: int) -> None:
        """A greedy chain's verdict (its positions' DraftBlock.ranked, n accepted, `target` the target's token at n):
        what tree nodes there would have shown, every round (trees taken rarely would learn little alone)."""
        self.decay()
        for j, (ids, bucket) in enumerate(ranked[:n + 1]):
            taken = 0 if j < n else ids.index(target) if target in ids else None  # rejected: which candidate, if any
            self.observe(bucket, 1 if j < n else MAX_BRANCH, taken)

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

    def key(self) -> tuple[float, ...]:
        """mean_p_rank to the percent, held while no chance moves two from it: the tree tables' cache key (a miss
        costs ~0.9 ms; chains move the chances every round: held within one, 2 in 5 `shape()` calls missed)."""
        p = self.mean_p_rank()
        if self._key is None or max(abs(a - b) for a, b in zip(p, self._key)) > 0.02:
            self._key = tuple(round(x, 2) for x in p)
        return self._key

    def mean_p_rank(self) -> list[float]:
        """P_r averaged over the classes the accepted path met (uniform before any verdict)."""
        if self._mean is None:
            total, ranks = sum(self.seen), [self.p_rank(b) for b in range(len(self.seen))]
            weights = [s / total if total else 1 / len(self.seen) for s in self.seen]
            self._mean = [sum(w * p[r] for w, p in zip(weights, ranks)) for r in range(MAX_BRANCH)]
        return self._mean


class EdgeEstimates:
    """What every session of an edge shares: pooled acceptance per position and rank, the draft's and the cloud's
    costs, the link's round trip. Untimed (the in-process reference): unit-free defaults, deterministic choices."""

    def __init__(self, predraft: bool = False) -> None:
        self.predraft = predraft
        self.acceptance, self.ranks = AcceptanceCounts(), RankAcceptance()
        self.opening = AcceptanceCounts()     # the blocks right after a prompt, apart (DraftPolicy.observe_block)
        self.draft = EWLine()                 # seconds per draft forward vs its columns (rows x new tokens)
        self.rows = EWMean(1.0)               # sessions per lockstep draft forward (one column each per step)
        self.cloud = EWLine()                 # the worker's forward, seconds vs its tokens (prior slope: token_us)
        self.curve: list[float] = []          # its VERIFY's seconds at CURVE_WIDTHS tokens (a hint's curve_us)
        self.batch = EWMean(1.0)              # rows per worker forward
        self.queue_share = EWMean(clip=float("inf"))  # a VERIFY's wait at the worker over its forward (each <= CLIP)
        self.latency = EWLine()               # seconds from VERIFY to VERDICT vs our row (its slope: no hints)
        self.waits, self.widths = EWMean(), EWMean()  # that latency and the row's tokens: the wait line's anchor
        self.provisional = False              # the anchor is a round that also ran its prompt (nothing else yet)
        self.single = EWMean()                # the wait of a row of 1 (a round at d = 0): the line's low end
        self.steps_per_token = EWMean(1.0)    # draft forwards per target token (a cross-vocabulary draft: > 1)
        self.steps = EWLine(1.0)              # draft forwards vs a block's target tokens (across vocabularies)
        self.waited = EWLine()                # a chain round's wait for its draft vs its fresh forwards
        self.explore_s = EWMean()             # the draft wait of a round exploring from d = 0 (its catch-up)
        self.drafting = 0                     # rounds at d > 0 (any session's) since the last one at d = 0
        self.tree_saved = EWMean(clip=float("inf"))  # levels a tree pre-draft had grown at the VERDICT (a count)
        self.tree_share = EWMean(clip=float("inf"))  # the share of rounds (any session's) that drafted a tree
        self.paid = tuple((EWMean(clip=float("inf")), EWMean()) for _ in range(2))  # chain rounds', tree rounds':
        self.vetoed = 0                       # (tokens / its session's best modelled rate, seconds); vetoes in a row
        self.tree_waited = EWLine(1.0)        # a tree round's wait for its draft vs its levels' modelled compute
        self.others = EWMean(clip=float("inf"))  # chain jobs a second that came in while a draft batch ran
        self.lookahead = 0                    # target tokens drafted past a block (1 across vocabularies)
        self.handled = (EWMean(), EWMean())   # H: the edge's own seconds a round besides its waits: d = 0, d > 0

    def observe_draft(self, rows: float, forwards: list[tuple[int, float]], others: float | None = None) -> None:
        """The draft thread ran a lockstep batch of `rows` sessions per forward on average (0: a pre-draft chunk), its
        forwards (columns, seconds: a catch-up is a wide forward), `others` chain jobs a second meanwhile (None)."""
        if others is not None:
            self.others.observe(others)
        if rows:
            self.rows.observe(rows)
        if forwards and not self.draft.known:  # the first forward (often a prompt's catch-up) sets no flat price:
            self.draft.slope = forwards[0][1] / max(1, forwards[0][0])  # until widths vary: as its columns
        for columns, seconds in forwards:
            self.draft.observe(columns, seconds)

    def observe_block_steps(self, points: list[tuple[int, int]], timed: bool = True) -> None:
        """A cross-vocabulary block's (target tokens, draft forwards until its text held them) per prefix (`timed`)."""
        self.lookahead = 1
        if timed:
            self.steps_per_token.observe(points[-1][1] / points[-1][0])
            self.steps.slope = self.steps_per_token.value
            self.steps.observe_points(points)

    def observe_round(self, width: int, latency_s: float, hint: LoadHint | None, prefilled: bool = False) -> None:
        """One VERIFY round: our row's `width` tokens, `latency_s` to its VERDICT, the worker's hint; `prefilled`: the
        worker ran the prompt first (it stands in for a verify only until one without a prompt is measured)."""
        if hint is not None and hint.token_us:
            self.cloud.slope = hint.token_us * 1e-6
        if hint is not None and len(hint.curve_us) == len(CURVE_WIDTHS):
            self.curve = [us * 1e-6 for us in hint.curve_us]
        if hint is not None and hint.batch >= 1:  # rows per worker forward: a round that ran its prompt shows it too
            self.batch.observe(hint.batch)
        if prefilled or self.provisional:
            if self.waits.count and not self.provisional:
                return
            self.waits, self.widths, self.provisional = EWMean(), EWMean(), prefilled
        self.waits.observe(latency_s)
        self.widths.observe(width)
        if prefilled:
            return
        self.latency.observe(width, latency_s)
        if width == 1:
            self.single.observe(latency_s)
        if hint is not None and hint.batch >= 1 and not hint.prefill:
            self.cloud.observe(hint.tokens or hint.batch * (hint.width or width), hint.forward_us * 1e-6)
            if hint.forward_us:
                self.queue_share.observe(min(CLIP, hint.queue_us / hint.forward_us))

    def step(self, columns: float | None = None) -> float:
        """t: seconds per draft forward at `columns` (default: one per session of a lockstep batch); before any
        timing a guess from the verify's cost (1 unit in-process)."""
        if self.draft.known:
            return self.draft.at(self.rows.value if columns is None else columns)
        return DRAFT_PRIOR * self.wait(0) if self.waits.count else 1.0

    def step_line(self) -> tuple[float, float]:
        """(c, s): t(columns) = c + s x columns (before any timing, step()'s guess for every width)."""
        return self.draft.fit() if self.draft.known else (self.step(), 0.0)

    def observe_waited(self, steps: int, seconds: float) -> None:
        """A chain round waited `seconds` for its `steps` fresh forwards (the first at most CLIP x their compute)."""
        self.waited.slope = self.step()
        self.waited.observe(steps, seconds, CLIP * steps * self.step())

    def tree_line(self) -> tuple[float, float]:
        """(c, k): a tree round waits c + k x its levels' modelled compute (k no less than 1; 0 and 1 unmeasured)."""
        return _at_least(self.tree_waited, 1.0) if self.tree_waited.known else (0.0, 1.0)

    def blocking(self, seconds: float) -> float:
        """Seconds the chain jobs of others wait behind a tree batch of `seconds` (`others` a second, half each)."""
        return self.others.value * seconds * seconds / 2

    def draft_line(self) -> tuple[float, float]:
        """(c, s): a chain round waits c + s x n for n > 0 fresh forwards, s no less than a forward's compute t
        (before any chain round: 0 and t). A part per round is paid once, not per forward (docs/policy.md)."""
        return _at_least(self.waited, self.step()) if self.waited.known else (0.0, self.step())

    def per_token(self) -> float:
        """A chain's draft token on the critical path, at the margin: the draft line's slope x forwards per token."""
        return self.draft_line()[1] * self.steps_per_token.value

    def wait_line(self) -> tuple[float, float]:
        """(w0, w1): R + V = w0 + w1 (tokens + 1), seconds from sending a row of `tokens` drafts to its VERDICT: the
        mean wait at the mean row, (1 + q) c1 B a token more (every row of the batch one more; no hints: latency's)."""
        if not self.waits.count:  # 1 / DRAFT_PRIOR draft forwards (in-process: in units of one)
            return (self.step() if self.draft.known else 1.0) / DRAFT_PRIOR, 0.0
        slope = (1 + self.queue_share.value) * self.cloud.fit()[1] * self.batch.value \
            if self.cloud.known or self.cloud.slope else self.latency.fit()[1]
        return max(0.0, self.waits.value - slope * self.widths.value), slope

    def more_wait(self, tokens: int, more: int) -> float:
        """Seconds `more` tokens past a row of `tokens` add to its wait, every row of the batch as much (wait_line's
        slope), on the worker's curve where it sent one (piecewise linear, at its last slope past its end; >= 0)."""
        if not self.curve or more <= 0:
            return self.wait_line()[1] * max(0, more)
        cost, w = [], CURVE_WIDTHS
        for x in (self.batch.value * tokens, self.batch.value * (tokens + more)):  # the forward's tokens
            k = min(max(1, bisect_left(w, x)), len(w) - 1)
            cost.append(self.curve[k - 1] + (self.curve[k] - self.curve[k - 1]) * (x - w[k - 1]) / (w[k] - w[k - 1]))
        return (1 + self.queue_share.value) * max(0.0, cost[1] - cost[0])

    def wait(self, tokens: int) -> float:
        """The line at `tokens`; at d = 0 at most a row of 1's own wait while our rows are the worker's only ones (a
        1-token forward can cost less than the line's low end; beside others, it was timed under other loads)."""
        w = (line := self.wait_line())[0] + line[1] * (tokens + 1)
        alone = tokens == 0 and self.single.count and self.batch.count and self.batch.value < 1.5
        return min(w, self.single.value) if alone else w

    def predraft_budget(self, tokens: int) -> int:
        """Draft tokens the idle draft thread can pre-draft while a row of `tokens` is verified (0 without
        --predraft, or before the draft is timed: a guess must not delay the VERDICT's handling)."""
        if not (self.predraft and self.draft.known):
            return 0
        return int(PREDRAFT_SHARE * self.wait(tokens) / max(self.per_token(), 1e-9))


def _at_least(line: EWLine, least: float) -> tuple[float, float]:
    """A measured line's (c, s), s at least `least` (a slope under the compute it waits for is noise): via its mean."""
    (c, s), mx, my = line.fit(), line.sx / line.sw, line.sy / line.sw
    return (c, s) if s >= least else (max(0.0, my - least * mx), least)

