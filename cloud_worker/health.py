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
import os
import socket
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger("specrelay.cloud")

PREFIX = "specrelay_cloud_"
GAUGES = frozenset({"sessions_open", "queued", "connected", "batch_size_mean"})
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_READ_TIMEOUT = 5.0
_MAX_HEADER_LINES = 100

Probe = Callable[[], tuple[bool, dict]]  # -> (healthy, details)


def prometheus_text(stats: Mapping[str, object]) -> str:
    """Flat ints/floats as counters (`_total`) or gauges; `errors` by code as a labelled counter;
    `batch_sizes` ({size: batches}) as a histogram of batch sizes."""
    lines: list[str] = []
    for name, value in stats.items():
        if name == "errors":
            metric = PREFIX + "errors_total"
            lines.append(f"# TYPE {metric} counter")
            lines += [f'{metric}{{code="{code}"}} {n}' for code, n in sorted(value.items())]
        elif name == "batch_sizes":
            lines += _histogram(PREFIX + "batch_size", value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            kind = "gauge" if name in GAUGES else "counter"
            metric = PREFIX + name + ("" if kind == "gauge" else "_total")
            lines += [f"# TYPE {metric} {kind}", f"{metric} {value}"]
    return "\n".join(lines) + "\n"


def _histogram(metric: str, sizes: Mapping[int, int]) -> list[str]:
    lines = [f"# TYPE {metric} histogram"]
    for bound in BATCH_BUCKETS:
        lines.append(f'{metric}_bucket{{le="{bound}"}} {sum(n for s, n in sizes.items() if s <= bound)}')
    lines.append(f'{metric}_bucket{{le="+Inf"}} {sum(sizes.values())}')
    lines.append(f"{metric}_sum {sum(s * n for s, n in sizes.items())}")
    lines.append(f"{metric}_count {sum(sizes.values())}")
    return lines


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
                status, ctype, body = _respond(parts[1].split("?")[0], healthz, readyz, stats)
            data = body.encode()
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                         "Connection: close\r\n\r\n".encode() + (b"" if parts[:1] == ["HEAD"] else data))
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, UnicodeDecodeError) as exc:
            log.debug("health request dropped", error=repr(exc))
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


def sd_notify(state: str) -> bool:
    """Send `state` (READY=1, WATCHDOG=1, STOPPING=1) to systemd when NOTIFY_SOCKET is set (Type=notify)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("systemd notify failed", state=state, error=repr(exc))
        return False
    return True
