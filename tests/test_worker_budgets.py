"""A cloud worker's budgets, pure (a real tiny target, no sockets): each client holds at most its share of the KV
store, each broker connection at most 1/brokers of the sessions and of the KV, only sessions idle for
evict_idle_s are ever evicted (before: an OPEN past max_sessions evicted the least recently used session whatever
its activity, and one client could fill the store), a queued VERIFY keeps its session from idling, and the
scheduler counts each connection's waiting requests (the worker refuses past its share)."""

from __future__ import annotations

import pytest
import torch

from specrelay.cloud_worker.config import SchedulerConfig, VerifierConfig
from specrelay.cloud_worker.kvcache import KVShape
from specrelay.cloud_worker.scheduler import Item, Scheduler
from specrelay.cloud_worker.verifier import Verifier
from specrelay.common import protocol as P
from specrelay.common.errors import Overloaded


def verifier(tiny_runners, slots: int = 1024, **config) -> tuple[Verifier, list[float]]:
    target, _ = tiny_runners
    now = [0.0]
    per_token = KVShape.of(target.model.config, torch.float32).bytes_per_token
    v = Verifier(target, VerifierConfig(max_cache_bytes=slots * per_token, evict_idle_s=10.0, **config),
                 clock=lambda: now[0])
    return v, now


def held(v: Verifier, peer: bytes) -> int:
    return sum(v.store.span(k).capacity for k in v.sessions if k[0] == peer)


def test_one_client_holds_at_most_its_share_of_the_kv_store(tiny_runners):
    v, _ = verifier(tiny_runners)
    with pytest.raises(Overloaded, match="this client holds its share"):
        for sid in range(100):
            v.open((b"\x00flood", sid), P.Open(sid, [5] * 60))
    assert held(v, b"\x00flood") <= v.store.capacity // 2
    for sid in range(4):  # the rest is everyone else's
        v.open((b"\x00legit", sid), P.Open(sid, [5] * 60))
    assert v.stats["evictions"] == 0 and v.stats["budget_refusals"] == 1


def test_a_client_s_connections_hold_one_share_of_the_kv_store_together(tiny_runners):
    v, _ = verifier(tiny_runners)
    client = b"\x00" + bytes(P.CLIENT_TAG)  # one client (a CURVE key) over 100 connections, a session on each
    with pytest.raises(Overloaded, match="this client holds its share"):
        for conn in range(100):
            v.open((client + conn.to_bytes(16, "big"), 1), P.Open(1, [5] * 60))
    assert sum(v.store.span(k).capacity for k in v.sessions) <= v.store.capacity // 2


def test_only_idle_sessions_are_evicted(tiny_runners):
    v, now = verifier(tiny_runners, max_sessions=4, client_kv_share=1.0)
    for sid in range(4):
        v.open((b"\x00a", sid), P.Open(sid, [5]))
    with pytest.raises(Overloaded, match="of the worker.s sessions|maximum of sessions"):
        v.open((b"\x00b", 9), P.Open(9, [5]))  # every session is active: none is evicted
    assert len(v.sessions) == 4 and v.stats["evictions"] == 0
    now[0] = 11.0
    v.touch((b"\x00a", 0))  # a VERIFY of session 0 is queued: it is not idle
    v.open((b"\x00b", 9), P.Open(9, [5]))
    assert (b"\x00a", 0) in v.sessions and (b"\x00a", 1) not in v.sessions and v.stats["evictions"] == 1


def test_each_broker_holds_its_share_of_the_sessions(tiny_runners):
    v, _ = verifier(tiny_runners, max_sessions=4, client_kv_share=1.0)
    v.brokers = 2
    for sid in range(2):
        v.open((b"\x00x", sid), P.Open(sid, [5]))
    with pytest.raises(Overloaded, match="this broker holds its share"):
        v.open((b"\x00y", 7), P.Open(7, [5]))  # a fresh client id of the same broker: the same budget
    for sid in range(2):
        v.open((b"\x01x", sid), P.Open(sid, [5]))  # the other broker's share is untouched
    assert len(v.sessions) == 4 and v.stats["evictions"] == 0


def test_the_scheduler_counts_each_connection_s_waiting_requests():
    class Contexts:
        sessions: dict = {}

        def cached(self, key) -> int:
            return 0

    s = Scheduler(SchedulerConfig(max_batch=2), Contexts())
    s.push(Item((b"c", 9), P.Open(9, [1]), 0.0, conn=2))
    for sid in range(5):
        s.push(Item((b"c", sid), P.Verify(sid, 1, 1), 0.0, conn=1))
    assert s.queued == {1: 5, 2: 1}
    s.plan(0.0, lambda it: None)
    assert s.queued[1] == 3 and s.queued[2] == 0  # two VERIFYs in the step, the OPEN handled
    s.drop({1})
    assert s.queued[1] == 0 and len(s) == 0


def test_the_broker_s_token_quota_is_no_larger_than_the_workers_share():
    """The broker let one client hold 1,048,576 prompt tokens beside a worker of 131,072 slots: now at most
    CLIENT_KV_SHARE of its live workers' KV slots (their own per-client share)."""
    from specrelay.broker.quotas import CLIENT_KV_SHARE, Quotas

    q = Quotas()
    assert q.refuse_open("c", new_session=True, extra_tokens=100_000) is None  # no worker reports its KV
    refusal = q.refuse_open("c", new_session=True, extra_tokens=70_000, kv_capacity=131_072)
    assert refusal is not None and f"limit {int(131_072 * CLIENT_KV_SHARE)}" in refusal
    assert q.refuse_open("c", new_session=True, extra_tokens=60_000, kv_capacity=131_072) is None
