"""The edge shell's plumbing for one generation (edge_worker/server.py drives it): `Route`, where the receiver
puts the replies of a session, and `Retries`, how long and how often its failures are retried.

Recovery never loses or repeats a committed token: a retry re-OPENs with the whole committed context and
redrafts; counter-based randomness makes the redraft identical.
"""

from __future__ import annotations

import asyncio

from ...common import protocol as P
from ...common.errors import RequestError, UnknownSession
from ..config import EdgeConfig
from ..session import EdgeSession


class Route:
    """Where the receiver puts replies for one session: the one request it waits on, by seq and type, and the
    broker (`link`, an index of the edge's brokers) the session is on; replies from any other are not its own."""

    def __init__(self, session: EdgeSession, link: int = 0) -> None:
        self.session, self.stats, self.link = session, session.stats, link
        self.seq = -1
        self.expect: type[P.Base] = P.Verdict
        self.waiter: asyncio.Future | None = None
        self.stash: P.Error | None = None  # an OPEN's ERROR (seq 0) that arrived while nothing waited
        self.failure: BaseException | None = None  # a link failure that came while nothing waited (drafting)

    def wait_for(self, seq: int, expect: type[P.Base]) -> asyncio.Future:
        self.seq, self.expect = seq, expect
        self.waiter = asyncio.get_running_loop().create_future()
        if self.failure is not None:
            self.waiter.set_exception(self.failure)
            self.failure = None
        return self.waiter

    def deliver(self, msg: P.Base, nbytes: int) -> None:
        self.stats.downlink_bytes += nbytes
        idle = self.waiter is None or self.waiter.done()
        if isinstance(msg, P.Error):
            if idle and msg.seq == 0:
                self.stash = msg
            elif not idle and msg.seq in (0, self.seq):
                self.waiter.set_result(msg)
        elif not idle and isinstance(msg, self.expect) and msg.seq == self.seq:
            self.waiter.set_result(msg)
        # anything else answers a request already given up on (timeout, retry): dropped

    def fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        else:
            self.failure = exc

    def reopened(self) -> None:
        """A re-OPEN is on its way: what came for the session before it no longer applies."""
        self.stash = self.failure = None


class Retries:
    """One generation's retry policy: a retryable failure (timeout, UNKNOWN_SESSION, WORKER_LOST, UNAVAILABLE,
    INTERNAL) is retried until failures have gone on for retry_budget_s in a row; before each retry a back-off
    doubling from retry_backoff_s up to max_backoff_s, none after UNKNOWN_SESSION (the cloud just lost it)."""

    def __init__(self, config: EdgeConfig) -> None:
        self.config = config
        self.count = 0                           # retries of this generation so far
        self.streak = 0                          # failures in a row (the log warns at the first of them)
        self._failing_since: float | None = None

    def give_up(self, exc: RequestError, now: float) -> bool:
        """True: `exc` ends the generation. False: it is retried (and counted)."""
        if self._failing_since is None:
            self._failing_since = now
        self.streak += 1
        if not exc.retryable or now - self._failing_since > self.config.retry_budget_s:
            return True
        self.count += 1
        return False

    def succeeded(self) -> None:
        self._failing_since, self.streak = None, 0

    def backoff_s(self, exc: RequestError) -> float | None:
        """Seconds to wait before this retry's re-OPEN; None: re-OPEN at once."""
        if isinstance(exc, UnknownSession):
            return None
        c = self.config
        return min(c.retry_backoff_s * 2 ** min(self.count - 1, 16), c.max_backoff_s)
