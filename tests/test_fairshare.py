"""One client trying to fill a cloud worker's KV store (`specrelay bench fairshare --only kv`, shortened; real
processes): 32 sessions of 400-token prompts against a 64 MiB store, kept busy and re-OPENed on every refusal,
while 4 legit edges generate. The attacker holds at most its share (before: 0.94 of the store), no session is
evicted, and the 4 legit generations equal the target alone's."""

from __future__ import annotations

import argparse

import pytest

from conftest import MODELS, demo_available
from specrelay.bench import fairshare
from specrelay.bench.runs import load_prompts
from specrelay.common.runner import ModelRunner
from specrelay.speculative import target_generate

pytestmark = [pytest.mark.process, pytest.mark.timeout(300),
              pytest.mark.skipif(not demo_available(), reason="demo models not trained")]


def test_one_client_filling_the_kv_store_holds_its_share_and_4_legit_edges_finish_exact():
    args = argparse.Namespace(target=str(MODELS / "demo-target"), draft=str(MODELS / "demo-draft"),
                              max_new_tokens=24, flood_s=20.0, fill_tokens=400, kv_cache_mb=64)
    prompts = load_prompts(str(MODELS / "heldout_prompts.jsonl"), 4)
    target = ModelRunner.load(args.target)
    refs = [target_generate(target, target.tokenizer(p).input_ids, args.max_new_tokens) for p in prompts]
    out = fairshare.kv_fill(args, prompts, refs)
    assert out["legit_completed"] == out["legit_exact"] == 4, out
    assert out["attacker_kv_fraction"] <= 0.5 and out["worker_evictions"] == 0, out
    assert out["worker_budget_refusals"] > 0, out  # the attacker did reach its share
