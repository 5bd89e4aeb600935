"""Token trees through the edge's session (edge_worker/session.py -> trees/rounds.py) and the cloud's Verifier,
in-process: greedy equals the target alone, coupled equals target-alone sampling for the seed, sample mode's
first two tokens follow p (chi-square); a retried round sends the very tree again; a worker that cannot verify
trees gets chains from then on; pre-drafts of the likely verdicts start the next tree."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from stats import chi2_pvalue

from specrelay.cloud_worker.verifier import Verifier, VerifierConfig
from specrelay.common import protocol as P
from specrelay.common.errors import ErrorCode, InvalidRequest
from specrelay.common.protocol import Mode
from specrelay.common.sampling import SamplingParams, probs_from_logits
from specrelay.edge_worker.config import SessionConfig
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.edge_worker.session import EdgeSession
from specrelay.edge_worker.trees.rounds import TreesRefused
from specrelay.speculative import speculative_generate_batch, target_generate

PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in"]


@pytest.mark.parametrize("trees", ["on", "auto"])
def test_greedy_trees_equal_the_target_alone(tiny_runners, trees):
    target, draft = tiny_runners
    ids = [target.tokenizer(p).input_ids for p in PROMPTS]
    configs = [SessionConfig(max_new_tokens=24, trees=trees, draft_len=d) for d in (None, 3, 6)]
    for (out, stats), p in zip(speculative_generate_batch(draft, target, ids, configs), ids):
        assert out == target_generate(target, p, 24)
        assert stats["tree_nodes"] > 0


def test_greedy_trees_of_the_demo_pair_equal_the_target_alone_and_commit_more_per_call(demo_runners):
    target, draft = demo_runners
    ids = [target.tokenizer(p).input_ids for p in PROMPTS]
    chain = speculative_generate_batch(draft, target, ids, [SessionConfig(max_new_tokens=32, draft_len=4)] * 3)
    tree = speculative_generate_batch(draft, target, ids, [SessionConfig(max_new_tokens=32, draft_len=4,
                                                                         trees="on")] * 3)
    for (c, _), (t, stats), p in zip(chain, tree, ids):
        assert t == c == target_generate(target, p, 32)
        assert stats["tree_rounds"] > 0
    calls = lambda runs: sum(s["cloud_calls"] for _, s in runs)  # noqa: E731
    assert calls(tree) < calls(chain)


def test_coupled_trees_equal_target_alone_sampling_for_the_seed(tiny_runners):
    target, draft = tiny_runners
    params = SamplingParams(temperature=1.0, top_p=0.9)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    configs = [SessionConfig(max_new_tokens=16, params=params, mode=Mode.COUPLED, seed=s, trees="on", draft_len=3)
               for s in range(4)]
    for seed, (out, _) in enumerate(speculative_generate_batch(draft, target, [ids] * 4, configs)):
        assert out == target_generate(target, ids, 16, params, Mode.COUPLED, seed), seed


def test_sampled_trees_commit_their_first_two_tokens_distributed_as_p(tiny_runners):
    """1,200 seeds, trees of three levels that branch at the root: the joint law of the first two committed
    tokens is the target's p(x1) p(x2 | x1) (chi-square over the 36 pairs of its top-6 support)."""
    target, draft = tiny_runners
    params = SamplingParams(temperature=1.5, top_k=6)
    ids = target.tokenizer(PROMPTS[1]).input_ids
    with torch.no_grad():
        p1 = probs_from_logits(target.model(torch.tensor([ids])).logits[0, -1].float(), params)
        support = p1.nonzero().squeeze(1).tolist()
        p2 = {x: probs_from_logits(target.model(torch.tensor([ids + [x]])).logits[0, -1].float(), params)
              for x in support}
    cells = {(a, b): float(p1[a] * p2[a][b]) for a in support for b in p2[a].nonzero().squeeze(1).tolist()}
    counts = dict.fromkeys(cells, 0)
    seeds = 1200
    configs = [SessionConfig(max_new_tokens=2, params=params, mode=Mode.SAMPLE, seed=s, trees="on", draft_len=3,
                             tree_nodes=8) for s in range(seeds)]
    runs = speculative_generate_batch(draft, target, [ids] * seeds, configs)
    for out, _ in runs:
        counts[tuple(out)] += 1
    assert sum(s["tree_rounds"] for _, s in runs) >= seeds // 2  # trees, not only chains
    keys = list(cells)
    assert chi2_pvalue(np.array([counts[k] for k in keys]), np.array([cells[k] for k in keys])) > 0.001


