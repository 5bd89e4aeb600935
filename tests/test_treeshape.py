"""The shape of a draft tree (edge_worker/treeshape.py), pure: the static tree grows by value, a level's nodes go
to its most valuable candidates (a prefix of each node's ranked candidates), rank acceptance is learnt from
verdicts, and the policy chooses chains where extra nodes cost more than they save and trees over a slow link."""

from __future__ import annotations

import pytest
import torch

from specrelay.common.protocol import LoadHint, Objective
from specrelay.edge_worker.draftlen import EdgeEstimates
from specrelay.edge_worker.drafttree import ROOT, DraftTree, NodeDist
from specrelay.edge_worker.treeshape import (MIN_VALUE, RankAcceptance, TreeEstimates, TreeShape, cap,
                                             expand_level, static_tree)


def test_the_static_tree_is_a_chain_while_the_first_choice_dominates():
    values, widths = static_tree([0.9, 0.05, 0.03, 0.01], depth=4, nodes=8)
    assert widths[3] == (1, 1, 1, 1)  # four nodes: the chain
    assert values[3] == pytest.approx(0.9 + 0.81 + 0.729 + 0.6561)
    assert all(b > a for a, b in zip(values, values[1:]))  # every node adds value
    _, wide = static_tree([0.5, 0.3, 0.1, 0.05], depth=3, nodes=9)
    assert wide[-1][0] >= 2  # an unsure draft: siblings before depth


def tree_with_level(buckets: list[int]) -> DraftTree:
    q = torch.full((100,), 0.01)
    tree = DraftTree(10, NodeDist([1, 2, 3, 4, 5], bucket=0, q=q))
    expand_level(tree, [ROOT], len(buckets), RankAcceptance(), frozenset(), True)
    for u, b in zip(tree.kids(ROOT), buckets):
        tree.nodes[u].dist = NodeDist([10 * u + k for k in range(1, 6)], bucket=b, q=q)
    return tree


def test_a_level_goes_to_its_most_valuable_candidates():
    """The unsure node (class 0) gets siblings; the sure one (class 4) one child; children are each node's first
    ranked candidates, in rank order; the level holds `want` nodes."""
    tree = tree_with_level([0, 4])
    unsure, sure = tree.kids(ROOT)
    new = expand_level(tree, [unsure, sure], 4, RankAcceptance(), frozenset(), False)
    assert len(new) == 4 and all(tree.node(u).expanded for u in (unsure, sure))
    assert [tree.nodes[k].token for k in tree.kids(sure)] == [tree.nodes[sure].dist.ranked[0]]
    kids = tree.kids(unsure)
    assert [tree.nodes[k].token for k in kids] == tree.nodes[unsure].dist.ranked[:len(kids)] and len(kids) == 3
    assert [tree.nodes[k].rank for k in kids] == [0, 1, 2]
    assert all(tree.nodes[k].value >= MIN_VALUE for k in new)


def test_sample_mode_caps_the_nodes_that_branch():
    tree = tree_with_level([0, 0, 0])
    level = tree.kids(ROOT)
    expand_level(tree, level, 9, RankAcceptance(), frozenset(), True, branching=1)
    assert sum(len(tree.kids(u)) >= 2 for u in level) == 1


def test_rank_acceptance_learns_second_children():
    acc = RankAcceptance()
    before = acc.rates(1)
    for _ in range(50):  # class 1: the first child always rejected, the second always accepted
        acc.decay()
        acc.observe(1, 2, 1)
    after = acc.rates(1)
    assert after[0] < 0.1 < before[0] and after[1] > 0.9
    assert acc.p_rank(1)[1] > 0.8 and len(acc.p_rank(1, 7)) == 7


def estimates_for(rtt_s: float, forward_per_token_s: float) -> EdgeEstimates:
    """An edge that measured this link and a cloud whose forward costs 10 ms + forward_per_token_s per token."""
    edge = EdgeEstimates()
    for d in (2, 4, 8, 16, 32, 4, 8):  # tokens per pass vary, so the slope is learnt
        forward = 0.010 + forward_per_token_s * (d + 1)
        hint = LoadHint(batch=1, width=d + 1, forward_us=int(forward * 1e6), queue_us=0, tokens=d + 1)
        edge.observe_round(d, 0.003 * d, rtt_s + forward, d + 1, d, hint)
    return edge


def trees_measured() -> TreeEstimates:
    """Draft forwards of 3-4 ms; the acceptance of a draft like the demo pair's: where it hesitates (class 0) its
    first child is the target's token half the time and the second often, where it is sure (class 3) nearly always."""
    trees = TreeEstimates()
    for _ in range(8):
        trees.observe_forward(1, 0.003)
        trees.observe_forward(8, 0.004)
    for i in range(200):
        trees.acceptance.decay()
        if i % 2:
            trees.acceptance.observe(0, 3, [0, 0, 1, 1, 2, None][i % 6] if i % 12 < 11 else None)
        else:
            trees.acceptance.observe(3, 1, 0 if i % 20 else None)
    return trees


def test_trees_pay_over_a_slow_link_and_chains_on_loopback_with_a_costly_cloud():
    slow = trees_measured().best(estimates_for(0.050, 0.0005), Objective.SPEED, "auto", None, None)
    assert not slow.is_chain and slow.depth >= 3
    costly = trees_measured().best(estimates_for(0.0, 0.004), Objective.SPEED, "auto", None, None)
    assert costly.is_chain or costly.depth == 0
    on = trees_measured().best(estimates_for(0.0, 0.004), Objective.SPEED, "on", 4, None)
    assert on.depth == 4 and on.nodes > 4  # `on` drafts trees, here at the fixed depth


def test_a_fixed_budget_and_the_tokens_left_bound_the_shape():
    shape = trees_measured().best(estimates_for(0.050, 0.0005), Objective.BALANCED, "on", 5, 12)
    assert shape.depth == 5 and shape.nodes == 12
    assert cap(shape, 2).depth == 2 and cap(TreeShape(), 3) == TreeShape()
    assert TreeShape.chain(3).is_chain and TreeShape.chain(3).label() == "chain"
