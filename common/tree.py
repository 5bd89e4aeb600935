"""Token trees over the link: the structure a tree VERIFY carries, shared by the edge and the cloud (pure).

A tree is n draft nodes (target ids) with `parents`: per node the index of its parent node, -1 for a child of the
last committed token (the root). Nodes come in topological order (a parent before its children), siblings are
distinct tokens, and a node's children come in their draw order. Depth: 1 for a child of the root, so the node at
depth k stands at absolute position pos - 1 + k of the sequence, and the decision made AT node u (which child to
follow, or the next token) is about absolute position pos + depth(u) (depth(root) = 0). A chain x_1..x_d is the tree
with parents [-1, 0, 1, ...]; on the wire it is sent as parents = [] and costs exactly a chain's bytes.

Sample mode: every branching node (two or more children; the root counts) sends the whole q row it drew its
children from (`protocol.QRow`, dense or sparse float32 over target ids), and its children must be drawn from that
row WITHOUT replacement, in index order (Gumbel-top-k of log q + g, `draw_children`); docs/exactness.md proves the
cloud's rule (common/verify.py `sampled_tree`) exact under exactly that obligation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import protocol as P
from .errors import InvalidRequest
from .packing import f32, from_f32
from .rng import Purpose, gumbel


@dataclass(frozen=True)
class Tree:
    """tokens [n] target ids; parents [n] (-1 = the root); depth [n] (1 = a child of the root);
    children [n + 1]: children[u + 1] = the children of node u (u = -1: the root), in index (draw) order."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depth: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]

    @classmethod
    def parse(cls, tokens, parents) -> "Tree":
        """Check and build a tree; any defect raises InvalidRequest naming `parents` (a BAD_REQUEST)."""
        n = len(tokens)
        if len(parents) != n:
            raise InvalidRequest(f"parents has {len(parents)} entries for {n} draft nodes", field="parents")
        depth: list[int] = []
        kids: list[list[int]] = [[] for _ in range(n + 1)]
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            if not -1 <= parent < i:
                raise InvalidRequest(f"parents[{i}] is {parent}: a node's parent is -1 (the last committed token) "
                                     "or an earlier node", field="parents")
            if any(tokens[c] == token for c in kids[parent + 1]):
                raise InvalidRequest(f"parents: node {i} repeats its sibling's token {token}; siblings must differ",
                                     field="parents")
            depth.append(1 if parent < 0 else depth[parent] + 1)
            kids[parent + 1].append(i)
        return cls(tuple(tokens), tuple(parents), tuple(depth), tuple(map(tuple, kids)))

    @classmethod
    def chain(cls, tokens) -> "Tree":
        return cls.parse(tokens, list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def children_of(self, node: int) -> tuple[int, ...]:
        return self.children[node + 1]

    def depth_of(self, node: int) -> int:
        return 0 if node < 0 else self.depth[node]

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    @property
    def max_children(self) -> int:
        return max(map(len, self.children))

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to `node` (empty for -1): the accepted path it ends."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def branching(self) -> list[int]:
        """Nodes with two or more children (-1 = the root), ascending: the ones whose q row travels."""
        return [u for u in range(-1, len(self)) if len(self.children_of(u)) >= 2]

    def prune(self, max_depth: int) -> tuple["Tree", list[int]]:
        """The nodes of depth <= max_depth (closed under ancestors: a node's depth exceeds its parent's), and
        each kept node's index in this tree."""
        kept = [i for i, k in enumerate(self.depth) if k <= max_depth]
        if len(kept) == len(self):
            return self, kept
        new = {old: i for i, old in enumerate(kept)}
        return Tree.parse([self.tokens[i] for i in kept], [new.get(self.parents[i], -1) for i in kept]), kept


@dataclass
class TreeDraft:
    """A tree VERIFY as the cloud verifies it: the tree (pruned to the model's context), each node's index in
    the request (`kept`), and in sample mode every branching node's q row, normalised: node -> [V] float64."""

    tree: Tree
    kept: list[int]
    rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def original(self, node: int) -> int:
        """The request's index of `node` (-1 stays -1): what the VERDICT names."""
        return node if node < 0 else self.kept[node]

    def pruned(self, max_depth: int) -> "TreeDraft":
        tree, kept = self.tree.prune(max_depth)
        if len(kept) == len(self.tree):
            return self
        new = {old: i for i, old in enumerate(kept)}
        branching = set(tree.branching())  # a kept node keeps all its children: they share a depth
        moved = {u: -1 if u < 0 else new.get(u) for u in self.rows}
        rows = {moved[u]: r for u, r in self.rows.items() if moved[u] in branching}
        return TreeDraft(tree, [self.kept[i] for i in kept], rows)


def from_verify(req: P.Verify, vocab_size: int, sample: bool) -> TreeDraft | None:
    """The tree of a VERIFY, checked (None for a chain). Raises InvalidRequest naming the field: bad parents,
    q_rows outside sample mode or without a tree, a q row count other than the branching nodes', a row of the
    wrong size, or a child its parent's row gives no mass (it cannot have been drawn from it)."""
    if not req.parents:
        if req.q_rows:
            raise InvalidRequest("q_rows travel only with a tree (parents)", field="q_rows")
        return None
    tree = Tree.parse(req.draft, req.parents)
    branching = tree.branching()
    if req.q_rows and not sample:
        raise InvalidRequest("q_rows travel only in SAMPLE mode", field="q_rows")
    if sample and len(req.q_rows) != len(branching):
        raise InvalidRequest(f"q_rows has {len(req.q_rows)} rows; this tree has {len(branching)} branching nodes "
                             "(two or more children), each needs one", field="q_rows")
    rows = {u: q_row_values(row, vocab_size) for u, row in zip(branching, req.q_rows)}
    for u, q in rows.items():
        starved = [tree.tokens[c] for c in tree.children_of(u) if not q[tree.tokens[c]] > 0]
        if starved:
            raise InvalidRequest(f"q_rows: the row of node {u} gives token {starved[0]}, one of its children, no mass",
                                 field="q_rows")
    return TreeDraft(tree, list(range(len(tree))), rows)


def q_row_values(row: P.QRow, vocab_size: int) -> torch.Tensor:  # -> [V] float64, sums to 1
    """A QRow -> q over the target ids; InvalidRequest (field q_rows) on a wrong size, unordered or out-of-range
    ids, or no mass."""
    if not row.ids:
        q = from_f32(row.probs, vocab_size, "q_rows").double()
    else:
        ids = torch.tensor(row.ids, dtype=torch.long)
        if int(ids[-1]) >= vocab_size or (len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all())):
            raise InvalidRequest(f"q_rows: a sparse row's ids must ascend strictly within [0, {vocab_size})",
                                 field="q_rows")
        q = torch.zeros(vocab_size, dtype=torch.float64)
        q[ids] = from_f32(row.probs, len(ids), "q_rows").double()
    total = float(q.sum())
    if not 0 < total < float("inf"):
        raise InvalidRequest("q_rows: a row must hold finite probabilities with a positive sum", field="q_rows")
    return q / total


def encode_q_row(q: torch.Tensor) -> P.QRow:  # q: [V]
    """The edge's QRow for q: sparse (its support, 4-byte probs plus ids of 1-5 bytes) when that is smaller
    than dense (4 bytes per target id)."""
    support = (q > 0).nonzero().squeeze(1)
    if 8 * len(support) < 4 * q.shape[0] and len(support) <= P.MAX_SPARSE:
        return P.QRow(f32(q[support]), support.tolist())
    return P.QRow(f32(q))


def draw_children(q: torch.Tensor, k: int, seed: int, position: int) -> list[int]:  # q: [V]
    """k distinct tokens drawn from q without replacement, in draw order: Gumbel-top-k of log q + g with the
    edge's own noise (Purpose.TREE_DRAFT at the absolute position they stand at). Fewer when q has fewer than k
    tokens of positive mass. This is the law `sampled_tree` needs; any other way of drawing them is not exact."""
    g = gumbel(seed, position, q.shape[0], Purpose.TREE_DRAFT)
    keys = torch.where(q > 0, q.double().log() + g, torch.tensor(float("-inf"), dtype=torch.float64))
    k = min(k, int((q > 0).sum()))
    return keys.topk(k).indices.tolist() if k else []
