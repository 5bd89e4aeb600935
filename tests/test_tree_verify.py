"""Token trees through the cloud's Verifier and its packed forward (tiny models, no sockets): greedy equals HF
`generate`, coupled equals target-alone sampling for the seed, sample mode's committed token follows p
(chi-square), deterministic node logits equal their chain's bit for bit, the KV store after a tree step equals
the one after the accepted chain alone, and hostile trees are BAD_REQUESTs that change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stats import chi2_pvalue

from specrelay.cloud_worker import attention
from specrelay.cloud_worker.attention import Row, forward_packed, install
from specrelay.cloud_worker.kvcache import KVShape, KVStore
from specrelay.cloud_worker.verifier import Verifier, VerifierConfig
from specrelay.common import protocol as P
from specrelay.common.packing import f32
from specrelay.common.errors import ErrorCode
from specrelay.common.protocol import Mode, Strategy
from specrelay.common.resample import Rejection
from specrelay.common.sampling import SamplingParams, probs_from_logits
from specrelay.common.tree import Tree, draw_children, encode_q_row
from specrelay.speculative import target_generate
from specrelay.treeref import TreeDrafter, TreeShape, tree_generate
from trees import Oracle, hf_greedy

PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in"]
TREE = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [-1, -1, 0, 0, 1, 2, 2, 4, 7, -1])  # branching at -1, 0, 2


@pytest.mark.parametrize("deterministic", [False, True])
def test_greedy_trees_equal_hf_generate(tiny_runners, deterministic):
    target, draft = tiny_runners
    verifier = Verifier(target, VerifierConfig(deterministic=deterministic))
    for drafter in (TreeDrafter(draft, target.vocab_size, TreeShape(depth=3, branch=3, nodes=12, unsure=0.9)),
                    Oracle(target)):
        for prompt in PROMPTS:
            ids = target.tokenizer(prompt).input_ids
            out, stats = tree_generate(drafter, verifier, ids, 30)
            assert out == hf_greedy(target, ids, 30), (prompt, type(drafter).__name__)
    assert stats["accepted"] >= 3 * stats["cloud_calls"]  # the oracle's paths run deep, through second children
    assert verifier.store.stats["path_tokens"] > 0          # ... so accepted K/V moved next to the history


def test_coupled_trees_equal_target_alone_sampling_for_the_seed(tiny_runners):
    target, draft = tiny_runners
    verifier = Verifier(target)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    for drafter in (TreeDrafter(draft, target.vocab_size, TreeShape(3, 3, 10, 0.9)), Oracle(target)):
        for seed in range(4):
            out, _ = tree_generate(drafter, verifier, ids, 20, params, Mode.COUPLED, seed)
            assert out == target_generate(target, ids, 20, params, Mode.COUPLED, seed), seed


@pytest.mark.parametrize("resample", [Strategy.FULL, Strategy.SRDV], ids=["full", "srdv"])
def test_sampled_trees_repeat_for_a_seed(tiny_runners, resample):
    target, draft = tiny_runners
    verifier = Verifier(target)
    drafter = TreeDrafter(draft, target.vocab_size, TreeShape(3, 3, 10, 0.9))
    ids = target.tokenizer(PROMPTS[1]).input_ids
    run = lambda seed: tree_generate(drafter, verifier, ids, 16, SamplingParams(1.0), Mode.SAMPLE, seed, resample)[0]
    assert run(3) == run(3)
    assert any(run(3) != run(s) for s in (4, 5, 6))


@pytest.mark.parametrize("cross", [False, True], ids=["same vocabulary, srdv", "cross vocabulary, hr"])
def test_sampled_tree_verification_commits_tokens_distributed_as_p(tiny_runners, cross):
    """Through the Verifier, 2,400 seeds: a root with three children drawn from q without replacement (each with
    one child), or a root with one child that branches; one-child rejections resolved by the edge (srdv; or hr
    when the target's likeliest token lies outside the draft's vocabulary, q' zero there). The first committed
    token's law is the target's p after the prompt (chi-square). q is the draft's, peaked on one token:
    exactness holds for any q the children are drawn from, and a peaked one exposes a wrong residual."""
    target, draft = tiny_runners
    v, params = target.vocab_size, SamplingParams(temperature=1.5, top_k=6)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    with torch.no_grad():
        p = probs_from_logits(target.model(torch.tensor([ids])).logits[0, -1].float(), params)
        q = probs_from_logits(draft.model(torch.tensor([ids])).logits[0, -1].float(), params)
    flat = (p > 0).float() / (p > 0).sum()  # p's support, evenly
    q = 0.1 * q + 0.2 * flat + 0.7 * torch.nn.functional.one_hot(p.topk(2).indices[1], v)  # peaked
    shared = torch.ones(v, dtype=torch.bool)
    shared[p.argmax()] = not cross  # V_o = {the target's likeliest token} across vocabularies
    q = q * shared / (q * shared).sum()
    bitmap = np.packbits(shared.numpy(), bitorder="little").tobytes() if cross else b""
    strategy = Strategy.HR if cross else Strategy.SRDV
    grandchildren = shared.nonzero().squeeze(1)[:3].tolist()
    verifier, key = Verifier(target), (b"e", 1)
    counts = torch.zeros(v)
    for seed in range(2400):
        verifier.open(key, P.Open(1, ids, Mode.SAMPLE, params.temperature, params.top_k, 1.0, seed, strategy,
                                  bitmap, v))
        if seed % 2:
            kids = draw_children(q, 3, seed, len(ids))
            tokens, parents, rows = kids + grandchildren, [-1, -1, -1, 0, 1, 2], [encode_q_row(q)]
            qs = [float(q[x]) for x in kids] + [0.5] * 3
        else:  # the root's one child: the chain rule at the root, then a branching node under it
            kids = draw_children(q, 1, seed, len(ids))
            tokens, parents, qs = kids + grandchildren[:2], [-1, 0, 0], [float(q[kids[0]]), 0.5, 0.5]
            rows = [encode_q_row(shared / shared.sum())]
        verdict = verifier.verify([(key, P.Verify(1, 1, len(ids), [], tokens, f32(qs), parents, rows))])[0]
        first = tokens[Tree.parse(tokens, parents).path(verdict.node)[0]] if verdict.n_accepted else None
        if first is None and verdict.next_token >= 0:
            first = verdict.next_token
        elif first is None:  # the root's one child was rejected: the edge draws from the residual with q'
            reply, rejection = verdict, Rejection(q, shared if cross else None, seed, len(ids), 1, 1, strategy)
            while not isinstance(first := rejection.step(reply), int):
                reply = verifier.resample(key, first)
        counts[first] += 1
    assert chi2_pvalue(counts.numpy(), p.numpy()) > 0.001
    assert counts[p.argmax()] > 0  # across vocabularies too: the target-only token is committed


# ------------------------------------------------------------------------------------------ the forward

def gqa_model(heads: int, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                                         max_position_embeddings=512, initializer_range=0.2)).eval()
    install(model)
    return model


def tree_and_chain_logits(model, history: list[int], deterministic: bool):
    """A tree verified beside another session, after `history`; and each node's root-to-node chain verified
    alone after the same history. Returns ([n+1, V] tree logits, [[V] per node, -1 first])."""
    shape, block = KVShape.of(model.config, torch.float32), 128 if deterministic else 32
    tokens, parents = TREE
    tree = Tree.parse(tokens, parents)

    def store_after_history():
        store = KVStore(shape, 2048, block=block)
        for key in ("t", "o"):
            store.reserve(key, 8)
        forward_packed(model, store, [Row("t", history[:-1], 0)], deterministic=deterministic)
        return store

    crowd = Row("o", list(range(30, 53)), 2)
    got = forward_packed(model, store_after_history(), [crowd, Row("t", history[-1:] + tokens, len(tokens) + 1,
                                                                   parents)], deterministic=deterministic)[1]
    chains = [forward_packed(model, store_after_history(), [Row("t", history[-1:] + [tokens[i] for i in
                                                                tree.path(node)], 1)], deterministic=deterministic)[0][0]
              for node in range(-1, len(tokens))]
    return got, chains


FEATURES = {"plain": {}, "window 5": {"window": 5}, "softcap 2": {"softcap": 2.0},
            "sinks": {"sinks": None}}


@pytest.mark.parametrize("heads", [(4, 2), (16, 1), (8, 8)])
@pytest.mark.parametrize("feature", FEATURES)
def test_deterministic_node_logits_are_their_chains_bit_for_bit(monkeypatch, heads, feature):
    """Grouped heads (2, and 16 per K/V head: several query tiles per token), MHA; histories that end before,
    at and past a key block (128); a sliding window, a softcap and sinks forced onto every layer."""
    model = gqa_model(*heads)
    extra = dict(FEATURES[feature])
    if "sinks" in extra:  # one logit per query head
        extra["sinks"] = torch.linspace(-1.0, 2.0, heads[0])
    monkeypatch.setattr(attention._Features, "of", classmethod(lambda cls, module, kwargs: cls(**extra)))
    gen = torch.Generator().manual_seed(heads[0])
    for length in (3, 120, 127, 128, 200):
        history = torch.randint(1, 300, (length,), generator=gen).tolist()
        got, chains = tree_and_chain_logits(model, history, deterministic=True)
        for node, want in enumerate(chains):
            assert torch.equal(got[node], want), (length, node - 1)
        fast, fast_chains = tree_and_chain_logits(model, history, deterministic=False)
        for node, want in enumerate(fast_chains):
            assert torch.allclose(fast[node], want, atol=1e-4) and torch.allclose(fast[node], got[node], atol=1e-4)


def test_a_tree_step_leaves_the_kv_store_the_accepted_chain_would(tiny_runners):
    """Deterministic numerics: a session that verified a tree holds, bit for bit, the K/V of one that verified
    its accepted path as a chain (the path's K/V moved next to the history, the branches gone); the next steps
    agree."""
    target, _ = tiny_runners
    ids = target.tokenizer(PROMPTS[0]).input_ids
    oracle = Oracle(target, TreeShape(depth=3, branch=3, nodes=20, unsure=2.0))
    verifier = Verifier(target, VerifierConfig(deterministic=True))
    tree_key, chain_key = (b"e", 1), (b"e", 2)
    for key in (tree_key, chain_key):
        verifier.open(key, P.Open(key[1], ids))
    context = list(ids)
    for seq in range(1, 4):
        t = oracle.draft(context, Mode.GREEDY, SamplingParams(), 0)
        tree_verdict = verifier.verify([(tree_key, P.Verify(1, seq, len(context), [], t.tokens, parents=t.parents))])[0]
        path = [t.tokens[i] for i in Tree.parse(t.tokens, t.parents).path(tree_verdict.node)]
        assert path and Tree.parse(t.tokens, t.parents).path(tree_verdict.node) != list(range(len(path)))
        chain_verdict = verifier.verify([(chain_key, P.Verify(2, seq, len(context), [], path))])[0]
        assert (chain_verdict.n_accepted, chain_verdict.next_token, chain_verdict.node) == (
            len(path), tree_verdict.next_token, None)
        spans = [verifier.store.span(key) for key in (tree_key, chain_key)]
        assert spans[0].length == spans[1].length == len(context) + len(path)
        assert torch.equal(*(s.kv[:, :, :, :s.length] for s in spans))
        context += path + [tree_verdict.next_token]


def bad_trees(n: int, v: int) -> list[tuple[dict, str]]:
    """Hostile tree fields of a VERIFY (as keyword overrides) and the field each must be refused by."""
    row = encode_q_row(torch.full((v,), 1.0 / v))
    return [({"parents": [-1, 0, 0, 5]}, "parents"), ({"parents": [-1, 1, 0, 0]}, "parents"),
            ({"parents": [-1, 0]}, "parents"), ({"draft": [5, 6, 6, 7], "parents": [-1, 0, 0, 1]}, "parents"),
            ({"q_rows": [row]}, "q_rows"), ({"mode": Mode.SAMPLE, "q_rows": []}, "q_rows"),
            ({"mode": Mode.SAMPLE, "q_rows": [P.QRow(f32([0.5] * (v - 1)))]}, "q_rows"),
            ({"mode": Mode.SAMPLE, "q_rows": [P.QRow(f32([1.0, 1.0]), [v, v + 1])]}, "q_rows"),
            ({"mode": Mode.SAMPLE, "q_rows": [P.QRow(f32([0.0] * v))]}, "q_rows"),
            ({"parents": [], "q_rows": [row]}, "q_rows")]


def test_hostile_trees_are_bad_requests_that_change_nothing(tiny_runners):
    target, _ = tiny_runners
    ids = target.tokenizer(PROMPTS[1]).input_ids
    for overrides, field in bad_trees(4, target.vocab_size):
        mode = overrides.pop("mode", Mode.GREEDY)
        verifier, key = Verifier(target), (b"e", 1)
        verifier.open(key, P.Open(1, ids, mode, 0.0 if mode == Mode.GREEDY else 1.0))
        req = P.Verify(1, 1, len(ids), [], [5, 6, 7, 8], f32([0.25] * 4) if mode == Mode.SAMPLE else b"",
                       [-1, 0, 0, 1])
        for name, value in overrides.items():
            setattr(req, name, value)
        error = verifier.verify([(key, req)])[0]
        assert isinstance(error, P.Error) and error.code == ErrorCode.BAD_REQUEST and field in error.message, (
            overrides, error)
        assert verifier.sessions[key].tokens == ids and verifier.stats["forward_passes"] == 0
        follow = P.Verify(1, 2, len(ids), [], [5, 6], b"", [-1, -1])
        if mode == Mode.SAMPLE:
            follow.q, follow.q_rows = f32([0.5, 0.5]), [encode_q_row(torch.full((target.vocab_size,), 0.5))]
        ok = verifier.verify([(key, follow)])[0]  # still served
        assert isinstance(ok, P.Verdict) and ok.node is not None


def test_replays_context_limit_and_chains_next_to_trees(tiny_runners):
    target, _ = tiny_runners
    limit = target.model.config.max_position_embeddings
    ids = [5 + i % 40 for i in range(limit - 2)]
    verifier, key = Verifier(target), (b"e", 1)
    verifier.open(key, P.Open(1, ids))
    want = hf_greedy(target, ids, 1)[0]
    tokens, parents = [(want + 1) % target.vocab_size, want, 9, 9, 9], [-1, -1, 1, 2, 3]
    req = P.Verify(1, 1, len(ids), [], tokens, b"", parents)
    verdict = verifier.verify([(key, req)])[0]
    assert verdict.node in (-1, 1, 2)  # nodes at depth 3+ stand past the model's context: pruned, never verified
    assert verifier.verify([(key, req)])[0] is verdict  # a replay: the same answer, nothing re-run
    req.parents = [-1, -1, 0, 2, 3]
    error = verifier.verify([(key, req)])[0]
    assert error.code == ErrorCode.BAD_REQUEST and "different draft" in error.message


@pytest.mark.parametrize("broken", ["positions", "mask"])
def test_the_start_up_self_check_catches_a_tree_path_that_is_wrong(tiny_runners, monkeypatch, broken):
    from specrelay.cloud_worker import treeattn
    from specrelay.common.errors import FatalError

    model = tiny_runners[0].model
    install(model)
    store = KVStore(KVShape.of(model.config, torch.float32), 256)
    attention.self_check(model, store, False)  # the real path passes
    if broken == "positions":  # nodes at their slots instead of past + depth
        real = treeattn.TreeLayout.of
        monkeypatch.setattr(treeattn.TreeLayout, "of", classmethod(
            lambda cls, parents, new, past: real(parents, new, past).__class__(
                new - len(parents), past + torch.arange(new), real(parents, new, past).seen, [])))
    else:  # every node sees every new token: no tree mask
        monkeypatch.setattr(treeattn.TreeLayout, "fast_mask", lambda self, past, first, window, device: torch.ones(
            len(self.pos), past + len(self.pos) - first, dtype=torch.bool, device=device))
    with pytest.raises(FatalError, match="with a token tree does not reproduce"):
        attention.self_check(model, KVStore(KVShape.of(model.config, torch.float32), 256), False)
