"""Operations hooks shared by the broker and cloud workers: a minimal HTTP/1.0 responder for Kubernetes probes
and Prometheus, the Prometheus text format, and systemd's sd_notify. No dependency.

Kubernetes must probe an HTTP port, never the ZeroMQ one: libzmq accepts TCP while the application hangs.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger("specrelay.health")

READ_TIMEOUT = 5.0
MAX_HEADER_LINES = 100
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

Respond = Callable[[str], tuple[str, str, str]]  # path -> (status line, content type, body)


async def start_http(host: str, port: int, respond: Respond) -> asyncio.Server:
    """Serve GET/HEAD on host:port (0 = any free port: read it from `server.sockets[0].getsockname()`)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), READ_TIMEOUT)
            for _ in range(MAX_HEADER_LINES):  # headers are read and ignored
                if (await asyncio.wait_for(reader.readline(), READ_TIMEOUT)).strip() == b"":
                    break
            parts = request.decode("latin-1").split()
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", "GET only\n"
            else:
                status, ctype, body = respond(parts[1].split("?")[0])
            data = body.encode()
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                         "Connection: close\r\n\r\n".encode() + (b"" if parts[:1] == ["HEAD"] else data))
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, UnicodeDecodeError) as exc:
            log.debug("health request dropped", error=repr(exc))
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


def prometheus_text(prefix: str, stats: Mapping[str, object], gauges: frozenset[str]) -> str:
    """Flat ints/floats as counters (`_total`) or gauges; `errors` ({code: n}) as a labelled counter;
    `batch_sizes` ({size: batches}) as a histogram (Prometheus exposition format 0.0.4)."""
    lines: list[str] = []
    for name, value in stats.items():
        if name == "errors":
            metric = prefix + "errors_total"
            lines.append(f"# TYPE {metric} counter")
            lines += [f'{metric}{{code="{code}"}} {n}' for code, n in sorted(value.items())]
        elif name == "batch_sizes":
            lines += _histogram(prefix + "batch_size", value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            kind = "gauge" if name in gauges else "counter"
            metric = prefix + name + ("" if kind == "gauge" else "_total")
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
