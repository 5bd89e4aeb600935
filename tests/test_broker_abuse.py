"""The Router under hostile input (pure: no sockets): ownership, booking only what a worker accepted, per-client
quotas, silent edges, routing ids reused by another key, and a bounded answer rate for bad requests."""

from __future__ import annotations

import msgspec
import pytest

from specrelay.broker.quotas import Limits
from specrelay.broker.routing import Router
from specrelay.broker.table import BACKEND, FRONTEND
from specrelay.common import protocol
from specrelay.common.errors import ErrorCode
from specrelay.common.protocol import MsgType

EDGE, VICTIM, ATTACKER = b"edge-1", b"victim", b"attacker"
W1, W2 = b"worker-1", b"worker-2"


def ready(router: Router, worker: bytes, now: float = 0.0):
    return router.from_worker([worker, b"", *protocol.encode(protocol.Ready())], now)


def edge_send(router, msg, edge=EDGE, now=0.0, user=None):
    frames = protocol.encode(msg) if isinstance(msg, protocol.Base) else msg
    return router.from_edge([edge, *frames], now, user=user)


def worker_send(router, worker, msg, client=EDGE, now=0.0):
    return router.from_worker([worker, router.handles.of(client) if client else b"", *protocol.encode(msg)], now)


def errors_to(actions, edge=EDGE) -> list[protocol.Error]:
    return [m for s, f in actions if s == FRONTEND and f[0] == edge for m in [protocol.decode(f[1:])]
            if isinstance(m, protocol.Error)]


def open_(session, n=3):
    return protocol.Open(session=session, tokens=list(range(1, n + 1)))


@pytest.fixture
def router() -> Router:
    r = Router(limits=Limits(max_sessions_per_client=8, max_prompt_tokens_per_client=100, edge_ttl=5.0,
                             bad_replies_per_s=10))
    ready(r, W1)
    ready(r, W2)
    return r


def test_a_worker_cannot_reply_for_a_session_it_does_not_hold(router):
    edge_send(router, open_(1), edge=VICTIM)  # on W1
    edge_send(router, protocol.Verify(1, 1, 3, [], [4]), edge=VICTIM)
    injected = protocol.Error(session=1, seq=1, code=ErrorCode.BAD_REQUEST, message="forged")
    assert worker_send(router, W2, injected, client=VICTIM) == []
    assert worker_send(router, W2, protocol.Verdict(1, 1, 0, 666), client=VICTIM) == []
    assert router.stats.foreign_replies == 2
    assert router.sessions[(VICTIM, 1)].in_flight == [(MsgType.OPEN, 0), (MsgType.VERIFY, 1)]
    verdict = protocol.Verdict(1, 1, 1, 5)
    assert worker_send(router, W1, verdict, client=VICTIM) == [(FRONTEND, [VICTIM, *protocol.encode(verdict)])]
    assert router.sessions[(VICTIM, 1)].booked


def test_a_refused_open_is_never_booked(router):
    """The worker answers ERROR to an OPEN it cannot take: the broker frees the session and the quota."""
    for sid in range(1, 1025):  # far more than the client's session quota of 8
        out = edge_send(router, open_(sid))
        (_, frames), = out
        assert frames[0] in (W1, W2)
        error = protocol.Error(session=sid, seq=0, code=ErrorCode.BAD_REQUEST, message="bad tokens")
        assert errors_to(worker_send(router, frames[0], error))[0].code == ErrorCode.BAD_REQUEST
    assert router.stats.sessions_open == 0 and router.quotas.usage == {} and router.stats.rejected_opens == 1024
    out = edge_send(router, open_(5000), edge=VICTIM)  # nobody is locked out
    assert out[0][0] == BACKEND


def test_malformed_opens_never_reach_a_worker_or_book_anything(router):
    for sid in range(1, 200):
        body = msgspec.msgpack.encode([sid, "not a list"])
        assert all(s == FRONTEND for s, _ in edge_send(router, [protocol.header(MsgType.OPEN), body]))
    assert router.stats.sessions_open == 0 and router.stats.bad_requests == 199
    assert router.stats.bad_requests_unanswered == 199 - 10  # answered while the budget (burst 10) lasts


def test_per_client_session_and_token_quotas(router):
    for sid in range(1, 9):
        assert edge_send(router, open_(sid), edge=ATTACKER)[0][0] == BACKEND
    refused = errors_to(edge_send(router, open_(9), edge=ATTACKER), ATTACKER)
    assert refused[0].code == ErrorCode.UNAVAILABLE and "8 sessions" in refused[0].message
    assert edge_send(router, open_(1), edge=VICTIM)[0][0] == BACKEND  # other clients are not affected
    refused = errors_to(edge_send(router, open_(2, n=101), edge=VICTIM), VICTIM)
    assert refused[0].code == ErrorCode.UNAVAILABLE and "prompt tokens" in refused[0].message
    assert router.stats.quota_refusals == 2 and (VICTIM, 2) not in router.sessions


def test_keys_share_one_quota_across_connections(router):
    for i in range(8):
        edge_send(router, open_(1), edge=b"conn-%d" % i, user="KEY")
    refused = errors_to(edge_send(router, open_(1), edge=b"conn-9", user="KEY"), b"conn-9")
    assert refused[0].code == ErrorCode.UNAVAILABLE
    assert edge_send(router, open_(1), edge=b"conn-10", user="OTHER")[0][0] == BACKEND


