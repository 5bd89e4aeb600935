"""The shape of a draft tree (`--trees on|auto`): how deep, how many nodes, where they go. Pure: no clocks, no
sockets; the model is in docs/trees.md.

Where the draft is unsure, its second and third choices are often the target's: the confidence class of a node
(`bucket_of`: the ratio of the draft's two likeliest tokens there) says how often its r-th child is accepted,

    A_r(b)  = P(child r accepted | children 0..r-1 rejected) at a node of class b   (measured per verdict)
    P_r(b)  = A_r(b) * prod_{i<r} (1 - A_i(b))                                     (the target's token is child r)
    value(child r of u) = value(u) * P_r(bucket(u)),   value(root) = 1              (the chance the path passes it)

so a tree's expected tokens per call is 1 + the sum of its nodes' values. A tree is drafted level by level (one
batched draft forward per depth): `expand_level` gives the level's w_k nodes to the most valuable candidates. The
shape (depth D, widths w_1..w_D, nodes N = sum w) is chosen like the draft length (edge_worker/draftlen.py):

    E(S) = 1 + c * V(D, N)          V: the best static tree's value at the class-averaged P_r; c: measured / predicted
    T(S) = (1 - h) * sum_k t(w_k)   draft forwards (t(w) = t0 + t1 * w, measured), h = share pre-drafted (measured)
           + R + Q + F(N)           the link, the worker's queue, its forward over N + 1 tokens (the edge's estimates)

and the objective's rule over E / T (speed, balanced, cloud). A chain is the shape with every w_k = 1; `auto` may
choose it (and does when extra nodes cost more than they save: loopback, a saturated cloud); `on` drafts trees only.

Sample mode's exactness needs each node's number of children fixed before its children are drawn, from nothing
drawn at their position (common/tree.py): a node's value depends on its ancestors' classes and ranks, never on the
drawn tokens, and a level is expanded once, all its nodes together.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field, replace

import torch

from ..common.protocol import MAX_DRAFT, Objective
from .draftlen import TIE, TIME_DECAY, EdgeEstimates, tolerance
from .estimators import CLIP, EWLine, EWMean
from .drafttree import DraftTree, TreeNode

BUCKETS = (1.17, 1.5, 2.25, 3.2)  # class edges of the draft's top-1 / top-2 probability ratio (unsure .. sure)
MAX_BRANCH = 4                    # children of one node at most
CANDIDATES = 8                    # candidates kept per fed node: children, then guesses of the next token
MIN_VALUE = 0.01                  # a node this unlikely to be on the accepted path is not drafted
MAX_DEPTH = 16                    # the deepest tree `auto` drafts
DECAY = 0.995                     # per verdict: the edge's rank-acceptance counts (memory ~200 verdicts)
PRIOR_WEIGHT = 4.0                # the priors below are worth this many observations per (class, rank)
PRIOR_A0 = (0.55, 0.75, 0.9, 0.95, 0.98)  # a first child's acceptance by class, until measured
PRIOR_AN = 0.45                   # a later child's, given its elder siblings were rejected
RECHOOSE_EVERY = 8                # verdicts (of all sessions) between two choices of the edge's shape


def bucket_of(q: torch.Tensor) -> int:  # q: [V] the draft's probabilities after the node
    """The node's confidence class, 0 (the draft hesitates between two tokens) .. len(BUCKETS) (sure)."""
    top = q.topk(2).values.double()
    return bisect_right(BUCKETS, float(top[0] / top[1].clamp(min=1e-30)))


@dataclass(frozen=True)
class TreeShape:
    """widths[k - 1]: nodes at depth k. A chain of d: widths (1,) * d. min_value: a node less likely than this to
    be on the accepted path costs more (cloud and draft time) than the tokens it is worth."""

    widths: tuple[int, ...] = ()
    min_value: float = MIN_VALUE

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


