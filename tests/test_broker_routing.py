"""The broker's pure routing core: events in, (socket, frames) actions out, time passed by hand."""

from __future__ import annotations

import pytest

from specrelay.broker.liveness import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS
from specrelay.broker.quotas import Limits
from specrelay.broker.routing import Router
from specrelay.broker.table import BACKEND, FRONTEND, Session
from specrelay.common import protocol
from specrelay.common.errors import ErrorCode
from specrelay.common.protocol import MsgType

EDGE, EDGE2 = b"edge-1", b"edge-2"
W1, W2 = b"worker-1", b"worker-2"
TTL = HEARTBEAT_INTERVAL * HEARTBEAT_LIVENESS


def ready(router: Router, worker: bytes, now: float = 0.0, max_sessions: int = 0):
    return router.from_worker([worker, b"", *protocol.encode(protocol.Ready(max_sessions=max_sessions))], now)


def edge_send(router: Router, msg, edge: bytes = EDGE, now: float = 0.0):
    return router.from_edge([edge, *protocol.encode(msg)], now)


def worker_send(router: Router, worker: bytes, msg, client: bytes = EDGE, now: float = 0.0):
    return router.from_worker([worker, router.handles.of(client) if client else b"", *protocol.encode(msg)], now)


def open_(session: int):
    return protocol.Open(session=session, tokens=[1, 2, 3])


def verify(session: int, seq: int):
    return protocol.Verify(session=session, seq=seq, pos=3, draft=[4, 5])


def only(actions):
    assert len(actions) == 1, actions
    return actions[0]


def error_of(action, edge: bytes = EDGE) -> protocol.Error:
    socket, frames = action
    assert socket == FRONTEND and frames[0] == edge
    msg = protocol.decode(frames[1:])
    assert isinstance(msg, protocol.Error), msg
    return msg


def worker_of(action) -> bytes:
    socket, frames = action
    assert socket == BACKEND
    return frames[0]


@pytest.fixture
def router() -> Router:
    r = Router()
    ready(r, W1)
    ready(r, W2)
    return r


def test_open_goes_to_least_loaded_worker_with_deterministic_ties(router):
    # equal loads -> the earliest registered worker; then alternate as loads grow
    assert [worker_of(only(edge_send(router, open_(s)))) for s in (1, 2, 3, 4)] == [W1, W2, W1, W2]
    assert router.stats.sessions_open == 4
    edge_send(router, protocol.Close(session=1))
    assert worker_of(only(edge_send(router, open_(5)))) == W1


def test_forwarded_frames_are_unchanged_and_prefixed_with_ids(router):
    frames = protocol.encode(open_(7))
    socket, out = only(router.from_edge([EDGE, *frames], 0.0))
    assert (socket, out) == (BACKEND, [W1, router.handles.of(EDGE), *frames])
    verdict = protocol.encode(protocol.Verdict(session=7, seq=0, n_accepted=0))
    assert router.from_worker([W1, router.handles.of(EDGE), *verdict], 0.0) == [(FRONTEND, [EDGE, *verdict])]


def test_workers_never_see_an_edge_routing_id(router):
    """The frontend's generated ids (`0x00` + counter) would tell a worker where the counter stands: workers get
    a keyed handle instead (its client's tag, then 16 bytes of the connection), unrelated for consecutive ids, and
    a reply under an unknown handle is dropped."""
    first, second = b"\x00\x12\x34\x56\x78", b"\x00\x12\x34\x56\x79"
    sent = [only(edge_send(router, open_(1), edge=e))[1][1] for e in (first, second)]
    assert all(len(h) == protocol.CLIENT_TAG + 16 and first not in h and second not in h for h in sent)
    assert sent[0] != sent[1] and sent == [router.handles.of(first), router.handles.of(second)]
    assert Router().handles.of(first) != sent[0]  # the key is per broker
    verdict = protocol.encode(protocol.Verdict(session=1, seq=0, n_accepted=0))
    assert router.from_worker([W1, first, *verdict], 0.0) == []
    assert router.stats.foreign_replies == 1