def session_and_verifier(runners, **config):
    target, draft = runners
    verifier = Verifier(target, VerifierConfig())
    s = EdgeSession(target.tokenizer(PROMPTS[0]).input_ids, SessionConfig(**{"max_new_tokens": 24, **config}),
                    Drafter(draft, target.vocab_size))
    verifier.open((b"", 1), s.open_message())
    return s, verifier


def whole_trees_of_one_shape(runners):
    """A session drafting trees of depth 4 and 8 nodes, 40 tokens, every node its shape holds drafted. The shape's
    nodes priced out (min_value: a node's seconds x the best rate) would depend on the clock: in-process nothing
    times the verify (a prior of 4 draft forwards) and only the first tree job's forwards time the draft (the shell's
    batcher times pre-drafts). One slow forward there made the line all slope, priced every node out, and 30 rounds
    in 34 sent empty trees (CI, stop 72)."""
    s, verifier = session_and_verifier(runners, trees="on", draft_len=4, tree_nodes=8)
    s.config = SessionConfig(max_new_tokens=40, trees="on", draft_len=4, tree_nodes=8)
    shape = s.policy.shape
    s.policy.shape = lambda *a, **k: replace(shape(*a, **k), min_value=0.0)
    return s, verifier


def one_round(s, verifier, before_verdict=None):
    job = s.draft_job()
    request = s.request_for(s.drafter.draft_batch([job])[0])
    if before_verdict is not None:
        before_verdict(s)
    reply = verifier.verify([((b"", 1), request)])[0]
    return request, reply


def test_a_retried_tree_round_sends_the_same_tree(tiny_runners):
    s, verifier = session_and_verifier(tiny_runners, trees="on", draft_len=3, params=SamplingParams(1.0),
                                       mode=Mode.SAMPLE, seed=5)
    first, _ = one_round(s, verifier)
    assert first.parents  # a tree
    verifier.open((b"", 1), s.open_message())  # the round failed (a timeout, a lost worker): re-OPEN
    again, reply = one_round(s, verifier)
    assert (again.draft, again.parents, again.q, again.q_rows, again.tail) == \
           (first.draft, first.parents, first.q, first.q_rows, s.tokens[:0] + first.tail[:0] + again.tail)
    assert again.seq == first.seq + 1
    s.apply(reply)


def test_a_worker_that_cannot_verify_trees_gets_chains(tiny_runners):
    s, verifier = session_and_verifier(tiny_runners, trees="on", draft_len=3)
    request, reply = one_round(s, verifier)
    old = P.Verdict(reply.session, reply.seq, reply.n_accepted, reply.next_token)  # no `node`: an older worker
    with pytest.raises(TreesRefused):
        s.apply(old)
    verifier.open((b"", 1), s.open_message())
    request, reply = one_round(s, verifier)
    assert not request.parents and s.trees.chains_only
    s.apply(reply)
    refusals = [P.Error(1, 1, ErrorCode.CHAINS_ONLY, "this worker ... verifies chains only"),  # Falcon, Bloom
                P.Error(1, 1, ErrorCode.BAD_REQUEST, "this worker ... verifies chains only: send parents = []")]
    for refusal in refusals:  # the second: a worker from before CHAINS_ONLY (accepted for one release)
        s2, verifier = session_and_verifier(tiny_runners, trees="on", draft_len=3)
        one_round(s2, verifier)
        with pytest.raises(TreesRefused):
            s2.apply(refusal)
        assert s2.trees.chains_only
    s3, verifier = session_and_verifier(tiny_runners, trees="on", draft_len=3)
    one_round(s3, verifier)
    with pytest.raises(InvalidRequest) as failed:  # any other bad request stays one, trees on
        s3.apply(P.Error(1, 1, ErrorCode.BAD_REQUEST, "parents[1] = 7 is not an earlier node"))
    assert not isinstance(failed.value, TreesRefused) and not s3.trees.chains_only


