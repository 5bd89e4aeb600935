"""The foundation's exactness checks on the trained demo pair (skipped until models/ holds it)."""

from __future__ import annotations

import pytest

from specrelay.common.sampling import SamplingParams
from specrelay.edge_worker.session import SessionConfig
from specrelay.speculative import speculative_generate, speculative_generate_batch, target_generate

pytestmark = pytest.mark.demo


@pytest.mark.timeout(600)
def test_greedy_speculative_equals_hf_generate_on_20_heldout_prompts(demo_runners, heldout_prompts, demo_greedy):
    target, draft = demo_runners
    prompts = [target.tokenizer(p).input_ids for p in heldout_prompts[:20]]
    results = speculative_generate_batch(draft, target, prompts, [SessionConfig(max_new_tokens=32)] * len(prompts))
    accepted = 0
    for text, (out, stats) in zip(heldout_prompts, results):
        assert out == demo_greedy(text, 32)
        accepted += stats["accepted_tokens"]
    assert accepted > 0


@pytest.mark.timeout(600)
def test_gumbel_coupled_equals_target_alone_with_same_seed(demo_runners, heldout_prompts):
    target, draft = demo_runners
    params = SamplingParams(temperature=0.8, top_k=50)
    for seed, prompt in enumerate(heldout_prompts[:5]):
        ids = target.tokenizer(prompt).input_ids
        out, _ = speculative_generate(draft, target, ids, max_new_tokens=24, params=params, mode="coupled", seed=seed)
        assert out == target_generate(target, ids, 24, params, "coupled", seed)
