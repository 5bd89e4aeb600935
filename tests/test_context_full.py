"""A generation that reaches the target's context ends there with its text (finish_reason "length"), also when the
edge does not know the target's context: the worker answers CONTEXT_FULL and the edge keeps every committed token
(issue 18, item 5: before, the edge answered an error and discarded what it had generated)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from specrelay.cluster import LocalCluster
from specrelay.edge_worker.server import load_edge
from specrelay.edge_worker.server import EdgeConfig
from specrelay.edge_worker.session import SessionConfig

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]
CONTEXT = 40


@pytest.fixture(scope="module")
def short_target(tiny_pair, tmp_path_factory):
    """The tiny target with a 40-position context."""
    target, _ = tiny_pair
    short = tmp_path_factory.mktemp("short") / "target"
    shutil.copytree(target, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": CONTEXT}))
    return short


def test_a_generation_past_the_context_ends_at_it_with_every_committed_token(tiny_pair, short_target):
    _, draft = tiny_pair
    with LocalCluster(str(short_target), threads=1) as cluster:
        async def run():
            async with await load_edge(cluster.frontend, str(draft), config=EdgeConfig(linger_ms=0)) as edge:
                assert edge.config.max_context is None  # the edge does not know the target's context
                prompt = edge.tokenizer("def add(a, b):\n    return").input_ids
                tokens, stats = await edge.generate(prompt, SessionConfig(max_new_tokens=200, draft_len=3))
                return prompt, tokens, stats

        prompt, tokens, stats = asyncio.run(run())
    assert stats["context_full"] == 1 and CONTEXT - 1 <= len(prompt) + len(tokens) <= CONTEXT + 1, stats
    model = AutoModelForCausalLM.from_pretrained(short_target)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False,
                             min_new_tokens=len(tokens))
    assert tokens == out[0, len(prompt):].tolist()  # exact up to the limit
