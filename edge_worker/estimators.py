"""The estimators the auto draft length (edge_worker/draftlen.py) learns with: exponentially decayed acceptance
counts per draft position, a cautious bound on the chance of reaching a position, a weighted least-squares line
with a prior, a weighted mean, and the schedule on which an edge at d = 0 samples acceptance again. Pure: numbers
in, numbers out; robust to one slow spell (after CLIP_AFTER observations a value over CLIP x the fit counts as
that)."""

from __future__ import annotations

import math
from dataclasses import dataclass

CLIP = 3.0                   # a timing over CLIP x its fitted value counts as CLIP x (one slow spell is not a trend)
CLIP_AFTER = 8               # ... once a line has seen this many
RATE_FLOOR = 0.01            # an acceptance rate's floor in the bound below (its logarithm)
PROBE_MAX = 256              # ZeroProbes' longest interval, reached by doubling while probes keep confirming d = 0
REACH_MIN = 1e-3             # a draft position reached less often than this is not worth evaluating (reachable)
EXPLORE_GRACE = 4            # rounds past a due probe without an acceptance sample before one round drafts a token


class AcceptanceCounts:
    """Exponentially decayed per-position counts: how often draft position j was reached / accepted."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.reached: list[float] = []
        self.accepted: list[float] = []

    def observe(self, d: int, n_accepted: int, bonus_match: bool | None = None) -> None:
        """A block of d drafts with n accepted; bonus_match: whether the draft's guess for the token after a
        fully accepted block was the target's (known when that guess was pre-drafted), i.e. position d."""
        top = d + 1 if (n_accepted == d and bonus_match is not None) else d
        self._grow(top)
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
        for j in range(min(n_accepted + 1, top)):  # positions 0..n reached; 0..n-1 accepted
            self.reached[j] += 1.0
            self.accepted[j] += 1.0 if j < n_accepted or (j == d and bonus_match) else 0.0

    def _grow(self, n: int) -> None:
        if len(self.reached) < n:
            self.reached.extend([0.0] * (n - len(self.reached)))
            self.accepted.extend([0.0] * (n - len(self.accepted)))

    def rates(self, n: int, prior: list[float], weight: float) -> list[float]:
        """a_0..a_{n-1}: counts shrunk toward `prior` (worth `weight` rounds)."""
        out = []
        for j in range(n):
            r = self.reached[j] if j < len(self.reached) else 0.0
            a = self.accepted[j] if j < len(self.accepted) else 0.0
            out.append((a + weight * prior[j]) / (r + weight))
        return out

    def evidence(self, n: int, prior_counts: list[float], weight: float) -> list[float]:
        """The observations behind rates(n, prior, weight) per position: the (decayed) times it was reached, plus
        the prior's worth, which is `weight` at most and no more than the prior's own evidence (`prior_counts`):
        a prior that is itself a guess (a position the edge rarely reached) lends little certainty."""
        return [(self.reached[j] if j < len(self.reached) else 0.0) + min(weight, prior_counts[j]) for j in range(n)]


def reach_bound(rates: list[float], counts: list[float], z: float) -> list[float]:
    """log P'_1..log P'_n: a lower confidence bound (z standard errors) on the chance P_k = prod_{j<k} a_j of
    reaching draft position k, from the rates a_j and the observations n_j behind each (delta method on
    log a_j: variance (1 - a_j) / (a_j (n_j + 1)), independent positions); z < 0: the upper bound."""
    out, log_p, var = [], 0.0, 0.0
    for a, n in zip(rates, counts):
        a = min(1.0, max(a, RATE_FLOOR))
        log_p += math.log(a)
        var += (1.0 - a) / (a * (n + 1.0))
        out.append(log_p - z * math.sqrt(var))
    return out


def conditional(log_reach: list[float]) -> list[float]:
    """The rates a'_j = P'_{j+1} / P'_j of log P'_1..log P'_n (P'_0 = 1), made non-increasing first (a chance
    of reaching a position is never above that of reaching the one before)."""
    out, before = [], 0.0
    for now in log_reach:
        now = min(now, before)
        out.append(math.exp(now - before))
        before = now
    return out


def reachable(a: list[float], top: int) -> int:
    """The longest d <= top worth evaluating: past the first position reached with probability < REACH_MIN a
    longer block adds under REACH_MIN tokens per round (nothing any objective pays a draft token for)."""
    p = 1.0
    for d in range(top):
        p *= a[d]
        if p < REACH_MIN:
            return d + 1
    return top