def test_full_workers_are_skipped():
    router = Router()
    ready(router, W1, max_sessions=1)
    ready(router, W2, max_sessions=1)
    assert worker_of(only(edge_send(router, open_(1)))) == W1
    assert worker_of(only(edge_send(router, open_(2)))) == W2
    assert error_of(only(edge_send(router, open_(3)))).code == ErrorCode.UNAVAILABLE


def test_session_affinity(router):
    edge_send(router, open_(1))
    edge_send(router, open_(2))
    for seq in range(3):
        assert worker_of(only(edge_send(router, verify(2, seq)))) == W2
    resample = protocol.Resample(session=2, seq=2)
    assert worker_of(only(edge_send(router, resample))) == W2
    assert worker_of(only(edge_send(router, open_(2)))) == W2  # re-OPEN from the same edge: same worker


def test_close_forwards_then_forgets(router):
    edge_send(router, open_(1))
    assert worker_of(only(edge_send(router, protocol.Close(session=1)))) == W1
    assert router.sessions == {}
    assert edge_send(router, protocol.Close(session=1)) == []  # closing twice is a no-op


def test_unknown_session_asks_for_context(router):
    err = error_of(only(edge_send(router, verify(99, 5))))
    assert (err.code, err.session, err.seq) == (ErrorCode.UNKNOWN_SESSION, 99, 5)
    assert router.stats.unknown_session_sent == 1


def test_no_workers_is_unavailable():
    router = Router()
    err = error_of(only(edge_send(router, open_(1))))
    assert (err.code, err.session) == (ErrorCode.UNAVAILABLE, 1)
    assert router.sessions == {}


def test_session_ids_are_scoped_by_edge(router):
    # both edges number their sessions from 1: two independent sessions, here on different workers
    assert worker_of(only(edge_send(router, open_(1), edge=EDGE))) == W1
    assert worker_of(only(edge_send(router, open_(1), edge=EDGE2))) == W2
    assert set(router.sessions) == {(EDGE, 1), (EDGE2, 1)} and router.stats.sessions_open == 2
    for edge, worker in ((EDGE, W1), (EDGE2, W2)):
        socket, frames = only(edge_send(router, verify(1, 7), edge=edge))
        assert (socket, frames[:2]) == (BACKEND, [worker, router.handles.of(edge)])
    # each worker's reply goes to the edge named in it and settles that edge's request only
    verdict = protocol.Verdict(session=1, seq=7, n_accepted=2)
    assert only(worker_send(router, W2, verdict, client=EDGE2)) == (FRONTEND, [EDGE2, *protocol.encode(verdict)])
    assert router.sessions[(EDGE2, 1)].in_flight == []
    assert router.sessions[(EDGE, 1)].in_flight == [(MsgType.OPEN, 0), (MsgType.VERIFY, 7)]
    # a reply from the wrong worker for this edge's session settles nothing and is dropped
    assert worker_send(router, W2, verdict, client=EDGE) == []
    assert router.sessions[(EDGE, 1)].in_flight == [(MsgType.OPEN, 0), (MsgType.VERIFY, 7)]
    worker_send(router, W1, verdict, client=EDGE)
    assert router.sessions[(EDGE, 1)].in_flight == []
    # CLOSE from one edge leaves the other's session 1 alone
    assert worker_of(only(edge_send(router, protocol.Close(session=1), edge=EDGE))) == W1
    assert set(router.sessions) == {(EDGE2, 1)} and router.workers[W1].sessions == set()
    err = error_of(only(edge_send(router, verify(1, 8), edge=EDGE)))
    assert (err.code, err.session) == (ErrorCode.UNKNOWN_SESSION, 1)
    assert worker_of(only(edge_send(router, verify(1, 8), edge=EDGE2))) == W2