class RankAcceptance:
    """Decayed counts per (class, rank): how often a node's r-th child was tested / accepted; and how often the
    accepted path met each class."""

    def __init__(self) -> None:
        b = len(BUCKETS) + 1
        self.reached = [[0.0] * MAX_BRANCH for _ in range(b)]
        self.accepted = [[0.0] * MAX_BRANCH for _ in range(b)]
        self.seen = [0.0] * b

    def decay(self) -> None:
        for rows in (self.reached, self.accepted):
            for row in rows:
                row[:] = [x * DECAY for x in row]
        self.seen = [x * DECAY for x in self.seen]

    def observe(self, bucket: int, children: int, accepted: int | None) -> None:
        """A node of class `bucket` the verdict's walk reached, with `children` sent; `accepted`: the rank it
        followed (None: all rejected)."""
        self.seen[bucket] += 1.0
        tested = children if accepted is None else accepted + 1
        for r in range(min(tested, MAX_BRANCH)):
            self.reached[bucket][r] += 1.0
        if accepted is not None and accepted < MAX_BRANCH:
            self.accepted[bucket][accepted] += 1.0

    def rates(self, bucket: int) -> list[float]:
        """A_0..A_{MAX_BRANCH-1} of a class, shrunk toward the priors."""
        prior = [PRIOR_A0[bucket]] + [PRIOR_AN] * (MAX_BRANCH - 1)
        return [(a + PRIOR_WEIGHT * p) / (r + PRIOR_WEIGHT)
                for a, r, p in zip(self.accepted[bucket], self.reached[bucket], prior)]

    def p_rank(self, bucket: int, n: int = MAX_BRANCH) -> list[float]:
        """P_0..P_{n-1}: the chance the target's token is a class-`bucket` node's r-th candidate (past the
        measured ranks, the last rank's acceptance)."""
        out, miss = [], 1.0
        rates = self.rates(bucket)
        for a in rates + rates[-1:] * (n - len(rates)):
            out.append(miss * a)
            miss *= 1.0 - a
        return out

    def mean_p_rank(self) -> list[float]:
        total = sum(self.seen)
        weights = [s / total for s in self.seen] if total > 0 else [0.0, 0.0, 0.0, 1.0, 0.0]
        ranks = [self.p_rank(b) for b in range(len(self.seen))]
        return [sum(w * p[r] for w, p in zip(weights, ranks)) for r in range(MAX_BRANCH)]


def static_tree(p: list[float], depth: int, nodes: int) -> tuple[list[float], list[tuple[int, ...]]]:
    """The best tree of at most `depth` levels at rank chances p (the same at every node), grown one node at a
    time by value: (value of the first n nodes for n = 1..nodes, widths of each)."""
    heap = [(-p[0], 1, 0, 1.0)]  # (-value, depth, rank, parent value)
    values, widths, total, count = [], [], 0.0, [0] * depth
    while heap and len(values) < nodes:
        v, k, r, up = heapq.heappop(heap)
        total -= v
        count[k - 1] += 1
        values.append(total)
        widths.append(tuple(c for c in count if c))
        if k < depth:
            heapq.heappush(heap, (v * p[0], k + 1, 0, -v))
        if r + 1 < len(p):
            heapq.heappush(heap, (-up * p[r + 1], k, r + 1, up))
    return values, widths


def expand_level(tree: DraftTree, level: list[int], want: int, acceptance: RankAcceptance,
                 eos: frozenset[int], mode_sample: bool, branching: int | None = None,
                 least: float = MIN_VALUE) -> list[int]:
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


def _value(node: TreeNode, rank: int, acceptance: RankAcceptance) -> float:
    return node.value * acceptance.p_rank(node.dist.bucket)[rank]


