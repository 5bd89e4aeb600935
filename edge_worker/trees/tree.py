"""A session's draft tree on the edge (pure: no model): the nodes drafted after its committed tokens, what the
draft said after each node it ran, which of them a VERIFY carries, and what a verdict leaves of it.

Node ids are stable for the tree's life (the node K/V in `trees.kv.NodeKV` are keyed by them), so a verdict that
commits a path re-roots the tree at the path's end without renumbering (`reroot`). A node at depth k stands at
absolute position root_len - 1 + k; the draft's distribution after node u (`NodeDist`, once u was fed to the draft
model) is about position root_len + depth(u): where u's children stand.

`outcome` nodes are pre-drafted guesses of a verdict (the path to their parent accepted, then their token as the
next token): they are never sent; when a verdict matches one, the tree re-roots there and its subtree, drafted
while the VERIFY was in flight, starts the next block.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass, field

import torch

ROOT = -1
BUCKETS = (1.17, 1.5, 2.25, 3.2)  # class edges of the draft's top-1 / top-2 probability ratio (unsure .. sure)
MAX_BRANCH = 4                    # children of one node at most
CANDIDATES = 8                    # candidates kept per fed node: children, then guesses of the next token


def bucket_of(q: torch.Tensor) -> int:  # q: [V] the draft's probabilities after the node
    """The node's confidence class, 0 (the draft hesitates between two tokens) .. len(BUCKETS) (sure)."""
    return _class(q.topk(min(2, q.shape[-1])).values.tolist())


def _class(top: list[float]) -> int:  # the likeliest probabilities, likeliest first (Python floats: ~3x faster)
    return bisect_right(BUCKETS, top[0] / max(top[1], 1e-30)) if len(top) > 1 else 0


def ranked(q: torch.Tensor, logits: bool = False, top: tuple[list[int], list[float]] | None = None
           ) -> tuple[list[int], int]:  # q: [V] the draft's probabilities at a chain's position
    """The MAX_BRANCH likeliest ids, likeliest first, and the confidence class: what a tree node there would have
    had as children (a chain's rejection shows which of them the target took: RankAcceptance.observe_chain).
    `logits`: q holds logits (the class is of their probabilities, exp(l_r - l_0) times a common factor); `top`:
    q's (ids, values) already taken (a batched topk)."""
    if top is None:
        found = q.topk(min(MAX_BRANCH, q.shape[-1]))  # to Python lists first: ~20 us a call, not ~60
        top = found.indices.tolist(), found.values.tolist()
    ids, values = top
    return ids, _class([math.exp(v - values[0]) for v in values] if logits else values)


@dataclass(frozen=True)
class TreeShape:
    """widths[k - 1]: nodes at depth k. A chain of d: widths (1,) * d. min_value: a node less likely than this to
    be on the accepted path costs more (cloud and draft time) than the tokens it is worth (the policy sets it)."""

    widths: tuple[int, ...] = ()
    min_value: float = 0.0

    @classmethod
    def chain(cls, d: int) -> "TreeShape":
        return cls((1,) * d)

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def nodes(self) -> int:
        return sum(self.widths)

    @property
    def is_chain(self) -> bool:
        return all(w == 1 for w in self.widths)

    def width(self, depth: int) -> int:
        return self.widths[depth - 1] if 0 < depth <= len(self.widths) else 0

    def label(self) -> str:
        return "chain" if self.is_chain else "tree"




@dataclass
class NodeDist:
    """The draft after a node: candidate children best first (greedy: the top of q; coupled: of log q + g_t; sample:
    drawn from q without replacement), its confidence class, and q' itself in sample mode ([V_target])."""

    ranked: list[int]
    bucket: int
    q: torch.Tensor | None = None


