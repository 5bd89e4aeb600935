"""Routing-id squatting (issue 18 item 1) against real processes: a peer holds, as ids it chose itself, the ids an
unseeded ROUTER would generate next (`specrelay.bench.attacks.predicted_routing_ids`), then connects 5 times without an
id. Unfixed, libzmq 4.3.5 asserts and the process dies (exit -6). On every ROUTER (broker frontend with an edge
key, backend with a worker key, a keyless loopback broker, `edge-worker --listen`): every process survives and a
greedy generation afterwards equals the target alone."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from rolekeys import role_keys
import torch

from specrelay import Client
from specrelay.cluster import LocalCluster, free_port
from specrelay.common import auth
from specrelay.bench.attacks import end_squat, predicted_routing_ids, squat

pytestmark = pytest.mark.timeout(240)

PROMPT = "def add(a, b):\n"
N_NEW = 24


@pytest.fixture(scope="module")
def reference(tiny_pair) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, _ = tiny_pair
    tok, model = AutoTokenizer.from_pretrained(target), AutoModelForCausalLM.from_pretrained(target)
    ids = tok(PROMPT).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return role_keys(tmp_path_factory.mktemp("keys"))

def attack(endpoint: str, curve, procs: list[subprocess.Popen], what: str) -> list:
    """Squat the predicted ids, then 5 connections without an id; every process must still run."""
    try:
        squatted = squat(endpoint, predicted_routing_ids(32), curve=curve, anonymous=5)
    except (TimeoutError, ConnectionRefusedError) as exc:
        squatted = None
        failure = exc
    dead = [(p.args[3], p.poll()) for p in procs if p.poll() is not None]
    assert not dead, f"squatting the {what} killed {dead}"
    assert squatted is not None, f"the squat on the {what} did not complete: {failure}"
    return squatted


def test_squatting_every_router_of_a_curve_cluster(tiny_pair, keys, reference):
    target, draft = tiny_pair
    secrets, edges, workers = keys
    client_keys = ("--curve-secret", "{}", "--broker-key", str(secrets / "broker.key"))
    worker_args = tuple(a.format(secrets / "worker.key_secret") for a in client_keys)
    broker_args = ("--curve-secret", str(secrets / "broker.key_secret"), "--edge-keys", str(edges),
                   "--worker-keys", str(workers))
    with LocalCluster(str(target), extra_broker_args=broker_args, extra_worker_args=worker_args) as cluster:
        listen = f"tcp://127.0.0.1:{free_port()}"
        cluster._spawn("edge-worker", "--broker", cluster.frontend, "--draft-model", str(draft), "--listen", listen,
                       "--client-keys", str(secrets.parent / "apps"),
                       *(a.format(secrets / "edge.key_secret") for a in client_keys))
        app = auth.client(secrets / "app.key_secret", secrets / "edge.key")
        asyncio.run(generate_via_client(listen, app))  # the edge is up and connected
        edge_curve = auth.client(secrets / "edge.key_secret", secrets / "broker.key")
        worker_curve = auth.client(secrets / "worker.key_secret", secrets / "broker.key")
        squats = [attack(cluster.frontend, edge_curve, cluster.procs, "broker frontend"),
                  attack(cluster.backend, worker_curve, cluster.procs, "broker backend"),
                  attack(listen, app, cluster.procs, "edge worker's --listen port (CURVE, an app key)")]
        try:
            assert asyncio.run(generate_via_client(listen, app)) == reference
        finally:
            for squatted in squats:
                end_squat(squatted)
        assert all(p.poll() is None for p in cluster.procs)


def test_squatting_a_keyless_loopback_broker_and_edge(tiny_pair, reference):
    target, draft = tiny_pair
    with LocalCluster(str(target)) as cluster:
        listen = f"tcp://127.0.0.1:{free_port()}"
        cluster._spawn("edge-worker", "--broker", cluster.frontend, "--draft-model", str(draft), "--listen", listen)
        asyncio.run(generate_via_client(listen))  # the edge is up and connected
        squats = [attack(cluster.frontend, None, cluster.procs, "keyless broker frontend"),
                  attack(cluster.backend, None, cluster.procs, "keyless broker backend"),
                  attack(listen, None, cluster.procs, "edge worker's keyless --listen port")]
        try:
            assert asyncio.run(generate_via_client(listen)) == reference
        finally:
            for squatted in squats:
                end_squat(squatted)
        assert all(p.poll() is None for p in cluster.procs)


async def generate_via_client(listen: str, curve=None) -> list[int]:
    async with Client(listen, timeout=120, curve=curve) as client:
        return (await client.generate(PROMPT, max_new_tokens=N_NEW)).token_ids


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
