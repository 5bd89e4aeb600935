"""A broker that is up but has no worker, with real processes: two `specrelay broker`, one `specrelay cloud-worker`
given only the first, one `specrelay generate --concurrency 8` given both. The sessions the hash puts on the
workerless broker are answered UNAVAILABLE "no live cloud worker"; the edge re-OPENs each on the other broker and steers
new sessions away from the workerless one (before, it retried that broker until the budget was spent: 3/8 failed
after 49-61 s). All 8 greedy outputs equal the target alone's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specrelay.cluster import LocalCluster, free_port
from specrelay.common.errors import NO_LIVE_WORKER, Overloaded
from tiny import greedy_references

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]

PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in", "print(", "    return", "import os\n",
           "while True:\n", "if x > 0:\n"]
N_NEW = 24


def test_sessions_on_a_broker_without_a_worker_finish_on_the_other_exact(tiny_pair, tmp_path):
    target, draft = tiny_pair
    references = greedy_references(target, PROMPTS, N_NEW)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))  # 16: both brokers get some
    with LocalCluster(str(target), workers=0, brokers=2, threads=1) as cluster:
        port = free_port()
        worker = cluster._spawn("cloud-worker", "--broker", cluster.backends[0], "--model", str(target),
                                "--health-port", str(port))
        cluster._wait_healthy(port, worker, "cloud worker")
        gen = subprocess.run([sys.executable, "-m", "specrelay.cli", "generate", "--broker", cluster.frontends[0],
                              "--broker", cluster.frontends[1], "--draft-model", str(draft),
                              "--prompts", str(prompts), "--concurrency", "8", "--max-new-tokens", str(N_NEW),
                              "--temperature", "0", "--retry-budget", "20", "--json"],
                             capture_output=True, text=True, timeout=200,
                             env=dict(os.environ, OMP_NUM_THREADS="1", SPECRELAY_THREADS="1"))
        refused = cluster.metrics(cluster.broker_health_ports[1]).get("specrelay_broker_unavailable_sent_total", 0)
    assert gen.returncode == 0, gen.stderr[-3000:]
    results = [json.loads(line) for line in gen.stdout.splitlines()]
    assert len(results) == 16
    for r in results:
        assert "error" not in r, r
        assert r["token_ids"] == references[r["prompt"]], r["prompt"]
    assert refused >= 1, "no session was put on the workerless broker: the test proved nothing"


def test_the_broker_s_refusal_is_what_the_edge_recognises():
    from specrelay.broker.routing import NO_LIVE_WORKER as used_by_the_broker

    assert used_by_the_broker == NO_LIVE_WORKER
    assert str(Overloaded(f"{NO_LIVE_WORKER} has room for a new session; retry later")).startswith(NO_LIVE_WORKER)
