"""Link emulation between edges and the broker: a userspace TCP relay with a per-direction delay queue and an
optional token-bucket rate, in front of the broker's frontend.

    edge DEALER ──tcp──► relay (127.0.0.1:P) ──tcp──► broker frontend
                 each direction: chunk read at t leaves the bucket at t' >= t, is written at t' + RTT/2

Why userspace: this kernel has no `netem` qdisc, so delay cannot come from tc. Each TCP connection (one per
edge) gets its own pair of queues and buckets: every edge has its own access link. The rate is the kernel's
when it can be (`--rate-by auto`, the default: as root, a veth pair into a namespace of our own with `tbf` on
each end, specrelay/bench/netns.py; then it is one link that all edges share), else the relay's token bucket.
Only 127.0.0.1 and that veth pair are used.

    python -m specrelay.bench.link --upstream tcp://127.0.0.1:5555 --link 50ms,20mbit [--rate-by auto|tbf|relay]
prints {"listen": "tcp://127.0.0.1:PORT", "link": "what runs"} and relays until SIGTERM. `LinkRelay` runs that
as a child process (its timers never wait behind a busy benchmark loop); `measure_rtt` times null requests
through it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

_TIME = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


@dataclass(frozen=True)
class LinkSpec:
    """RTT (seconds, split evenly between directions) and rate (bits/s per direction, None = unlimited).
    Text form as in tc: `50ms`, `50ms,20mbit`, `0` (no emulation), `none`; `kbps`/`mbps` are BYTES per second."""

    rtt_s: float = 0.0
    rate_bps: float | None = None

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        parts = [p.strip().lower() for p in text.split(",")]
        if parts == ["none"]:
            return cls()
        if len(parts) > 2:
            raise ValueError(f"--link is RTT[,RATE], e.g. 50ms,20mbit; got {text!r}")
        m = re.fullmatch(r"([\d.]+)\s*(us|ms|s)?", parts[0])
        if not m:
            raise ValueError(f"cannot read the RTT {parts[0]!r}: use e.g. 50ms, 0.05s or 50 (ms)")
        rtt = float(m.group(1)) * _TIME[m.group(2) or "ms"]
        rate = None
        if len(parts) == 2:
            m = re.fullmatch(r"([\d.]+)\s*(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)", parts[1])
            if not m or float(m.group(1)) <= 0:
                raise ValueError(f"cannot read the rate {parts[1]!r}: use e.g. 20mbit, 512kbit (tc units)")
            rate = float(m.group(1)) * _RATE[m.group(2)]
        return cls(rtt, rate)

    @property
    def emulated(self) -> bool:
        return self.rtt_s > 0 or self.rate_bps is not None

    @property
    def label(self) -> str:
        rtt = f"{self.rtt_s * 1e3:g}ms"
        return rtt if self.rate_bps is None else f"{rtt},{self.rate_bps / 1e6:g}mbit"

    def describe(self, rate: str | None = None) -> str:
        """What runs; `rate` names what limits the rate when it is not the relay's token bucket."""
        if not self.emulated:
            return "none (loopback)"
        if rate is None:
            rate = "unlimited rate" if self.rate_bps is None else f"token bucket {self.rate_bps / 1e6:g} Mbit/s"
        return f"userspace TCP relay: RTT {self.rtt_s * 1e3:g} ms ({self.rtt_s * 500:g} ms each way), {rate}"


class TokenBucket:
    """tbf semantics for one direction: `rate` bytes/s refill a bucket of `burst` bytes; a chunk (<= burst) leaves
    once the bucket holds its size, and never before the chunk ahead of it (FIFO). Pure: times are passed in."""

    def __init__(self, rate_bytes: float, burst: int, now: float) -> None:
        self.rate, self.burst = rate_bytes, burst
        self.tokens, self.updated, self.free_at = float(burst), now, now

    def depart(self, now: float, size: int) -> float:
        """When a chunk of `size` bytes arriving at `now` leaves the bucket."""
        t = max(now, self.free_at)
        self.tokens = min(self.burst, self.tokens + (t - self.updated) * self.rate)
        self.updated = t
        if self.tokens < size:
            t += (size - self.tokens) / self.rate
            self.tokens, self.updated = float(size), t
        self.tokens -= size
        self.free_at = t
        return t


