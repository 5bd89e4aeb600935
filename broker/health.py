"""/healthz, /readyz and /metrics for the broker over a minimal asyncio HTTP/1.0 server.

No dependency: the broker's counters are a flat dict of ints, which is all the Prometheus text format
needs. /healthz is liveness (the event loop answers); /readyz is 503 while no worker is registered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from ..common import health

GAUGES = frozenset({"sessions_open", "live_workers"})
_PREFIX = "specrelay_broker_"


def prometheus_text(stats: dict[str, int]) -> str:
    """Counters as `<name>_total`, gauges as they are."""
    return health.prometheus_text(_PREFIX, stats, GAUGES)


def _respond(path: str, stats: dict[str, int]) -> tuple[str, str, str]:
    """(status line, content type, body) for one GET path."""
    if path == "/metrics":
        return "200 OK", "text/plain; version=0.0.4", prometheus_text(stats)
    summary = {"live_workers": stats["live_workers"], "sessions_open": stats["sessions_open"]}
    if path == "/healthz":
        return "200 OK", "application/json", json.dumps({"status": "ok", **summary})
    if path == "/readyz":
        ready = stats["live_workers"] > 0
        return ("200 OK" if ready else "503 Service Unavailable", "application/json",
                json.dumps({"status": "ready" if ready else "no workers", **summary}))
    return "404 Not Found", "text/plain", "not found\n"


async def start_health_server(host: str, port: int, stats: Callable[[], dict[str, int]]) -> asyncio.Server:
    """Listen on host:port (0 = any free port; read it from `server.sockets[0].getsockname()`)."""
    return await health.start_http(host, port, lambda path: _respond(path, stats()))