def test_predrafted_verdicts_start_the_next_tree(demo_runners):
    """Between each VERIFY and its VERDICT the pre-draft runs (as the edge shell runs it when the draft thread is
    idle): most rounds then start from a pre-drafted tree, and the output is still the target's own."""
    target, draft = demo_runners
    s, verifier = whole_trees_of_one_shape(demo_runners)

    def predraft(session):
        pre = session.predraft_job()
        while pre is not None and not pre.finished:
            pre.absorb(session.drafter.draft_batch([pre.next_chunk(1)])[0])
        session.take_predraft(pre.block if pre is not None else None)

    counted = []
    while not s.done:
        _, reply = one_round(s, verifier, predraft)
        counted.append(s.policy.edge.tree_saved.count)
        s.apply(reply)
    assert s.generated == target_generate(target, s.prompt_ids, 40)
    assert counted[0] == 0 and counted[1] == 1  # the first tree followed no tree round: a switch, not steady state
    st = s.stats
    print(st)
    assert st.predraft_tries >= st.cloud_calls - 3  # not in the last rounds, with a token or two left
    assert st.predraft_rounds >= 0.6 * st.predraft_tries and st.predraft_tokens > st.predraft_rounds
    assert s.policy.edge.tree_saved.value > 0  # the pre-drafted levels price the next trees (its first tree saved none)


def test_a_tree_round_is_an_acceptance_sample_of_its_first_ranked_chain(demo_runners):
    """A tree's first-ranked path is the chain the draft drafts alone: each verdict counts, per position, what that
    chain would have had accepted (the prefix the accepted path shares with it), so trees keep the positions'
    rates measured (chains are priced from them, trees' E scaled by them) while no chain runs."""
    from specrelay.edge_worker.policy.estimates import AcceptanceCounts

    s, verifier = whole_trees_of_one_shape(demo_runners)
    expected, branched = AcceptanceCounts(), 0
    while not s.done:
        request, reply = one_round(s, verifier)
        parents = request.parents or [i - 1 for i in range(len(request.draft))]  # a path travels as a chain
        spine, at = [], -1
        while (kid := next((i for i, p in enumerate(parents) if p == at), None)) is not None:
            spine.append(kid)
            at = kid
        path, at = [], reply.node if request.parents else reply.n_accepted - 1
        while at >= 0:
            path.insert(0, at)
            at = parents[at]
        same = next((k for k, (u, p) in enumerate(zip(spine, path)) if u != p), min(len(spine), len(path)))
        branched += same < len(path)  # the accepted path left the chain: a side branch won
        if request.seq > 1 and spine:  # the first round follows the prompt, a round drafting nothing: no sample
            expected.observe(len(spine), same)
        s.apply(reply)
    got = s.policy.edge.acceptance
    assert (got.reached, got.accepted) == (expected.reached, expected.accepted) and sum(got.accepted) > 0
    assert branched  # the test saw a verdict whose chain acceptance differs from the tree's


def test_a_chain_block_that_waited_behind_trees_does_not_teach_the_chains_draft_line(tiny_runners):
    """The batcher marks a chain block whose wait saw tree work in the draft thread (DraftBlock.behind_trees); its
    round timed the trees' load, so the session does not feed it to the chains' draft wait line (with 16 sessions
    over 50 ms such rounds priced chains above the trees they would replace). An unmarked round does teach it."""
    s, verifier = session_and_verifier(tiny_runners, draft_len=3)
    waited = s.policy.edge.waited
    for behind in (None, True, False):  # the opening (a catch-up either way), then one marked, then one not
        block = s.drafter.draft_batch([s.draft_job()])[0]
        block.behind_trees = bool(behind)
        reply = verifier.verify([((b"", 1), s.request_for(block))])[0]
        before = waited.count
        s.record_timing(0.01, 0.02)
        s.apply(reply)
        if behind is not None:
            assert block.steps > 0 and waited.count == before + (not behind)


