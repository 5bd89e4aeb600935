"""Operations hooks of every process: an HTTP health port (Kubernetes probes, Prometheus) and systemd's sd_notify.

Kubernetes must probe an HTTP port, never the ZeroMQ one: libzmq accepts TCP while the application hangs.
  GET /healthz  200 while the process is alive and its event loop keeps time (liveness), else 503
  GET /readyz   200 while it can serve (readiness), else 503
  GET /metrics  Prometheus exposition (prometheus_client) of the process's counters and gauges
The HTTP responder is deliberately tiny (GET/HEAD, one request per connection, bounded reads and connections):
it must answer while the process is under attack. Idle or slow connections never block a probe: each gets
READ_TIMEOUT to send its request, and past MAX_CONNECTIONS the oldest open connection is closed to make room for
the new one (a fixed pool that refuses newcomers is what let 64 idle connections starve /healthz).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .metrics import Histogram

log = structlog.get_logger("specrelay.health")

READ_TIMEOUT = 2.0           # seconds a connection may take to send its request line and headers
MAX_REQUEST_BYTES = 8192      # request line + headers; a longer request is refused with 431
MAX_CONNECTIONS = 256         # open health connections; a new one past this closes the oldest (descriptor bound)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

Probe = Callable[[], tuple[bool, dict]]  # -> (ok, details)


@dataclass
class Endpoints:
    """What the health port serves: two probes and a registry of metrics."""

    healthz: Probe
    readyz: Probe
    registry: CollectorRegistry

    def respond(self, path: str) -> tuple[str, str, bytes]:
        """(status line, content type, body) for one GET path."""
        if path == "/metrics":
            return "200 OK", "text/plain; version=0.0.4; charset=utf-8", generate_latest(self.registry)
        probe = {"/healthz": self.healthz, "/readyz": self.readyz}.get(path)
        if probe is None:
            return "404 Not Found", "text/plain", b"not found\n"
        ok, details = probe()
        body = json.dumps({"status": "ok" if ok else "unavailable", **details}) + "\n"
        return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body.encode()


async def start_http(host: str, port: int, endpoints: Endpoints) -> asyncio.Server:
    """Serve GET/HEAD on host:port (0 = any free port: read it from `server.sockets[0].getsockname()`)."""
    open_writers: dict[asyncio.StreamWriter, None] = {}  # insertion order = age: the first is the oldest

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(open_writers) >= MAX_CONNECTIONS:  # evict the oldest: newcomers (the kubelet's probe) get served
            oldest = next(iter(open_writers))
            open_writers.pop(oldest)
            oldest.transport.abort()
        open_writers[writer] = None
        try:
            status, ctype, body, head = await asyncio.wait_for(_answer(reader, endpoints), READ_TIMEOUT)
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + (b"" if head else body))
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT)  # a client that never reads cannot hold us
        except (asyncio.TimeoutError, ConnectionError) as exc:
            log.debug("health request dropped", error=repr(exc))
        finally:
            open_writers.pop(writer, None)
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_BYTES)


async def _answer(reader: asyncio.StreamReader, endpoints: Endpoints) -> tuple[str, str, bytes, bool]:
    """Read one request (bounded) and build its response: (status, content type, body, is HEAD)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.LimitOverrunError, ValueError):
        return "431 Request Header Fields Too Large", "text/plain", b"request too large\n", False
    except asyncio.IncompleteReadError as exc:
        head = exc.partial  # HTTP/0.9-style or a truncated request: answer what the first line asks
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
        return "405 Method Not Allowed", "text/plain", b"GET only\n", False
    return (*endpoints.respond(parts[1].split("?")[0]), parts[0] == "HEAD")


class StatsCollector:
    """prometheus_client collector over a process's stats dict, read at scrape time (no double bookkeeping).

    Flat ints/floats become counters (`<prefix><name>_total`) or, if named in `gauges`, gauges;
    `errors` ({code: n}) a counter labelled by code; `batch_sizes` ({size: batches}) a histogram;
    `*_per_pos` ([n_0, n_1, ...]) a counter labelled by draft position; `*_per_broker` ({endpoint: n}) a counter
    (or gauge) labelled by broker; a `metrics.Histogram` a histogram.
    """

    def __init__(self, prefix: str, stats: Callable[[], Mapping[str, object]], gauges: Iterable[str]) -> None:
        self.prefix, self.stats, self.gauges = prefix, stats, frozenset(gauges)

    def collect(self):
        for name, value in self.stats().items():
            metric = self.prefix + name
            if name == "errors":
                family = CounterMetricFamily(metric, "ERROR replies by code", labels=["code"])
                for code, n in sorted(value.items()):
                    family.add_metric([str(code)], n)
                yield family
            elif name == "batch_sizes":
                yield _histogram(self.prefix + "batch_size", value)
            elif isinstance(value, Histogram):
                yield HistogramMetricFamily(metric, name.replace("_", " "), buckets=value.cumulative(),
                                            sum_value=value.total)
            elif name.endswith("_per_broker"):  # {endpoint: n}, labelled by broker
                kind = GaugeMetricFamily if name in self.gauges else CounterMetricFamily
                family = kind(metric.removesuffix("_per_broker"), name.replace("_", " "), labels=["broker"])
                for broker, n in value.items():
                    family.add_metric([broker], n)
                yield family
            elif name.endswith("_per_pos"):
                family = CounterMetricFamily(metric, name.replace("_", " "), labels=["position"])
                for position, n in enumerate(value):
                    family.add_metric([str(position)], n)
                yield family
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                kind = GaugeMetricFamily if name in self.gauges else CounterMetricFamily
                yield kind(metric, name.replace("_", " "), value=value)


def _histogram(metric: str, sizes: Mapping[int, int]) -> HistogramMetricFamily:
    buckets = [(str(bound), sum(n for s, n in sizes.items() if s <= bound)) for bound in BATCH_BUCKETS]
    buckets.append(("+Inf", sum(sizes.values())))
    return HistogramMetricFamily(metric, "verification batch sizes", buckets=buckets,
                                 sum_value=sum(s * n for s, n in sizes.items()))


def registry_for(prefix: str, stats: Callable[[], Mapping[str, object]], gauges: Iterable[str]) -> CollectorRegistry:
    """A registry of its own per process object (tests run several in one interpreter)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(prefix, stats, gauges))
    return registry


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
