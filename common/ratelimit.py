"""Token buckets: how often a process answers or logs bad input under a flood (the counters stay exact)."""

from __future__ import annotations

import time
from collections.abc import Callable

LOG_LINES_PER_S = 5.0  # per event name: enough to see a flood's shape, too few to fill a disk
LOG_BURST = 20.0       # a short burst of distinct failures is logged whole


class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; `take(now)` spends one if there is one."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, None

    def take(self, now: float) -> bool:
        if self.stamp is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


class LogLimiter:
    """At most LOG_LINES_PER_S log lines per second per event name (burst LOG_BURST); the lines that were held
    back are reported as `suppressed=N` on the next line that passes."""

    def __init__(self, logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.clock = logger, clock
        self._buckets: dict[str, TokenBucket] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: str, event: str, **fields) -> None:
        bucket = self._buckets.setdefault(event, TokenBucket(LOG_LINES_PER_S, LOG_BURST))
        if not bucket.take(self.clock()):
            self._suppressed[event] = self._suppressed.get(event, 0) + 1
            return
        held = self._suppressed.pop(event, 0)
        getattr(self.logger, level)(event, **fields, **({"suppressed": held} if held else {}))

    def info(self, event: str, **fields) -> None:
        self.log("info", event, **fields)

    def warning(self, event: str, **fields) -> None:
        self.log("warning", event, **fields)
