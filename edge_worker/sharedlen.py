"""A busy edge's shared draft length, measured (docs/draftlen.md "One length for a busy edge").

While an edge runs several sessions they all draft one length d, chosen every choice period (an *epoch*) at the
edge's pooled estimates (edge_worker/draftlen.py). A model of one session cannot see the regime all sessions
create together: at d = 0 the event loop handles a round per token for every session and the draft thread gets
less of the core; while all draft, the draft's forwards take the CPU of a cloud worker sharing the machine; the
draft thread's queue grows with everyone's d; acceptance per position measured at one length does not carry over
to another (agreement comes in runs). So the edge *measures* the regimes it chooses between:

- every round of an epoch but each session's first (a catch-up after d = 0, or a block chosen under the previous
  length) adds its committed tokens and wall time, and the model's E(d) and T(d) at the epoch's choice, to the
  shared length's decayed sums (`LengthRates`);
- where the measured round times grow with d faster than the model's T(d) (a slope fitted to the log ratios of
  the lengths actually run, weighted by their rounds and shrunk toward none), longer lengths are marked down by
  it: model proposes, measurement disposes. A round's time is a low-noise measurement; its tokens are not (they
  come in runs), so E(d) is the model's, from the pooled acceptance per position. Measurement only vetoes: a
  ratio that looks good does not pull the choice anywhere;
- an epoch at d = 0 is probed by a *shared* epoch at the best d > 0 (every session drafts: what is timed is the
  drafting regime), after 4 epochs at d = 0, the interval doubling (to 64) while probes confirm d = 0;
- the slope is fitted on the lengths the epochs ran (the choice moves with acceptance and load, and probe
  epochs run another length); old evidence decays, so a length once marked down is not banned forever. (Forced
  tries of a shorter neighbour, every 4th epoch, were tried and not kept: with one vocabulary, 8 sessions on
  loopback, they and a two-state E(d) raised `balanced`'s calls per token from 0.24 to 0.25-0.28.)

Ratios to the model, not raw rates, are compared, because rates drift along a generation and with the prompt mix
(the model's pooled acceptance follows them). Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MEASURE_DECAY = 0.995    # per measured round (all sessions): a length's sums (memory ~200 rounds)
TREND_PRIOR = 100.0      # ridge on the slope: rounds x tokens^2 of spread in d at which the fitted slope counts half
TREND_MAX = 0.05         # the slope of log(measured / model round time) per draft token at most
EXTRAPOLATE = 4          # the slope is applied up to this many tokens past the longest measured length
EPOCH_PER_SESSION = 3    # an epoch lasts at least this many rounds per session in flight (one is not measured)
PROBE_EPOCHS = 4         # epochs at d = 0 before a shared probe epoch; doubles while probes confirm d = 0
PROBE_LEVELS = 4         # ... up to 4 << 4 = 64 epochs
CLIP = 3.0               # a round's wall time counts at most CLIP x the model's T(d)
WARM = 4                 # rounds per session before epochs are measured (start-up: every session's prefill)


class LengthRates:
    """Per shared length d: decayed sums of measured rounds, committed tokens, wall seconds, and the model's
    E(d) and T(d) for those rounds. `slope()` fits log(measured round time / the model's T(d)) against d."""

    def __init__(self, decay: float = MEASURE_DECAY) -> None:
        self.decay = decay
        self.sums: dict[int, list[float]] = {}  # d -> [rounds, tokens, seconds, model tokens, model seconds]

    def observe(self, d: int, tokens: int, seconds: float, model_tokens: float, model_seconds: float) -> None:
        for row in self.sums.values():
            for i in range(5):
                row[i] *= self.decay
        row = self.sums.setdefault(d, [0.0] * 5)
        seconds = min(seconds, CLIP * model_seconds) if model_seconds > 0 else seconds
        for i, x in enumerate((1.0, tokens, seconds, model_tokens, model_seconds)):
            row[i] += x

    def evidence(self, d: int) -> float:
        """Decayed measured rounds at length d."""
        return self.sums.get(d, [0.0])[0]

    def ratio(self, d: int) -> float | None:
        """Measured round time / the model's T(d) at length d (None: not measured)."""
        rounds, _, seconds, _, t = self.sums.get(d, [0.0] * 5)
        return seconds / t if rounds > 0 and seconds > 0 and t > 0 else None

    def slope(self) -> tuple[float, int, int]:
        """(slope, lowest, highest): log(measured round time / the model's T(d)) ~ c + slope * d over the measured
        lengths, weighted by their rounds, ridge toward 0 (TREND_PRIOR), kept to 0 <= slope <= TREND_MAX; and the
        range of lengths it was measured on. A positive slope: rounds grow with d faster than the model says."""
        points = [(d, r[0], math.log(q)) for d, r in self.sums.items() if (q := self.ratio(d)) is not None]
        if len(points) < 2:
            return 0.0, 0, 0
        w = sum(p[1] for p in points)
        mx, my = sum(p[0] * p[1] for p in points) / w, sum(p[2] * p[1] for p in points) / w
        sxx = sum(p[1] * (p[0] - mx) ** 2 for p in points)
        sxy = sum(p[1] * (p[0] - mx) * (p[2] - my) for p in points)
        return max(0.0, min(TREND_MAX, sxy / (sxx + TREND_PRIOR))), min(p[0] for p in points), max(p[0] for p in points)

    def corrections(self, top: int) -> list[float]:
        """Factors (<= 1) on the model's rate E(d) / T(d) at d = 0..top: where the measured round times grow with d
        faster than the model's (a positive slope), a length past the shortest measured one is marked down by
        exp(-slope * (d - shortest)), up to EXTRAPOLATE tokens past the longest measured (flat beyond). A round's
        time is a low-noise measurement (its tokens are not: agreement comes in runs), and a ratio common to all
        lengths does not move the choice; measurement only vetoes (a noisy ratio that looks good does not pull
        the choice to a length nobody ran)."""
        slope, low, high = self.slope()
        return [math.exp(-slope * (min(max(d, low), high + EXTRAPOLATE) - low)) for d in range(top + 1)]


@dataclass
class Epoch:
    d: int          # the length every session drafts
    at: int         # the edge's round count when it was chosen
    serial: int     # which epoch (a session's round is measured when its previous one was in the same epoch)
    model: tuple[float, float] | None = None  # the model's E(d), T(d) at the choice (None: not timed yet)


@dataclass
class SharedLength:
    """The epochs of a busy edge's shared length (per objective) and what was measured at each length."""

    measured: LengthRates = field(default_factory=LengthRates)
    epochs: dict = field(default_factory=dict)  # objective -> Epoch
    serial: int = 0
    zero_epochs: int = 0   # epochs at d = 0 since the last probe epoch
    zero_level: int = 0    # the probe interval is PROBE_EPOCHS << zero_level

    def current(self, objective) -> Epoch | None:
        return self.epochs.get(objective)

    def due(self, objective, rounds: int, sessions: int, every: int) -> bool:
        """Whether the objective's epoch is over (or none was chosen yet)."""
        epoch = self.epochs.get(objective)
        return epoch is None or rounds - epoch.at >= max(every, EPOCH_PER_SESSION * sessions)

    def begin(self, objective, chosen: int, curve: list[tuple[float, float]], rates: list[float],
              rounds: int, timed: bool = True) -> int:
        """Start the next epoch: the objective's `chosen` length at the corrected `rates`, or a probe of drafting
        from d = 0 (a shared probe epoch). `curve`: the model's (E(d), T(d)) for d = 0..top; `timed` False:
        its costs are still priors (nothing to compare a measurement with)."""
        d = self._explore(chosen, rates)
        self.serial += 1
        self.epochs[objective] = Epoch(d, rounds, self.serial, curve[min(d, len(curve) - 1)] if timed else None)
        return d

    def _explore(self, chosen: int, rates: list[float]) -> int:
        top = len(rates) - 1
        if chosen == 0:
            self.zero_epochs += 1
            if top < 1 or self.zero_epochs < PROBE_EPOCHS << self.zero_level:
                return 0
            self.zero_epochs, self.zero_level = 0, min(self.zero_level + 1, PROBE_LEVELS)
            return max(range(1, top + 1), key=lambda d: rates[d])  # every session drafts: the drafting regime
        self.zero_epochs = self.zero_level = 0
        return chosen

    def observe(self, epoch: Epoch, d: int, tokens: int, seconds: float) -> None:
        """A measured round of `epoch` (d <= epoch.d: a block cut by the generation's end counts at epoch.d)."""
        if epoch.model is not None and (d > 0) == (epoch.d > 0) and d <= epoch.d:
            self.measured.observe(epoch.d, tokens, seconds, *epoch.model)