def test_a_silent_edge_has_its_sessions_closed(router):
    edge_send(router, open_(1), now=0.0)
    edge_send(router, open_(2), now=0.0)
    edge_send(router, protocol.Heartbeat(), now=4.0)  # alive at t = 4: expires at t = 9
    for worker in (W1, W2):  # the workers stay alive
        worker_send(router, worker, protocol.Heartbeat(), client=b"", now=8.0)
    assert all(f[1] == b"" for _, f in router.tick(8.9))  # worker heartbeats only: the edge is still alive
    actions = router.tick(9.0)
    closes = [(f[0], protocol.decode(f[2:])) for s, f in actions if s == BACKEND and f[1] == router.handles.of(EDGE)]
    assert sorted((w, m.session) for w, m in closes) == [(W1, 1), (W2, 2)]
    assert all(isinstance(m, protocol.Close) for _, m in closes)
    assert router.stats.sessions_open == 0 and router.stats.live_edges == 0 and router.stats.edges_expired == 1


def test_a_routing_id_reused_by_another_key_cannot_reach_the_old_sessions(router):
    edge_send(router, open_(1), edge=EDGE, user="VICTIM-KEY")
    actions = edge_send(router, protocol.Verify(1, 1, 3, [], [4]), edge=EDGE, user="ATTACKER-KEY")
    closes = [protocol.decode(f[2:]) for s, f in actions if s == BACKEND]
    assert [type(m) for m in closes] == [protocol.Close]  # the victim's session is closed on its worker
    assert errors_to(actions)[0].code == ErrorCode.UNKNOWN_SESSION  # and the attacker reaches nothing


def test_a_worker_error_that_drops_the_session_frees_it(router):
    edge_send(router, open_(1))
    worker_send(router, W1, protocol.Verdict(1, 0, 0, 5))  # booked (a verdict for the pipelined VERIFY)
    edge_send(router, protocol.Verify(1, 2, 4, [], [4]))
    worker_send(router, W1, protocol.Error(1, 2, ErrorCode.UNKNOWN_SESSION, "evicted"))
    assert router.sessions == {} and router.quotas.usage == {}


def test_gauges_return_to_zero(router):
    for sid in range(1, 5):
        edge_send(router, open_(sid))
        edge_send(router, protocol.Verify(sid, 1, 3, [], [4]))
    router.tick(100.0)  # every worker and the edge expired
    s = router.stats
    assert (s.sessions_open, s.live_workers, s.live_edges) == (0, 0, 0) and router.quotas.usage == {}


def test_worker_load_reports_are_clamped_to_what_it_declared():
    """A worker claiming more free KV memory than its READY capacity, a negative load, or no capacity at all
    cannot draw every new session: its figures are clamped to what it declared and was given, and no worker
    takes more than 1.5x the mean session count (+4) while another has room."""
    r = Router()
    r.from_worker([W1, b"", *protocol.encode(protocol.Ready(max_sessions=100, kv_capacity=10_000))], 0.0)
    r.from_worker([W2, b"", *protocol.encode(protocol.Ready(max_sessions=10**9, kv_capacity=0))], 0.0)
    r.from_worker([b"w3", b"", *protocol.encode(protocol.Ready(max_sessions=100, kv_capacity=1_000))], 0.0)
    worker_send(r, b"w3", protocol.Heartbeat(load=-5, kv_free=10**9), client=b"")
    assert (r.workers[b"w3"].kv_free, r.workers[b"w3"].kv_load) == (1_000, 0)
    for sid in range(1, 61):
        edge_send(r, open_(sid))
        honest = r.workers[W1]
        worker_send(r, W1, protocol.Heartbeat(load=len(honest.sessions), kv_free=10_000 - 250 * len(honest.sessions)),
                    client=b"")
        worker_send(r, b"w3", protocol.Heartbeat(load=0, kv_free=10**9), client=b"")  # "still empty"
    counts = {w: len(r.workers[w].sessions) for w in (W1, W2, b"w3")}
    assert max(counts.values()) <= 1.5 * 60 / 3 + 4 and counts[W1] > 0, counts  # before: w3 took all 60


def test_a_worker_routing_id_speaks_only_for_the_key_that_registered_it():
    """After a link blip another worker key reconnects under a registered worker's routing id: its heartbeats
    and replies are not that worker's (dropped, told to register); its READY replaces the worker, whose sessions
    are answered WORKER_LOST and inherited by nobody."""
    r = Router()
    r.from_worker([W1, b"", *protocol.encode(protocol.Ready())], 0.0, user="WORKER-KEY")
    edge_send(r, open_(1))
    assert r.from_worker([W1, b"", *protocol.encode(protocol.Heartbeat())], 0.0, user="OTHER-KEY") == [
        (BACKEND, [W1, b"", *protocol.encode(protocol.Disconnect(reason="unknown worker: send READY to register"))])]
    forged = protocol.encode(protocol.Verdict(1, 0, 0, 5))
    assert all(s == BACKEND for s, _ in r.from_worker([W1, r.handles.of(EDGE), *forged], 0.0, user="OTHER-KEY"))
    assert r.stats.unknown_worker_messages == 2 and r.sessions[(EDGE, 1)].worker == W1
    actions = r.from_worker([W1, b"", *protocol.encode(protocol.Ready())], 0.0, user="OTHER-KEY")
    assert [e.code for e in errors_to(actions)] == [ErrorCode.WORKER_LOST] and r.sessions == {}
    assert r.workers[W1].user == "OTHER-KEY"
