"""A cloud worker's settings, validated once, here: the Verifier's, the Scheduler's, and the worker's, which
holds both; and its counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..common.errors import SettingError
from ..common.metrics import Histogram, SpecDecodeCounters
from ..common.protocol import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS, MAX_DRAFT, MAX_TAIL

MAX_VERIFY_TOKENS = MAX_TAIL + MAX_DRAFT + 1  # new tokens of the largest VERIFY: its tail, draft and the row after
ATTENTION_PATHS = ("auto", "batched", "per-session")


def _check(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise SettingError(message)


@dataclass
class VerifierConfig:
    """The model side (cloud_worker/verifier.py): sessions, KV memory, numerics, eviction."""

    max_sessions: int = 1024
    max_cache_bytes: int = 2 << 30       # the KV store's size (preallocated; capped at max_sessions full contexts)
    deterministic: bool = False          # batch-invariant numerics: a session's logits never depend on its batch
    evict_idle_s: float = 60.0           # sessions silent this long may be evicted to admit a new one
    # one attention call per layer for the whole batch (batched) or one per session (per-session, the
    # reference); auto: batched on cuda (one kernel launch per layer, not per session), per-session on the cpu
    # (measured faster there: docs/gpu.md)
    attention: str = "auto"
    # the most of the KV store one client (an edge, under one broker) may hold: half, so one client alone uses
    # half the store and a client filling it leaves the other half to everyone else
    client_kv_share: float = 0.5

    def __post_init__(self) -> None:
        _check(self._checks())

    def _checks(self) -> list[tuple[bool, str]]:
        return [(self.max_sessions >= 1, "max_sessions must be >= 1"),
                (self.attention in ATTENTION_PATHS, f"attention must be one of {', '.join(ATTENTION_PATHS)}"),
                (self.max_cache_bytes > 0, "max_cache_bytes must be > 0"),
                (self.evict_idle_s >= 0, "evict_idle_s must be >= 0"),
                (0 < self.client_kv_share <= 1, "client_kv_share must be in (0, 1]")]


@dataclass
class SchedulerConfig:
    """What goes into each forward pass (cloud_worker/scheduler.py)."""

    max_batch: int = 32                  # VERIFYs in one forward pass
    max_wait_ms: float = 5.0             # longest wait to fill a batch, and only while others may still send
    prefill_tokens: int = 64             # prompt tokens prefilled per forward pass (chunked prefill)
    # new tokens of the VERIFYs in one forward pass (tail + draft or tree nodes + the row after them), like vLLM's
    # max_num_batched_tokens: 256 holds 32 chains of 7 (so it never binds a chain batch at max_batch) or 3 full
    # 64-node trees with their tails, so a tree flood cannot make one step 32 x 65 tokens
    max_step_tokens: int = 256
    idle_after_s: float = 5.0            # a session silent this long is not waited for when batching

    def __post_init__(self) -> None:
        _check(self._checks())

    def _checks(self) -> list[tuple[bool, str]]:
        return [(self.max_batch >= 1, "max_batch must be >= 1"),
                (0 <= self.max_wait_ms <= 1000, "max_wait_ms must be in [0, 1000]"),
                (self.prefill_tokens >= 1, "prefill_tokens must be >= 1"),
                (self.max_step_tokens >= MAX_VERIFY_TOKENS, f"max_step_tokens must be >= {MAX_VERIFY_TOKENS} "
                 "(the largest VERIFY)"),
                (self.idle_after_s > 0, "idle_after_s must be > 0")]


@dataclass
class WorkerConfig(SchedulerConfig, VerifierConfig):
    """A cloud worker's settings: the Verifier's and the Scheduler's (it is both configs), and how it heartbeats,
    reconnects and reports. Every default is defined here once; the CLI's flags take theirs from these fields."""

    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_liveness: int = HEARTBEAT_LIVENESS  # broker silent this many intervals = dead: reconnect
    health_port: int | None = None       # HTTP /healthz /readyz /metrics (0 = any free port)
    health_host: str = "127.0.0.1"
    identity: bytes | None = None        # explicit DEALER identity (default: chosen by the broker's ROUTER)
    linger_ms: int = 200                 # bounded, so shutdown cannot hang on unsent frames
    reconnect_max_s: float = 32.0        # reconnect back-off doubles from heartbeat_interval up to this
    drain_timeout_s: float = 30.0        # on stop, how long the running batch may take to finish

    def __post_init__(self) -> None:
        _check(VerifierConfig._checks(self) + SchedulerConfig._checks(self) + [
            (self.heartbeat_interval > 0, "heartbeat_interval must be > 0"),
            (self.heartbeat_liveness >= 1, "heartbeat_liveness must be >= 1"),
            (0 <= self.linger_ms <= 5000, "linger_ms must be in [0, 5000] so shutdown cannot hang"),
            (self.identity is None or (0 < len(self.identity) <= 255 and self.identity[0] != 0),
             "identity must be 1-255 bytes and not start with a zero byte (reserved by ZeroMQ)"),
            (self.reconnect_max_s > 0 and self.drain_timeout_s >= 0,
             "reconnect_max_s must be > 0, drain_timeout_s >= 0"),
        ])

    @property
    def broker_ttl(self) -> float:
        """Seconds of broker silence after which the connection is declared dead."""
        return self.heartbeat_interval * self.heartbeat_liveness


@dataclass
class WorkerStats:
    requests: int = 0               # edge messages received (malformed ones included)
    verify_requests: int = 0        # VERIFYs run through the model
    batches: int = 0
    batch_sizes: Counter = field(default_factory=Counter)  # batch size -> batches of that size
    bad_requests: int = 0           # BAD_REQUEST and CHAINS_ONLY answered (InvalidRequest)
    internal_errors: int = 0        # batches the model failed on
    errors: Counter = field(default_factory=Counter)       # ERROR replies by code name
    replies: int = 0
    replies_dropped: int = 0        # stale (older broker connection) or refused by the socket
    queue_refusals: int = 0         # requests answered UNAVAILABLE: their broker's share of the queue was full
    heartbeats_sent: int = 0
    heartbeats_received: int = 0
    bad_broker_messages: int = 0
    reconnects: int = 0
    spec: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)  # vLLM's spec_decode_* counters
    forward_seconds: Histogram = field(default_factory=Histogram)         # one verification forward pass
