"""The edge's token-tree drafting (edge_worker/trees/drafter.py, draft/kv.py trees, trees/tree.py): a tree node's logits
are the draft model's for its own path alone, in any batch and after its ancestors were kept aside; a tree level
costs one forward for every session; a verdict's path joins the history without re-running it and the subtree
under it stays; the shapes follow the contract (parents first, distinct siblings in draw order)."""

from __future__ import annotations

import pytest
import torch

from specrelay.common.protocol import MAX_DRAFT, Mode
from specrelay.common.sampling import SamplingParams
from specrelay.common.tree import Tree
from specrelay.edge_worker.draft.kv import LockstepKV, SessionKV, TreeFeed, Workspace
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.edge_worker.trees.tree import ROOT
from specrelay.edge_worker.trees.drafter import TreeJob, node_dist
from specrelay.edge_worker.trees.tree import TreeShape
from specrelay.edge_worker.policy import RankAcceptance

TEXTS = ["def add(a, b):\n", "class Point:\n", "for i in range(10):\n"]


def plain(runner, context: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return runner.model(torch.tensor([context])).logits[0, -1].float()


def test_tree_nodes_see_their_own_path_only(tiny_runners):
    """Two rows, two levels (siblings share positions), then a second batch that gathers kept nodes and extends
    one: every node's logits equal a plain forward of its root-to-node path."""
    _, draft = tiny_runners
    a, b = (draft.tokenizer(t * 2).input_ids for t in TEXTS[:2])
    sa, sb = SessionKV(), SessionKV()
    kv = LockstepKV(draft, Workspace(), trees=True)
    history = kv.feed([0, 1], [sa, sb], [0, 0], [a, b], room=8)
    assert torch.allclose(history[1, len(b) - 1], plain(draft, b), atol=1e-4)
    pa, pb = len(a), len(b)
    one = kv.feed([0, 1], [sa, sb], [pa, pb], [[5, 6], [7]], room=4,
                  trees=[TreeFeed([(1, None, pa), (2, None, pa)]), TreeFeed([(1, None, pb)])])
    two = kv.feed([0, 1], [sa, sb], [pa, pb], [[8, 9, 10], [11, 12]], room=0,
                  trees=[TreeFeed([(3, 1, pa + 1), (4, 2, pa + 1), (5, 2, pa + 1)]),
                         TreeFeed([(2, 1, pb + 1), (3, 1, pb + 1)])])
    kv.close()
    for got, path in [(one[0, 0], a + [5]), (one[0, 1], a + [6]), (one[1, 0], b + [7]), (two[0, 0], a + [5, 8]),
                      (two[0, 1], a + [6, 9]), (two[0, 2], a + [6, 10]), (two[1, 1], b + [7, 12])]:
        assert torch.allclose(got, plain(draft, path), atol=1e-4)
    assert (sa.length, len(sa.nodes), sb.length, len(sb.nodes)) == (pa, 5, pb, 3)  # nodes kept beside the history
    again = LockstepKV(draft, Workspace(), trees=True)
    three = again.feed([0], [sa], [pa], [[13]], room=0,
                       trees=[TreeFeed([(6, 5, pa + 2)], gather=[(2, None, pa), (5, 2, pa + 1)])])
    assert torch.allclose(three[0, 0], plain(draft, a + [6, 10, 13]), atol=1e-4)


def jobs_for(drafter, contexts, shape, mode=Mode.GREEDY, params=SamplingParams()):
    states = [drafter.new_state(c) for c in contexts]
    return states, [TreeJob(s, list(c), shape, mode, params, 7, RankAcceptance()) for s, c in zip(states, contexts)]


@pytest.mark.parametrize("mode", [Mode.GREEDY, Mode.COUPLED, Mode.SAMPLE])
def test_trees_of_many_sessions_cost_one_forward_per_level(tiny_runners, mode):
    """Three sessions, a 4-level tree each: 4 forwards in all (the history's catch-up, then one per level), every
    node's children are the first of the draft's ranked candidates for its own path, and the wire form parses."""
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    contexts = [draft.tokenizer(t).input_ids for t in TEXTS]
    shape = TreeShape((3, 4, 4, 3))
    params = SamplingParams() if mode == Mode.GREEDY else SamplingParams(1.0, top_k=8)
    states, jobs = jobs_for(drafter, contexts, shape, mode, params)
    calls = []
    forward = draft.model.forward
    draft.model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    try:
        blocks = drafter.draft_batch(jobs)
    finally:
        draft.model.forward = forward
    assert len(calls) == shape.depth
    for state, context, block in zip(states, contexts, blocks):
        tree = state.tree
        Tree.parse(block.ids, block.parents)  # parents first, distinct siblings
        assert 1 < len(block.ids) <= shape.nodes and block.steps == shape.depth
        for u in [ROOT] + block.nodes:
            kids = [tree.nodes[k].token for k in tree.kids(u)]
            path = [tree.nodes[k].token for k in tree.path(u)]
            if kids:
                want = node_dist(drafter, plain(draft, context + path), mode, params, 7,
                                 len(context) + len(path), {})
                assert kids == want.ranked[:len(kids)], (u, kids, want.ranked)


def test_a_verdict_keeps_the_accepted_path_and_the_subtree_under_it(tiny_runners):
    """After a verdict commits a path plus a token the tree holds (a pre-drafted guess), the path's K/V join the
    history without a forward, the subtree stays rooted there, and the next tree drafts on from it exactly."""
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    context = draft.tokenizer(TEXTS[2]).input_ids
    (state,), (job,) = jobs_for(drafter, [context], TreeShape((2, 3, 3)))
    block = drafter.draft_batch([job])[0]
    tree = state.tree
    leaf = next(u for u in block.nodes if tree.nodes[u].depth == 2)  # fed: its K/V are in the node store
    path = tree.path(leaf)
    guess = tree.add(leaf, tree.nodes[leaf].dist.ranked[len(tree.kids(leaf))], 1.0, outcome=True)  # not a child
    tree.nodes[guess].dist = tree.nodes[leaf].dist  # as a pre-draft would have fed it (dist is only read back)
    state.kv.nodes.add([guess], state.kv.nodes.get([leaf]))
    committed = context + [tree.nodes[u].token for u in path] + [tree.nodes[guess].token]
    state.sync(committed)
    assert state.ids == committed and state.kv.length == len(committed)
    assert state.tree.root_len == len(committed) and state.tree.root.dist is tree.nodes[guess].dist


def test_the_same_context_drafts_the_same_tree_again(tiny_runners):
    """A retry re-drafts nothing: the levels are drafted already, the wire form is the same."""
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    context = draft.tokenizer(TEXTS[0]).input_ids
    (state,), (job,) = jobs_for(drafter, [context], TreeShape((2, 3, 2)), Mode.SAMPLE, SamplingParams(1.0))
    first = drafter.draft_batch([job])[0]
    again = drafter.draft_batch([TreeJob(state, list(context), job.shape, Mode.SAMPLE, SamplingParams(1.0), 7,
                                         RankAcceptance())])[0]
    assert (again.ids, again.parents, again.q_tok, again.steps) == (first.ids, first.parents, first.q_tok, 0)


@pytest.mark.parametrize("mode", [Mode.GREEDY, Mode.SAMPLE])
def test_a_tree_grown_wider_before_sends_no_more_than_this_rounds_shape(tiny_runners, mode):
    """A pre-draft grows the next tree under an earlier round's shape; the job keeps those nodes, but the VERIFY
    carries only this round's shape's count of them (at most MAX_DRAFT, which a worker enforces): the most valuable,
    each with its parent and earlier siblings (sample mode's draw order). Without the cap this tree went out with 68
    nodes: a worker answers that BAD_REQUEST, which ends the generation."""
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    context = draft.tokenizer(TEXTS[1]).input_ids
    params = SamplingParams() if mode == Mode.GREEDY else SamplingParams(1.0)
    (state,), (job,) = jobs_for(drafter, [context], TreeShape((4, 16, 44)), mode, params)
    wide = drafter.draft_batch([job])[0]
    assert len(wide.ids) == 64
    for shape in (TreeShape((4, 16, 44, 4)), TreeShape((2, 2, 2, 2, 2))):
        block = drafter.draft_batch([TreeJob(state, list(context), shape, mode, params, 7, RankAcceptance())])[0]
        tree = state.tree
        assert len(block.ids) == min(shape.nodes, MAX_DRAFT)
        Tree.parse(block.ids, block.parents)
        sent = set(block.nodes)
        for u in [ROOT] + block.nodes:
            kids = tree.kids(u)
            assert [k for k in kids if k in sent] == kids[:len([k for k in kids if k in sent])]  # a prefix
        dropped = [u for u in tree.sent_order(shape.depth, 10 ** 6) if u not in sent]
        frontier = [u for u in dropped if tree.nodes[u].parent in sent | {ROOT}
                    and all(k in sent for k in tree.kids(tree.nodes[u].parent)[:tree.nodes[u].rank])]
        assert max(tree.nodes[u].value for u in frontier) <= min(tree.nodes[u].value for u in block.nodes)
