"""One cloud worker given several brokers, over real sockets (the test plays each broker with a ROUTER, as in
test_cloud_worker): it registers with every broker, serves them all from one KV store with sessions keyed per
broker (the same client id and session id on two brokers are two sessions), replies on the connection a request
came in on, and a reset of one broker's connection drops only that broker's sessions and queued work; heartbeats
report the worker's real totals to each broker; /readyz holds while one broker is alive."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specrelay.cloud_worker.server import CloudWorker, WorkerConfig
from specrelay.common import protocol as P
from specrelay.common.errors import ErrorCode
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.edge_worker.session import EdgeSession, SessionConfig
from specrelay.speculative import next_request
from test_cloud_worker import PROMPTS, FakeBroker, drive, ids_of, wait_until

pytestmark = pytest.mark.timeout(60)

N_NEW = 16


@pytest.fixture
async def two_brokers(zctx):
    brokers = [FakeBroker(zctx), FakeBroker(zctx)]
    yield brokers
    for broker in brokers:
        await broker.close()


@pytest.fixture
async def worker(zctx, tiny_runners, two_brokers):
    config = WorkerConfig(heartbeat_interval=0.1, linger_ms=0, max_wait_ms=20)
    running = await CloudWorker([b.endpoint for b in two_brokers], tiny_runners[0], config,
                                context=zctx).__aenter__()
    for broker in two_brokers:
        await broker.ready()
    yield running
    await running.stop()


def reference(target, prompt: str) -> list[int]:
    ids = ids_of(target, prompt)
    out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=N_NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def session(tiny_runners, prompt: str, sid: int = 1) -> EdgeSession:
    target, draft = tiny_runners
    return EdgeSession(ids_of(target, prompt), SessionConfig(max_new_tokens=N_NEW, draft_len=3),
                       Drafter(draft, target.vocab_size), sid=sid)


async def test_one_kv_store_serves_every_broker_and_equal_ids_never_collide(two_brokers, worker, tiny_runners):
    """Both brokers send client id b"e", session 1 (their handles may well be equal): two sessions, each exact,
    each broker getting the replies of its own requests only."""
    a, b = two_brokers
    sessions = [session(tiny_runners, PROMPTS[0]), session(tiny_runners, PROMPTS[1])]
    outs = await asyncio.gather(drive(a, b"e", sessions[0]), drive(b, b"e", sessions[1]))
    assert outs == [reference(tiny_runners[0], PROMPTS[0]), reference(tiny_runners[0], PROMPTS[1])]
    assert 2 in worker.stats["batch_sizes"]  # one forward pass held both brokers' sessions
    assert a.queue(b"e").empty() and b.queue(b"e").empty()  # nothing more came back than was asked for
    await wait_until(lambda: worker.stats["sessions_open"] == 0)


async def test_a_reset_of_one_broker_drops_only_its_sessions(two_brokers, worker, tiny_runners):
    a, b = two_brokers
    target = tiny_runners[0]
    on_a, on_b = session(tiny_runners, PROMPTS[0]), session(tiny_runners, PROMPTS[1])
    for broker, s in ((a, on_a), (b, on_b)):
        await broker.send(b"e", s.open_message())
        await broker.send(b"e", next_request(s))
        s.apply(await broker.reply(b"e"))
    await b.send(b"e", next_request(on_b))  # queued on the worker while broker A goes away
    assert worker.stats["broker_sessions_per_broker"] == {a.endpoint: 1, b.endpoint: 1}
    await a.sock.send_multipart([a.worker, b"", *P.encode(P.Disconnect(reason="broker restarting"))])
    await a.ready(2)  # the worker registered with A again at once
    await wait_until(lambda: worker.stats["broker_resets_per_broker"][a.endpoint] == 1)
    assert worker.stats["broker_sessions_per_broker"] == {a.endpoint: 0, b.endpoint: 1}
    on_b.apply(await b.reply(b"e"))  # B's queued VERIFY survived A's reset
    while not on_b.done:
        await b.send(b"e", next_request(on_b))
        on_b.apply(await b.reply(b"e"))
    assert on_b.generated == reference(target, PROMPTS[1])
    await a.send(b"e", next_request(on_a))  # A's session is gone: the edge will re-OPEN it
    reply = await a.reply(b"e")
    assert isinstance(reply, P.Error) and reply.code == ErrorCode.UNKNOWN_SESSION
    assert worker.stats["broker_resets_per_broker"][b.endpoint] == 0


async def test_heartbeats_report_the_worker_s_totals_to_every_broker(two_brokers, worker, tiny_runners):
    a, b = two_brokers
    await a.send(b"e", P.Open(1, ids_of(tiny_runners[0], PROMPTS[0])))
    await b.send(b"e", P.Open(1, ids_of(tiny_runners[0], PROMPTS[1])))
    for broker in (a, b):
        await wait_until(lambda: any(m.load == 2 for _, m, _ in broker.of_type(P.Heartbeat)))
        beat = [m for _, m, _ in broker.of_type(P.Heartbeat) if m.load == 2][-1]
        assert beat.kv_free == worker.verifier.kv_free_tokens  # the one store's free memory, not a share
        assert beat.kv_free < (await broker.ready()).kv_capacity


async def test_ready_while_one_broker_is_alive_and_the_body_names_each(zctx, tiny_runners):
    alive, silent = FakeBroker(zctx), FakeBroker(zctx, heartbeat=None)
    config = WorkerConfig(heartbeat_interval=0.1, linger_ms=0)
    try:
        async with CloudWorker(f"{alive.endpoint},{silent.endpoint}", tiny_runners[0], config,
                               context=zctx) as running:
            await alive.ready()
            await silent.ready()
            await wait_until(lambda: running.connections[0].alive and not running.connections[1].alive)
            ok, body = running._readyz()
            assert ok and body["brokers"][alive.endpoint]["alive"] and not body["brokers"][silent.endpoint]["alive"]
            assert running.stats["broker_alive_per_broker"] == {alive.endpoint: 1, silent.endpoint: 0}
            await alive.close()
            await wait_until(lambda: not running._readyz()[0])
    finally:
        await silent.close()
        if not alive.sock.closed:
            await alive.close()


def test_the_scheduler_drops_one_broker_s_generation_and_keeps_the_other_s_equal_keys():
    """Pure: the same client id and session through brokers 0 and 1 are two keys; dropping broker 0's lost
    connection (0, generation 1) removes its requests and nothing of broker 1's, nor of broker 0's next one."""
    from specrelay.cloud_worker.config import SchedulerConfig
    from specrelay.cloud_worker.connection import broker_peer
    from specrelay.cloud_worker.scheduler import Item, Scheduler

    class Contexts:
        sessions: dict = {}

        def cached(self, key) -> int:
            return 0

    s = Scheduler(SchedulerConfig(max_batch=8), Contexts())
    keys = [(broker_peer(0, b"e"), 1), (broker_peer(1, b"e"), 1)]
    assert keys[0] != keys[1]
    for key, conn in ((keys[0], (0, 1)), (keys[1], (1, 1)), (keys[0], (0, 2))):
        s.push(Item(key, P.Verify(1, 1, 1), 0.0, conn))
    stale = s.drop({(0, 1)})
    assert [i.conn for i in stale] == [(0, 1)] and [i.conn for i in s.queue] == [(1, 1), (0, 2)]
