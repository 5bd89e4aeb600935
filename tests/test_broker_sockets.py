"""The broker over real sockets on 127.0.0.1 random ports: DEALERs play the edge and the workers."""

from __future__ import annotations

import asyncio
import socket

import pytest
import zmq
import zmq.asyncio

from specrelay.broker.server import Broker, serve
from specrelay.common import protocol
from specrelay.common.errors import ErrorCode
from specrelay.common.protocol import MsgType

pytestmark = pytest.mark.timeout(30)

ANY_PORT = "tcp://127.0.0.1:0"
RECV_TIMEOUT = 5.0


@pytest.fixture
def dealer(zctx):
    """dealer(endpoint) -> a connected DEALER, closed with linger=0 after the test."""
    sockets = []

    def make(endpoint: str) -> zmq.asyncio.Socket:
        sock = zctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    yield make
    for sock in sockets:
        sock.close(linger=0)


@pytest.fixture
async def broker(zctx):
    async with Broker(ANY_PORT, ANY_PORT, context=zctx, linger_ms=0) as running:
        yield running


async def recv(sock: zmq.asyncio.Socket) -> list[bytes]:
    return await asyncio.wait_for(sock.recv_multipart(), RECV_TIMEOUT)


async def edge_recv(sock: zmq.asyncio.Socket) -> protocol.Base:
    return protocol.decode(await recv(sock))


async def wait_until(condition, timeout: float = RECV_TIMEOUT) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


class FakeWorker:
    """A cloud worker in a few lines: READY, heartbeats, VERIFY -> VERDICT accepting the whole draft."""

    def __init__(self, sock: zmq.asyncio.Socket, heartbeat: float = 0.05) -> None:
        self.sock, self.heartbeat = sock, heartbeat
        self.seen: list[tuple[MsgType, int]] = []  # (type, session) of every request received
        self.answer = True
        self.beating = True
        self._tasks: list[asyncio.Task] = []

    async def start(self, broker: Broker, max_sessions: int = 0) -> FakeWorker:
        live = broker.router.stats.live_workers
        await self.sock.send_multipart([b"", *protocol.encode(protocol.Ready(max_sessions=max_sessions))])
        await wait_until(lambda: broker.router.stats.live_workers > live)
        self._tasks = [asyncio.create_task(self._serve()), asyncio.create_task(self._beat())]
        return self

    async def _beat(self) -> None:
        while self.beating:
            await self.sock.send_multipart([b"", *protocol.encode(protocol.Heartbeat(load=len(self.seen)))])
            await asyncio.sleep(self.heartbeat)

    async def _serve(self) -> None:
        while True:
            client, *message = await self.sock.recv_multipart()
            msg_type = protocol.parse_header(message[0])
            if msg_type in (MsgType.HEARTBEAT, MsgType.DISCONNECT):
                continue
            msg = protocol.decode(message)
            self.seen.append((msg_type, msg.session))
            if msg_type == MsgType.VERIFY and self.answer:
                verdict = protocol.Verdict(session=msg.session, seq=msg.seq, n_accepted=len(msg.draft))
                await self.sock.send_multipart([client, *protocol.encode(verdict)])

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture
async def workers(dealer):
    """workers(broker, n) -> n started FakeWorkers, stopped after the test."""
    started: list[FakeWorker] = []

    async def make(broker: Broker, n: int = 1, **kwargs) -> list[FakeWorker]:
        for _ in range(n):
            started.append(await FakeWorker(dealer(broker.backend), **kwargs).start(broker))
        return started[-n:]

    yield make
    for worker in started:
        await worker.stop()


def open_(session: int) -> list[bytes]:
    return protocol.encode(protocol.Open(session=session, tokens=[1, 2, 3]))


def verify(session: int, seq: int) -> list[bytes]:
    return protocol.encode(protocol.Verify(session=session, seq=seq, pos=3, draft=[7, 8, 9]))


