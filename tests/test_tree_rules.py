"""Token trees, pure: the wire fields and their bounds, the tree structure's checks, and the exact rule per mode
three ways (hand-written tables, fixed seeds, convergence to p by chi-square). No model, no sockets."""

from __future__ import annotations

import msgspec
import pytest
import torch
from stats import chi2_pvalue

from specrelay.common import protocol as P
from specrelay.common.packing import f32
from specrelay.common import verify
from specrelay.common.errors import InvalidRequest
from specrelay.common.rng import Purpose, gumbel, sample_index, uniform
from specrelay.common.tree import Tree, draw_children, encode_q_row, from_verify, q_row_values
from specrelay.common.verify import residual

#        root
#       /    \
#    0:5      1:6
#     |      /   \
#    2:7  3:8    4:9
TREE = Tree.parse([5, 6, 7, 8, 9], [-1, -1, 0, 1, 1])


def one_hot(ids: list[int], v: int = 12) -> torch.Tensor:  # [len(ids), v] logits whose argmaxes are ids
    logits = torch.zeros(len(ids), v)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


# ------------------------------------------------------------------------------------------ the wire

def test_a_chain_costs_exactly_todays_bytes_and_a_tree_verdict_always_names_its_node():
    chain = P.Verify(37, 57, 300, [], [8000, 8001, 8002, 8003])
    assert P.encode(chain)[1] == msgspec.msgpack.encode([37, 57, 300, [], [8000, 8001, 8002, 8003]])
    assert P.encode(P.Verdict(37, 57, 3, 8001))[1] == msgspec.msgpack.encode([37, 57, 3, 8001])
    for node in (-1, 3):  # -1 (nothing accepted) travels too: a tree verdict without `node` is an old worker's
        verdict = P.decode(P.encode(P.Verdict(37, 57, 0, 8001, node=node)))
        assert verdict.node == node
    tree = P.Verify(37, 57, 300, [], [5, 6, 7], f32([0.5] * 3), [-1, -1, 0],
                    [P.QRow(f32([0.25] * 4)), P.QRow(f32([0.5, 0.5]), [3, 9])])
    assert P.decode(P.encode(tree)) == tree


