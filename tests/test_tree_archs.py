"""Token trees beside chains in one packed forward, on many architectures: batched tree verdicts equal the greedy
rule on Hugging Face's own logits of every node's path; greedy generation with trees equals HF `generate` on
sliding-window, softcapped, sink and learned-position models; the own-cache fallback refuses trees clearly."""

from __future__ import annotations

import pytest
import torch
from trees import Oracle, hf_greedy

from specrelay.archs import ARCHS, build
from specrelay.cloud_worker.owncache import OwnCacheStore
from specrelay.cloud_worker.verifier import Verifier, VerifierConfig
from specrelay.common import protocol as P
from specrelay.common import verify
from specrelay.common.errors import ErrorCode, InvalidRequest, from_wire
from specrelay.common.protocol import Mode
from specrelay.common.runner import ModelRunner
from specrelay.common.sampling import SamplingParams
from specrelay.common.tree import Tree
from specrelay.treeref import TreeDrafter, TreeShape, tree_generate

from conftest import MODELS

BY_TYPE = {a.model_type: a for a in ARCHS}
TREE_ARCHS = ("mistral", "gemma2", "gemma3_text", "gpt_oss", "gpt2", "opt")  # windows, softcap, sinks, positions
SMALL = dict(max_sessions=8, max_cache_bytes=1 << 22)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree-archs")
    return {t: build(BY_TYPE[t], MODELS / "demo-target", root / t) for t in TREE_ARCHS + ("falcon", "llama")}


def hf_last(runner, ids: list[int]) -> torch.Tensor:  # [V] logits after ids
    with torch.no_grad():
        return runner.model(input_ids=torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("deterministic", [False, True])
def test_batched_trees_and_chains_follow_hf_logits(tiny_runners, deterministic):
    """Four sessions of ragged contexts share every forward: two send oracle trees (deep accepted paths), one a
    tree from the tiny draft (early rejections), one a chain. Each verdict is the rule applied to HF's logits
    after each node's root-to-node path, and the chain's verdict names no node."""
    target, draft = tiny_runners
    verifier = Verifier(target, VerifierConfig(deterministic=deterministic))
    gen = torch.Generator().manual_seed(5)
    ctx = {sid: torch.randint(1, target.vocab_size, (n,), generator=gen).tolist() for sid, n in
           zip(range(1, 5), (4, 30, 11, 63))}
    for sid, ids in ctx.items():
        verifier.open((b"e", sid), P.Open(sid, ids))
    drafters = {1: Oracle(target, TreeShape(3, 2, 12, 2.0)), 2: Oracle(target, TreeShape(4, 3, 20, 2.0)),
                3: TreeDrafter(draft, target.vocab_size, TreeShape(3, 3, 12, 0.9))}
    for seq in range(1, 4):
        requests = []
        for sid, ids in ctx.items():
            if sid in drafters:
                t = drafters[sid].draft(ids, Mode.GREEDY, SamplingParams(), 0)
                requests.append(((b"e", sid), P.Verify(sid, seq, len(ids), [], t.tokens, parents=t.parents)))
            else:
                requests.append(((b"e", sid), P.Verify(sid, seq, len(ids), [], [hf_last(target, ids).argmax().item(), 7])))
        for (key, req), verdict in zip(requests, verifier.verify(requests)):
            ids = ctx[req.session]
            tree = Tree.parse(req.draft, req.parents) if req.parents else Tree.chain(req.draft)
            logits = torch.stack([hf_last(target, ids + [req.draft[i] for i in tree.path(node)])
                                  for node in range(-1, len(tree))])
            node, n, token = verify.greedy_tree(tree, logits)
            assert (verdict.node, verdict.n_accepted, verdict.next_token) == (node if req.parents else None, n, token)
            ctx[req.session] = ids + [req.draft[i] for i in tree.path(node)] + [token]
    assert verifier.stats["forward_passes"] == 3


@pytest.mark.parametrize("name", TREE_ARCHS)
def test_greedy_trees_equal_hf_generate_on_other_architectures(checkpoints, name):
    target = ModelRunner.load(str(checkpoints[name]))
    verifier = Verifier(target, VerifierConfig(**SMALL))
    ids = target.tokenizer("class Point:\n    def __init__(self, x, y):\n").input_ids  # past the window of 8
    want = hf_greedy(target, ids, 16)
    other = TreeDrafter(ModelRunner.load(str(checkpoints["llama"])), target.vocab_size, TreeShape(3, 3, 10, 0.9))
    for drafter in (Oracle(target, TreeShape(4, 2, 20, 2.0)), other):
        out, stats = tree_generate(drafter, verifier, ids, 16)
        assert out == want, type(drafter).__name__
    assert verifier.store.stats["path_tokens"] > 0


def test_the_own_cache_fallback_refuses_trees_and_serves_chains(checkpoints):
    runner = ModelRunner.load(str(checkpoints["falcon"]))
    verifier, key = Verifier(runner, VerifierConfig(**SMALL)), (b"e", 1)
    assert isinstance(verifier.store, OwnCacheStore)
    ids = runner.tokenizer("def add(a, b):\n").input_ids
    verifier.open(key, P.Open(1, ids))
    error = verifier.verify([(key, P.Verify(1, 1, len(ids), [], [5, 6], parents=[-1, -1]))])[0]
    assert error.code == ErrorCode.CHAINS_ONLY and "verifies chains only" in error.message
    assert isinstance(from_wire(error.code, error.message), InvalidRequest)  # a bad request, not a retry
    bad = verifier.verify([(key, P.Verify(1, 1, len(ids), [], [5, 6], parents=[-1, 7]))])[0]  # malformed too
    assert bad.code == ErrorCode.CHAINS_ONLY and verifier.sessions[key].tokens == ids
    verdict = verifier.verify([(key, P.Verify(1, 2, len(ids), [], [5, 6]))])[0]
    assert verdict.next_token >= 0 and verdict.node is None
