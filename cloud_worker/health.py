"""Operations hooks of the cloud worker: an HTTP health port (Kubernetes probes, Prometheus) and systemd notify.

Kubernetes must probe an HTTP port, never the ZeroMQ one: libzmq accepts TCP while the application hangs.
  GET /healthz  200 when the model is loaded and the event loop ticked recently (liveness), else 503
  GET /readyz   200 while the broker has been heard from recently (readiness), else 503
  GET /metrics  Prometheus text format 0.0.4 of the worker's counters
No dependency: a minimal HTTP/1.0 responder on asyncio streams, and `sd_notify` in a few lines.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping

from ..common import health

PREFIX = "specrelay_cloud_"
GAUGES = frozenset({"sessions_open", "queued", "connected", "batch_size_mean"})

Probe = Callable[[], tuple[bool, dict]]  # -> (healthy, details)


def prometheus_text(stats: Mapping[str, object]) -> str:
    """The worker's counters, gauges, errors by code and batch-size histogram."""
    return health.prometheus_text(PREFIX, stats, GAUGES)


def _respond(path: str, healthz: Probe, readyz: Probe, stats: Callable[[], Mapping]) -> tuple[str, str, str]:
    """(status line, content type, body) for one GET path."""
    if path == "/metrics":
        return "200 OK", "text/plain; version=0.0.4", prometheus_text(stats())
    probe = {"/healthz": healthz, "/readyz": readyz}.get(path)
    if probe is None:
        return "404 Not Found", "text/plain", "not found\n"
    ok, details = probe()
    return ("200 OK" if ok else "503 Service Unavailable", "application/json",
            json.dumps({"status": "ok" if ok else "unhealthy", **details}) + "\n")


async def start_health_server(host: str, port: int, *, healthz: Probe, readyz: Probe,
                              stats: Callable[[], Mapping]) -> asyncio.Server:
    """Listen on host:port (0 = any free port: read it from `server.sockets[0].getsockname()`)."""
    return await health.start_http(host, port, lambda path: _respond(path, healthz, readyz, stats))
