"""/healthz, /readyz and /metrics for the broker over a minimal asyncio HTTP/1.0 server.

No dependency: the broker's counters are a flat dict of ints, which is all the Prometheus text format
needs. /healthz is liveness (the event loop answers); /readyz is 503 while no worker is registered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import structlog

log = structlog.get_logger("specrelay.broker")

GAUGES = frozenset({"sessions_open", "live_workers"})
_PREFIX = "specrelay_broker_"
_READ_TIMEOUT = 5.0
_MAX_HEADER_LINES = 100


def prometheus_text(stats: dict[str, int]) -> str:
    """Counters as `<name>_total`, gauges as they are (Prometheus exposition format 0.0.4)."""
    lines = []
    for name, value in stats.items():
        kind = "gauge" if name in GAUGES else "counter"
        metric = _PREFIX + name + ("" if kind == "gauge" else "_total")
        lines += [f"# TYPE {metric} {kind}", f"{metric} {value}"]
    return "\n".join(lines) + "\n"


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

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), _READ_TIMEOUT)
            for _ in range(_MAX_HEADER_LINES):  # headers are read and ignored
                if (await asyncio.wait_for(reader.readline(), _READ_TIMEOUT)).strip() == b"":
                    break
            parts = request.decode("latin-1").split()
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", "GET only\n"
            else:
                status, ctype, body = _respond(parts[1].split("?")[0], stats())
            payload = body.encode() if parts[:1] != ["HEAD"] else b""
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body.encode())}\r\n"
                         f"Connection: close\r\n\r\n".encode() + payload)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError) as exc:
            log.debug("health request dropped", error=repr(exc))
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