@pytest.mark.parametrize("body, field", [
    ([5, 1, 1, [], [1] * 3, b"", [-2, 0, 1]], "parents"),                      # below -1
    ([5, 1, 1, [], [1] * 3, b"", [-1, P.MAX_DRAFT, 0]], "parents"),            # past any node index
    ([5, 1, 1, [], [1] * 3, b"", [-1] * (P.MAX_DRAFT + 1)], "parents"),        # too many nodes
    ([5, 1, 1, [], [1], b"", [-1], [[b""]] * (P.MAX_DRAFT // 2 + 1)], "q_rows"),
    ([5, 1, 1, [], [1], b"", [-1], [[b"", list(range(P.MAX_SPARSE + 1))]]], "q_rows"),
    ([5, 1, 0, 8001, [], b"", b"", 0.0, None, P.MAX_DRAFT], "node"),
])
def test_hostile_tree_fields_are_refused_at_decode(body, field):
    kind = P.MsgType.VERDICT if field == "node" else P.MsgType.VERIFY
    with pytest.raises(InvalidRequest) as err:
        P.decode([P.header(kind), msgspec.msgpack.encode(body)])
    assert err.value.field == field


@pytest.mark.parametrize("tokens, parents, match", [
    ([1, 2, 3], [-1, 0], "2 entries for 3"),
    ([1, 2, 3], [-1, 1, 0], r"parents\[1\] is 1"),      # its own parent
    ([1, 2, 3], [-1, 2, 0], r"parents\[1\] is 2"),      # a later node: a cycle could hide there
    ([1, 2, 3], [-1, 0, 5], r"parents\[2\] is 5"),      # out of range
    ([1, 2, 1], [-1, 0, -1], "repeats its sibling's token 1"),
])
def test_malformed_trees_are_bad_requests(tokens, parents, match):
    with pytest.raises(InvalidRequest, match=match) as err:
        Tree.parse(tokens, parents)
    assert err.value.field == "parents"


def test_tree_structure_paths_branching_and_pruning():
    assert TREE.depth == (1, 1, 2, 2, 2) and TREE.children_of(-1) == (0, 1) and TREE.children_of(1) == (3, 4)
    assert TREE.path(4) == [1, 4] and TREE.path(-1) == [] and TREE.branching() == [-1, 1]
    pruned, kept = Tree.parse([5, 6, 7, 8], [-1, 0, 1, 0]).prune(2)
    assert kept == [0, 1, 3] and pruned.parents == (-1, 0, 0)
    assert Tree.chain([4, 5, 6]).parents == (-1, 0, 1)


def test_q_rows_dense_and_sparse_and_their_checks():
    q = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0, 0, 0, 0, 0, 0, 0])
    sparse = encode_q_row(q)
    assert sparse.ids == [1, 3, 4] and torch.allclose(q_row_values(sparse, 12), q.double())
    assert encode_q_row(torch.full((4,), 0.25)).ids == []  # dense is smaller
    for row, match in [(P.QRow(f32([0.5] * 4)), "4 values, expected 5"), (P.QRow(f32([0.5, 0.5]), [3, 1]), "ascend"),
                       (P.QRow(f32([0.5]), [9]), "ascend"), (P.QRow(f32([0.0] * 5)), "positive sum")]:
        with pytest.raises(InvalidRequest, match=match):
            q_row_values(row, 5)
    req = P.Verify(1, 1, 3, [], [1, 2], f32([0.5, 0.5]), [-1, -1], [P.QRow(f32([0.0, 1.0, 0, 0, 0]))])
    with pytest.raises(InvalidRequest, match="gives token 2, one of its children, no mass"):
        from_verify(req, 5, sample=True)
    with pytest.raises(InvalidRequest, match="2 rows; this tree has 1 branching"):
        from_verify(P.Verify(1, 1, 3, [], [1, 2], b"", [-1, -1], [P.QRow(f32([.2] * 5))] * 2), 5, True)
    with pytest.raises(InvalidRequest, match="only in SAMPLE mode"):
        from_verify(P.Verify(1, 1, 3, [], [1, 2], b"", [-1, -1], [P.QRow(f32([.2] * 5))]), 5, False)


# ------------------------------------------------------------------------------------------ greedy and coupled

@pytest.mark.parametrize("argmax, outcome", [
    ([6, 1, 9, 0, 0, 3], (4, 2, 3)),   # root -> node 1 (6) -> node 4 (9), a leaf: bonus 3
    ([5, 7, 1, 0, 0, 0], (2, 2, 0)),   # root -> 0 -> 2 (7), a leaf: bonus = argmax after node 2
    ([5, 2, 0, 0, 0, 0], (0, 1, 2)),   # root -> 0; its child is 7, the target says 2: recovered 2
    ([3, 0, 0, 0, 0, 0], (-1, 0, 3)),  # no child of the root matches
])
def test_greedy_tree_table(argmax, outcome):
    assert verify.greedy_tree(TREE, one_hot(argmax)) == outcome


def test_tree_rules_on_a_chain_are_the_chain_rules():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        d, v = trial % 5, 6
        draft = torch.randint(0, v, (d,), generator=gen)
        chain = Tree.chain(draft.tolist())
        logits = torch.randn(d + 1, v, generator=gen) * 3
        n, token = verify.greedy(draft, logits)
        assert verify.greedy_tree(chain, logits) == (n - 1, n, token)
        logp, noise = logits.log_softmax(-1), torch.stack([gumbel(trial, j, v) for j in range(d + 1)])
        n, token = verify.coupled(draft, logp, noise)
        assert verify.coupled_tree(chain, logp, noise) == (n - 1, n, token)
        p, q = logits.softmax(-1), torch.rand(d, generator=gen)
        u, bonus = torch.rand(d + 1, 1, dtype=torch.float64, generator=gen), torch.rand(d + 1, dtype=torch.float64)
        n, token = verify.sampled(draft, p, q, u[:d, 0], float(bonus[d]))
        assert verify.sampled_tree(chain, p, q, {}, u, torch.zeros(d + 1), bonus) == (n - 1, n, token)


# ------------------------------------------------------------------------------------------ sample mode

P1 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])   # target: the last token is cut (top-k)
Q1 = torch.tensor([0.02, 0.75, 0.00, 0.03, 0.10, 0.10])   # draft: token 2 outside its vocabulary (V_o), 5 not in p


