"""Pre-drafting: while a VERIFY is in flight, the edge drafts on past the block as if every draft token and the
draft's own guess for the bonus token were accepted. After the VERDICT, the part of that chain which continues
the committed tokens exactly becomes the start of the next block.

Exactness is unchanged: a draft token is a pure function of the draft context, its absolute position and the
session seed (common/rng.py), so a reused token is the very token a fresh draft would have produced. Reuse is
checked, not assumed: the committed tokens must equal the chain's prefix AND the draft context the edge now
derives from them must equal the context the chain was drafted from (with a cross-vocabulary draft the
re-tokenised text can differ; then nothing is reused).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ...common.protocol import Mode
from .drafter import DraftBlock
from ..trees.tree import expand_level


@dataclass
class DraftChain:
    """The drafted tokens from one absolute position on: the VERIFY's block, then the pre-drafted continuation."""

    start: int             # absolute position of block.ids[0]
    context: list[int]     # draft-vocabulary context block.ids[0] was drafted after
    block: DraftBlock      # the chain (target ids, with q' in sample mode)
    sent: int              # how many of the chain's tokens the VERIFY carried

    def extend(self, more: DraftBlock) -> None:
        self.block = self.block + more

    def guess(self, index: int) -> int | None:
        """The chain's token at `index` (index `sent` is the guess for the bonus token), if drafted."""
        return self.block.ids[index] if index < len(self.block.ids) else None

    def reusable(self, tokens: list[int], context: list[int], d: int,
                 context_after: Callable[[list[int]], list[int] | None]) -> DraftBlock:
        """Up to d chain tokens that continue `tokens` (committed target ids) drafted in `context` (their draft
        context now); an empty block when the chain went another way. `context_after(ids)`: the draft context
        the chain's continuation after its first tokens `ids` was drafted in (Drafter.extend_context)."""
        m = len(tokens) - self.start
        if d <= 0 or m < 0 or m >= len(self.block.ids) or tokens[self.start:] != self.block.ids[:m]:
            return DraftBlock()
        if context != context_after(self.block.ids[:m]):
            return DraftBlock()
        return self.block.part(m, m + d)


# ------------------------------------------------------------------------------------------- token trees

