"""Several brokers with failover, with real processes (issue 23): two `specrelay broker`, two `specrelay
cloud-worker` given both, one `specrelay generate --concurrency 16` given both. Both brokers carry sessions;
broker A is killed with SIGKILL mid-run and never restarted; all 16 greedy outputs equal the target alone's, and
every session gauge left (broker B, both workers) returns to zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from specrelay.cluster import LocalCluster
from tiny import greedy_references

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in", "print(", "    return", "import os\n",
           "while True:\n", "if x > 0:\n", "def main():\n", "# a comment\n", "x = [", "with open(",
           "try:\n", "lambda x:", "async def f():\n", "from typing import"]
N_NEW = 48


@pytest.fixture(scope="module")
def references(tiny_pair):
    return greedy_references(tiny_pair[0], PROMPTS, N_NEW)


def sessions_open(cluster: LocalCluster, port: int, name: str) -> float:
    try:
        return cluster.metrics(port).get(name, 0.0)
    except OSError:
        return 0.0


def wait_both_carry_sessions(cluster: LocalCluster, gen: subprocess.Popen, timeout: float = 90.0) -> list[float]:
    """Poll both brokers' open-session gauges until each carries at least one session at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and gen.poll() is None:
        open_ = [sessions_open(cluster, port, "specrelay_broker_sessions_open") for port in cluster.broker_health_ports]
        if all(open_):
            return open_
        time.sleep(0.02)
    raise AssertionError(f"the brokers never both carried sessions (generate exited {gen.poll()})")


def test_broker_a_sigkilled_mid_run_sessions_finish_on_broker_b_identical(tiny_pair, references, tmp_path):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    with LocalCluster(str(target), workers=2, brokers=2, threads=1) as cluster:
        gen = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "generate", "--broker", cluster.frontends[0],
                                "--broker", cluster.frontends[1], "--draft-model", str(draft),
                                "--prompts", str(prompts),
                                "--concurrency", "16", "--max-new-tokens", str(N_NEW), "--temperature", "0",
                                "--draft-len", "1", "--retry-budget", "30", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1", SPECRELAY_THREADS="1"))
        try:
            carried = wait_both_carry_sessions(cluster, gen)
            cluster.kill(cluster.broker_procs[0])  # broker A: no goodbye, never restarted
            out, err = gen.communicate(timeout=120)
        finally:
            if gen.poll() is None:
                gen.kill()
        assert gen.returncode == 0, err[-3000:]
        results = [json.loads(line) for line in out.splitlines()]
        assert [r["prompt"] for r in results] == PROMPTS
        for r in results:
            assert "error" not in r, r
            assert r["token_ids"] == references[r["prompt"]], r["prompt"]
        moved = sum(r["stats"]["retries"] for r in results)
        assert moved > 0, f"no session was on broker A when it died ({carried} open before the kill)"
        wait_gauges_zero(cluster)


def wait_gauges_zero(cluster: LocalCluster, timeout: float = 15.0) -> None:
    """Broker B and both workers hold no session once generate is done (A's sessions left the workers too)."""
    deadline = time.monotonic() + timeout
    ports = [(cluster.broker_health_ports[1], "specrelay_broker_sessions_open")]
    ports += [(port, "specrelay_cloud_sessions_open") for port in cluster.health_ports]
    while True:
        open_ = [cluster.metrics(port).get(name, 0.0) for port, name in ports]
        if not any(open_):
            return
        assert time.monotonic() < deadline, f"session gauges still {open_}"
        time.sleep(0.2)
