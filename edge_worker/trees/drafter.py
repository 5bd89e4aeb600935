"""Drafting token trees for many sessions at once: ONE batched draft forward per depth level, not one per branch.

A tree job grows its session's draft tree (edge_worker/trees/tree.py) level by level to its shape
(edge_worker/trees/tree.py, chosen by edge_worker/policy): at each step every session still drafting feeds the nodes of its next level (the
draft model with a tree attention mask over its K/V, edge_worker/draft/kv.py `trees=True`), then each fed node's
children are chosen from what the draft says after it (`node_dist`), in the mode's way:
  greedy   the draft's likeliest tokens;
  coupled  the top of log q + g_t with the SHARED Gumbel noise of their position (the first is the chain's token);
  sample   drawn from q without replacement (common/tree.py `draw_children`; the node's q row travels).
Nodes a pre-draft already drafted are kept: the job only drafts what is missing. The nodes' K/V stay beside the
history until a verdict commits a path (DraftState.sync -> trees.tree.adopt).

A pre-draft job (`OutcomePlan`) runs while the VERIFY is in flight, one forward per chunk: it feeds the tree's
leaves and guesses of the verdict's next token (`outcome` nodes), likeliest first, and grows the next tree under
each guess; when the verdict matches one, the next block starts from it.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass, field

import torch

from ...common.protocol import MAX_DRAFT, Mode
from ...common.rng import Purpose, gumbel
from ...common.sampling import SamplingParams, probs_from_logits
from ...common.tree import draw_children
from ..draft.kv import LockstepKV, TreeFeed, Workspace
from .tree import BUCKETS, CANDIDATES, ROOT, DraftTree, NodeDist, TreeShape, bucket_of, expand_level
from ..policy import RankAcceptance

PREDRAFT_WIDTH = 64     # columns one pre-draft chunk feeds per session at most (a chunk delays a real draft)
PREDRAFT_COLUMNS = 128  # ... and all sessions of an edge together (each gets its share, at least 4)
PREDRAFT_MIN = 0.0003   # a guess of the verdict less likely than this is not pre-drafted
GUESSES = 6             # guesses of the next token per node (after its children)


@dataclass
class TreeJob:
    """Grow `state`'s draft tree after `context` (committed target ids) to `shape`; `plan`: a pre-draft chunk."""

    state: object          # drafter.DraftState
    context: list[int]
    shape: TreeShape
    mode: Mode
    params: SamplingParams
    seed: int
    acceptance: RankAcceptance
    plan: "OutcomePlan | None" = None
    branching: int | None = None  # sample mode: nodes with two or more children a VERIFY can carry

    @property
    def d(self) -> int:  # the batcher's "anything to draft?"
        return max(1, self.shape.depth)

    @property
    def position(self) -> int:
        return len(self.context)


@dataclass
class TreeBlock:
    """What a tree job hands back: the VERIFY's nodes in wire order (target ids), their parents by index, their
    node ids, q'(x) per node (sample mode), and what it cost."""

    ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    q_tok: list[float] = field(default_factory=list)
    steps: int = 0                 # draft forwards the session waited for
    reused: int = 0                # nodes drafted before this job (pre-drafted)
    forwards: list[tuple[int, float]] = field(default_factory=list)  # (columns fed, seconds) per forward


def node_dist(drafter, logits: torch.Tensor, mode: Mode, params: SamplingParams, seed: int, position: int,
              noise: dict) -> NodeDist:  # logits: [V_draft]
    """The draft after a node, for its children at absolute `position` (noise: the batch's Gumbel cache)."""
    if mode == Mode.GREEDY:
        q = drafter.to_target(torch.softmax(logits, -1))
        return NodeDist(q.topk(CANDIDATES).indices.tolist(), bucket_of(q))
    q = drafter.to_target(probs_from_logits(logits, params))  # [V_target] q'
    if mode == Mode.SAMPLE:
        return NodeDist(draw_children(q, CANDIDATES, seed, position), bucket_of(q), q)
    g = _noise(noise, seed, position, q.shape[0])
    keys = torch.where(q > 0, q.double().log() + g, torch.tensor(float("-inf"), dtype=torch.float64))
    return NodeDist(keys.topk(min(CANDIDATES, int((q > 0).sum()))).indices.tolist(), bucket_of(q))