def sample_step(p_rows, tree, rows, q_node, seed: int, pos: int = 0) -> tuple[list[int], int]:
    """One tree VERIFY decided by the pure rule with the cloud's draws; a one-child rejection finished as the
    edge's `full` strategy does. Returns (accepted tokens, next token)."""
    depths = range(tree.max_depth + 1)
    u = torch.tensor([[uniform(seed, pos + k, Purpose.ACCEPT, i) for i in range(max(1, tree.max_children))]
                      for k in depths], dtype=torch.float64)
    res = torch.tensor([uniform(seed, pos + k, Purpose.RESIDUAL) for k in depths], dtype=torch.float64)
    bonus = torch.tensor([uniform(seed, pos + k, Purpose.BONUS) for k in depths], dtype=torch.float64)
    node, n, token = verify.sampled_tree(tree, p_rows, q_node, rows, u, res, bonus)
    if token is None:  # the edge holds q at `node`: the residual of the chain rule
        token = sample_index(residual(p_rows[node + 1], rows[node]), uniform(seed, pos + n, Purpose.RESIDUAL))
    return [tree.tokens[i] for i in tree.path(node)], token


# k = 3 (`extended`) is the same rule as k = 2 (some of q's support left over) at the same cost: the default run's
# siblings are k = 2 and k = 6 (q exhausted), with k = 1 (one child, the chain rule)
@pytest.mark.parametrize("k", [1, 2, pytest.param(3, marks=pytest.mark.extended), 6])
def test_branching_root_commits_a_token_distributed_as_p(k):
    """Children drawn without replacement from q (k = 6 exhausts q's support of 5): the first committed token's
    law is p (chi-square over 20,000 seeds), whichever child or residual it came from."""
    counts = torch.zeros(6)
    for seed in range(20_000):
        kids = draw_children(Q1, k, seed, 0)
        tree = Tree.parse(kids, [-1] * len(kids))
        p_rows = torch.cat([P1[None], torch.ones(len(kids), 6) / 6])  # after a child: anything (the bonus)
        accepted, token = sample_step(p_rows, tree, {-1: Q1.double()}, Q1[kids], seed)
        counts[(accepted or [token])[0]] += 1
    assert chi2_pvalue(counts.numpy(), P1.numpy()) > 0.001


def test_two_levels_of_branches_and_the_next_block_give_the_joint_law():
    """Depth-2 trees (a branching root, branching or one-child nodes under it), a second block wherever the
    first committed one token: the law of the first two tokens is p1(x1) p2(x2 | x1) (chi-square)."""
    v = 4
    p1 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    p2 = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25] * 4, [0.0, 0.5, 0.5, 0.0]])
    q1 = torch.tensor([0.05, 0.05, 0.8, 0.1])  # peaked: a rule that forgets a rejected child's mass is off by far
    q2 = torch.tensor([[0.8, 0.1, 0.05, 0.05], [0.1, 0.6, 0.3, 0.0], [0.7, 0.0, 0.0, 0.3], [0.25] * 4])
    counts = torch.zeros(v * v)
    for seed in range(12_000):
        tokens, parents, rows = [], [], {-1: q1.double()}
        for x in draw_children(q1, 2, seed, 0):
            tokens.append(x)
            parents.append(-1)
        for i, x in enumerate(list(tokens)):
            kids = draw_children(q2[x], 1 + (x + seed) % 2, seed, 1)  # one child or two, by node
            rows[i] = q2[x].double()
            tokens += kids
            parents += [i] * len(kids)
        tree = Tree.parse(tokens, parents)
        p_rows = torch.stack([p1] + [p2[x] if parents[i] < 0 else torch.ones(v) / v for i, x in enumerate(tokens)])
        q_node = torch.tensor([q1[x] if parents[i] < 0 else q2[tokens[parents[i]]][x] for i, x in enumerate(tokens)])
        accepted, token = sample_step(p_rows, tree, rows, q_node, seed)
        out = accepted + [token]
        if len(out) < 2:  # the next block at position 1: one child drawn from q2, the chain rule
            x1 = out[0]
            kid = draw_children(q2[x1], 1, seed, 1)
            more, token = sample_step(torch.stack([p2[x1], torch.ones(v) / v]), Tree.parse(kid, [-1]),
                                      {-1: q2[x1].double()}, q2[x1][kid], seed, pos=1)
            out += more + [token]
        counts[out[0] * v + out[1]] += 1
    assert chi2_pvalue(counts.numpy(), (p1[:, None] * p2).flatten().numpy()) > 0.001


def test_fixed_seeds_repeat_and_different_seeds_differ():
    def run(seed):
        kids = draw_children(Q1, 3, seed, 7)
        tree = Tree.parse(kids, [-1] * 3)
        return sample_step(torch.cat([P1[None], torch.ones(3, 6) / 6]), tree, {-1: Q1.double()}, Q1[kids], seed, 7)
    assert all(run(s) == run(s) for s in range(20))
    assert len({str(run(s)) for s in range(20)}) > 3
