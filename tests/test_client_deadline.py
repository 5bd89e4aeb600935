"""The client's waits, over real ZeroMQ against a scripted edge (a ROUTER in the test): `timeout` is the gap
between replies (a long generation that keeps replying never hits it), `deadline` bounds the whole call, an ipc://
endpoint nothing listens on fails in one line instead of waiting out the timeout, and `r.stats` has the types the
HTTP API's `speculative` object has (counts are ints, seconds floats)."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from specrelay.client import Client
from specrelay.common import protocol as P
from specrelay.common.errors import FatalError, GenerationTimeout
from specrelay.edge_worker.http.api import speculative

pytestmark = pytest.mark.timeout(60)
STATS = {"generated_tokens": 6, "cloud_calls": 3, "uplink_bytes": 120, "wall_s": 0.25, "draft_s": 0.01}


async def scripted_edge(sock, tokens: int, every_s: float) -> None:
    """Answer one GENERATE with `tokens` TOKENS, one every `every_s`, then DONE."""
    client, *frames = await sock.recv_multipart()
    msg = P.decode(frames)
    for i in range(tokens):
        await asyncio.sleep(every_s)
        await sock.send_multipart([client, *P.encode(P.Tokens(msg.request, [i + 1], f"t{i}"))])
    await sock.send_multipart([client, *P.encode(P.Done(msg.request, STATS))])


@pytest.fixture
async def edge_socket(zctx, tmp_path):
    sock = zctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path / 'edge.sock'}"
    sock.bind(endpoint)
    yield sock, endpoint
    sock.close()


async def test_timeout_is_a_gap_not_a_deadline(edge_socket, zctx):
    sock, endpoint = edge_socket
    edge = asyncio.create_task(scripted_edge(sock, tokens=12, every_s=0.1))  # 1.2 s in all, never a 0.5 s gap
    async with Client(endpoint, timeout=0.5, context=zctx) as client:
        result = await client.generate("x", max_new_tokens=12)
    await edge
    assert result.token_ids == list(range(1, 13))


async def test_deadline_bounds_the_whole_call_and_keeps_what_came(edge_socket, zctx):
    sock, endpoint = edge_socket
    edge = asyncio.create_task(scripted_edge(sock, tokens=40, every_s=0.1))
    async with Client(endpoint, timeout=0.5, deadline=1.0, context=zctx) as client:
        t0 = time.monotonic()
        with pytest.raises(GenerationTimeout, match="deadline of 1 s") as info:
            await client.generate("x", max_new_tokens=40)
        assert time.monotonic() - t0 < 3
    edge.cancel()
    committed = info.value.committed
    assert 0 < len(committed.token_ids) < 40 and committed.token_ids == list(range(1, len(committed.token_ids) + 1))
    assert committed.text == "".join(f"t{i}" for i in range(len(committed.token_ids)))


async def test_an_ipc_endpoint_nothing_listens_on_fails_fast(tmp_path, zctx):
    t0 = time.monotonic()
    with pytest.raises(FatalError, match="no edge worker listens on ipc://"):
        async with Client(f"ipc://{tmp_path / 'nope.sock'}", timeout=60, connect_timeout=0.5, context=zctx):
            pass
    assert time.monotonic() - t0 < 5  # not the 60 s timeout


async def test_stats_have_the_http_api_types(edge_socket, zctx):
    sock, endpoint = edge_socket
    edge = asyncio.create_task(scripted_edge(sock, tokens=1, every_s=0))
    async with Client(endpoint, context=zctx) as client:
        result = await client.generate("x")
    await edge
    over_http = speculative(STATS)
    assert {k: type(v) for k, v in result.stats.items()} == {k: type(over_http[k]) for k in STATS}
    assert result.stats["generated_tokens"] == 6 and isinstance(result.stats["wall_s"], float)


def test_timeout_and_deadline_must_be_positive():
    with pytest.raises(ValueError, match="deadline"):
        Client(deadline=0)