def test_worker_lost_reaches_each_edge_of_a_shared_session_id():
    router = Router()
    ready(router, W1)
    edge_send(router, open_(1), edge=EDGE)
    edge_send(router, open_(1), edge=EDGE2)
    edge_send(router, verify(1, 3), edge=EDGE)
    edge_send(router, verify(1, 4), edge=EDGE2)
    actions = router.tick(TTL)
    lost = {(a[1][0], e.session, e.seq) for a in actions if a[0] == FRONTEND
            for e in [protocol.decode(a[1][1:])]}
    assert lost == {(EDGE, 1, 3), (EDGE2, 1, 4)}
    assert router.sessions == {}


@pytest.mark.parametrize("frames, field", [
    ([b"\x02\x02"], "frames"),
    ([b"\x02\x02", b"x", b"y"], "frames"),
    ([b"\x01", protocol.encode(verify(1, 0))[1]], "header"),
    ([b"\x09\x02", protocol.encode(verify(1, 0))[1]], "version"),
    ([b"\x02\x63", protocol.encode(verify(1, 0))[1]], "type"),
    ([b"\x02\x02", b"\xc1garbage"], "session"),
    ([b"\x02\x02", protocol.encode(protocol.Close(session=1))[1]], "seq"),
    (protocol.encode(protocol.Verdict(session=1, seq=0, n_accepted=0)), "VERDICT"),
    (protocol.encode(protocol.Ready()), "READY"),
])
def test_malformed_edge_input_is_bad_request_and_counted(router, frames, field):
    err = error_of(only(router.from_edge([EDGE, *frames], 0.0)))
    assert err.code == ErrorCode.BAD_REQUEST and field in err.message, err.message
    assert router.stats.bad_requests == 1
    assert worker_of(only(edge_send(router, open_(1)))) == W1  # still serving


def test_oversized_message_is_rejected_by_its_real_frame_count(router):
    err = error_of(only(router.from_edge([EDGE, b"a", b"b", b"c", b"d", b"e"], 0.0, n_frames=1000)))
    assert err.code == ErrorCode.BAD_REQUEST and "999" in err.message


def test_bad_request_names_the_readable_session(router):
    body = protocol.encode(verify(42, 0))[1]
    err = error_of(only(router.from_edge([EDGE, b"\x02\x63", body], 0.0)))
    assert err.session == 42


def test_heartbeats_every_interval_with_assigned_load(router):
    edge_send(router, open_(1))
    beats = router.tick(0.0)
    assert sorted(worker_of(a) for a in beats) == [W1, W2]
    for _, frames in beats:
        assert frames[1] == b"" and protocol.parse_header(frames[2]) == MsgType.HEARTBEAT
    assert protocol.decode(beats[0][1][2:]).load == 1  # W1 holds session 1
    assert router.tick(HEARTBEAT_INTERVAL / 2) == []
    assert len(router.tick(HEARTBEAT_INTERVAL)) == 2
    assert router.next_deadline() == pytest.approx(2 * HEARTBEAT_INTERVAL)


def test_worker_messages_keep_it_alive(router):
    for t in (1.0, 2.0, 3.0, 4.0):
        worker_send(router, W1, protocol.Heartbeat(load=2), now=t)
    router.tick(TTL + 1.5)
    assert set(router.workers) == {W1}


