"""A hostile broker beside an honest one, real processes (`specrelay bench hostile-broker`, shortened): it floods
the worker with 1-token OPENs + VERIFYs under fresh client ids. The honest broker's 8 greedy generations equal the
target alone's, no session is evicted (before: 1,280 evicted least-recently-used in 20 s whatever their activity,
and the worker's RSS grew 58 MiB), the worker refuses the flood past that broker's share of its queue and
sessions, and its RSS stays bounded."""

from __future__ import annotations

import argparse

import pytest

from conftest import MODELS, demo_available
from specrelay.bench import hostile_broker

pytestmark = [pytest.mark.process, pytest.mark.timeout(300),
              pytest.mark.skipif(not demo_available(), reason="demo models not trained")]


def test_a_hostile_broker_s_flood_leaves_the_honest_broker_s_generations_exact():
    args = argparse.Namespace(target=str(MODELS / "demo-target"), draft=str(MODELS / "demo-draft"),
                              prompts=str(MODELS / "heldout_prompts.jsonl"), max_new_tokens=16, flood_s=10.0)
    out = hostile_broker.run(args)
    assert out["honest_outputs_exact"] == out["honest_generations"] == 8, out
    assert out["worker_alive"] and out["worker_evictions"] == 0, out
    assert out["worker_queue_refusals"] > 0 or out["worker_budget_refusals"] > 0, out
    assert out["worker_rss_growth_mib"] < hostile_broker.MAX_RSS_GROWTH_MIB, out
