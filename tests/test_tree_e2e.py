"""Token trees through real processes: `specrelay broker` + `specrelay cloud-worker` children, the edge as a
`specrelay generate --trees on` child or in-process, real sockets on 127.0.0.1. Greedy equals HF `generate`
(tiny models and the demo pair), seeded coupled sampling equals the target alone's, sample mode runs its trees
(and their RESAMPLE rounds) through the same plumbing; pre-drafted verdicts start most rounds over a link."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import pytest

from specrelay.cluster import LocalCluster
from specrelay.common.protocol import Mode
from specrelay.common.runner import ModelRunner
from specrelay.common.sampling import SamplingParams
from specrelay.speculative import target_generate
from tiny import hf_greedy

PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in", "print("]


@pytest.fixture(scope="module")
def tiny_cluster(tiny_pair):
    target, _ = tiny_pair
    with LocalCluster(str(target), threads=1) as cluster:
        yield cluster


@pytest.mark.timeout(240)
def test_cli_generate_with_trees_equals_hf_greedy(tiny_cluster, tiny_pair, tmp_path):
    target, draft = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = subprocess.run([sys.executable, "-m", "specrelay.cli", "generate", "--broker", tiny_cluster.frontend,
                          "--draft-model", str(draft), "--prompts", str(prompts), "--max-new-tokens", "24",
                          "--draft-len", "4", "--trees", "on", "--json"], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    runner = ModelRunner.load(str(target))
    for r in rows:
        assert r["token_ids"] == hf_greedy(runner.model, runner.tokenizer, r["prompt"], 24), r["prompt"]
        assert r["stats"]["tree_rounds"] > 0


@pytest.mark.timeout(240)
def test_coupled_and_sampled_trees_through_real_processes(tiny_cluster, tiny_pair):
    from specrelay.bench import run_edge

    target, draft = tiny_pair
    runner = ModelRunner.load(str(target))
    out, _ = asyncio.run(run_edge(tiny_cluster.frontend, str(draft), PROMPTS, 4, max_new_tokens=20, temperature=1.0,
                                  mode=Mode.COUPLED, seed=11, draft_len=3, trees="on"))
    for prompt, (ids, stats) in zip(PROMPTS, out):
        want = target_generate(runner, runner.tokenizer(prompt).input_ids, 20, SamplingParams(1.0), Mode.COUPLED, 11)
        assert ids == want, prompt
        assert stats["tree_rounds"] > 0
    out, _ = asyncio.run(run_edge(tiny_cluster.frontend, str(draft), PROMPTS, 4, max_new_tokens=20, temperature=1.0,
                                  mode=Mode.SAMPLE, seed=3, draft_len=3, trees="on"))
    for ids, stats in out:  # the law is checked in-process (tests/test_tree_session.py); here the plumbing
        assert len(ids) == stats["generated_tokens"] > 0 and all(0 <= t < runner.vocab_size for t in ids)
        assert stats["tree_rounds"] > 0 and stats["uplink_bytes"] > 0


@pytest.mark.timeout(240)
def test_a_chains_only_worker_answers_chains_only_and_the_edge_sends_chains(tiny_pair, tmp_path):
    """A cloud worker on a model served through its own cache (Falcon: no AttentionInterface) refuses a tree with
    CHAINS_ONLY, counted as a bad request; the edge re-OPENs, drafts chains, and its output is still the target's."""
    from specrelay.archs import ARCHS, build
    from specrelay.bench import run_edge

    target = build(next(a for a in ARCHS if a.model_type == "falcon"), tiny_pair[0], tmp_path / "falcon")
    with LocalCluster(str(target), threads=1) as cluster:
        out, _ = asyncio.run(run_edge(cluster.frontend, str(tiny_pair[1]), PROMPTS[:2], 2, max_new_tokens=12,
                                      draft_len=3, trees="on"))
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.health_ports[0]}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        values = cluster.metrics(cluster.health_ports[0])
    refused = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if 'code="CHAINS_ONLY"' in line and not line.startswith("#")]
    bad_requests = [v for name, v in values.items() if name.endswith("_bad_requests_total")]
    assert refused and refused[0] >= 1 and bad_requests == [refused[0]], metrics[-3000:]
    runner = ModelRunner.load(str(target))
    for prompt, (ids, stats) in zip(PROMPTS, out):
        assert ids == hf_greedy(runner.model, runner.tokenizer, prompt, 12), prompt


@pytest.mark.demo
@pytest.mark.timeout(600)
def test_demo_trees_over_a_link_equal_hf_and_start_from_predrafts(demo_runners, heldout_prompts, demo_greedy):
    """The demo pair over an emulated 50 ms link: greedy trees equal HF's output and, with the draft thread idle
    during the round trip, most rounds start from a pre-drafted verdict."""
    from specrelay.bench.link import LinkRelay, LinkSpec
    from specrelay.bench.runs import run_sessions
    from specrelay.edge_worker.config import EdgeConfig, SessionConfig
    from specrelay.edge_worker.server import load_edge

    target, _ = demo_runners
    prompts = heldout_prompts[:4]

    async def run(endpoint: str):
        config = SessionConfig(max_new_tokens=32, draft_len=6, trees="on")
        edge = await load_edge(endpoint, target.name.replace("demo-target", "demo-draft"),
                               config=EdgeConfig(request_timeout_s=120.0))
        async with edge:
            await run_sessions(edge, prompts[:1], config, 1)  # warm-up: the link and the costs are learnt
            runs, _ = await run_sessions(edge, prompts, config, 1)
        return runs

    with LocalCluster(target.name) as cluster, LinkRelay(LinkSpec.parse("50ms"), cluster.frontend) as relay:
        runs = asyncio.run(run(relay.endpoint))
    tries = sum(r.stats["predraft_tries"] for r in runs)
    hits = sum(r.stats["predraft_rounds"] for r in runs)
    for prompt, r in zip(prompts, runs):
        assert r.error is None and r.ids == demo_greedy(prompt, 32), prompt
    assert tries > 0 and hits >= 0.5 * tries, (hits, tries)