class OutcomePlan:
    """While a tree VERIFY is in flight: what each pre-draft chunk (one draft forward) feeds, likeliest verdict
    first. A verdict is a path (to node u) and the next token t; with A_r, P_r per confidence class
    (edge_worker/policy), P(u, t = u's r-th candidate) ~ value(u) * P_r(bucket(u)) for r past u's sent
    children (a leaf: r >= 0, once the leaf itself was fed). Each guess becomes an `outcome` node of the draft tree;
    under it the next tree grows, level by level with the next round's shape, each subtree on its own: a node's
    children never depend on another subtree's draws (sample mode's exactness, docs/policy.md)."""

    def __init__(self, sent: list[int], shape, chunks: int, width: int = 32) -> None:
        self.sent, self.shape, self.chunks, self.width = set(sent), shape, chunks, width
        self.outcomes: dict[int, int] = {}  # guess node -> its subtree's shallowest level not expanded yet
        self.waiting: dict[int, list[int]] = {}  # guess node -> the unfed nodes of that level

    def next(self, cursor) -> list[int]:
        """The nodes the next chunk feeds (new outcome nodes included); [] when nothing is worth it."""
        from ..trees.drafter import GUESSES, PREDRAFT_MIN

        tree, job = cursor.job.state.tree, cursor.job
        if tree is None or self.chunks <= 0:
            return []
        self.chunks -= 1
        self._expand_ready(cursor)
        items = []  # (prob, nodes to feed, guess to add: (parent, token) or None)
        for u in [-1, *self.sent]:
            node = tree.node(u)
            if node.dist is None:
                if not node.final and u != -1:
                    items.append((node.value, [u], None))  # a sent leaf: fed, its guesses come next chunk
                continue
            k = sum(1 for c in node.kids if c in self.sent)
            p = job.acceptance.p_rank(node.dist.bucket, k + GUESSES)
            for r in range(k, min(k + GUESSES, len(node.dist.ranked))):
                if tree.child_with(u, node.dist.ranked[r]) is None:
                    items.append((node.value * p[r], [], (u, node.dist.ranked[r])))
        for o, unfed in self.waiting.items():
            items.append((tree.nodes[o].prob * 0.9 ** self.outcomes[o], unfed, None))
        # per column fed: a guess saves its next tree's first forward for 1 column, a subtree's level one more
        # forward for all its nodes (a wide level after a likely guess must not crowd out the other guesses)
        items.sort(key=lambda i: -i[0] / max(1, len(i[1])))
        return self._pick(tree, items, cursor.drafter.eos_ids, self.width, PREDRAFT_MIN)

    def _pick(self, tree, items, eos, width: int, least: float) -> list[int]:
        out = []
        for prob, nodes, guess in items:
            if prob < least:
                continue
            if len(out) + max(1, len(nodes)) > width:
                continue
            if guess is not None:
                u, token = guess
                o = tree.add(u, token, 1.0, outcome=True, final=token in eos)  # the next tree's root: value 1
                tree.nodes[o].prob = prob
                nodes = [] if token in eos else [o]
                if token not in eos:
                    self.outcomes[o] = 0
            out += nodes
        return out

    def fed(self, cursor) -> None:
        self._expand_ready(cursor)

    def _expand_ready(self, cursor) -> None:
        """In every guess's subtree, expand the levels whose nodes are all fed (no forward needed), shallowest
        first, and note the unfed nodes of the first level that is not."""
        from ..trees.drafter import branching_left

        tree, job = cursor.job.state.tree, cursor.job
        sample, depth = job.mode == Mode.SAMPLE, self.shape.depth
        self.waiting = {}
        for o, j in list(self.outcomes.items()):
            if tree.nodes[o].dist is None:
                continue
            while j < depth:
                levels = tree.levels(j, start=o)
                if len(levels) <= j:
                    j = depth
                    break
                todo = [v for v in levels[j] if not tree.node(v).expanded]
                unfed = [v for v in todo if tree.node(v).dist is None]
                if unfed:
                    self.waiting[o] = unfed
                    break
                if todo:
                    below = sum(len(tree.kids(v)) for v in levels[j])
                    expand_level(tree, todo, self.shape.width(j + 1) - below, job.acceptance,
                                 cursor.drafter.eos_ids, sample, branching_left(tree, o, job.branching),
                                 self.shape.min_value)
                j += 1
            if j >= depth:
                del self.outcomes[o]
            else:
                self.outcomes[o] = j


class TreePreDraft:
    """A tree pre-draft in the batcher (the PreDraft interface): each chunk is one forward of `job`'s plan. It
    starts no chunk that would end past its time budget (the expected wait for the VERDICT, less a margin: the
    draft thread should be idle when it arrives); None = no budget (nothing timed yet)."""

    def __init__(self, job, budget_s: float | None = None) -> None:
        self.job = job
        self.block = None
        self.stopped = False
        self.running = None
        self.deadline = None if budget_s is None else time.perf_counter() + budget_s
        self.chunk_s = 0.0     # the last chunk's duration, queueing included
        self._started = 0.0

    @property
    def finished(self) -> bool:
        late = self.deadline is not None and time.perf_counter() + self.chunk_s > self.deadline
        return self.stopped or self.job.plan.chunks <= 0 or late

    def next_chunk(self, chunk: int):
        self._started = time.perf_counter()
        return self.job

    def absorb(self, block) -> None:
        self.block = block
        self.chunk_s = time.perf_counter() - self._started
        self.stopped = self.stopped or block.steps == 0  # nothing was worth a forward: it is over