@dataclass
class TreeNode:
    token: int
    parent: int            # node id, ROOT for a child of the last committed token
    depth: int             # 1: a child of the root
    rank: int              # index among its parent's children (draw order)
    value: float           # estimated chance the accepted path passes through it (1 for the root)
    q: float = 0.0         # q'(token) under its parent (sample mode)
    dist: NodeDist | None = None  # once fed: the draft after it
    kids: list[int] = field(default_factory=list)
    expanded: bool = False  # its children were chosen (a level is expanded once: sample mode's exactness)
    outcome: bool = False   # a pre-drafted guess of a verdict's next token (never sent)
    prob: float = 0.0       # outcome nodes: the estimated chance of that verdict
    final: bool = False     # EOS: the generation ends here, nothing is drafted after it


class DraftTree:
    def __init__(self, root_len: int, root_dist: NodeDist | None, next_id: int = 0) -> None:
        self.root_len = root_len  # committed tokens the tree hangs from
        self.root = TreeNode(-1, ROOT, 0, 0, 1.0, dist=root_dist)
        self.nodes: dict[int, TreeNode] = {}
        self.next_id = next_id

    def node(self, nid: int) -> TreeNode:
        return self.root if nid == ROOT else self.nodes[nid]

    def position(self, nid: int) -> int:
        """The absolute position of node `nid`'s token."""
        return self.root_len - 1 + self.node(nid).depth

    def add(self, parent: int, token: int, value: float, q: float = 0.0, outcome: bool = False,
            final: bool = False) -> int:
        up = self.node(parent)
        nid, self.next_id = self.next_id, self.next_id + 1
        self.nodes[nid] = TreeNode(token, parent, up.depth + 1, len(up.kids), value, q, outcome=outcome,
                                   final=final, expanded=final)
        up.kids.append(nid)
        return nid

    def kids(self, nid: int, outcomes: bool = False) -> list[int]:
        return [k for k in self.node(nid).kids if outcomes or not self.nodes[k].outcome]

    def path(self, nid: int) -> list[int]:
        """Node ids from the root's child down to `nid` (empty for the root)."""
        out = []
        while nid != ROOT:
            out.append(nid)
            nid = self.nodes[nid].parent
        return out[::-1]

    def child_with(self, nid: int, token: int) -> int | None:
        return next((k for k in self.node(nid).kids if self.nodes[k].token == token), None)

    def levels(self, top: int, start: int = ROOT) -> list[list[int]]:
        """The subtree under `start` by depth below it (0: [start]), down to `top` levels below, outcome nodes left
        out (except `start` itself); within a level parents in order, siblings in rank order."""
        out, level = [], [start]
        while level and len(out) <= top:
            out.append(level)
            level = [k for u in level for k in self.kids(u)]
        return out

    def sent_order(self, depth: int, most: int) -> list[int]:
        """The nodes a VERIFY of this depth carries, in wire order (each parent first, siblings in draw order): the
        `most` most valuable, each with its parent and its earlier siblings (sample mode's draw order). A subtree a
        pre-draft grew under an earlier shape may hold more than this round's shape prices, or than a VERIFY takes."""
        order = [u for level in self.levels(depth)[1:] for u in level]
        if len(order) <= most:
            return order
        sent = set(order)
        kids = {u: [k for k in self.node(u).kids if k in sent] for u in [ROOT, *order]}
        heap, keep = [(-self.nodes[kids[ROOT][0]].value, 0, ROOT)], set()
        while heap and len(keep) < most:  # best first over the frontier: a parent's first child, a node's next sibling
            _, rank, parent = heapq.heappop(heap)
            u = kids[parent][rank]
            keep.add(u)
            for up, r in ((parent, rank + 1), (u, 0)):
                if r < len(kids[up]):
                    heapq.heappush(heap, (-self.nodes[kids[up][r]].value, r, up))
        return [u for u in order if u in keep]

    def wire(self, order: list[int]) -> tuple[list[int], list[int]]:
        """(tokens, parents) as a VERIFY carries them: parents by index into `order`, -1 for the root."""
        index = {nid: i for i, nid in enumerate(order)}
        nodes = [self.nodes[u] for u in order]
        return [n.token for n in nodes], [index[n.parent] if n.parent != ROOT else -1 for n in nodes]

    def reroot(self, nid: int) -> "DraftTree":
        """The subtree under node `nid` as the tree after it (`nid` committed): ids kept, depths shifted."""
        top = self.nodes[nid]
        tree = DraftTree(self.root_len + top.depth, top.dist, self.next_id)
        tree.root.expanded, tree.root.kids = top.expanded, list(top.kids)
        for k in self.descendants(nid):
            n = self.nodes[k]
            parent = ROOT if n.parent == nid else n.parent
            tree.nodes[k] = TreeNode(n.token, parent, n.depth - top.depth, n.rank, n.value, n.q, n.dist,
                                     list(n.kids), n.expanded, n.outcome, n.prob, n.final)
        return tree

    def descendants(self, nid: int) -> list[int]:
        out, stack = [], list(self.node(nid).kids)
        while stack:
            k = stack.pop()
            out.append(k)
            stack.extend(self.nodes[k].kids)
        return out

    def fed(self) -> list[int]:
        """Nodes the draft model ran (their K/V and dist are known), parents first."""
        return [u for u in self.topological() if self.nodes[u].dist is not None]

    def topological(self) -> list[int]:
        out, level = [], list(self.root.kids)
        while level:
            out += level
            level = [k for u in level for k in self.nodes[u].kids]
        return out