def node_dists(drafter, logits: torch.Tensor, mode: Mode, params: SamplingParams, seed: int, positions: list[int],
               noise: dict) -> list[NodeDist]:  # logits: [n, V_draft]
    """`node_dist` of n nodes at once (greedy and coupled in one top-k; sample mode draws each node's children
    with common/tree.py's own function)."""
    if mode == Mode.SAMPLE or logits.shape[-1] != drafter.target_vocab_size:
        return [node_dist(drafter, row, mode, params, seed, pos, noise) for row, pos in zip(logits, positions)]
    if mode == Mode.GREEDY:
        top = torch.softmax(logits, -1).topk(CANDIDATES, dim=-1)  # [n, K]
        return [NodeDist(ids, _bucket(v)) for ids, v in zip(top.indices.tolist(), top.values)]
    q = probs_from_logits(logits, params)  # [n, V]
    g = torch.stack([_noise(noise, seed, pos, q.shape[-1]) for pos in positions])  # [n, V]
    keys = torch.where(q > 0, q.double().log() + g, torch.tensor(float("-inf"), dtype=torch.float64))
    support = (q > 0).sum(-1).tolist()
    ranked = keys.topk(min(CANDIDATES, max(support)), dim=-1).indices.tolist()
    top2 = q.topk(2, dim=-1).values
    return [NodeDist(r[:min(CANDIDATES, k)], _bucket(v)) for r, k, v in zip(ranked, support, top2)]


def _bucket(top: torch.Tensor) -> int:  # top: [>= 2] the two likeliest probabilities first
    return bisect_right(BUCKETS, float(top[0]) / max(float(top[1]), 1e-30))


def _noise(noise: dict, seed: int, position: int, vocab: int) -> torch.Tensor:
    g = noise.get(position)
    if g is None:
        g = noise[position] = gumbel(seed, position, vocab, Purpose.GUMBEL)
    return g


class Cursor:
    """One job in a tree batch: what it feeds at each step, and what it does with the logits."""

    def __init__(self, drafter, job: TreeJob) -> None:
        self.drafter, self.job = drafter, job
        self.noise: dict = {}  # position -> the shared Gumbel noise there (coupled)
        state, context = job.state, job.context
        state.sync(context)  # a verdict's path joins the history; the subtree after it stays (trees.tree.adopt)
        self.history: list[int] = []
        if job.plan is not None and (state.tree is None or state.tree.root_len != len(context)):
            job.plan.chunks = 0  # the tree it was to grow is gone (a failed batch reset the state): nothing to do
        elif state.tree is None or state.tree.root_len != len(context):
            state.tree = None
            state.kv.nodes.clear()
            if len(state.ids) == len(context) and state.last_logits is not None:
                state.tree = DraftTree(len(context), self.dist(state.last_logits, len(context)))
            else:
                if len(state.ids) == len(context):  # logits lost to a rollback: re-run the last id
                    state.sync(context[:-1])
                self.history = context[len(state.ids):]
        tree = state.tree
        self.reused = 0 if tree is None else sum(not n.outcome for n in tree.nodes.values())
        self.fed: list[int] = []
        self.gathered = False
        self.steps = 0

    def dist(self, logits: torch.Tensor, position: int) -> NodeDist:
        j = self.job
        return node_dist(self.drafter, logits, j.mode, j.params, j.seed, position, self.noise)

    def next_feed(self) -> tuple[list[int], TreeFeed | None] | None:
        """The tokens this job feeds at the next step (with their TreeFeed, None for history), or None: done."""
        if self.history:
            tokens, self.history = self.history, []
            self.fed = []
            return tokens, None
        tree = self.job.state.tree
        if self.job.plan is not None and self.steps:  # a pre-draft chunk is one forward
            return None
        self.fed = self.job.plan.next(self) if self.job.plan is not None else self._grow(tree)
        if not self.fed:
            return None
        refs = [(u, None if tree.nodes[u].parent == ROOT else tree.nodes[u].parent, tree.position(u))
                for u in self.fed]
        gather = []
        if not self.gathered:  # nodes fed before (their K/V in the session's NodeKV) that this batch's attend to
            kept = self.job.state.kv.nodes
            gather = [(u, None if tree.nodes[u].parent == ROOT else tree.nodes[u].parent, tree.position(u))
                      for u in self._gathered(tree) if u in kept]
        self.gathered = True
        return [tree.nodes[u].token for u in self.fed], TreeFeed(refs, gather)

    def _gathered(self, tree: DraftTree) -> list[int]:
        """The fed nodes this batch's new nodes may descend from, parents first: a pre-draft chunk's (one forward)
        ancestors; a tree job's whole tree above its depth (its later levels hang from any of them)."""
        if self.job.plan is None:
            return [u for level in tree.levels(self.job.shape.depth - 1)[1:] for u in level
                    if tree.nodes[u].dist is not None]
        need: set[int] = set()
        for u in self.fed:
            up = tree.nodes[u].parent
            while up != ROOT and up not in need:
                need.add(up)
                up = tree.nodes[up].parent
        return sorted(need, key=lambda u: tree.nodes[u].depth)

    def take(self, logits: torch.Tensor) -> None:  # logits: [fed, V_draft]
        """The draft's logits after each token fed at this step."""
        self.steps += 1
        state, tree = self.job.state, self.job.state.tree
        if not self.fed:  # the history caught up: the tree starts after it
            state.ids, state.last_logits = list(self.job.context), logits[-1]
            state.tree = DraftTree(len(self.job.context), self.dist(logits[-1], len(self.job.context)))
            return
        j = self.job
        positions = [tree.position(u) + 1 for u in self.fed]
        for u, dist in zip(self.fed, node_dists(self.drafter, logits, j.mode, j.params, j.seed, positions,
                                                self.noise)):
            tree.nodes[u].dist = dist
        if self.job.plan is not None:
            self.job.plan.fed(self)

    def _grow(self, tree: DraftTree) -> list[int]:
        """Expand levels whose nodes are all fed (no forward), until a level needs feeding: its nodes."""
        shape, eos = self.job.shape, self.drafter.eos_ids
        sample = self.job.mode == Mode.SAMPLE
        for k in range(shape.depth):
            levels = tree.levels(k)  # depths 0..k, as expanded so far
            if len(levels) <= k:
                return []
            level = levels[k]
            todo = [u for u in level if not tree.node(u).expanded]
            if not todo:
                continue
            unfed = [u for u in todo if tree.node(u).dist is None]
            if unfed:
                return unfed
            below = sum(len(tree.kids(u)) for u in level)
            expand_level(tree, todo, shape.width(k + 1) - below, self.job.acceptance, eos, sample,
                         branching_left(tree, ROOT, self.job.branching), shape.min_value)
        return []

    def block(self) -> TreeBlock:
        if self.job.plan is not None:
            return TreeBlock(steps=self.steps)
        tree, depth = self.job.state.tree, self.job.shape.depth
        order = tree.sent_order(depth, min(self.job.shape.nodes, MAX_DRAFT))
        ids, parents = tree.wire(order)
        q = [tree.nodes[u].q for u in order] if self.job.mode == Mode.SAMPLE else []
        return TreeBlock(ids, parents, order, q, self.steps, min(self.reused, len(order)))