class EWLine:
    """y = c + s * x by exponentially weighted least squares, shrunk toward a prior line that the first
    observation sets (c0 = y, s0 = slope_ratio * y): a slope is learnt only once x varies. After a few
    observations a y over `clip` x the fitted line counts as that much (a stall is not a trend)."""

    def __init__(self, decay: float, slope_ratio: float, prior_weight: float = 1.0, clip: float = CLIP) -> None:
        self.decay, self.slope_ratio, self.prior_weight, self.clip = decay, slope_ratio, prior_weight, clip
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.prior: tuple[float, float] | None = None
        self.count = 0

    def observe(self, x: float, y: float) -> None:
        if self.prior is None:
            self.prior = (y / (1 + self.slope_ratio * x), self.slope_ratio * y / (1 + self.slope_ratio * x))
        elif self.count >= CLIP_AFTER:
            c, s = self.fit()
            y = min(y, self.clip * (c + s * x))
        self.count += 1
        g = self.decay
        self.sw, self.sx, self.sy = g * self.sw + 1, g * self.sx + x, g * self.sy + y
        self.sxx, self.sxy = g * self.sxx + x * x, g * self.sxy + x * y

    @property
    def known(self) -> bool:
        return self.prior is not None

    def fit(self) -> tuple[float, float]:
        """(c, s): ridge solution of the weighted normal equations plus the prior as pseudo-observations."""
        c0, s0 = self.prior
        lam = self.prior_weight
        # minimise sum w (y - c - s x)^2 + lam (c - c0)^2 + lam * 10 (s - s0)^2  (2x2 normal equations)
        a11, a12, a22 = self.sw + lam, self.sx, self.sxx + 10 * lam
        b1, b2 = self.sy + lam * c0, self.sxy + 10 * lam * s0
        det = a11 * a22 - a12 * a12
        c, s = (b1 * a22 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det
        return max(c, 0.0), max(s, 0.0)


class EWMean:
    """Exponentially weighted mean; with `clip`, after `clip_after` observations (CLIP_AFTER) an x over clip x
    the mean counts as that much."""

    def __init__(self, decay: float, default: float, clip: float | None = None, clip_after: int = CLIP_AFTER) -> None:
        self.decay, self.value, self.weight, self.clip = decay, default, 0.0, clip
        self.count, self.clip_after = 0, clip_after

    def observe(self, x: float) -> None:
        if self.clip is not None and self.count >= self.clip_after:
            x = min(x, self.clip * self.value)
        self.count += 1
        self.weight = self.decay * self.weight + 1
        self.value += (x - self.value) / self.weight


@dataclass
class ZeroProbes:
    """When an edge at d = 0 samples acceptance again: after `interval` rounds at d = 0 without a sample (all its
    sessions' rounds) a session pre-drafts the guess for the next token (a probe), or, where none came
    EXPLORE_GRACE rounds later (no pre-drafting, no budget), drafts one token. A due sample after which d = 0 is
    still the choice doubles the interval, up to PROBE_MAX; a round that drafts by choice (the costs or the
    acceptance moved) resets it, as does a sample that makes drafting pay: where drafting never pays, exploring
    costs ~1 / PROBE_MAX of the rounds, where it has just stopped paying it is checked again soon."""

    level: int = 0  # the interval is the base (draftlen: PROBE_EVERY, EXPLORE_AFTER across vocabularies) doubled
    idle: int = 0   # rounds at d = 0 since the last acceptance sample

    def interval(self, base: int) -> int:
        return min(base << self.level, max(base, PROBE_MAX))

    def due(self, base: int) -> bool:
        return self.idle >= self.interval(base)

    def explore(self, base: int) -> bool:
        return self.idle >= self.interval(base) + EXPLORE_GRACE

    def observe(self, base: int, d: int, sampled: bool, chosen: bool, still_zero: bool) -> None:
        """A round of d drafts: `sampled` whether it taught acceptance, `chosen` whether d > 0 was the policy's
        choice (not an exploring round), `still_zero` whether d = 0 is the choice after it."""
        if d > 0 and chosen:
            self.level = self.idle = 0
        elif sampled:
            if self.due(base):  # the first sample of a due probe (sessions probing at once count once)
                self.level = min(self.level + 1, 16) if still_zero else 0
            self.idle = 0
        else:
            self.idle += 1