def adopt(tree: DraftTree, kv, ids: list[int], context: list[int]) -> tuple[list[int], DraftTree | None]:
    """After a verdict: follow the committed tokens past the tree's root down the tree and move the K/V of every fed
    node on that path into the session's history (kv: draft.kv.SessionKV), dropping the rest. Returns (the ids the
    history now holds, what is left of the tree: the subtree under the path's end when it covers the whole
    context, else None)."""
    n = len(ids)
    if tree.root_len != n or ids != context[:n]:
        kv.nodes.clear()
        return ids, None
    if len(context) == n:  # nothing committed since (a retry): the tree stands
        return ids, tree
    path, at = [], ROOT
    for token in context[n:]:
        child = tree.child_with(at, token)
        if child is None or tree.nodes[child].dist is None:  # not drafted, or never fed: the history catches up
            break
        path.append(child)
        at = child
    if path:
        kv.append(kv.nodes.get(path))
        ids = ids + [tree.nodes[u].token for u in path]
    if path and len(ids) == len(context):
        rest = tree.reroot(path[-1])
        kv.nodes.keep(set(rest.nodes))
        return ids, rest
    kv.nodes.clear()
    return ids, None


def expand_level(tree: DraftTree, level: list[int], want: int, acceptance,
                 eos: frozenset[int], mode_sample: bool, branching: int | None = None,
                 least: float = 0.0) -> list[int]:
    """Give the level's nodes their children: the `want` most valuable candidates (a node's children are a prefix
    of its ranked candidates), none below `least`, and at most `branching` nodes with a second child (None: any).
    Marks every node of the level expanded. Returns the new ids."""
    heap = []
    for u in level:
        node = tree.node(u)
        if node.dist is not None and not node.final:
            heapq.heappush(heap, (-_value(node, 0, acceptance), u, 0))
    new = []
    while heap and len(new) < want:
        v, u, r = heapq.heappop(heap)
        if -v < least:
            break
        if r == 1 and branching is not None:
            if branching <= 0:
                continue
            branching -= 1
        node = tree.node(u)
        token = node.dist.ranked[r]
        q = float(node.dist.q[token]) if mode_sample else 0.0
        new.append(tree.add(u, token, -v, q, final=token in eos))
        if r + 1 < min(MAX_BRANCH, len(node.dist.ranked)):
            heapq.heappush(heap, (-_value(node, r + 1, acceptance), u, r + 1))
    for u in level:
        tree.node(u).expanded = True
    return new


def _value(node: TreeNode, rank: int, acceptance) -> float:  # acceptance: policy.RankAcceptance
    return node.value * acceptance.p_rank(node.dist.bucket)[rank]
