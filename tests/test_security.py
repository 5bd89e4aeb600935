"""CURVE on every TCP socket (real sockets, real models): allowlists per role, refusals end a client quickly,
0 prompts reach an unauthorised process, binding beyond loopback without keys needs --insecure."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
from rolekeys import role_keys
import torch
import zmq
import zmq.asyncio

from specrelay.broker.server import Broker
from specrelay.cloud_worker.server import CloudWorker, WorkerConfig
from specrelay.common import auth, protocol, transport
from specrelay.common.errors import AuthenticationFailed, FatalError
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.edge_worker.server import EdgeConfig, EdgeWorker
from specrelay.edge_worker.session import SessionConfig

pytestmark = pytest.mark.timeout(90)
ANY = "tcp://127.0.0.1:0"


@pytest.fixture
def keys(tmp_path):
    return role_keys(tmp_path)

def client_keys(secrets, name: str) -> transport.Curve:
    return auth.client(secrets / f"{name}.key_secret", secrets / "broker.key")


def broker_with_keys(zctx, keys) -> Broker:
    secrets, edges, workers = keys
    return Broker(ANY, ANY, context=zctx, linger_ms=0, curve_secret=str(secrets / "broker.key_secret"),
                  edge_keys=str(edges), worker_keys=str(workers))


async def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def edge(zctx, broker, tiny_runners, curve) -> EdgeWorker:
    target, draft = tiny_runners
    return EdgeWorker(broker.frontend, Drafter(draft, target.vocab_size), target.tokenizer,
                      EdgeConfig(request_timeout_s=10, linger_ms=0, retry_budget_s=5), context=zctx, curve=curve)


async def test_keys_admit_each_role_and_refuse_everything_else(zctx, keys, tiny_runners):
    target, _ = tiny_runners
    secrets = keys[0]
    ids = target.tokenizer("def add(a, b):\n").input_ids
    ref = target.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    async with broker_with_keys(zctx, keys) as broker:
        # the broker beats every 1 s: a worker liveness of 3 x 0.2 s held only while other traffic woke the broker
        # (a refused edge reconnecting); a refused edge now stops, so the worker waits 10 x 0.2 s
        worker = CloudWorker(broker.backend, target, WorkerConfig(linger_ms=0, heartbeat_interval=0.2,
                                                                  heartbeat_liveness=10),
                             context=zctx, curve=client_keys(secrets, "worker"))
        async with worker:
            await wait_until(lambda: broker.stats["live_workers"] == 1)
            async with edge(zctx, broker, tiny_runners, client_keys(secrets, "edge")) as good:
                out, _ = await good.generate(ids, SessionConfig(max_new_tokens=12))
            assert out == ref
            await wait_until(lambda: worker.stats["sessions_open"] == 0)  # the good edge's CLOSE arrived
            requests_seen = worker.stats["requests"]
            for name in ("rogue", "worker"):  # an unlisted key, and a worker key posing as an edge
                t0 = time.monotonic()
                with pytest.raises(AuthenticationFailed, match="authentication failed"):  # the edge stops with it
                    async with edge(zctx, broker, tiny_runners, client_keys(secrets, name)) as bad:
                        with pytest.raises(AuthenticationFailed, match="authentication failed"):
                            await bad.generate(ids, SessionConfig(max_new_tokens=12))
                        await asyncio.wait_for(bad.wait_closed(), 5)
                assert time.monotonic() - t0 < 15  # retrying would spend the 30 s retry budget; the edge's start
                # alone took 10 s once on a loaded machine, so the bound sits between the two
            assert worker.stats["requests"] == requests_seen  # not one prompt reached the worker
            # an edge key posing as a worker: refused at the handshake, the worker stops with the error
            impostor = CloudWorker(broker.backend, target, WorkerConfig(linger_ms=0), context=zctx,
                                   curve=client_keys(secrets, "edge"))
            with pytest.raises(AuthenticationFailed):
                await asyncio.wait_for(impostor.run(), 10)
            assert broker.stats["live_workers"] == 1


async def test_an_unauthorised_worker_never_receives_a_prompt(zctx, keys, tiny_runners):
    """A raw DEALER with an unlisted key on the backend: refused at the handshake, so routing never sees it."""
    secrets = keys[0]
    async with broker_with_keys(zctx, keys) as broker:
        rogue = transport.make_socket(zctx, zmq.DEALER, linger_ms=0, curve=client_keys(secrets, "rogue"))
        events: list[int] = []
        monitor = transport.Monitor(rogue, events.append)
        watching = asyncio.create_task(monitor.run())
        rogue.connect(broker.backend)
        rogue.send_multipart([b"", *protocol.encode(protocol.Ready(max_sessions=100))])
        try:
            await wait_until(lambda: zmq.EVENT_HANDSHAKE_FAILED_AUTH in events)
            assert broker.stats["live_workers"] == 0 and broker.stats["backend_in"] == 0
            assert await rogue.poll(200) == 0  # nothing was ever sent to it
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            monitor.close()
            rogue.close(linger=0)


async def handshake(zctx, endpoint: str, curve: transport.Curve) -> int:
    """Connect a DEALER with `curve` and return the first handshake verdict (SUCCEEDED or FAILED_AUTH)."""
    dealer = transport.make_socket(zctx, zmq.DEALER, linger_ms=0, curve=curve)
    events: list[int] = []
    monitor = transport.Monitor(dealer, events.append)
    watching = asyncio.create_task(monitor.run())
    dealer.connect(endpoint)
    verdicts = {zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH}
    try:
        await wait_until(lambda: verdicts & set(events))
        return next(e for e in events if e in verdicts)
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        monitor.close()
        dealer.close(linger=0)


async def test_reloaded_allowlist_admits_a_new_edge(zctx, keys):
    """SIGHUP re-reads the directories. (libzmq does not reconnect a socket whose key was refused, so a client
    that was refused starts over with a new socket.)"""
    secrets, edges, _ = keys
    async with broker_with_keys(zctx, keys) as broker:
        rogue = client_keys(secrets, "rogue")
        assert await handshake(zctx, broker.frontend, rogue) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        shutil.copy(secrets / "rogue.key", edges)
        broker.reload_keys()  # what SIGHUP does
        assert await handshake(zctx, broker.frontend, rogue) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        (edges / "rogue.key").unlink()
        broker.reload_keys()
        assert await handshake(zctx, broker.frontend, rogue) == zmq.EVENT_HANDSHAKE_FAILED_AUTH


async def test_binding_beyond_loopback_needs_keys_or_insecure(zctx, keys):
    with pytest.raises(FatalError, match="--insecure"):
        await Broker("tcp://0.0.0.0:0", ANY, context=zctx, linger_ms=0).start()
    async with Broker("tcp://0.0.0.0:0", ANY, context=zctx, linger_ms=0, insecure=True):
        pass
    secrets, edges, workers = keys
    with pytest.raises(FatalError, match="worker-keys"):
        Broker(ANY, ANY, context=zctx, curve_secret=str(secrets / "broker.key_secret"), edge_keys=str(edges))


def test_generated_secret_is_private_and_loadable(tmp_path):
    public, secret = auth.generate(tmp_path, "me")
    assert secret.stat().st_mode & 0o777 == 0o600
    curve = auth.client(secret, public)
    assert len(curve.public) == len(curve.secret) == len(curve.server_key) == 40
    with pytest.raises(FatalError, match="no secret key"):
        auth.client(public, public)
    with pytest.raises(FatalError, match="already exists"):
        auth.generate(tmp_path, "me")
    assert auth.is_loopback("tcp://127.0.0.1:5555") and auth.is_loopback("ipc:///tmp/x")
    assert not auth.is_loopback("tcp://0.0.0.0:5555") and not auth.is_loopback("tcp://*:5555")


def test_cli_generate_with_a_refused_key_fails_fast_with_one_line(keys, tiny_pair):
    """`specrelay generate` with an unlisted key: exit 1 with one line that says authentication failed. The
    refusal itself is noticed in milliseconds (test above: < 5 s from `generate`); the whole command takes about
    5 s on an idle 2-core machine, model loading included. The bound here only has to tell "noticed" from
    "hung": unnoticed, the request would wait 30 s per attempt for the whole 30 s retry budget."""
    import subprocess
    import sys

    from specrelay.cluster import free_port

    secrets, edges, workers = keys
    frontend, backend = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "broker", "--frontend", frontend, "--backend",
                               backend, "--curve-secret", str(secrets / "broker.key_secret"), "--edge-keys",
                               str(edges), "--worker-keys", str(workers)], stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "specrelay.cli", "--log-level", "error", "generate",
                              "--broker", frontend, "--draft-model", str(tiny_pair[1]), "--prompt", "def f():",
                              "--curve-secret", str(secrets / "rogue.key_secret"),
                              "--broker-key", str(secrets / "broker.key")], capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        broker.terminate()
        broker.wait(10)
    lines = [line for line in out.stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert out.returncode == 1 and out.stdout == ""
    assert len(lines) == 1 and "authentication failed" in lines[0], out.stderr
    assert elapsed < 50, elapsed


async def test_identity_takeover_affects_no_victim_session(zctx, tiny_runners):
    """An attacker that learned a live edge's routing id connects with it and sends CLOSE and VERIFY for the
    victim's sessions: libzmq refuses a second connection with a live identity (ROUTER_HANDOVER off), so none
    of it reaches the broker and the victim's generations finish exactly. (Edges never pick their identity,
    so an attacker cannot claim one before the victim connects; with keys, a reused identity under another key
    closes the old sessions instead of handing them over: tests/test_broker_abuse.py.)"""
    target, _ = tiny_runners
    ids = target.tokenizer("def add(a, b):\n").input_ids
    ref = target.model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids):].tolist()
    async with Broker(ANY, ANY, context=zctx, linger_ms=0) as broker:
        async with CloudWorker(broker.backend, target, WorkerConfig(linger_ms=0), context=zctx):
            await wait_until(lambda: broker.stats["live_workers"] == 1)
            async with edge(zctx, broker, tiny_runners, None) as victim:
                attack_done = asyncio.Event()

                async def attack() -> None:
                    await wait_until(lambda: broker.router.sessions)
                    (victim_id, sid), = list(broker.router.sessions)
                    frontend_in = broker.stats["frontend_in"]
                    rogue = transport.make_socket(zctx, zmq.DEALER, linger_ms=0, identity=victim_id)
                    rogue.connect(broker.frontend)
                    try:
                        for seq in range(1, 50):
                            rogue.send_multipart(protocol.encode(protocol.Verify(sid, seq, 3, [], [1])))
                            rogue.send_multipart(protocol.encode(protocol.Close(sid)))
                            await asyncio.sleep(0.002)
                        await asyncio.sleep(0.3)
                        assert await rogue.poll(100) == 0  # nothing ever came back to the impostor
                    finally:
                        rogue.close(linger=0)
                    # what reached the broker meanwhile came from the victim (heartbeats, its own requests)
                    assert broker.stats["unknown_session_sent"] == 0 and broker.stats["bad_requests"] == 0
                    assert broker.stats["frontend_in"] - frontend_in < 98
                    attack_done.set()

                attacker = asyncio.create_task(attack())
                session = SessionConfig(max_new_tokens=40, draft_len=1)
                out, stats = await victim.generate(ids, session)
                await asyncio.wait_for(attacker, 20)
                assert out == ref and attack_done.is_set()
                assert stats["retries"] == 0 and stats["reopens"] == 0  # its session was never disturbed