def branching_left(tree: DraftTree, start: int, most: int | None) -> int | None:
    """How many more nodes under `start` may get a second child (None: no limit)."""
    if most is None:
        return None
    under = [start] + [u for level in tree.levels(64, start)[1:] for u in level]
    return max(0, most - sum(len(tree.kids(u)) >= 2 for u in under))


def draft_trees(drafter, jobs: list[TreeJob], workspace: Workspace, ready=None) -> list[TreeBlock]:
    """Every job in lockstep: at each step ONE forward over the jobs still drafting (history catch-up or a tree
    level, each row its own); a job that is done leaves the batch and `ready(index, block)` hands its block over
    at once. A failure resets the jobs' states (their K/V may be half in the batch)."""
    batch = LockstepKV(drafter.runner, workspace, trees=True)
    blocks: list[TreeBlock | None] = [None] * len(jobs)
    timings: list[tuple[int, float]] = []

    def done(i: int, cursor: Cursor) -> None:
        blocks[i] = cursor.block()
        blocks[i].forwards = timings[:cursor.steps]
        if ready is not None:
            ready(i, blocks[i])

    try:
        cursors = [Cursor(drafter, job) for job in jobs]
        live = list(range(len(jobs)))
        while live:
            feeds = {}
            for i in live:
                feed = cursors[i].next_feed()
                if feed is None:
                    done(i, cursors[i])
                else:
                    feeds[i] = feed
            live = list(feeds)
            if not live:
                break
            states = [jobs[i].state for i in live]
            room = max(jobs[i].shape.nodes for i in live) + 1
            t0 = time.perf_counter()
            logits = batch.feed(live, [s.kv for s in states], [len(s.ids) for s in states],
                                [feeds[i][0] for i in live], room, [feeds[i][1] for i in live])
            timings.append((sum(len(feeds[i][0]) for i in live), time.perf_counter() - t0))
            for row, i in enumerate(live):
                cursors[i].take(logits[row, :len(feeds[i][0])])
        batch.close()
    except BaseException:
        for job in jobs:
            job.state.reset()
        raise
    return blocks
