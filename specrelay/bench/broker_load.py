"""`specrelay bench broker`: how many VERIFY -> VERDICT round trips one broker core routes.

The real broker (`specrelay broker`, a child process pinned to one core with `taskset`) between a load generator
that speaks the real protocol from the other cores: fake cloud workers (READY, heartbeats, a VERDICT for every
VERIFY at once) and fake edges (OPEN, one 4-token VERIFY in flight per session, heartbeats). No model anywhere:
what is measured is the broker alone. Per configuration (edges x sessions, workers): round trips per second over
the window, the broker's CPU share (from /proc), round-trip latency percentiles, `/healthz` latency while loaded.

    specrelay bench broker [--config 16x64x1 ...] [--warmup 3] [--window 20] [--broker-cpu 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import zmq

from ..cluster import free_port
from ..common import protocol as P
from .runs import DEFAULT_OUT, HelpFormatter, meta, text_table, write_result

DEFAULT_CONFIGS = ("1x1x1", "1x64x1", "4x64x1", "16x64x1", "16x64x2")
DRAFT = [8000, 8001, 8002, 8003]
CAPACITY = 10_000_000  # KV slots a fake worker declares: the broker never runs out of room


@dataclass
class Load:
    """One run's counters (the generator's thread writes, the caller reads after the window)."""

    round_trips: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    counting: bool = False


class Generator:
    """Fake workers and edges on one zmq.Poller loop (a thread of this process)."""

    def __init__(self, frontend: str, backend: str, edges: int, sessions: int, workers: int) -> None:
        self.ctx = zmq.Context()
        self.workers = [self._socket(backend) for _ in range(workers)]
        self.edges = [self._socket(frontend) for _ in range(edges)]
        self.sessions = sessions
        self.sent: dict[tuple[int, int], float] = {}
        self.seq: dict[tuple[int, int], int] = {}
        self.load = Load()
        self.stop = threading.Event()
        self._verify = msgspec_decoder(P.Verify)

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        return sock

    def start(self) -> None:
        for w in self.workers:
            w.send_multipart([b"", *P.encode(P.Ready("fake", 8192, 1 << 20, 64, CAPACITY))])
        time.sleep(0.5)  # the broker registers the workers before the first OPEN
        for e, edge in enumerate(self.edges):
            for s in range(1, self.sessions + 1):
                edge.send_multipart(P.encode(P.Open(s, [1, 2, 3])))
                self._send_verify(e, s)

    def _send_verify(self, e: int, s: int) -> None:
        seq = self.seq.get((e, s), 0) + 1
        self.seq[(e, s)] = seq
        self.sent[(e, s)] = time.perf_counter()
        self.edges[e].send_multipart(P.encode(P.Verify(s, seq, 3 + 5 * seq, [], DRAFT)), zmq.NOBLOCK)

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (*self.workers, *self.edges):
            poller.register(sock, zmq.POLLIN)
        role = {sock: ("w", i) for i, sock in enumerate(self.workers)} | \
            {sock: ("e", i) for i, sock in enumerate(self.edges)}
        next_beat = 0.0
        while not self.stop.is_set():
            now = time.perf_counter()
            if now >= next_beat:
                self._heartbeat()
                next_beat = now + 0.5
            for sock, _ in poller.poll(100):
                kind, i = role[sock]
                for _ in range(256):  # drain, but let the other sockets in
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_worker(sock, frames) if kind == "w" else self._on_edge(i, frames)

    def _heartbeat(self) -> None:
        for w in self.workers:
            w.send_multipart([b"", *P.encode(P.Heartbeat(0, CAPACITY))], zmq.NOBLOCK)
        for e in self.edges:
            e.send_multipart(P.encode(P.Heartbeat()), zmq.NOBLOCK)

    def _on_worker(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        client, head, body = frames[0], frames[1], frames[-1]
        if head[1] != P.MsgType.VERIFY:
            return  # heartbeats, OPEN, CLOSE: nothing to answer
        v = self._verify.decode(body)
        sock.send_multipart([client, *P.encode(P.Verdict(v.session, v.seq, len(v.draft), 8004))], zmq.NOBLOCK)

    def _on_edge(self, e: int, frames: list[bytes]) -> None:
        kind = frames[0][1]
        if kind == P.MsgType.ERROR:
            self.load.errors += 1
            return
        if kind != P.MsgType.VERDICT:
            return
        s = P.session_of(frames[1])
        if self.load.counting:
            self.load.round_trips += 1
            self.load.latencies.append(time.perf_counter() - self.sent[(e, s)])
        self._send_verify(e, s)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def msgspec_decoder(kind):
    import msgspec

    return msgspec.msgpack.Decoder(kind)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and all its threads, in seconds."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def health_probe(port: int, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read()
            out.append(time.perf_counter() - t0)
        except OSError:
            out.append(5.0)
        stop.wait(0.1)


def start_broker(broker_cpu: int | None) -> tuple[subprocess.Popen, str, str, int]:
    frontend, backend, health = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port())
    cmd = [sys.executable, "-m", "specrelay.cli", "--log-level", "error", "broker", "--frontend", frontend,
           "--backend", backend, "--health-port", str(health), "--max-sessions-per-client", "100000",
           "--max-prompt-tokens-per-client", str(1 << 30)]
    if broker_cpu is not None:
        cmd = ["taskset", "-c", str(broker_cpu), *cmd]
    proc = subprocess.Popen(cmd, env=dict(os.environ, SPECRELAY_LOG="error"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=1).read()
            return proc, frontend, backend, health
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the broker did not come up within 30 s")


def measure(config: str, warmup: float, window: float, broker_cpu: int | None) -> dict:
    edges, sessions, workers = (int(x) for x in config.split("x"))
    proc, frontend, backend, health = start_broker(broker_cpu)
    gen = Generator(frontend, backend, edges, sessions, workers)
    probe_stop, health_s = threading.Event(), []
    try:
        gen.start()
        loop = threading.Thread(target=gen.run, daemon=True)
        loop.start()
        time.sleep(warmup)
        probe = threading.Thread(target=health_probe, args=(health, probe_stop, health_s), daemon=True)
        cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        gen.load.counting = True
        probe.start()
        time.sleep(window)
        gen.load.counting = False
        cpu1, t1 = cpu_seconds(proc.pid), time.perf_counter()
        probe_stop.set()
        gen.stop.set()
        loop.join(5)
        probe.join(6)
    finally:
        gen.close()
        proc.terminate()
        proc.wait(10)
    lat = sorted(gen.load.latencies) or [0.0]
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]
    return {"config": config, "edges": edges, "sessions_per_edge": sessions, "workers": workers,
            "round_trips_per_s": round(gen.load.round_trips / (t1 - t0), 1),
            "broker_cpu": round((cpu1 - cpu0) / (t1 - t0), 3),
            "cpu_us_per_round_trip": round(1e6 * (cpu1 - cpu0) / max(gen.load.round_trips, 1), 1),
            "p50_ms": round(1e3 * pct(lat, 0.5), 2), "p99_ms": round(1e3 * pct(lat, 0.99), 2),
            "healthz_p99_ms": round(1e3 * pct(sorted(health_s) or [0.0], 0.99), 1),
            "healthz_median_ms": round(1e3 * statistics.median(health_s or [0.0]), 1),
            "errors": gen.load.errors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench broker", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--config", action="append", default=None, metavar="EDGESxSESSIONSxWORKERS",
                    help=f"repeatable (default: {' '.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before the window")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured")
    ap.add_argument("--broker-cpu", type=int, default=0, help="core the broker is pinned to (-1: not pinned); the "
                    "load generator runs on the others")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    pinned = args.broker_cpu if args.broker_cpu >= 0 else None
    if pinned is not None:
        others = set(range(os.cpu_count() or 1)) - {pinned}
        if others:
            os.sched_setaffinity(0, others)
    rows = []
    for config in args.config or DEFAULT_CONFIGS:
        rows.append(measure(config, args.warmup, args.window, pinned))
        print(rows[-1], file=sys.stderr, flush=True)
    columns = ["config", "round_trips_per_s", "broker_cpu", "cpu_us_per_round_trip", "p50_ms", "p99_ms",
               "healthz_p99_ms", "errors"]
    print(text_table(columns, [[row[c] for c in columns] for row in rows]))
    write_result(args.out, "broker", {"bench": "broker", "meta": meta(["broker", *(argv or [])]), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