def test_each_round_teaches_what_its_kind_committed_a_second_a_fully_pre_drafted_tree_a_trees(tiny_runners):
    """`--trees auto` weighs trees by what tree rounds and chain rounds committed a second (EdgeEstimates.paid).
    A tree whose every level its predecessor's pre-draft grew waits for no draft forward (0 steps): it is still a
    tree round, and it teaches no draft wait line (it was timed as a chain round, at a chain round's old steps). Only
    `auto` reads them (its guard): with `on` or `off` nothing is counted."""
    from specrelay.edge_worker.trees.tree import TreeShape

    for trees, kind in (("auto", "on"), ("auto", "off"), ("on", "on"), ("off", "off")):
        s, verifier = session_and_verifier(tiny_runners, trees=trees, draft_len=3, tree_nodes=6)
        if trees == "auto":
            s.policy.shape = lambda *a, tree=kind == "on", **k: TreeShape((2, 2, 1)) if tree else None
        est = s.policy.edge
        committed = []
        for steps in (None, None, 0):  # the opening (not counted: the worker ran the prompt), two rounds
            block = s.drafter.draft_batch([s.draft_job()])[0]
            if steps is not None:
                block.steps = steps
            reply = verifier.verify([((b"", 1), s.request_for(block))])[0]
            lines = est.waited.count, est.tree_waited.count
            new = s.apply(reply)
            s.record_timing(0.01, 0.02, 0.001, len(new))
            committed.append(len(new))
        (tokens, seconds), other = est.paid[kind == "on"], est.paid[kind == "off"]
        assert other[0].count == other[1].count == 0
        if trees != "auto":
            assert tokens.count == seconds.count == 0
            continue
        assert tokens.count == seconds.count == 2
        assert 0 < tokens.value < min(committed[-2:])  # over the session's best modelled chain rate (> 1 a second)
        assert seconds.value == pytest.approx(0.031)
        assert (est.waited.count, est.tree_waited.count) == lines  # the round of 0 steps taught no line


def test_the_chain_round_after_a_tree_round_is_the_trees_exit_and_counts_as_theirs(tiny_runners):
    """A tree round's pre-draft grows trees, so the chain round after it drafts its block fresh: that switch is
    the tree's cost (one session on loopback: such rounds 58.6 ms for 3.9 tokens, chain rounds after chains 49.8 ms
    for 4.2). Counted as the chains', it lowered their rate and hid the trees' exit from the measured guard."""
    from specrelay.edge_worker.trees.tree import TreeShape

    s, verifier = session_and_verifier(tiny_runners, trees="auto", draft_len=3)
    kinds = iter([None, TreeShape((2, 2)), None, None])  # the opening, a tree, its exit, a chain after a chain
    s.policy.shape = lambda *a, **k: next(kinds)
    sent = []
    for _ in range(4):
        block = s.drafter.draft_batch([s.draft_job()])[0]
        request = s.request_for(block)
        sent.append(bool(request.parents))
        new = s.apply(verifier.verify([((b"", 1), request)])[0])
        s.record_timing(0.01, 0.02, 0.001, len(new))
    assert sent == [False, True, False, False] and not s.done
    chains, trees = s.policy.edge.paid
    assert (chains[0].count, trees[0].count) == (1, 2)  # not the opening; the exit is the tree's


