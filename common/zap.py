"""The broker's ZAP handler (RFC 27): pyzmq's asyncio authenticator plus a handshake budget and a log of refusals.

Handshake budget: each (domain, peer address, CURVE key) may complete `burst` handshakes at once and then
`rate` per second (GCRA). A handshake past the budget is never refused (a refusal tells a client its key is bad,
and edges end on that): its ZAP reply waits until the budget allows it; one that would wait longer than
`MAX_WAIT_S`, or arrives while `MAX_PENDING` replies already wait, is left unanswered, so libzmq drops it after
its handshake timeout (HANDSHAKE_IVL, 30 s) and the client reconnects. No routing id is made for either.
This bounds how many connections, and so how many routing ids, one key from one address can make in a given
time (README, Security: routing ids). A key not listed is refused at once and spends no budget (so unlisted keys
cannot fill the budget's table); refused keys are logged at a bounded rate with their domain and address.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from .ratelimit import LogLimiter

log = structlog.get_logger("specrelay.auth")
limited = LogLimiter(log)

MAX_WAIT_S = 10.0      # a handshake that would be held longer than this is left unanswered
MAX_PENDING = 1024     # ZAP replies held back at once, over all peers
MAX_PEERS = 65_536     # (domain, address, key) budgets remembered; idle ones are dropped first


class HandshakeBudget:
    """GCRA per peer: `tat` is when the peer's budget is next back to full minus `burst` intervals."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic) -> None:
        self.interval, self.window, self.clock = 1.0 / rate, burst / rate, clock
        self._tat: dict[tuple, float] = {}

    def delay(self, peer: tuple) -> float | None:
        """Seconds this handshake must wait (0: go now), booked; None: past MAX_WAIT_S or too many peers."""
        now = self.clock()
        if peer not in self._tat and len(self._tat) >= MAX_PEERS:
            self._tat = {p: t for p, t in self._tat.items() if t > now}  # idle budgets are full: forget them
            if len(self._tat) >= MAX_PEERS:
                return None
        tat = max(self._tat.get(peer, now), now)
        wait = max(0.0, tat + self.interval - now - self.window)
        if wait > MAX_WAIT_S:
            return None
        self._tat[peer] = tat + self.interval
        return wait


class ThrottledAuthenticator(AsyncioAuthenticator):
    """pyzmq's ZAP handler with a per-peer handshake budget, and refused keys logged (rate-bounded)."""

    def __init__(self, ctx, *, handshakes_per_s: float, handshake_burst: int) -> None:
        super().__init__(ctx)
        self.budget = HandshakeBudget(handshakes_per_s, handshake_burst)
        self.refused = self.delayed = 0
        self._held: set[asyncio.Task] = set()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) < 7:  # not a CURVE request with its key: pyzmq answers it
            await super().handle_zap_message(msg)
            return
        domain, address, key = msg[2].decode("utf-8", "replace"), msg[3].decode("utf-8", "replace"), msg[6]
        if not self.certs.get(domain, {}).get(z85.encode(key)):  # refused at once: unlisted keys spend no budget
            await self._answer(msg, domain, address)
            return
        wait = self.budget.delay((domain, address, key)) if len(self._held) < MAX_PENDING else None
        if wait is None:
            # unanswered: libzmq drops the connection at its handshake timeout
            limited.warning("handshake left unanswered: too many from this key and address", domain=domain,
                            address=address, key=z85.encode(key).decode())
        elif wait == 0:
            await self._answer(msg, domain, address)
        else:
            self.delayed += 1
            task = asyncio.create_task(self._answer(msg, domain, address, wait))
            self._held.add(task)
            task.add_done_callback(self._held.discard)

    async def _answer(self, msg: list[bytes], domain: str, address: str, wait: float = 0.0) -> None:
        if wait:
            await asyncio.sleep(wait)
        key = z85.encode(msg[6]).decode()
        if not (await self._authenticate_curve(domain, msg[6]))[0]:
            self.refused += 1
            limited.warning("CURVE key refused", domain=domain, address=address, key=key)
        await super().handle_zap_message(msg)

    def stop(self) -> None:
        for task in self._held:
            task.cancel()
        super().stop()