def burst_for(rate_bps: float) -> int:
    """Bucket size: 1 ms of line rate, at least two full-size packets (tbf needs burst >= rate / HZ)."""
    return max(3000, int(rate_bps / 8 * 1e-3))


async def _direction(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, spec: LinkSpec) -> None:
    """Relay one direction: each chunk leaves its bucket, then is written RTT/2 later (in order). Times are
    perf_counter seconds: uvloop's loop.time() only has millisecond resolution."""
    clock = time.perf_counter
    bucket = TokenBucket(spec.rate_bps / 8, burst_for(spec.rate_bps), clock()) if spec.rate_bps else None
    piece = bucket.burst if bucket else 1 << 20
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(maxsize=1024)  # full: TCP backpressure

    async def inbound() -> None:
        try:
            while data := await reader.read(65536):
                for i in range(0, len(data), piece):
                    chunk, now = data[i:i + piece], clock()
                    leave = bucket.depart(now, len(chunk)) if bucket else now
                    await queue.put((leave + spec.rtt_s / 2, chunk))
        except ConnectionError:
            pass  # the peer went away: end this direction like an EOF
        finally:
            await queue.put(None)

    async def outbound() -> None:
        while (item := await queue.get()) is not None:
            due, chunk = item
            if due > clock():
                await asyncio.sleep(due - clock())
            writer.write(chunk)
            await writer.drain()

    await asyncio.gather(inbound(), outbound())