def test_the_round_that_ends_a_generation_teaches_no_kind_its_rate(tiny_runners):
    """The last round commits what was left, and what was left picked its kind: where trees take most rounds the
    chain rounds are mostly such last rounds (`--trees on`, one session on loopback: a token in 10.8 ms, 93 tokens a
    second against the trees' 99 and mid-generation chains' 120), so the chains' rate read as low as the trees'. Only
    the rounds between the opening and the last teach EdgeEstimates.paid."""
    s, verifier = session_and_verifier(tiny_runners, trees="auto", draft_len=3, max_new_tokens=10)
    s.policy.shape, rounds = lambda *a, **k: None, 0  # chains only
    while not s.done:
        block = s.drafter.draft_batch([s.draft_job()])[0]
        s.apply(verifier.verify([((b"", 1), s.request_for(block))])[0])
        s.record_timing(0.01, 0.02, 0.001, 1)
        rounds += 1
    (tokens, seconds), _ = s.policy.edge.paid
    assert rounds >= 3 and tokens.count == seconds.count == rounds - 2  # not the opening, not the last


def test_a_trees_sessions_greedy_chain_rounds_teach_the_rank_chances(tiny_runners, monkeypatch):
    """With --trees auto a greedy session's chain rounds keep each position's likeliest draft ids, and each
    verdict teaches the edge's rank chances (RankAcceptance.observe_chain: the rejected position shows which of them
    the target took); with trees off nothing is kept or taught (the topk costs a draft step)."""
    from specrelay.edge_worker.policy import RankAcceptance

    target, draft = tiny_runners
    seen, observe = [], RankAcceptance.observe_chain
    monkeypatch.setattr(RankAcceptance, "observe_chain",
                        lambda self, ranked, n, token: (seen.append((ranked, n, token)),
                                                        observe(self, ranked, n, token)))
    ids = [target.tokenizer(p).input_ids for p in PROMPTS]
    for trees in ("off", "auto"):
        seen.clear()
        configs = [SessionConfig(max_new_tokens=24, trees=trees, draft_len=d) for d in (None, 3, 6)]
        for (out, stats), p in zip(speculative_generate_batch(draft, target, ids, configs), ids):
            assert out == target_generate(target, p, 24)
        assert bool(seen) == (trees == "auto")
    for ranked, n, token in seen:
        assert n + 1 >= len(ranked) >= n and all(len(r) == 4 for r, _ in ranked)
        assert token >= 0


def test_an_auto_sessions_next_round_is_weighed_while_its_chain_is_in_flight(tiny_runners, monkeypatch):
    """`--trees auto`: whether the next round drafts a tree is weighed while a chain round's VERIFY is in flight
    (EdgeSession.plan, at the estimates before its VERDICT), so a VERDICT goes straight on to the next draft: shape()
    took 0.46 ms of a 35 ms round there with one session on loopback. A plan from another round is not taken."""
    from specrelay.edge_worker.policy import DraftPolicy
    from specrelay.edge_worker.trees.tree import TreeShape

    calls, answer = [], [None]  # what shape() decides: None, a chain
    monkeypatch.setattr(DraftPolicy, "shape", lambda self, *a, **k: calls.append(a) or answer[0])
    s, verifier = session_and_verifier(tiny_runners, trees="auto", max_new_tokens=40)
    for _ in range(2):  # the opening (no plan: its timings price a prompt), then a chain round that plans
        request, reply = one_round(s, verifier, before_verdict=lambda s: s.plan())
        s.apply(reply)
    assert len(calls) == 3 and s.trees.planned == (s.seq, None)  # 2 rounds' jobs, 1 plan in flight
    answer[0] = TreeShape((2, 1))
    job = s.draft_job()
    assert len(calls) == 3 and job is s._job  # nothing weighed between the VERDICT and the draft: the planned chain
    s.apply(verifier.verify([((b"", 1), s.request_for(s.drafter.draft_batch([job])[0]))])[0])
    s.plan()
    assert len(calls) == 4 and s.trees.planned == (s.seq, TreeShape((2, 1)))
    answer[0] = None
    assert s.draft_job().shape == TreeShape((2, 1)) and len(calls) == 4  # a planned tree is drafted as planned
    s.trees.block = None
    s.trees.planned = (s.seq - 1, TreeShape((2, 1)))  # another round's plan: weighed again
    assert s.draft_job() is s._job and len(calls) == 5 and s.trees.planned is None
