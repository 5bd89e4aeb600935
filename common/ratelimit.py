"""Token buckets: how often a process answers or logs bad input under a flood (the counters stay exact)."""

from __future__ import annotations

import time
from collections.abc import Callable


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
    """At most `rate` log lines per second per event name (burst `burst`); the lines that were held back are
    reported as `suppressed=N` on the next line that passes."""

    def __init__(self, logger, rate: float = 5.0, burst: float = 20.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.rate, self.burst, self.clock = logger, rate, burst, clock
        self._buckets: dict[str, TokenBucket] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: str, event: str, **fields) -> None:
        bucket = self._buckets.setdefault(event, TokenBucket(self.rate, self.burst))
        if not bucket.take(self.clock()):
            self._suppressed[event] = self._suppressed.get(event, 0) + 1
            return
        held = self._suppressed.pop(event, 0)
        getattr(self.logger, level)(event, **fields, **({"suppressed": held} if held else {}))

    def info(self, event: str, **fields) -> None:
        self.log("info", event, **fields)

    def warning(self, event: str, **fields) -> None:
        self.log("warning", event, **fields)
