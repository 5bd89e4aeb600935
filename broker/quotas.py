"""What one client of the broker may hold (`Limits`), what it holds now (`Usage`), and the refusals past it
(`Quotas`): open sessions, their prompt tokens, and requests in flight per session and per client.

A client is an edge key with CURVE (all connections of one key share its quota), else one edge connection
(`table.Peer.client`). A refusal is answered UNAVAILABLE by the Router; nothing here sends anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrelay.common.errors import SettingError


# a client's prompt tokens, at most this share of its live workers' KV slots: the workers' own per-client share
# (cloud_worker VerifierConfig.client_kv_share), so the broker refuses what the workers would refuse anyway
CLIENT_KV_SHARE = 0.5


@dataclass
class Limits:
    """What one client (an edge key; without keys, one edge connection) may hold at once, and how long an edge
    may stay silent before its sessions are closed for it."""

    max_sessions_per_client: int = 256
    max_in_flight_per_client: int = 1024
    max_prompt_tokens_per_client: int = 1 << 20
    max_in_flight_per_session: int = 64
    edge_ttl: float = 10.0             # seconds without a message (edges heartbeat every second)
    bad_replies_per_s: float = 50.0    # BAD_REQUEST answers per edge per second; past it they are only counted

    def __post_init__(self) -> None:
        if min(self.max_sessions_per_client, self.max_in_flight_per_client, self.max_prompt_tokens_per_client,
               self.max_in_flight_per_session) < 1 or self.edge_ttl <= 0 or self.bad_replies_per_s < 0:
            raise SettingError("broker limits must be >= 1, edge_ttl > 0 and bad_replies_per_s >= 0")


@dataclass
class Usage:
    """What one client holds now."""

    sessions: int = 0
    in_flight: int = 0
    tokens: int = 0


class Quotas:
    """Every client's Usage against the Limits. A client's record exists only while it holds a session, so the
    table never outgrows the sessions open."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.usage: dict[object, Usage] = {}

    def refuse_open(self, client: object, *, new_session: bool, extra_tokens: int, kv_capacity: int = 0) -> str | None:
        """Why this client may not open (or, re-OPENing, grow by `extra_tokens`) a session now, or None.
        `kv_capacity`: the live workers' KV slots (0: unknown); a client's tokens are held to CLIENT_KV_SHARE."""
        usage, lim = self.usage.get(client) or Usage(), self.limits
        tokens = lim.max_prompt_tokens_per_client
        tokens = min(tokens, max(1, int(kv_capacity * CLIENT_KV_SHARE))) if kv_capacity > 0 else tokens
        if new_session and usage.sessions >= lim.max_sessions_per_client:
            reason = f"this client already holds {usage.sessions} sessions (limit {lim.max_sessions_per_client})"
        elif usage.tokens + extra_tokens > tokens:
            reason = (f"this client's open sessions would hold {usage.tokens + extra_tokens} prompt tokens "
                      f"(limit {tokens})")
        else:
            return None
        return reason + "; close sessions or retry later"

    def take_request(self, client: object, session_id: int, in_flight: int) -> str | None:
        """One more request in flight for a session with `in_flight` outstanding: counted (None), or why not."""
        usage, lim = self.usage[client], self.limits
        if in_flight < lim.max_in_flight_per_session and usage.in_flight < lim.max_in_flight_per_client:
            usage.in_flight += 1
            return None
        if in_flight >= lim.max_in_flight_per_session:
            return f"session {session_id} already has {in_flight} requests in flight; retry later"
        return f"this client already has {usage.in_flight} requests in flight; retry later"

    def settled(self, client: object, n: int) -> None:
        """`n` of the client's requests in flight were answered (or never reached a worker)."""
        self.usage[client].in_flight -= n

    def opened(self, client: object) -> None:
        """The client holds one more session."""
        self.usage.setdefault(client, Usage()).sessions += 1

    def add_tokens(self, client: object, n: int) -> None:
        """The client's sessions hold `n` more prompt tokens (negative: fewer)."""
        self.usage[client].tokens += n

    def closed(self, client: object, tokens: int, in_flight: int) -> None:
        """A session with `tokens` prompt tokens and `in_flight` requests outstanding is gone: its quota is back."""
        usage = self.usage[client]
        usage.sessions -= 1
        usage.tokens -= tokens
        usage.in_flight -= in_flight
        if usage.sessions == 0:
            del self.usage[client]