def test_expired_worker_answers_in_flight_requests_with_worker_lost(router):
    edge_send(router, open_(1))              # W1
    edge_send(router, open_(2), edge=EDGE2)  # W2
    edge_send(router, open_(3))              # W1, idle after its OPEN is answered
    worker_send(router, W1, protocol.Error(session=3, code=ErrorCode.BAD_REQUEST))
    edge_send(router, verify(1, 10))
    edge_send(router, verify(1, 11))
    worker_send(router, W1, protocol.Verdict(session=1, seq=10, n_accepted=2))
    worker_send(router, W2, protocol.Heartbeat(), client=b"", now=TTL - 0.1)

    actions = router.tick(TTL)
    lost = [error_of(a) for a in actions if a[0] == FRONTEND]
    assert [(e.code, e.session, e.seq) for e in lost] == [(ErrorCode.WORKER_LOST, 1, 11)]
    to_workers = {(worker_of(a), protocol.parse_header(a[1][2])) for a in actions if a[0] == BACKEND}
    assert to_workers == {(W1, MsgType.DISCONNECT), (W2, MsgType.HEARTBEAT)}
    assert set(router.sessions) == {(EDGE2, 2)} and set(router.workers) == {W2}
    assert router.stats.worker_lost_sent == 1 and router.stats.live_workers == 1
    assert worker_of(only(edge_send(router, open_(1), now=TTL))) == W2  # re-OPEN lands on a live worker


def test_disconnect_loses_an_unanswered_open(router):
    edge_send(router, open_(1))
    err = error_of(only(worker_send(router, W1, protocol.Disconnect(reason="bye"), client=b"")))
    assert (err.code, err.session, err.seq) == (ErrorCode.WORKER_LOST, 1, 0)


def test_ready_again_means_restart(router):
    edge_send(router, open_(1))
    edge_send(router, verify(1, 4))
    err = error_of(only(ready(router, W1)))
    assert (err.code, err.seq) == (ErrorCode.WORKER_LOST, 4)
    assert set(router.workers) == {W1, W2} and router.sessions == {}


def test_unknown_worker_is_told_to_register(router):
    actions = worker_send(router, b"stranger", protocol.Verdict(session=1, seq=0, n_accepted=0))
    assert worker_of(only(actions)) == b"stranger"
    assert protocol.parse_header(actions[0][1][2]) == MsgType.DISCONNECT
    assert router.stats.unknown_worker_messages == 1


@pytest.mark.parametrize("frames", [
    [b"", b"\x02\x06"],
    [b"", b"\x07\x07", b""],
    [b"", *protocol.encode(verify(1, 0))],
    [b"", b"\x02\x06", b"\xc1"],
    [b"", *protocol.encode(protocol.Verdict(session=1, seq=0, n_accepted=0))],  # no edge id
])
def test_bad_worker_input_is_counted_and_dropped(router, frames):
    assert router.from_worker([W1, *frames], 0.0) == []
    assert router.stats.bad_worker_messages == 1


def test_in_flight_cap():
    router = Router(limits=Limits(max_in_flight_per_session=2))
    ready(router, W1)
    edge_send(router, open_(1))
    edge_send(router, verify(1, 1))
    err = error_of(only(edge_send(router, verify(1, 2))))
    assert (err.code, err.seq) == (ErrorCode.UNAVAILABLE, 2)


def test_unreachable_worker_is_lost_at_once(router):
    edge_send(router, open_(1))
    _, frames = only(edge_send(router, verify(1, 3)))
    err = error_of(only(router.undeliverable(BACKEND, frames, 0.0, peer_gone=True)))
    assert (err.code, err.seq) == (ErrorCode.WORKER_LOST, 3)
    assert W1 not in router.workers and router.stats.unroutable == 1


def test_full_worker_queue_answers_unavailable(router):
    _, frames = only(edge_send(router, open_(1)))
    err = error_of(only(router.undeliverable(BACKEND, frames, 0.0, peer_gone=False)))
    assert err.code == ErrorCode.UNAVAILABLE
    assert router.sessions[(EDGE, 1)].in_flight == [] and W1 in router.workers


def test_gone_edge_closes_its_sessions(router):
    edge_send(router, open_(1))
    edge_send(router, open_(2), edge=EDGE2)
    _, frames = only(worker_send(router, W1, protocol.Verdict(session=1, seq=0, n_accepted=0)))
    socket, close = only(router.undeliverable(FRONTEND, frames, 0.0, peer_gone=True))
    assert socket == BACKEND and close[:2] == [W1, router.handles.of(EDGE)]
    assert protocol.decode(close[2:]) == protocol.Close(session=1)
    assert set(router.sessions) == {(EDGE2, 2)}


