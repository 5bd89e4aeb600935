"""common/health.py's HTTP responder under idle and slow connections, in-process (the real-process check of every
role is tests/test_http_guards.py): past MAX_CONNECTIONS the oldest connection is closed so a probe still gets
its answer, and a connection that never sends its request is closed after READ_TIMEOUT."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from specrelay.common import health


async def _get(port: int, path: str = "/healthz") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.0\r\n\r\n".encode())
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def test_more_idle_connections_than_the_cap_never_keep_a_probe_out(monkeypatch):
    monkeypatch.setattr(health, "READ_TIMEOUT", 60.0)  # only the cap closes connections here
    endpoints = health.Endpoints(lambda: (True, {}), lambda: (True, {}), CollectorRegistry())
    server = await health.start_http("127.0.0.1", 0, endpoints)
    port = server.sockets[0].getsockname()[1]
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(health.MAX_CONNECTIONS + 44)]
    try:
        t0 = time.monotonic()
        assert (await _get(port)).startswith(b"HTTP/1.0 200")
        assert time.monotonic() - t0 < 1
        closed = [await _closed_within(reader, 5) for reader, _ in idle[:44]]
        assert all(closed), "the oldest connections make room for the newcomers"
        assert not await _closed_within(idle[-1][0], 0.5), "the newest idle connection stays open"
    finally:
        for _, writer in idle:
            writer.close()
        server.close()


async def test_a_connection_that_never_sends_its_request_is_closed():
    endpoints = health.Endpoints(lambda: (True, {}), lambda: (True, {}), CollectorRegistry())
    server = await health.start_http("127.0.0.1", 0, endpoints)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    writer.write(b"GET /heal")  # never finished
    t0 = time.monotonic()
    assert await asyncio.wait_for(reader.read(), health.READ_TIMEOUT + 10) == b""
    assert time.monotonic() - t0 >= health.READ_TIMEOUT - 0.5
    writer.close()
    server.close()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except ConnectionError:  # closed with a reset (abort)
        return True
    except asyncio.TimeoutError:
        return False
