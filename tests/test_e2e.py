"""The whole distributed path with real processes: `specrelay broker` + `specrelay cloud-worker` children,
edges in-process or as `specrelay generate` / `specrelay edge-worker` children, real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import pytest

from specrelay.cluster import LocalCluster, free_port
from tiny import hf_greedy

PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in", "print(", "    return", "import os\n"]


@pytest.fixture(scope="module")
def tiny_cluster(tiny_pair):
    target, _ = tiny_pair
    with LocalCluster(str(target), workers=2) as cluster:
        yield cluster


def worker_metric(cluster: LocalCluster, i: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.health_ports[i]}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.timeout(240)
def test_cli_generate_json_greedy_equals_hf_and_two_workers_share_load(tiny_cluster, tiny_pair, tmp_path):
    target, draft = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    before = [worker_metric(tiny_cluster, i, "specrelay_cloud_verify_requests_total") for i in range(2)]
    out = subprocess.run([sys.executable, "-m", "specrelay.cli", "generate", "--broker", tiny_cluster.frontend,
                          "--draft-model", str(draft), "--prompts", str(prompts), "--max-new-tokens", "24", "--json"],
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok, model = AutoTokenizer.from_pretrained(target), AutoModelForCausalLM.from_pretrained(target)
    assert [r["prompt"] for r in rows] == PROMPTS  # input order
    for r in rows:
        assert r["token_ids"] == hf_greedy(model, tok, r["prompt"], 24)
        assert r["text"] == tok.decode(r["token_ids"])
        assert set(r["stats"]) >= {"generated_tokens", "draft_tokens", "accepted_tokens", "cloud_calls",
                                   "uplink_bytes", "downlink_bytes", "wall_s"}
        assert r["stats"]["generated_tokens"] == len(r["token_ids"])
    tokens, calls = (sum(r["stats"][k] for r in rows) for k in ("generated_tokens", "cloud_calls"))
    assert f"--- all: {len(rows)} of {len(rows)} prompts, {tokens} tokens, {calls} cloud calls " \
           f"({calls / tokens:.4f} a token)" in out.stderr  # the run's figure, as bench calls reports it
    after = [worker_metric(tiny_cluster, i, "specrelay_cloud_verify_requests_total") for i in range(2)]
    assert all(a > b for a, b in zip(after, before)), "both workers should have verified some sessions"


@pytest.mark.timeout(240)
def test_draft_len_zero_is_target_alone_one_call_per_token(tiny_cluster, tiny_pair):
    from specrelay.bench import run_edge

    _, draft = tiny_pair
    out, _ = asyncio.run(run_edge(tiny_cluster.frontend, str(draft), PROMPTS[:2], 2, max_new_tokens=12, draft_len=0))
    for ids, stats in out:
        assert stats["cloud_calls"] == stats["generated_tokens"] == len(ids) and stats["draft_tokens"] == 0


@pytest.mark.timeout(240)
async def test_client_stream_and_cancel_through_edge_worker_process(tiny_cluster, tiny_pair):
    from specrelay import Client

    target, draft = tiny_pair
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    edge = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "edge-worker", "--broker", tiny_cluster.frontend,
                             "--draft-model", str(draft), "--listen", endpoint])
    try:
        async with Client(endpoint, timeout=60) as client:
            result = await client.generate(PROMPTS[0], max_new_tokens=20)
            pieces = [piece async for piece in client.stream(PROMPTS[0], max_new_tokens=20)]
            assert "".join(pieces) == result.text and len(pieces) > 1
            stream = client.stream(PROMPTS[1], max_new_tokens=200)
            async for _ in stream:  # leave early: the edge closes the cloud session
                break
            await stream.aclose()
            again = await client.generate(PROMPTS[0], max_new_tokens=20)
            assert again.token_ids == result.token_ids
    finally:
        edge.terminate()
        assert edge.wait(timeout=20) == 0


# ------------------------------------------------------------------------------------------ demo pair

@pytest.mark.demo
@pytest.mark.timeout(600)
def test_demo_greedy_through_broker_equals_hf_20_prompts_8_in_flight(demo_runners, heldout_prompts, demo_greedy):
    from specrelay.bench import run_edge

    target, _ = demo_runners
    prompts = heldout_prompts[:20]
    with LocalCluster(target.name) as cluster:
        out, _ = asyncio.run(run_edge(cluster.frontend, target.name.replace("demo-target", "demo-draft"), prompts, 8,
                                      max_new_tokens=32))
        xv, _ = asyncio.run(run_edge(cluster.frontend, target.name.replace("demo-target", "demo-draft-xv"), prompts,
                                     8, target_tok=target.name, max_new_tokens=32))
    for prompt, (ids, stats), (xv_ids, _) in zip(prompts, out, xv):
        ref = demo_greedy(prompt, 32)
        assert ids == ref, prompt
        assert xv_ids == ref, prompt  # cross-vocabulary draft: still exactly the target's greedy output


@pytest.mark.timeout(240)
def test_cli_generate_reports_a_failed_prompt_and_keeps_the_others(tiny_cluster, tiny_pair, tmp_path):
    """One prompt too long for any context: its line is {"prompt", "error"}, the others are printed in order,
    and the exit code is 1 at the end (never silence)."""
    target, draft = tiny_pair
    too_long = "x = 1\n" * 20_000
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (PROMPTS[0], too_long, PROMPTS[1])))
    out = subprocess.run([sys.executable, "-m", "specrelay.cli", "generate", "--broker", tiny_cluster.frontend,
                          "--draft-model", str(draft), "--prompts", str(prompts), "--max-new-tokens", "8", "--json"],
                         capture_output=True, text=True, timeout=200)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert out.returncode == 1, out.stderr[-2000:]
    assert [r["prompt"] for r in rows] == [PROMPTS[0], too_long, PROMPTS[1]]
    assert "error" in rows[1] and "token_ids" in rows[0] and "token_ids" in rows[2]
