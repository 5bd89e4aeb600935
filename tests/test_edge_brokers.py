"""An edge given several brokers, over real sockets on 127.0.0.1: sessions spread over the brokers, a lost broker's
sessions re-OPEN on another with their committed context (outputs identical to the target alone), new sessions
avoid it, replies count only from the session's broker, a silent broker is lost too, and readiness is "one broker
up". The brokers are test_edge_client's FakeCloud (a ROUTER answering with a real Verifier)."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
import zmq

from specrelay.common import protocol as P
from specrelay.common.errors import ErrorCode, FatalError
from specrelay.edge_worker.routing.links import DOWN, UP
from specrelay.edge_worker.routing.probe import probe_brokers
from specrelay.edge_worker.server import EdgeConfig, EdgeHealth, EdgeWorker
from specrelay.edge_worker.session import SessionConfig
from test_edge_client import N_NEW, PROMPTS, FakeCloud, drafter, greedy_refs, wait_until  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(90)


class Cloud(FakeCloud):
    """FakeCloud that also records the routing ids of the edges it hears (a broker's view of its edges)."""

    def __init__(self, ctx, runner) -> None:
        super().__init__(ctx, runner)
        self.peers: set[bytes] = set()

    async def run(self) -> None:
        while True:
            edge, *frames = await self.sock.recv_multipart()
            self.peers.add(edge)
            msg = P.decode(frames)
            if isinstance(msg, P.Heartbeat):
                continue
            reply = await self.handle(msg, edge)
            if reply is not None:
                await self.sock.send_multipart([edge, *P.encode(reply)])


class Brokers:
    """Two Clouds: `stop(i)` closes one's socket (its TCP connections drop, as when a broker is killed)."""

    def __init__(self, ctx, runner, n: int = 2) -> None:
        self.clouds = [Cloud(ctx, runner) for _ in range(n)]
        self.tasks = [asyncio.create_task(cloud.run()) for cloud in self.clouds]

    @property
    def endpoints(self) -> list[str]:
        return [cloud.endpoint for cloud in self.clouds]

    async def stop(self, i: int) -> None:
        self.tasks[i].cancel()
        await asyncio.gather(self.tasks[i], return_exceptions=True)
        self.clouds[i].sock.close(linger=0)

    async def close(self) -> None:
        for i, task in enumerate(self.tasks):
            if not task.done():
                await self.stop(i)


@pytest.fixture
async def brokers(zctx, tiny_runners):
    pair = Brokers(zctx, tiny_runners[0])
    yield pair
    await pair.close()


def edge(zctx, endpoints, drafter, tokenizer, **config) -> EdgeWorker:
    config = {"request_timeout_s": 10.0, "retry_budget_s": 20.0, "retry_backoff_s": 0.05, "linger_ms": 0,
              "heartbeat_s": 0.2} | config
    return EdgeWorker(endpoints, drafter, tokenizer, EdgeConfig(**config), context=zctx)


def opened_on(cloud: FakeCloud) -> set[int]:
    return {sid for kind, sid in cloud.seen if kind == "Open"}


async def test_sessions_spread_and_a_lost_broker_s_sessions_finish_on_the_other(zctx, brokers, drafter, tiny_runners,
                                                                                greedy_refs):
    tokenizer = tiny_runners[0].tokenizer
    prompts = PROMPTS * 4  # 16 sessions
    committed, lost = {"n": 0}, asyncio.Event()

    async def on_tokens(new: list[int]) -> None:
        committed["n"] += len(new)
        if committed["n"] >= 60 and not lost.is_set():
            lost.set()
            await brokers.stop(0)

    async with edge(zctx, brokers.endpoints, drafter, tokenizer) as running:
        await wait_until(lambda: running.ready)
        config = SessionConfig(max_new_tokens=N_NEW, draft_len=1)
        outs = await asyncio.gather(*(running.generate(greedy_refs[p][0], config, on_tokens) for p in prompts))
        assert lost.is_set() and running.links[0].state == DOWN and running.links[1].state == UP
        assert running.metrics.failovers > 0 and running.ready
    first, second = (opened_on(cloud) for cloud in brokers.clouds)
    assert first and second, "both brokers carry sessions"
    moved = first & second  # re-OPENed on the second broker
    assert moved == {sid for sid in first if brokers.clouds[1].opens.get(sid)}
    for sid in moved:  # with the whole committed context: the prompt and every token committed on the first
        reopen = brokers.clouds[1].opens[sid][0]
        assert len(reopen) > len(brokers.clouds[0].opens[sid][0])
    for prompt, (ids, _) in zip(prompts, outs):
        assert ids == greedy_refs[prompt][1]


async def test_new_sessions_avoid_a_lost_broker_and_use_it_again_when_it_is_back(zctx, brokers, drafter,
                                                                                  tiny_runners, greedy_refs):
    tokenizer = tiny_runners[0].tokenizer
    async with edge(zctx, brokers.endpoints, drafter, tokenizer) as running:
        await wait_until(lambda: len(running.links.up) == 2)
        await brokers.stop(0)
        await wait_until(lambda: running.links[0].state == DOWN)
        config = SessionConfig(max_new_tokens=4, draft_len=2)
        outs = await asyncio.gather(*(running.generate(greedy_refs[p][0], config) for p in PROMPTS * 2))
        assert not running.metrics.retries  # nothing was sent to the lost broker
        assert [ids for ids, _ in outs] == [greedy_refs[p][1][:4] for p in PROMPTS * 2]
        assert len(opened_on(brokers.clouds[1])) == 2 * len(PROMPTS)
        assert {running.links.choose(sid) for sid in range(1, 33)} == {1}
        # a broker on the same endpoint again: up, and new sessions go to both again
        revived = zctx.socket(zmq.ROUTER)
        revived.linger = 0
        revived.bind(brokers.endpoints[0])
        try:
            await wait_until(lambda: running.links[0].state == UP, timeout=15)
            assert {running.links.choose(sid) for sid in range(1, 33)} == {0, 1}
        finally:
            revived.close(linger=0)


async def test_replies_count_only_from_the_session_s_broker(zctx, brokers, drafter, tiny_runners, greedy_refs):
    tokenizer = tiny_runners[0].tokenizer
    async with edge(zctx, brokers.endpoints, drafter, tokenizer) as running:
        await wait_until(lambda: len(running.links.up) == 2)
        await wait_until(lambda: all(cloud.peers for cloud in brokers.clouds))  # heartbeats reached both
        brokers.clouds[0].delay = brokers.clouds[1].delay = 0.3
        config = SessionConfig(max_new_tokens=4, draft_len=2)
        task = asyncio.create_task(running.generate(greedy_refs[PROMPTS[0]][0], config))
        await wait_until(lambda: running.sessions_open == 1)
        route = next(iter(running._routes.values()))
        other = brokers.clouds[1 - route.link]
        # the other broker answers for the session (a wrong token): not the session's broker, so not its reply
        forged = P.Verdict(route.session.sid, 1, 0, 0)
        for edge_id in other.peers:
            await other.sock.send_multipart([edge_id, *P.encode(forged)])
        ids, _ = await task
        assert ids == greedy_refs[PROMPTS[0]][1][:4]
        assert running.links[1 - route.link].stats["stale_replies"] >= 1
        assert not opened_on(other)


async def test_a_silent_broker_that_answered_heartbeats_is_lost(zctx, brokers, drafter, tiny_runners, greedy_refs):
    """A broker that echoes the edge's HEARTBEATs and then stops answering anything (hung, not disconnected):
    lost after the grace, and its sessions finish on the other broker."""
    tokenizer = tiny_runners[0].tokenizer
    async with edge(zctx, brokers.endpoints, drafter, tokenizer) as running:
        await wait_until(lambda: all(cloud.peers for cloud in brokers.clouds))
        for edge_id in brokers.clouds[0].peers:  # as a broker that echoes heartbeats would
            await brokers.clouds[0].sock.send_multipart([edge_id, *P.encode(P.Heartbeat())])
        await wait_until(lambda: running.links[0].echoes)
        brokers.clouds[0].silent = True  # receives, never answers: the socket stays connected
        config = SessionConfig(max_new_tokens=8, draft_len=2)
        outs = await asyncio.gather(*(running.generate(greedy_refs[p][0], config) for p in PROMPTS * 2))
        assert running.links[0].state == DOWN and running.links[0].connected and running.links[0].beating
        assert [ids for ids, _ in outs] == [greedy_refs[p][1][:8] for p in PROMPTS * 2]
        for edge_id in brokers.clouds[0].peers:  # it answers again: up again
            await brokers.clouds[0].sock.send_multipart([edge_id, *P.encode(P.Heartbeat())])
        await wait_until(lambda: running.links[0].state == UP)


async def test_readiness_is_one_broker_up_and_the_body_names_them(zctx, brokers, drafter, tiny_runners):
    async with (edge(zctx, brokers.endpoints, drafter, tiny_runners[0].tokenizer) as running,
                EdgeHealth(running, None, "127.0.0.1", 0) as health):
        await wait_until(lambda: len(running.links.up) == 2)
        status, body = await asyncio.to_thread(_get, health.port, "/readyz")
        assert status == 200 and all(e in body for e in brokers.endpoints)
        await brokers.stop(0)
        await wait_until(lambda: running.links[0].state == DOWN)
        status, body = await asyncio.to_thread(_get, health.port, "/readyz")
        assert status == 200 and '"down"' in body
        metrics = (await asyncio.to_thread(_get, health.port, "/metrics"))[1]
        assert f'specrelay_edge_broker_up{{broker="{brokers.endpoints[0]}"}} 0.0' in metrics
        assert f'specrelay_edge_broker_up{{broker="{brokers.endpoints[1]}"}} 1.0' in metrics
        await brokers.stop(1)
        await wait_until(lambda: not running.ready)
        status, _ = await asyncio.to_thread(_get, health.port, "/readyz")
        assert status == 503


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def fake_broker(router, has_worker) -> None:
    """A broker's answers to the probe: UNAVAILABLE while `has_worker()` is False, else a VERDICT."""
    while True:
        peer, *frames = await router.recv_multipart()
        msg = P.decode(frames)
        if isinstance(msg, P.Verify):
            reply = P.Verdict(msg.session, msg.seq, 0, 5) if has_worker() else \
                P.Error(msg.session, msg.seq, ErrorCode.UNAVAILABLE, "no cloud worker is registered")
            await router.send_multipart([peer, *P.encode(reply)])


async def test_the_probe_succeeds_through_any_broker_with_a_live_worker_and_says_which(zctx):
    routers = [zctx.socket(zmq.ROUTER) for _ in range(2)]
    endpoints = [f"tcp://127.0.0.1:{r.bind_to_random_port('tcp://127.0.0.1')}" for r in routers]
    worker_on = {"b": False}
    tasks = [asyncio.create_task(fake_broker(routers[0], lambda: False)),
             asyncio.create_task(fake_broker(routers[1], lambda: worker_on["b"]))]
    notices: list[str] = []
    try:
        with pytest.raises(FatalError) as info:
            await probe_brokers(endpoints, 1.0, context=zctx)
        assert all(e in str(info.value) for e in endpoints) and "no live cloud worker" in str(info.value)
        asyncio.get_running_loop().call_later(2.5, lambda: worker_on.update(b=True))
        found = await probe_brokers(endpoints, 20.0, context=zctx, on_wait=notices.append)
        assert found == endpoints[1]
        assert len(notices) == 1 and all(e in notices[0] for e in endpoints), notices
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for router in routers:
            router.close(linger=0)


def test_the_broker_answers_an_edge_heartbeat():
    """Pure: the Router echoes an edge's HEARTBEAT (what lets an edge of several brokers tell a silent broker)."""
    from specrelay.broker.routing import Router
    from specrelay.broker.table import FRONTEND

    actions = Router().from_edge([b"edge-1", *P.encode(P.Heartbeat())], 0.0)
    assert [(socket, frames[0], type(P.decode(frames[1:]))) for socket, frames in actions] == \
        [(FRONTEND, b"edge-1", P.Heartbeat)]


async def test_an_edge_learns_that_a_real_broker_answers_its_heartbeats(zctx, drafter, tiny_runners):
    from specrelay.broker.server import Broker

    async with Broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", context=zctx, linger_ms=0) as broker:
        async with edge(zctx, [broker.frontend], drafter, tiny_runners[0].tokenizer) as running:
            await wait_until(lambda: running.links[0].echoes and running.links[0].state == UP)


async def test_a_broker_that_never_answers_costs_nothing_but_a_retry(zctx, brokers, drafter, tiny_runners,
                                                                       greedy_refs):
    """One of the brokers is not there from the start (nothing listens): sessions hashed to it move to the live one
    as soon as the connection is refused, and every output is the target's."""
    from specrelay.cluster import free_port

    dead = f"tcp://127.0.0.1:{free_port()}"
    tokenizer = tiny_runners[0].tokenizer
    async with edge(zctx, [dead, brokers.endpoints[1]], drafter, tokenizer) as running:
        config = SessionConfig(max_new_tokens=6, draft_len=2)
        outs = await asyncio.gather(*(running.generate(greedy_refs[p][0], config) for p in PROMPTS * 4))
        assert running.links[0].state == DOWN and running.ready
    assert [ids for ids, _ in outs] == [greedy_refs[p][1][:6] for p in PROMPTS * 4]