async def test_round_trip(broker, dealer, workers):
    [worker] = await workers(broker)
    edge = dealer(broker.frontend)
    await edge.send_multipart(open_(1))
    await edge.send_multipart(verify(1, seq=5))
    verdict = await edge_recv(edge)
    assert verdict == protocol.Verdict(session=1, seq=5, n_accepted=3)
    assert worker.seen == [(MsgType.OPEN, 1), (MsgType.VERIFY, 1)]
    await wait_until(lambda: broker.stats["frontend_out"] == 1)
    [(_, session_id)] = broker.router.sessions
    assert broker.stats["sessions_open"] == 1 and session_id == 1
    assert next(iter(broker.router.sessions.values())).in_flight == []


async def test_two_workers_share_sessions_with_affinity(broker, dealer, workers):
    w1, w2 = await workers(broker, 2)
    edge = dealer(broker.frontend)
    for session in range(4):
        await edge.send_multipart(open_(session))
    for seq in range(3):
        for session in range(4):
            await edge.send_multipart(verify(session, seq))
    verdicts = [await edge_recv(edge) for _ in range(12)]
    assert sorted((v.session, v.seq) for v in verdicts) == [(s, q) for s in range(4) for q in range(3)]
    by_worker = [{s for _, s in w.seen} for w in (w1, w2)]
    assert by_worker == [{0, 2}, {1, 3}]  # least-loaded alternation, then every request stays put
    assert len(w1.seen) == len(w2.seen) == 2 * (1 + 3)


async def test_two_edges_with_the_same_session_id_are_independent(broker, dealer, workers):
    w1, w2 = await workers(broker, 2)
    edges = [dealer(broker.frontend), dealer(broker.frontend)]
    for edge in edges:
        await edge.send_multipart(open_(1))
        await wait_until(lambda: broker.stats["sessions_open"] == edges.index(edge) + 1)
    for seq, edge in enumerate(edges):
        await edge.send_multipart(verify(1, seq=seq))
    # each edge gets the verdict for its own request, from the worker its session went to
    assert [await edge_recv(edge) for edge in edges] == [protocol.Verdict(session=1, seq=s, n_accepted=3)
                                                         for s in range(2)]
    assert w1.seen == w2.seen == [(MsgType.OPEN, 1), (MsgType.VERIFY, 1)]
    await edges[0].send_multipart(protocol.encode(protocol.Close(session=1)))
    await wait_until(lambda: (MsgType.CLOSE, 1) in w1.seen)
    await edges[1].send_multipart(verify(1, seq=5))
    assert await edge_recv(edges[1]) == protocol.Verdict(session=1, seq=5, n_accepted=3)
    assert broker.stats["sessions_open"] == 1 and w2.seen[-1] == (MsgType.VERIFY, 1)


@pytest.mark.parametrize("frames, field", [
    ([b"\x02\x03", b"junk"], "VERDICT"),
    ([b"\x02\x02"], "frames"),
    ([b"\x02\x02", b"\xc1", b"x", b"y", b"z", b"w", b"v", b"u"], "frames"),  # past the frame cap
    ([b"\x02\x02", b"\xc1not msgpack"], "session"),
])
async def test_malformed_input_gets_bad_request_and_broker_keeps_serving(broker, dealer, workers, frames, field):
    await workers(broker)
    edge = dealer(broker.frontend)
    await edge.send_multipart(frames)
    err = await edge_recv(edge)
    assert isinstance(err, protocol.Error) and err.code == ErrorCode.BAD_REQUEST and field in err.message
    await edge.send_multipart(open_(1))
    await edge.send_multipart(verify(1, seq=0))
    assert isinstance(await edge_recv(edge), protocol.Verdict)
    assert broker.stats["bad_requests"] == 1


