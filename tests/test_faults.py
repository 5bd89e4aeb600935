"""Faults with real processes (`specrelay broker` / `cloud-worker` / `edge-worker` children): SIGKILL of a
worker, of every worker (a new one starts within the retry budget), of the broker (restarted on the same
endpoints), and of an edge. Every surviving generation finishes token-identical to the fault-free target, and
the session gauges return to zero."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from specrelay import Client
from specrelay.cluster import LocalCluster, free_port
from specrelay.edge_worker.server import load_edge
from specrelay.edge_worker.server import EdgeConfig
from specrelay.edge_worker.session import SessionConfig
from tiny import greedy_references

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in", "print(", "    return", "import os\n"]
N_NEW = 40


@pytest.fixture(scope="module")
def references(tiny_pair):
    return greedy_references(tiny_pair[0], PROMPTS, N_NEW)


async def generate_through_fault(cluster: LocalCluster, draft: str, fault, after_tokens: int) -> dict[str, list]:
    """Greedy generations of every prompt at once (draft length 1: many round trips); `fault()` runs in a
    thread once `after_tokens` tokens are committed in total. Returns prompt -> generated ids."""
    committed, fired = 0, asyncio.Event()
    loop = asyncio.get_running_loop()
    fault_task: list[asyncio.Future] = []

    def count(new: list[int]) -> None:
        nonlocal committed
        committed += len(new)
        if committed >= after_tokens and not fired.is_set():
            fired.set()
            fault_task.append(loop.run_in_executor(None, fault))

    config = EdgeConfig(request_timeout_s=15, retry_budget_s=30, linger_ms=0)
    async with await load_edge(cluster.frontend, draft, config=config) as edge:
        session = SessionConfig(max_new_tokens=N_NEW, draft_len=2)
        outs = await asyncio.gather(*(edge.generate(edge.tokenizer(p).input_ids, session, count) for p in PROMPTS))
    assert fired.is_set(), "the fault never fired: the run was shorter than expected"
    await asyncio.gather(*fault_task)
    return {p: ids for p, (ids, _) in zip(PROMPTS, outs)}


def wait_gauges_zero(cluster: LocalCluster, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ports = [cluster.broker_health_port] + [port for port, proc in zip(cluster.health_ports, cluster.worker_procs)
                                                if proc.poll() is None]
        open_ = [cluster.metrics(port).get(name, 0.0) for port in ports
                 for name in ("specrelay_broker_sessions_open", "specrelay_cloud_sessions_open")]
        if not any(open_):
            return
        assert time.monotonic() < deadline, f"session gauges still {open_}"
        time.sleep(0.2)


def test_worker_sigkill_sessions_move_to_the_other_worker(tiny_pair, references):
    target, draft = tiny_pair
    with LocalCluster(str(target), workers=2) as cluster:
        outs = asyncio.run(generate_through_fault(cluster, str(draft), lambda: cluster.kill(cluster.worker_procs[0]),
                                                  after_tokens=30))
        assert outs == references
        wait_gauges_zero(cluster)


def test_all_workers_lost_then_a_new_one_within_the_budget(tiny_pair, references):
    target, draft = tiny_pair

    def fault() -> None:
        cluster.kill(cluster.worker_procs[0])
        time.sleep(2.0)  # no worker at all for a while: edges get WORKER_LOST, then UNAVAILABLE, and retry
        cluster.start_worker()

    with LocalCluster(str(target), workers=1) as cluster:
        outs = asyncio.run(generate_through_fault(cluster, str(draft), fault, after_tokens=30))
        assert outs == references
        wait_gauges_zero(cluster)


def test_broker_restart_sessions_resume(tiny_pair, references):
    target, draft = tiny_pair

    def fault() -> None:
        cluster.kill(cluster.broker)
        time.sleep(0.5)
        cluster.start_broker()  # same endpoints: edges and the worker reconnect by themselves

    with LocalCluster(str(target), workers=1) as cluster:
        t0 = time.monotonic()
        outs = asyncio.run(generate_through_fault(cluster, str(draft), fault, after_tokens=30))
        assert outs == references
        assert time.monotonic() - t0 < 60
        wait_gauges_zero(cluster)


def test_edge_sigkill_frees_its_sessions_everywhere(tiny_pair, tmp_path):
    """An edge killed with sessions open: the broker notices its silence (edge TTL) and closes them on the
    worker; every gauge returns to zero."""
    target, draft = tiny_pair
    with LocalCluster(str(target), workers=1, extra_broker_args=("--edge-ttl", "2")) as cluster:
        listen = f"tcp://127.0.0.1:{free_port()}"
        edge = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "edge-worker", "--broker", cluster.frontend,
                                 "--draft-model", str(draft), "--listen", listen], stderr=subprocess.DEVNULL)
        try:
            async def start_sessions() -> None:
                async with Client(listen, timeout=60) as client:
                    streams = [client.stream(p, max_new_tokens=400, temperature=1.0, draft_len=1) for p in PROMPTS]
                    for stream in streams:
                        await stream.__anext__()  # every session has produced text: it is open in the cloud
                    edge.kill()  # the edge dies with its sessions open: nobody sends CLOSE
                    edge.wait()
            asyncio.run(start_sessions())
            assert cluster.metrics(cluster.health_ports[0])["specrelay_cloud_sessions_open"] > 0
            wait_gauges_zero(cluster, timeout=15)
        finally:
            if edge.poll() is None:
                edge.kill()
