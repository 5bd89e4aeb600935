"""Keys and the broker's ZAP handler (issue 18 items 10, 11): file modes, one role per key, all-or-nothing
reloads, one-line start-up refusals, refused keys logged, the handshake budget, and a worker's routing id bound
to its key (real CURVE sockets)."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys

import pytest
from rolekeys import role_keys
import zmq
import zmq.auth

from specrelay.broker.server import Broker
from specrelay.common import auth, protocol, transport
from specrelay.common.errors import FatalError
from specrelay.common.zap import MAX_WAIT_S, HandshakeBudget
from specrelay.bench.attacks import connect_and_handshake

pytestmark = pytest.mark.timeout(60)
ANY = "tcp://127.0.0.1:0"


@pytest.fixture
def keys(tmp_path):
    return role_keys(tmp_path)

def test_a_secret_key_is_private_from_the_start_and_checked_on_load(tmp_path):
    umask = os.umask(0o022)
    try:
        public, secret = auth.generate(tmp_path, "k")
        assert os.umask(0o022) == 0o022  # generate restored the process's umask
    finally:
        os.umask(umask)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE(public.stat().st_mode) == 0o644
    auth.server(secret, auth.EDGE_DOMAIN)
    os.chmod(secret, 0o640)
    with pytest.raises(FatalError, match="chmod 600"):
        auth.server(secret, auth.EDGE_DOMAIN)


def test_one_role_per_key(zctx, keys):
    secrets, edges, workers = keys
    with pytest.raises(FatalError, match="same directory"):
        auth.Allowlists(zctx, edges, edges)
    shutil.copy(secrets / "edge.key", workers / "edge-too.key")
    with pytest.raises(FatalError, match="both edge and worker"):
        auth.Allowlists(zctx, edges, workers)


def test_keys_need_the_broker_secret():
    with pytest.raises(FatalError, match="need --curve-secret"):
        Broker(ANY, ANY, edge_keys="e", worker_keys="w")


async def test_a_bad_reload_keeps_the_lists_in_force(zctx, keys):
    secrets, edges, workers = keys
    async with Broker(ANY, ANY, context=zctx, linger_ms=0, curve_secret=str(secrets / "broker.key_secret"),
                      edge_keys=str(edges), worker_keys=str(workers)) as broker:
        allow = broker._allowlists
        shutil.copy(secrets / "rogue.key", edges)
        assert allow.reload() == {"edge": 2, "worker": 1}
        (edges / "broken.key").write_text("not a certificate")
        shutil.copy(secrets / "worker.key", edges / "worker-too.key")
        assert allow.reload() is None  # refused: the two keys above stay admitted, nothing new
        assert len(allow._auth.certs["edge"]) == 2 and len(allow._auth.certs["worker"]) == 1


def test_startup_refusal_is_one_line(keys):
    secrets, edges, _ = keys
    proc = subprocess.run([sys.executable, "-m", "specrelay.cli", "broker", "--frontend", "tcp://127.0.0.1:0",
                           "--backend", "tcp://127.0.0.1:0", "--curve-secret", str(secrets / "broker.key_secret"),
                           "--edge-keys", str(edges), "--worker-keys", str(edges)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "same directory" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_handshake_budget_delays_then_refuses():
    now = [0.0]
    budget = HandshakeBudget(rate=1.0, burst=3, clock=lambda: now[0])
    peer = ("edge", "10.0.0.1", b"k")
    assert [budget.delay(peer) for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert budget.delay(peer) == pytest.approx(1.0)                  # then one per second, held back
    assert budget.delay(("edge", "10.0.0.2", b"k")) == 0.0            # another address has its own budget
    while budget.delay(peer) is not None:
        pass
    assert budget._tat[peer] - now[0] <= MAX_WAIT_S + 3 + 1  # past MAX_WAIT_S: refused, not booked
    now[0] += 100.0
    assert budget.delay(peer) == 0.0


async def test_refused_keys_are_counted_and_a_worker_id_is_bound_to_its_key(zctx, keys):
    secrets, edges, workers = keys
    async with Broker(ANY, ANY, context=zctx, linger_ms=0, curve_secret=str(secrets / "broker.key_secret"),
                      edge_keys=str(edges), worker_keys=str(workers)) as broker:
        rogue = auth.client(secrets / "rogue.key_secret", secrets / "broker.key")
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(_handshake, broker.frontend, rogue, None)
        assert broker._allowlists._auth.refused >= 1
        worker = transport.make_socket(zctx, zmq.DEALER, linger_ms=0, identity=b"w-1",
                                       curve=auth.client(secrets / "worker.key_secret", secrets / "broker.key"))
        worker.connect(broker.backend)
        await worker.send_multipart([b"", *protocol.encode(protocol.Ready())])
        while broker.stats["live_workers"] != 1:
            await asyncio.sleep(0.01)
        assert broker.router.workers[b"w-1"].user == zmq.auth.load_certificate(secrets / "worker.key")[0].decode()
        worker.close(linger=0)


def _handshake(endpoint: str, curve, identity: bytes | None) -> None:
    ctx = zmq.Context()
    sock = transport.make_socket(ctx, zmq.DEALER, linger_ms=0, identity=identity, curve=curve)
    try:
        connect_and_handshake(sock, endpoint, 10.0)
    finally:
        sock.close(linger=0)
        ctx.term()


async def test_an_edge_without_keys_is_told_the_broker_wants_them(zctx, keys):
    from specrelay.edge_worker.routing.probe import probe_broker

    secrets, edges, workers = keys
    async with Broker(ANY, ANY, context=zctx, linger_ms=0, curve_secret=str(secrets / "broker.key_secret"),
                      edge_keys=str(edges), worker_keys=str(workers)) as broker:
        with pytest.raises(FatalError, match="one side has keys and the other none"):
            await probe_broker(broker.frontend, 10.0, worker=False, context=zctx)


@pytest.mark.parametrize("listen, refused", [("tcp://0.0.0.0:0", True), ("tcp://127.0.0.1:0", False)])
async def test_the_edge_client_port_without_curve_stays_on_loopback(zctx, tiny_runners, listen, refused):
    from specrelay.edge_worker.draft.drafter import Drafter
    from specrelay.edge_worker.server import EdgeConfig, EdgeWorker

    target, draft = tiny_runners
    edge = EdgeWorker("tcp://127.0.0.1:9", Drafter(draft, target.vocab_size), target.tokenizer,
                      EdgeConfig(listen=listen, linger_ms=0), context=zctx)
    if refused:
        with pytest.raises(FatalError, match="--insecure"):
            await edge.start()
        await edge.stop()
        edge = EdgeWorker("tcp://127.0.0.1:9", Drafter(draft, target.vocab_size), target.tokenizer,
                          EdgeConfig(listen=listen, linger_ms=0, insecure_listen=True), context=zctx)
    async with edge:
        assert edge.frontend.endpoint.startswith("tcp://")


async def test_handshakes_past_the_budget_are_held_not_refused(zctx, keys):
    """A valid key reconnecting past its budget is slowed (its ZAP reply held), never told its key is bad."""
    import time

    secrets, edges, workers = keys
    async with Broker(ANY, ANY, context=zctx, linger_ms=0, curve_secret=str(secrets / "broker.key_secret"),
                      edge_keys=str(edges), worker_keys=str(workers)) as broker:
        zap = broker._allowlists._auth
        zap.budget = HandshakeBudget(rate=0.5, burst=2)
        edge = auth.client(secrets / "edge.key_secret", secrets / "broker.key")
        for _ in range(2):
            await asyncio.to_thread(_handshake, broker.frontend, edge, None)
        t0 = time.monotonic()
        await asyncio.to_thread(_handshake, broker.frontend, edge, None)  # held ~2 s, then admitted
        assert time.monotonic() - t0 >= 1.5 and zap.delayed == 1 and zap.refused == 0


async def test_the_edge_client_port_with_client_keys_is_curve(zctx, keys, tiny_runners):
    """`--client-keys`: the client port is a CURVE server with the edge's key pair, on any address; a listed
    application key completes the handshake, an unlisted one is refused."""
    from specrelay.edge_worker.draft.drafter import Drafter
    from specrelay.edge_worker.server import EdgeConfig, EdgeWorker

    secrets, edges, _ = keys
    apps = secrets.parent / "apps"
    target, draft = tiny_runners
    edge_curve = auth.client(secrets / "edge.key_secret", secrets / "broker.key")
    edge = EdgeWorker("tcp://127.0.0.1:9", Drafter(draft, target.vocab_size), target.tokenizer,
                      EdgeConfig(listen="tcp://0.0.0.0:0", linger_ms=0, client_keys=str(apps)), context=zctx,
                      curve=edge_curve)
    async with edge:
        endpoint = edge.endpoint.replace("0.0.0.0", "127.0.0.1")
        app = auth.client(secrets / "app.key_secret", secrets / "edge.key")
        await asyncio.to_thread(_handshake, endpoint, app, None)
        rogue = auth.client(secrets / "rogue.key_secret", secrets / "edge.key")
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(_handshake, endpoint, rogue, None)
        with pytest.raises((ConnectionRefusedError, TimeoutError)):
            await asyncio.to_thread(_handshake, endpoint, None, None)  # no keys at all