async def test_silent_worker_causes_worker_lost_for_request_in_flight(zctx, dealer, workers):
    async with Broker(ANY_PORT, ANY_PORT, heartbeat_interval=0.05, liveness=3, context=zctx, linger_ms=0) as broker:
        [worker] = await workers(broker, heartbeat=0.01)
        edge = dealer(broker.frontend)
        worker.answer = False
        await edge.send_multipart(open_(9))
        await edge.send_multipart(verify(9, seq=42))
        await wait_until(lambda: (MsgType.VERIFY, 9) in worker.seen)
        worker.beating = False  # the process hangs: no heartbeat, no verdict
        err = await edge_recv(edge)
        assert (err.code, err.session, err.seq) == (ErrorCode.WORKER_LOST, 9, 42)
        assert broker.stats["live_workers"] == 0 and broker.stats["sessions_open"] == 0
        await edge.send_multipart(open_(9))
        err = await edge_recv(edge)
        assert err.code == ErrorCode.UNAVAILABLE  # no live worker left to re-OPEN on


async def test_no_worker_and_unknown_session(broker, dealer):
    edge = dealer(broker.frontend)
    await edge.send_multipart(open_(1))
    assert (await edge_recv(edge)).code == ErrorCode.UNAVAILABLE
    await edge.send_multipart(verify(2, seq=3))
    err = await edge_recv(edge)
    assert (err.code, err.session, err.seq) == (ErrorCode.UNKNOWN_SESSION, 2, 3)


async def test_vanished_edge_is_counted_and_its_session_closed(broker, dealer, workers):
    [worker] = await workers(broker)
    edge = dealer(broker.frontend)
    worker.answer = False
    await edge.send_multipart(open_(5))
    await edge.send_multipart(verify(5, seq=1))
    await wait_until(lambda: len(worker.seen) == 2)
    [(edge_id, _)] = broker.router.sessions
    edge.close(linger=0)
    await _wait_peer_gone(broker, edge_id)
    verdict = protocol.encode(protocol.Verdict(session=5, seq=1, n_accepted=0))
    await worker.sock.send_multipart([broker.router.handles.of(edge_id), *verdict])
    await wait_until(lambda: (MsgType.CLOSE, 5) in worker.seen)
    assert broker.stats["unroutable"] == 1 and broker.stats["sessions_open"] == 0


async def _wait_peer_gone(broker: Broker, edge_id: bytes) -> None:
    """Probe the frontend until libzmq has dropped the edge's pipe (its close travels asynchronously)."""
    probe = zmq.Socket.shadow(broker._sockets["frontend"].underlying)  # a plain socket: send raises at once
    for _ in range(500):
        try:
            probe.send_multipart([edge_id, *protocol.encode(protocol.Heartbeat())], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return
        await asyncio.sleep(0.01)
    pytest.fail("the broker still sees the closed edge")


async def test_health_endpoints(zctx, dealer, workers):
    async with Broker(ANY_PORT, ANY_PORT, health_port=0, context=zctx, linger_ms=0) as broker:
        assert (await _get(broker.health_port, "/readyz")).startswith(b"HTTP/1.0 503")
        await workers(broker)
        assert (await _get(broker.health_port, "/readyz")).startswith(b"HTTP/1.0 200")
        metrics = await _get(broker.health_port, "/metrics")
        assert b"specrelay_broker_live_workers 1.0\n" in metrics
        assert b"# TYPE specrelay_broker_frontend_in_total counter" in metrics
        assert b'"status": "ok"' in await _get(broker.health_port, "/healthz")
        assert b'"status": "ok"' in await _get(broker.health_port, "/healthz")


async def _get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), RECV_TIMEOUT)
    writer.close()
    await writer.wait_closed()
    return data


async def test_serve_runs_until_cancelled(zctx, dealer):
    frontend, backend = (f"tcp://127.0.0.1:{_free_port()}" for _ in range(2))
    task = asyncio.create_task(serve(frontend, backend, context=zctx, linger_ms=0))
    edge = dealer(frontend)
    await edge.send_multipart(open_(1))
    assert (await edge_recv(edge)).code == ErrorCode.UNAVAILABLE
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_bind_conflict_is_fatal(broker, zctx):
    from specrelay.common.errors import FatalError

    with pytest.raises(FatalError, match="frontend"):
        await Broker(broker.frontend, ANY_PORT, context=zctx).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
