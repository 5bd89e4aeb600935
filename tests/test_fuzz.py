"""Fuzzing: hypothesis against the pure Router, and raw hostile bytes (specrelay.bench.attacks) at the broker's frontend and
backend and at a cloud worker, with legit greedy sessions running alongside that must equal the target alone."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrelay.broker.routing import Router
from specrelay.broker.server import Broker
from specrelay.broker.quotas import Limits
from specrelay.cloud_worker.server import CloudWorker, WorkerConfig
from specrelay.common import protocol as P
from specrelay.common import transport
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.edge_worker.server import EdgeConfig, EdgeWorker
from specrelay.edge_worker.session import SessionConfig
from specrelay.bench.attacks import Fuzzer
from specrelay.speculative import next_request

PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in", "import os\n"]
N_NEW = 24
N_ATTACK = 10_000

# ---------------------------------------------------------------------------------------------- pure Router

values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() |
                      st.binary(max_size=12) | st.text(max_size=6),
                      lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=3), inner,
                                                                                   max_size=3), max_leaves=12)
headers = st.binary(min_size=0, max_size=3) | st.tuples(st.sampled_from([P.PROTOCOL_VERSION, 1, 7]),
                                                         st.integers(0, 255)).map(bytes)
bodies = st.binary(max_size=40) | values.map(msgspec.msgpack.encode) | \
    st.lists(st.integers(0, 2**63), min_size=1, max_size=4).map(msgspec.msgpack.encode)
messages = st.tuples(st.sampled_from(["edge", "worker"]), st.integers(0, 3), headers, bodies,
                     st.lists(st.binary(max_size=4), max_size=3))


def check_invariants(router: Router) -> None:
    """The tables agree with each other whatever came in."""
    assert router.stats.sessions_open == len(router.sessions)
    for (edge, sid), session in router.sessions.items():
        assert (edge, sid) in router.workers[session.worker].sessions
        assert (edge, sid) in router.peers[edge].sessions
    for client, usage in router.quotas.usage.items():
        mine = [s for s in router.sessions.values() if s.client == client]
        assert usage.sessions == len(mine) > 0
        assert usage.in_flight == sum(len(s.in_flight) for s in mine) >= 0
        assert usage.tokens == sum(s.tokens for s in mine)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages, min_size=1, max_size=40))
def test_router_survives_any_input(batch):
    router = Router(limits=Limits(max_sessions_per_client=4, max_prompt_tokens_per_client=64))
    router.from_worker([b"w1", b"", *P.encode(P.Ready())], 0.0)
    now = 0.0
    for side, peer, header, body, extra in batch:
        now += 0.5
        who = b"peer-%d" % peer
        if side == "edge":
            router.from_edge([who, header, body, *extra], now)
            router.from_edge([who, *P.encode(P.Open(peer + 1, [1, 2]))], now)  # legit traffic interleaved
        else:
            router.from_worker([b"w1", router.handles.of(who), header, body, *extra], now)
        router.tick(now)
        check_invariants(router)


# ---------------------------------------------------------------------------------------------- raw bytes

@pytest.fixture(scope="module")
def greedy_refs(tiny_runners):
    target = tiny_runners[0]
    refs = {}
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt).input_ids
        refs[prompt] = target.model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False)[0, len(ids):]
    return {p: r.tolist() for p, r in refs.items()}


async def legit_sessions(edge: EdgeWorker, refs: dict, rounds: int) -> None:
    for _ in range(rounds):
        outs = await asyncio.gather(*(edge.generate(edge.tokenizer(p).input_ids, SessionConfig(N_NEW, draft_len=2))
                                      for p in PROMPTS))
        assert {p: ids for p, (ids, _) in zip(PROMPTS, outs)} == refs


async def flood(sock, make, n: int) -> None:
    for i in range(n):
        transport.send_nowait(sock, make())
        if i % 200 == 0:
            await asyncio.sleep(0.005)  # let the queues drain: a bounded flood, not a full send queue


@pytest.mark.timeout(240)
async def test_broker_and_worker_under_a_raw_flood_keep_legit_sessions_exact(zctx, tiny_runners, greedy_refs):
    target, draft = tiny_runners
    fuzz = Fuzzer(seed=1, vocab_size=target.vocab_size)
    async with Broker("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", context=zctx, linger_ms=0) as broker:
        async with CloudWorker(broker.backend, target, WorkerConfig(linger_ms=0), context=zctx) as worker:
            edge = EdgeWorker(broker.frontend, Drafter(draft, target.vocab_size), target.tokenizer,
                              EdgeConfig(request_timeout_s=30, linger_ms=0), context=zctx)
            attacker = transport.make_socket(zctx, zmq.DEALER, linger_ms=0)
            rogue = transport.make_socket(zctx, zmq.DEALER, linger_ms=0)
            attacker.connect(broker.frontend)
            rogue.connect(broker.backend)
            rogue.send_multipart([b"", *P.encode(P.Ready(max_sessions=5))])  # a registered rogue worker
            try:
                async with edge:
                    t0 = time.monotonic()
                    await asyncio.gather(
                        legit_sessions(edge, greedy_refs, rounds=3),
                        flood(attacker, lambda: fuzz.malformed() if fuzz.rng.random() < 0.7 else fuzz.abusive(),
                              N_ATTACK),
                        flood(rogue, fuzz.worker_reply, N_ATTACK))
                    elapsed = time.monotonic() - t0
            finally:
                attacker.close(linger=0)
                rogue.close(linger=0)
            stats = broker.stats
            assert stats["frontend_in"] >= N_ATTACK and stats["backend_in"] >= N_ATTACK
            assert stats["bad_requests"] > 0 and stats["bad_worker_messages"] + stats["foreign_replies"] > 0
            # the rogue is dropped (no heartbeats) and re-registers when its garbage holds a READY; the real worker
            # is never declared lost: it never had to reconnect and is still registered
            assert worker.stats["reconnects"] == 0 and worker.stats["bad_requests"] > 0
            assert any(w.model == target.name for w in broker.router.workers.values())
            assert elapsed < 180


@pytest.mark.timeout(120)
async def test_worker_under_a_raw_flood_keeps_a_legit_session_exact(zctx, tiny_runners, greedy_refs):
    """Hostile frames straight at a worker (a fake broker ROUTER), interleaved with a legit session."""
    from specrelay.edge_worker.session import EdgeSession

    target, draft = tiny_runners
    fuzz = Fuzzer(seed=2, vocab_size=target.vocab_size)
    router = transport.make_socket(zctx, zmq.ROUTER, linger_ms=0, mandatory=True)
    endpoint = transport.bind(router, "tcp://127.0.0.1:0", "test broker")
    async with CloudWorker(endpoint, target, WorkerConfig(linger_ms=0), context=zctx) as worker:
        identity, *ready = await router.recv_multipart()
        assert isinstance(P.decode(ready[1:]), P.Ready)
        prompt = PROMPTS[0]
        session = EdgeSession(target.tokenizer(prompt).input_ids, SessionConfig(N_NEW, draft_len=2),
                              Drafter(draft, target.vocab_size), sid=7)
        legit = b"legit"
        await router.send_multipart([identity, legit, *P.encode(session.open_message())])
        sent = 0
        while not session.done:
            for _ in range(N_ATTACK // 20):
                frames = fuzz.malformed() if fuzz.rng.random() < 0.5 else fuzz.abusive()
                transport.send_nowait(router, [identity, b"attacker", *frames])
                sent += 1
            await router.send_multipart([identity, legit, *P.encode(next_request(session))])
            while True:  # replies to the attacker are skipped; the legit one comes in order
                peer, *frames = await asyncio.wait_for(router.recv_multipart(), 30)
                if frames[0] == legit:
                    session.apply(P.decode(frames[1:]))
                    break
        assert session.generated == greedy_refs[prompt]
        assert sent >= N_ATTACK // 2 and worker.stats["bad_requests"] > 0 and worker.stats["internal_errors"] == 0
    router.close(linger=0)
