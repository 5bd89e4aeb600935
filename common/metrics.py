"""Counters every process keeps for Prometheus (common/health.py exports them): speculative-decoding counters
under vLLM's names, and fixed-bucket histograms.

Both are plain objects updated in place by the process that owns them and read at scrape time, so there is one
copy of every number (the stats dict a process shows is the one its /metrics serves).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class Histogram:
    """Observations counted into fixed upper bounds (Prometheus `le` semantics; the last bucket is +Inf)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; len(bounds) + 1
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    @classmethod
    def of(cls, values: Mapping[float, int], bounds: tuple[float, ...]) -> "Histogram":
        """A histogram of {value: times observed} (e.g. a Counter of batch sizes)."""
        hist = cls(bounds)
        for value, times in values.items():
            hist.counts[bisect_left(bounds, value)] += times
            hist.total += value * times
            hist.n += times
        return hist

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, observations <= le)] with '+Inf' last, as Prometheus wants them."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, "+Inf"), self.counts):
            running += count
            out.append((str(bound), running))
        return out


@dataclass
class SpecDecodeCounters:
    """vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py): drafts (VERIFYs with at least one
    draft token), draft tokens, accepted tokens, and accepted tokens per draft position (0 = the first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, draft_len: int, n_accepted: int) -> None:
        if draft_len <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += draft_len
        self.num_accepted_tokens += n_accepted
        if len(self.accepted_per_pos) < draft_len:
            self.accepted_per_pos.extend([0] * (draft_len - len(self.accepted_per_pos)))
        for position in range(n_accepted):
            self.accepted_per_pos[position] += 1

    def as_stats(self) -> dict[str, object]:
        """Stats-dict entries with vLLM's names (the collector exports `*_per_pos` with a `position` label)."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}


class Utilisation:
    """The share of wall time a worker spent in forward passes, over windows of at least `window_s` seconds
    (the load hint's `busy`: near 1, the cloud is the bottleneck and every extra cloud call delays everyone)."""

    def __init__(self, clock, window_s: float = 2.0) -> None:
        self.clock, self.window_s = clock, window_s
        self.busy, self.since, self.value = 0.0, clock(), 0.0

    def add(self, seconds: float) -> None:
        self.busy += seconds
        now = self.clock()
        if now - self.since >= self.window_s:
            self.value = min(1.0, self.busy / (now - self.since))
            self.busy, self.since = 0.0, now

    def per_mille(self) -> int:
        return int(round(1000 * self.value))