@dataclass
class TreeEstimates:
    """What every session of an edge shares for its trees: rank acceptance per class, the draft forward's cost
    against its width, the share of a tree that pre-drafting saved, and the value model's calibration."""

    acceptance: RankAcceptance = field(default_factory=RankAcceptance)
    level: EWLine = field(default_factory=lambda: EWLine(TIME_DECAY, 0.05))  # seconds per draft forward vs width
    width: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 1.0))       # columns of those forwards
    wait: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0, CLIP))  # waited per forward of a tree job
    saved: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0))       # levels a pre-draft drafted
    predicted: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0))   # sum of sent nodes' values
    realised: EWMean = field(default_factory=lambda: EWMean(TIME_DECAY, 0.0))    # accepted nodes
    verdicts: int = 0
    _chosen: dict = field(default_factory=dict)  # (objective, trees, depth, nodes) -> (shape, at verdict)

    def calibration(self) -> float:
        if self.predicted.count < 8 or self.predicted.value <= 0:
            return 1.0
        return min(2.0, max(0.25, self.realised.value / self.predicted.value))

    def observe_forward(self, width: int, seconds: float) -> None:
        self.level.observe(width, seconds)
        self.width.observe(width)

    def observe_wait(self, draft_s: float, forwards: int) -> None:
        """A round's session waited `draft_s` for a tree job of `forwards` forwards (queueing behind other work of
        the draft thread included: what the critical path pays, as docs/draftlen.md's t)."""
        if forwards > 0:
            self.wait.observe(draft_s / forwards)

    def shape(self, edge: EdgeEstimates, objective: Objective, trees: str, top: int,
              depth: int | None = None, nodes: int | None = None) -> TreeShape:
        """The edge's shape for its sessions, chosen again every RECHOOSE_EVERY verdicts, capped at `top` levels
        (tokens left - 1). depth / nodes: fixed by the caller (--draft-len, --tree-nodes), else chosen."""
        key = (objective, trees, depth, nodes)
        chosen = self._chosen.get(key)
        if chosen is None or self.verdicts - chosen[1] >= RECHOOSE_EVERY:
            chosen = self._chosen[key] = (self.best(edge, objective, trees, depth, nodes), self.verdicts)
        return cap(chosen[0], top)

    def node_cost(self, edge: EdgeEstimates) -> float:
        """Seconds one more node adds to a round: its share of the worker's forward (every row of the batch
        drafting like us: the mean field) and of the draft's forwards."""
        f1 = edge.forward.fit()[1] * max(1.0, edge.batch.value) if edge.forward.known else 0.0
        return f1 + (self.level.fit()[1] if self.level.known else 0.0)

    def best(self, edge: EdgeEstimates, objective: Objective, trees: str, depth: int | None,
             nodes: int | None) -> TreeShape:
        """The objective's shape over every candidate (docs/trees.md)."""
        p, c = self.acceptance.mean_p_rank(), self.calibration()
        rows = []  # (shape, E, T)
        for d in ([depth] if depth is not None else range(0 if trees == "auto" else 1, MAX_DEPTH + 1)):
            if d == 0:
                rows.append((TreeShape(), 1.0, self.round_time(edge, TreeShape())))
                continue
            values, widths = static_tree(p, d, min(MAX_DRAFT, nodes or MAX_DRAFT))
            for n in _budgets(d, len(values), nodes, trees):
                shape = TreeShape(widths[n - 1])
                rows.append((shape, 1.0 + c * values[n - 1], self.round_time(edge, shape)))
        best = max(rows, key=lambda r: r[1] / max(r[2], 1e-9))
        least = max(MIN_VALUE, self.node_cost(edge) * best[1] / max(best[2], 1e-9))  # a node pays at the best rate
        return replace(choose(rows, objective, edge), min_value=least)

    def round_time(self, edge: EdgeEstimates, shape: TreeShape) -> float:
        """T(S): the draft forwards on the critical path (those a pre-draft did not do: the measured levels
        saved, the shallowest first), the link and queue, the worker's forward."""
        t0, t1 = self.level.fit() if self.level.known else (1.0, 0.05)
        levels = [1] + [w for w in shape.widths[:-1]] if shape.depth else []  # the root's catch-up, then depth k
        base = self.wait.value if self.wait.count else t0 + t1 * self.width.value  # per forward, at the usual width
        rows = max(1, edge.sessions)  # mean field: every session of the batch drafts this shape
        left = levels[min(len(levels), round(self.saved.value)):]
        draft = sum(max(0.0, base + t1 * (rows * w - self.width.value)) for w in left)
        if not edge.forward.known:
            l0, l1 = edge.latency.fit() if edge.latency.known else (10.0, 0.2)
            return draft + l0 + l1 * (shape.nodes + 1)
        return draft + edge.link_rtt() + edge.queue.value + edge.forward_time(shape.nodes)


def _budgets(depth: int, most: int, nodes: int | None, trees: str) -> list[int]:
    """Node budgets tried at a depth: the chain (auto), then trees up to four nodes a level."""
    if nodes is not None:
        return [min(nodes, most)] if most >= depth else []
    tried = {depth + k for k in (1, 2, 4)} | {int(depth * f) for f in (1.5, 2, 3, 4)} | {most}
    out = sorted(n for n in tried if depth < n <= min(most, 4 * depth))
    return ([depth] if trees == "auto" and most >= depth else []) + out


def choose(rows: list[tuple[TreeShape, float, float]], objective: Objective, edge: EdgeEstimates) -> TreeShape:
    """speed: the fewest nodes within TIE of the best rate E / T; balanced: the most tokens per call within the
    objective's tolerance of it; cloud: the least cloud time per token within TIE, never fewer tokens per call
    than balanced. Ties go to fewer nodes, then to shallower trees."""
    rows = sorted(rows, key=lambda r: (r[0].nodes, r[0].depth))
    rates = [e / max(t, 1e-9) for _, e, t in rows]
    best = max(rates)
    if objective == Objective.SPEED:
        return next(s for (s, _, _), rate in zip(rows, rates) if rate >= (1 - TIE) * best)
    tol = tolerance(objective if objective != Objective.CLOUD else Objective.BALANCED, edge.busy.value)
    ok = [(s, e) for (s, e, _), rate in zip(rows, rates) if rate >= (1 - tol) * best]
    balanced = max(ok, key=lambda r: r[1])
    if objective != Objective.CLOUD:
        return balanced[0]
    costs = [(s, e, edge.row_share(s.nodes) / e) for s, e, _ in rows if e >= balanced[1]]
    least = min(c for _, _, c in costs)
    return next(s for s, _, c in costs if c <= (1 + TIE) * least)


def cap(shape: TreeShape, top: int) -> TreeShape:
    """At most `top` levels (a block past the tokens left is wasted)."""
    return shape if shape.depth <= top else replace(shape, widths=shape.widths[:max(0, top)])
