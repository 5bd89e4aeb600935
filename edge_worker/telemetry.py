"""What the edge worker counts; server.EdgeHealth serves it on the health port (`specrelay edge-worker
--health-port`): speculative-decoding counters under vLLM's names, latency histograms, sessions, queue depth,
bytes, errors.

    GET /metrics   specrelay_edge_spec_decode_num_drafts_total, ..._num_draft_tokens_total,
                   ..._num_accepted_tokens_total, ..._num_accepted_tokens_per_pos_total{position="j"},
                   specrelay_edge_verify_latency_seconds (histogram), ..._draft_wait_seconds, ...,
                   specrelay_edge_predraft_rounds_total / ..._predraft_tries_total (the pre-draft hit rate,
                   chains and trees), specrelay_edge_tree_rounds_total
    GET /healthz   200 while the worker's event loop answers
    GET /readyz    200 while at least one of its brokers is up (the body says which)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..common.metrics import SIZE_BUCKETS, Histogram, SpecDecodeCounters



@dataclass
class EdgeMetrics:
    spec: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)
    verify_latency_seconds: Histogram = field(default_factory=Histogram)   # VERIFY sent -> VERDICT
    draft_wait_seconds: Histogram = field(default_factory=Histogram)       # waited for a block's draft
    draft_len: Histogram = field(default_factory=lambda: Histogram(SIZE_BUCKETS))  # tokens per VERIFY
    generations: int = 0
    generations_failed: int = 0
    generated_tokens: int = 0
    predraft_tokens: int = 0
    predraft_rounds: int = 0    # tries whose next block started from their pre-draft (hits)
    predraft_tries: int = 0     # verdicts (chain or tree) that came while a pre-draft of their outcome ran
    tree_rounds: int = 0        # VERIFY rounds that carried a token tree
    retries: int = 0
    failovers: int = 0          # sessions moved off a lost broker onto another
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    errors: Counter = field(default_factory=Counter)                        # by ErrorCode name

    def on_round(self, d: int, n_accepted: int, draft_s: float | None, latency_s: float) -> None:
        self.spec.record(d, n_accepted)
        self.draft_len.observe(d)
        self.verify_latency_seconds.observe(latency_s)
        if draft_s is not None:
            self.draft_wait_seconds.observe(draft_s)

    def on_generation(self, stats: dict, error_code: str | None) -> None:
        self.generations += 1
        self.generated_tokens += int(stats.get("generated_tokens", 0))
        for key in ("predraft_tokens", "predraft_rounds", "predraft_tries", "tree_rounds"):
            setattr(self, key, getattr(self, key) + int(stats.get(key, 0)))
        if error_code is not None:
            self.generations_failed += 1
            self.errors[error_code] += 1

    def stats(self, edge) -> dict[str, object]:
        """The stats dict /metrics serves (read at scrape time)."""
        batcher = edge._batcher
        return {
            **self.spec.as_stats(), "generations": self.generations, "generations_failed": self.generations_failed,
            "generated_tokens": self.generated_tokens, "predraft_tokens": self.predraft_tokens,
            "predraft_rounds": self.predraft_rounds, "predraft_tries": self.predraft_tries,
            "tree_rounds": self.tree_rounds,
            "retries": self.retries, "failovers": self.failovers, "uplink_bytes": self.uplink_bytes, "downlink_bytes": self.downlink_bytes,
            "draft_queue_depth": batcher.queued if batcher else 0,
            "draft_batches": batcher.batches if batcher else 0,
            "draft_joins": batcher.joins if batcher else 0,
            "draft_batch_sizes": Histogram.of(batcher.batch_sizes if batcher else {}, SIZE_BUCKETS),
            "verify_latency_seconds": self.verify_latency_seconds, "draft_wait_seconds": self.draft_wait_seconds,
            "draft_len": self.draft_len, "errors": dict(self.errors),
        }