class Relay:
    """The relay in this event loop: `relay = await Relay(upstream, spec).start()`, `relay.endpoint`,
    `await relay.close()`."""

    def __init__(self, upstream: str, spec: LinkSpec, host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream, self.spec, self.host, self.port = upstream, spec, host, port
        self.server: asyncio.Server | None = None
        self.endpoint = ""
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, sock=None) -> "Relay":
        """Listen on host:port, or on `sock` (a listening socket made elsewhere, e.g. inside a namespace)."""
        if sock is not None:
            self.server = await asyncio.start_server(self._connection, sock=sock)
        else:
            self.server = await asyncio.start_server(self._connection, self.host, self.port)
        host, port = self.server.sockets[0].getsockname()[:2]
        self.endpoint = f"tcp://{host}:{port}"
        return self

    async def _connection(self, client_r, client_w) -> None:
        up_host, up_port = _host_port(self.upstream)
        try:
            up_r, up_w = await asyncio.open_connection(up_host, up_port)
        except OSError:
            client_w.close()
            return
        self._writers |= {client_w, up_w}
        tasks = [asyncio.create_task(_direction(client_r, up_w, self.spec)),
                 asyncio.create_task(_direction(up_r, client_w, self.spec))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # one side closed: close both
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (up_w, client_w):
                self._writers.discard(w)
                w.close()

    async def close(self) -> None:
        """Close every connection (their handlers end normally, not cancelled), then the listening socket."""
        for w in list(self._writers):
            w.close()
        for _ in range(100):
            if not self._writers:
                break
            await asyncio.sleep(0.01)
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def _host_port(endpoint: str) -> tuple[str, int]:
    m = re.fullmatch(r"tcp://([\w.\-]+):(\d+)", endpoint)
    if not m:
        raise ValueError(f"the link relay needs a tcp://HOST:PORT endpoint, got {endpoint!r}")
    return m.group(1), int(m.group(2))


class LinkRelay:
    """`with LinkRelay(spec, broker_frontend) as link:` edges connect to `link.endpoint`. Without emulation
    (`spec.emulated` False) nothing runs and the endpoint is the broker's own."""

    def __init__(self, spec: LinkSpec, upstream: str, startup_timeout: float = 30.0, rate_by: str = "auto") -> None:
        self.spec, self.upstream, self.startup_timeout, self.rate_by = spec, upstream, startup_timeout, rate_by
        self.endpoint = upstream
        self.described = spec.describe()  # what ran: the relay says whether tbf or its token bucket paces
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LinkRelay":
        if not self.spec.emulated:
            return self
        self.proc = subprocess.Popen([sys.executable, "-m", "specrelay.bench.link", "--upstream", self.upstream,
                                      "--link", self.spec.label, "--rate-by", self.rate_by],
                                     stdout=subprocess.PIPE, text=True)
        started = json.loads(_readline(self.proc, self.startup_timeout))
        self.endpoint, self.described = started["listen"], started["link"]
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            raise TimeoutError("the link relay did not start")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the link relay exited with code {proc.wait()}")
    return line


def measure_rtt(endpoint: str, n: int = 20, timeout_s: float = 5.0) -> dict:
    """Round trip of a null request through `endpoint`: a VERIFY for a session nobody opened, which the broker
    answers at once with ERROR UNKNOWN_SESSION. The first (connection set-up) is not counted; median of n."""
    import zmq

    from ..common import protocol as P

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = int(timeout_s * 1000)
    sock.connect(endpoint)
    samples = []
    try:
        for i in range(n + 1):
            t0 = time.perf_counter()
            sock.send_multipart(P.encode(P.Verify(session=2**32 + 7, seq=i + 1, pos=1)))
            reply = P.decode(sock.recv_multipart())
            if not isinstance(reply, P.Error) or reply.code != P.ErrorCode.UNKNOWN_SESSION:
                raise RuntimeError(f"the null request got {reply!r}, not ERROR UNKNOWN_SESSION")
            if i:
                samples.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.005)
    finally:
        sock.close()
    samples.sort()
    return {"rtt_ms_measured": round(statistics.median(samples), 3), "rtt_ms_p10": round(samples[len(samples) // 10], 3),
            "rtt_ms_p90": round(samples[(9 * len(samples)) // 10], 3), "rtt_samples": len(samples)}


def main(argv: list[str] | None = None) -> int:
    from .runs import HelpFormatter

    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m specrelay.bench.link", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--upstream", required=True, help="tcp://HOST:PORT to relay to (the broker's frontend)")
    ap.add_argument("--link", default="0", help="RTT[,RATE], e.g. 50ms,20mbit")
    ap.add_argument("--port", type=int, default=0, help="port to listen on, 127.0.0.1 (0 = any free port)")
    ap.add_argument("--rate-by", choices=["auto", "tbf", "relay"], default="auto",
                    help="what limits the rate: tbf on a veth pair (root), the relay's token bucket, or tbf when "
                         "it can be set up here (auto)")
    args = ap.parse_args(argv)
    spec = LinkSpec.parse(args.link)
    from contextlib import ExitStack

    from . import netns

    with ExitStack() as stack:
        veth = None
        if spec.rate_bps and args.rate_by != "relay":
            try:
                veth = stack.enter_context(netns.VethTbf(spec.rate_bps))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                if args.rate_by == "tbf":
                    raise
                print(f"link: rate by the relay's token bucket (no tbf here: {exc})", file=sys.stderr)

        async def run() -> None:
            if veth is None:
                relay = await Relay(args.upstream, spec, port=args.port).start()
                relays, described = [relay], spec.describe()
            else:  # delay here, rate by tbf on the way through the namespace, then on to the broker
                forwarder = await Relay(args.upstream, LinkSpec()).start(sock=veth.listen_in_ns())
                relay = await Relay(forwarder.endpoint, LinkSpec(spec.rtt_s), port=args.port).start()
                relays, described = [relay, forwarder], spec.describe(veth.describe())
            print(json.dumps({"listen": relay.endpoint, "link": described}), flush=True)
            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            await stop.wait()
            for r in relays:
                await r.close()

        from ..runtime import run_async
        run_async(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
