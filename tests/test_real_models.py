"""The release check on two real pretrained checkpoints (`make real-models`, then `make test-real`): gemma-3-270m
(Gemma 3, sliding windows, 262,144 tokens) as the target, SmolLM2-135M-Instruct (Llama, 49,152 tokens, a chat
template) as its cross-vocabulary draft and as its own target. Real processes (broker, cloud worker, edge) on
127.0.0.1; every output is compared with the target model's own. Each model loads once per module."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from specrelay.cluster import LocalCluster, free_port
from tiny import hf_greedy

pytestmark = pytest.mark.real

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL = os.path.join(ROOT, "models", "real")
GEMMA, SMOL = os.path.join(REAL, "gemma-3-270m"), os.path.join(REAL, "smollm2-135m")
SMOL_GGUF = os.path.join(REAL, "gguf", "SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "La casa de mi abuela",
           "SELECT name FROM users WHERE"]
N = 24  # tokens per prompt: enough for several drafting rounds, few enough for a modest runtime

if not all(os.path.isfile(os.path.join(d, "model.safetensors")) for d in (GEMMA, SMOL)):
    pytest.skip("models/real/ is missing: run `make real-models` first (docs/real-models.md)",
                allow_module_level=True)


def hf(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def gemma_cluster():
    with LocalCluster(GEMMA, startup_timeout=600) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def smol_cluster():
    with LocalCluster(SMOL, startup_timeout=600) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def gemma_greedy():
    model, tok = hf(GEMMA)
    return {p: hf_greedy(model, tok, p, N) for p in PROMPTS}


@pytest.fixture(scope="module")
def smol_hf():
    return hf(SMOL)


def edge(cluster, draft: str, prompts, target_tok: str | None = None, **cfg):
    from specrelay.bench import run_edge

    out, _ = asyncio.run(run_edge(cluster.frontend, draft, list(prompts), 1, target_tok, max_new_tokens=N, **cfg))
    return out


@pytest.mark.timeout(1800)
def test_cross_pair_greedy_equals_gemma_and_the_bitmap_travels_once(gemma_cluster, gemma_greedy):
    # a fixed length: this draft does not pay on a CPU, so `auto` rightly verifies rows of 1 and drafts nothing
    out = edge(gemma_cluster, SMOL, PROMPTS, GEMMA, draft_len=3)
    for prompt, (ids, stats) in zip(PROMPTS, out):
        assert ids == gemma_greedy[prompt], prompt
        # run_edge's warm-up session was the edge's first with this pair: these OPENs name the bitmap by hash
        assert 8 * stats["uplink_bytes"] / stats["generated_tokens"] <= 1000, stats
    assert sum(s["accepted_tokens"] for _, s in out) > 0  # the draft was used, not only the target


@pytest.mark.timeout(1800)
def test_cross_pair_coupled_and_sampled(gemma_cluster):
    """Coupled: token for token gemma alone's coupled draw for the same seed (the shared noise). Sampled (srdv):
    the first token's law over seeds is gemma's (chi-square over its likeliest tokens)."""
    from specrelay.common.runner import ModelRunner
    from specrelay.common.sampling import SamplingParams, probs_from_logits
    from specrelay.edge_worker.loading import load_drafter
    from specrelay.edge_worker.session import SessionConfig
    from specrelay.speculative import speculative_generate_batch, target_generate
    from stats import chi2_pvalue

    target = ModelRunner.load(GEMMA)
    drafter, tok = load_drafter(SMOL, GEMMA)
    params = SamplingParams(temperature=1.0)
    prompt = tok(PROMPTS[2]).input_ids
    coupled = [SessionConfig(max_new_tokens=8, params=params, mode="coupled", seed=s) for s in range(4)]
    for seed, (ids, _) in enumerate(speculative_generate_batch(drafter, target, [prompt] * 4, coupled)):
        assert ids == target_generate(target, prompt, 8, params, "coupled", seed), seed
    out = edge(gemma_cluster, SMOL, PROMPTS[2:3] * 2, GEMMA, temperature=1.0, mode="coupled", seed=3)
    assert out[0][0] == out[1][0] == target_generate(target, prompt, N, params, "coupled", 3)
    seeds = 300
    sampled = [SessionConfig(max_new_tokens=1, params=params, mode="sample", seed=s) for s in range(seeds)]
    firsts = [ids[0] for ids, _ in speculative_generate_batch(drafter, target, [prompt] * seeds, sampled)]
    from specrelay.common.runner import Decoder

    p = probs_from_logits(Decoder(target).next_logits(prompt), params).double()
    top = torch.argsort(p, descending=True)[:8].tolist()
    counts = [sum(t == x for t in firsts) for x in top] + [sum(t not in top for t in firsts)]
    probs = [float(p[x]) for x in top] + [float(1 - p[top].sum())]
    assert chi2_pvalue(counts, probs) > 0.001, (counts, probs)


@pytest.mark.timeout(1200)
def test_smollm2_as_its_own_draft_chains_and_trees(smol_cluster, smol_hf):
    model, tok = smol_hf
    want = {p: hf_greedy(model, tok, p, N) for p in PROMPTS[:3]}
    for trees in ("off", "on"):
        for prompt, (ids, _) in zip(PROMPTS, edge(smol_cluster, SMOL, PROMPTS[:3], trees=trees)):
            assert ids == want[prompt], (trees, prompt)
    gguf = edge(smol_cluster, SMOL_GGUF, PROMPTS[:1])  # the GGUF file itself as the draft model
    assert gguf[0][0] == want[PROMPTS[0]]


@pytest.mark.timeout(1200)
def test_chat_completions_through_smollm2s_chat_template(smol_cluster, smol_hf):
    model, tok = smol_hf
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    want = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False)[0, len(ids):].tolist()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "edge-worker", "--broker", smol_cluster.frontend,
                             "--draft-model", SMOL, "--http", f"127.0.0.1:{port}", "--health-port", str(free_port()),
                             "--served-model-name", "smollm2"])
    try:
        from specrelay.bench import httpfuzz

        base = f"http://127.0.0.1:{port}"
        httpfuzz.wait_http(base + "/health", proc, timeout=600)
        status, reply, _ = httpfuzz.post(base, "/v1/chat/completions", {"model": "smollm2", "messages": messages,
                                         "max_tokens": N, "temperature": 0}, key=None, timeout=600)
        assert status == 200, reply
        eos = want.index(tok.eos_token_id) if tok.eos_token_id in want else len(want)
        assert reply["choices"][0]["message"]["content"] == tok.decode(want[:eos], skip_special_tokens=True)
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


@pytest.mark.timeout(1200)
def test_deterministic_bfloat16_greedy_equals_hf_bfloat16(smol_hf):
    model, tok = hf(SMOL, torch.bfloat16)
    want = {p: hf_greedy(model, tok, p, N) for p in PROMPTS[:2]}
    with LocalCluster(SMOL, startup_timeout=600, extra_worker_args=("--dtype", "bfloat16", "--deterministic")) as c:
        for prompt, (ids, _) in zip(PROMPTS, edge(c, SMOL, PROMPTS[:2])):
            assert ids == want[prompt], prompt
