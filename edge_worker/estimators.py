"""The estimators the auto draft length (edge_worker/draftlen.py) learns with: exponentially decayed acceptance
counts per draft position, a weighted least-squares line with a prior, and a weighted mean. Pure: numbers in,
numbers out; robust to one slow spell (after CLIP_AFTER observations a value over CLIP x the fit counts as that)."""

from __future__ import annotations

CLIP = 3.0                   # a timing over CLIP x its fitted value counts as CLIP x (one slow spell is not a trend)
CLIP_AFTER = 8               # ... once a line has seen this many


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
    """Exponentially weighted mean; with `clip`, after CLIP_AFTER observations an x over clip x the mean counts
    as that much."""

    def __init__(self, decay: float, default: float, clip: float | None = None) -> None:
        self.decay, self.value, self.weight, self.clip = decay, default, 0.0, clip
        self.count = 0

    def observe(self, x: float) -> None:
        if self.clip is not None and self.count >= CLIP_AFTER:
            x = min(x, self.clip * self.value)
        self.count += 1
        self.weight = self.decay * self.weight + 1
        self.value += (x - self.value) / self.weight