def test_gone_edge_closes_only_its_own_sessions(router):
    edge_send(router, open_(1), edge=EDGE)   # W1
    edge_send(router, open_(1), edge=EDGE2)  # W2, same session id
    _, frames = only(worker_send(router, W2, protocol.Verdict(session=1, seq=0, n_accepted=0), client=EDGE2))
    socket, close = only(router.undeliverable(FRONTEND, frames, 0.0, peer_gone=True))
    assert socket == BACKEND and close[:2] == [W2, router.handles.of(EDGE2)]
    assert set(router.sessions) == {(EDGE, 1)}


def test_replies_settle_the_request_they_answer():
    session = Session(edge=EDGE, worker=W1, client=EDGE, in_flight=[
        (MsgType.OPEN, 0), (MsgType.VERIFY, 1), (MsgType.VERIFY, 2), (MsgType.RESAMPLE, 1)])
    session.settle(MsgType.VERDICT, 2)  # out of order; the OPEN before it was handled too
    assert session.in_flight == [(MsgType.VERIFY, 1), (MsgType.RESAMPLE, 1)]
    session.settle(MsgType.RESAMPLED, 1)  # a RESAMPLE shares its verdict's seq: the type decides
    assert session.in_flight == [(MsgType.VERIFY, 1)]
    session.settle(MsgType.ERROR, 1)
    assert session.in_flight == []
    session.in_flight = [(MsgType.OPEN, 0), (MsgType.VERIFY, 3)]
    session.settle(MsgType.VERDICT, 99)  # unmatched: only the OPENs before it are settled
    assert session.in_flight == [(MsgType.VERIFY, 3)]


def test_new_sessions_go_to_the_worker_with_the_most_free_kv_memory():
    r = Router()
    for w in (W1, W2):
        r.from_worker([w, b"", *protocol.encode(protocol.Ready(max_sessions=100, kv_capacity=10_000))], 0.0)
    assert [worker_of(only(edge_send(r, open_(s)))) for s in (1, 2)] == [W1, W2]  # no reports yet: by count
    worker_send(r, W1, protocol.Heartbeat(load=1, kv_free=2_000), client=b"")  # one long session: 8000 used
    worker_send(r, W2, protocol.Heartbeat(load=1, kv_free=9_800), client=b"")
    assert [worker_of(only(edge_send(r, open_(s)))) for s in (3, 4, 5)] == [W2, W2, W2]
    # W2 is expected to fill as it takes sessions (200 slots each, its average), W1 stays at 20 % free
    worker_send(r, W2, protocol.Heartbeat(load=40, kv_free=1_000), client=b"")
    assert worker_of(only(edge_send(r, open_(6)))) == W1


def test_a_curve_key_s_connections_are_one_client_to_the_workers(router):
    """A worker shares its KV store and each step per client (protocol.client_of): every connection of one CURVE
    key carries the same client tag, anonymous connections each their own; when an edge goes, the CLOSEs its
    workers get still carry its handle (so they find its sessions)."""
    handle = lambda edge, user: only(router.from_edge([edge, *protocol.encode(open_(1))], 0.0, user=user))[1][1]  # noqa: E731
    alice = [handle(b"\x00\x01", "alice-key"), handle(b"\x00\x02", "alice-key")]
    anon = [handle(b"\x00\x03", None), handle(b"\x00\x04", None)]
    client = lambda h: protocol.client_of(b"\x00" + h)  # noqa: E731
    assert client(alice[0]) == client(alice[1]) and alice[0] != alice[1]
    assert client(anon[0]) != client(anon[1]) and client(anon[0]) != client(alice[0])
    gone = router._edge_gone(b"\x00\x01")
    assert [frames[1] for _, frames in gone] == [alice[0]]
