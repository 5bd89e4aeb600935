"""One multipart message can grow a process by any amount (issue 18 item 2): libzmq buffers it whole before the
application sees a frame. The broker's memory budget (--max-rss-mb) ends it with exit code 75 instead, and a
restarted broker serves a greedy generation exactly (edges re-OPEN with the full context)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq

from specrelay.cluster import LocalCluster
from specrelay.common.membudget import EXIT_MEMORY, MemoryBudget, rss_mb
from specrelay.edge_worker.server import load_edge
from specrelay.edge_worker.server import EdgeConfig
from specrelay.edge_worker.session import SessionConfig

pytestmark = pytest.mark.timeout(180)
PROMPT, N_NEW = "def add(a, b):\n", 32


def test_the_budget_ends_the_process_past_its_limit():
    exits = []
    budget = MemoryBudget(rss_mb() / 2, interval_s=0.01, exit=exits.append)
    budget.start()
    budget._thread.join(timeout=10)
    assert exits == [EXIT_MEMORY]
    calm = MemoryBudget(rss_mb() + 1024, interval_s=0.01, exit=exits.append)
    calm.start()
    time.sleep(0.1)
    calm.stop()
    assert exits == [EXIT_MEMORY]


def test_a_huge_multipart_message_restarts_the_broker_and_the_generation_finishes_exactly(tiny_pair):
    """Mid-generation, 300 MiB in one message at the frontend: the broker (budget 160 MiB) exits 75, is restarted
    on the same endpoints, and the generation resumes (re-OPEN with the full context) token-identical."""
    target, draft = tiny_pair
    with LocalCluster(str(target), extra_broker_args=("--max-rss-mb", "160")) as cluster:
        assert asyncio.run(generate_through_attack(cluster, str(draft))) == reference(target)


def attack_and_restart(cluster: LocalCluster) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.frontend)
    frame = zmq.Frame(b"x" * 2**20)
    for _ in range(300):  # the sender holds one 1 MiB buffer (zero-copy)
        sock.send(frame, zmq.SNDMORE, copy=False)
    sock.send(b"end")
    try:
        assert cluster.broker.wait(timeout=60) == EXIT_MEMORY
    finally:
        sock.close()
        ctx.term()
    cluster.start_broker()  # what systemd (Restart=on-failure) or Kubernetes does


async def generate_through_attack(cluster: LocalCluster, draft: str) -> list[int]:
    """A greedy generation that, once it has committed tokens, waits for the attack and the restart."""
    done = False

    async def on_tokens(_new: list[int]) -> None:
        nonlocal done
        if not done:
            done = True
            await asyncio.to_thread(attack_and_restart, cluster)

    config = EdgeConfig(request_timeout_s=30, retry_budget_s=60, linger_ms=0)
    async with await load_edge(cluster.frontend, draft, config=config) as edge:
        out, _ = await edge.generate(edge.tokenizer(PROMPT).input_ids, SessionConfig(max_new_tokens=N_NEW), on_tokens)
    assert done
    return out


def reference(target) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(target), AutoModelForCausalLM.from_pretrained(target)
    ids = tok(PROMPT).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()
