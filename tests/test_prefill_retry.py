"""Long prefill under load (issue 18, item 9): a re-OPEN never redoes a finished (or half-done) prefill, a CLOSE
stops the prefill of an edge that gave up, and the edge's timeout counts the prefill its sessions wait for."""

from __future__ import annotations

import asyncio

import pytest

from specrelay.cloud_worker.config import SchedulerConfig
from specrelay.cloud_worker.scheduler import ChunkedPrefill, Item, Scheduler
from specrelay.cloud_worker.verifier import Verifier
from specrelay.cluster import LocalCluster
from specrelay.common import protocol as P
from specrelay.edge_worker.server import load_edge
from specrelay.edge_worker.server import EdgeConfig
from specrelay.edge_worker.session import SessionConfig

pytestmark = pytest.mark.timeout(180)

KEY = (b"e", 1)


def prefill(verifier: Verifier, tokens: int, key=KEY) -> None:
    chunks = ChunkedPrefill(verifier, tokens)
    while not chunks.ready(key):
        verifier.verify([], chunks.rows())


def test_a_reopen_keeps_the_prefilled_prefix_and_verifies_the_same(tiny_runners):
    target, _ = tiny_runners
    ids = target.tokenizer("def add(a, b):\n    return a + b\n" * 6).input_ids
    verifier, fresh = Verifier(target), Verifier(target)
    verifier.open(KEY, P.Open(1, ids))
    prefill(verifier, 4)
    done = verifier.stats["prefill_tokens"]  # the last < 4 tokens go with the first VERIFY's row
    assert len(ids) - 4 <= done == verifier.cached(KEY) <= len(ids) - 1
    verifier.open(KEY, P.Open(1, ids))  # the edge timed out and re-OPENs: nothing is prefilled again
    assert ChunkedPrefill(verifier, 4).ready(KEY) and verifier.cached(KEY) == done
    prefill(verifier, 4)
    assert verifier.stats["prefill_tokens"] == done
    fresh.open(KEY, P.Open(1, ids))
    prefill(fresh, 64)
    request = P.Verify(1, 1, len(ids), [], [5, 6, 7])
    assert verifier.verify([(KEY, request)]) == fresh.verify([(KEY, request)])
    # a re-OPEN with a different context keeps only the common prefix
    verifier.open(KEY, P.Open(1, ids[:10] + [9] * 20))
    assert verifier.cached(KEY) == 10


def test_a_close_drops_the_held_work_of_a_session_still_prefilling(tiny_runners):
    """Session 1's 60-token prompt needs 15 steps at 4 tokens each; its VERIFY waits for them. The edge gives up:
    its CLOSE drops that VERIFY, and the step that goes carries session 2's VERIFY and no prefill for session 1."""
    verifier = Verifier(tiny_runners[0])
    scheduler = Scheduler(SchedulerConfig(prefill_tokens=4), verifier)
    for msg in (P.Open(1, [5] * 60), P.Verify(1, 1, 60), P.Open(2, [5] * 3), P.Verify(2, 1, 3), P.Close(1)):
        scheduler.push(Item((b"e", msg.session), msg, 0.0))
    handled = []

    def control(item: Item) -> None:
        handled.append(item.msg)
        verifier.close(item.key) if isinstance(item.msg, P.Close) else verifier.open(item.key, item.msg)

    step = scheduler.plan(0.0, control).step
    assert [type(m) for m in handled] == [P.Open, P.Open, P.Close] and [i.msg.session for i in step.verifies] == [2]
    assert step.prefill == [] and len(scheduler) == 0 and list(verifier.sessions) == [(b"e", 2)]


def test_long_prompts_under_a_small_prefill_budget_all_finish_and_are_prefilled_once(tiny_pair):
    """Item 9 in small: 6 prompts of ~300 tokens at once, a worker prefilling 4 tokens per forward pass, and a
    base request timeout (0.5 s) far below the time the last prompt waits for its prefill."""
    target, draft = tiny_pair
    with LocalCluster(str(target), threads=1, extra_worker_args=("--prefill-tokens", "4")) as cluster:
        async def run():
            config = EdgeConfig(request_timeout_s=0.5, retry_budget_s=60, linger_ms=0)
            async with await load_edge(cluster.frontend, str(draft), config=config) as edge:
                prompts = [edge.tokenizer(f"# prompt {i}\n" + "x = x + 1\n" * 50).input_ids for i in range(6)]
                outs = await asyncio.gather(*(edge.generate(p, SessionConfig(max_new_tokens=4)) for p in prompts))
                return prompts, [stats["reopens"] for _, stats in outs], edge.metrics.retries

        prompts, reopens, retries = asyncio.run(run())
        stats = cluster.metrics(cluster.health_ports[0])
    assert all(len(p) > 250 for p in prompts)
    prefilled = stats["specrelay_cloud_prefill_tokens_total"]  # chunks; each prompt's last < 4 go with its VERIFY
    assert sum(len(p) - 4 for p in prompts) <= prefilled <= sum(len(p) - 1 for p in prompts), (stats, retries)
