"""A session's token-tree rounds (edge_worker/session.py hands them here while trees are on): the shape of the next
tree, the VERIFY that carries it, the pre-draft of the likely verdicts while it is in flight, and what a VERDICT
commits. The wire contract is common/tree.py's (docs/exactness.md "Token trees").

A tree that came out a path (every level one node) travels as a chain (parents = []): byte for byte a chain's
VERIFY, answered by a chain's VERDICT. A worker that predates trees answers a tree without `node`, and one that
verifies chains only (Falcon, Bloom: the model's own cache) refuses it: either way the session re-OPENs and drafts
chains from then on (`TreesRefused`). A retried round (re-OPEN after a failure) sends the very tree it sent
before: its levels are drafted already, so the job only rebuilds the wire form.
"""

from __future__ import annotations

from ...common import protocol as P
from ...common.errors import InternalError, InvalidRequest
from ...common.packing import f32
from ...common.protocol import Mode
from ...common.resample import Rejection
from ...common.tree import Tree, encode_q_row
from ..draft.drafter import DraftBlock, DraftJob
from .tree import ROOT, TreeShape
from ..draft.predraft import OutcomePlan, TreePreDraft
from ..policy import PREDRAFT_SHARE, EdgeEstimates
from .drafter import PREDRAFT_COLUMNS, PREDRAFT_WIDTH, TreeBlock, TreeJob

MAX_FRAME_ROWS = 6 << 20  # bytes of q rows one VERIFY may carry (common/protocol.py MAX_FRAME is 8 MiB)


class TreesRefused(InternalError):
    """The worker cannot verify trees (it predates them, or serves its model through the model's own cache):
    retried by re-OPENing, and the session drafts chains from then on."""


class TreeRounds:
    def __init__(self, session, trees: str, nodes: int | None) -> None:
        self.s, self.trees, self.nodes = session, trees, nodes
        self.block: TreeBlock | None = None   # the tree in flight
        self.tree = None                      # its DraftTree (state.tree when sent)
        self.shape: TreeShape | None = None
        self.chain = False                    # it travelled as a chain
        self.root_len = 0
        self.chains_only = False
        self.last_steps = 0                   # forwards the last tree job ran (0: not a tree round)
        self.last_tree = False                # the last round drafted a tree (its pre-draft grew the next one)
        self.planned: tuple[int, TreeShape | None] | None = None  # (seq, shape): the next round's, weighed in flight

    @property
    def on(self) -> bool:
        return self.trees != "off" and getattr(self.s.drafter, "trees", False) and not self.chains_only

    def edge(self) -> EdgeEstimates:
        return self.s.policy.edge

    def next_shape(self, remaining: int, after_tree: bool = True, opening: bool = False) -> TreeShape | None:
        """The policy's tree (None: with `auto`, a chain pays more); `after_tree`: the round follows a tree round,
        whose pre-draft grew this one (after a chain round a tree's levels are all drafted fresh); `opening`: the
        block right after the prompt (priced with the draft's catch-up on the tokens it has not seen)."""
        s = self.s
        return s.policy.shape(remaining, self.trees, s.config.draft_len, self.nodes, after_tree, opening,
                              stretch=len(s.tokens) - s._seen)

    def job(self) -> TreeJob | DraftJob | None:
        """The next tree job; with `auto`, None when the shape policy finds no tree that pays (the session drafts
        its chain as with trees off: chains lose nothing to the tree engine); with `on`, a chain job drafting
        nothing when no draft pays at all."""
        s, c = self.s, self.s.config
        retry = self.block is not None and self.root_len == len(s.tokens)
        remaining, (seq, planned) = c.max_new_tokens - len(s.generated), self.planned or (None, None)
        self.planned = None
        if retry:
            shape = self.shape
        elif seq == s.seq and s.prefill_due == 0 and (planned is None or planned.depth < remaining):
            shape = planned  # weighed while the round before was in flight (plan, predraft_job)
        else:
            shape = self.next_shape(remaining, self.last_tree, opening=s.prefill_due > 0)
        if shape is None or (not retry and self.trees == "auto" and shape.is_chain):
            return None
        if shape.depth == 0:
            s._job = DraftJob(s.state, list(s.tokens), len(s.tokens), 0, s.mode, c.params, c.seed)
            return s._job
        self.shape, s._job, s._seen = shape, None, len(s.tokens)  # the tree job catches the draft up
        return TreeJob(s.state, list(s.tokens), shape, s.mode, c.params, c.seed, self.edge().ranks,
                       branching=self._rows_left())

    def plan(self, remaining: int) -> None:
        """While a chain round is in flight (`auto`): weigh the next round's tree now, at the estimates before its
        VERDICT, `remaining` tokens left if the whole chain is accepted; `job` takes it. Its 0.3-0.5 ms (one session,
        loopback) then is not on the critical path between a VERDICT and the next VERIFY (docs/policy.md)."""
        s = self.s
        if self.trees == "auto" and self.on and remaining > 1 and not (s._prefilled or s.policy.second):
            self.planned = s.seq, self.next_shape(remaining, after_tree=False)

    def _rows_left(self) -> int | None:
        """Sample mode: branching nodes a VERIFY can carry (a dense q row is 4 bytes per target id)."""
        if self.s.mode != Mode.SAMPLE:
            return None
        return min(P.MAX_DRAFT // 2, MAX_FRAME_ROWS // (4 * self.s.drafter.target_vocab_size))

    def request(self, block: TreeBlock) -> P.Verify:
        s = self.s
        self.block, self.tree, self.root_len = block, s.state.tree, len(s.tokens)
        grown, self.last_steps, self.last_tree = self.last_tree, block.steps, True
        self.chain = all(p == i - 1 for i, p in enumerate(block.parents))
        s._block, s._chain, s._reused = DraftBlock(list(block.ids)), None, DraftBlock()
        s._width = len(s.tokens) - s.cloud_len + len(block.ids) + 1
        s._prefilled = s.prefill_due > 0
        s.seq += 1
        st = s.stats
        st.draft_tokens += len(block.ids)
        st.tree_rounds += not self.chain
        st.tree_nodes += len(block.ids)
        st.predraft_tokens += block.reused
        st.predraft_rounds += s._hit(block.reused)
        for width, seconds in block.forwards:
            self.edge().draft.observe(width, seconds)  # one draft forward of a tree job
        if self.shape.depth and grown:  # after a chain round nothing grew it: a switch's cost, not steady state
            self.edge().tree_saved.observe(max(0, self.shape.depth - block.steps))
        sample = s.mode == Mode.SAMPLE
        req = P.Verify(s.sid, s.seq, len(s.tokens), s.tokens[s.cloud_len:], list(block.ids),
                       f32(block.q_tok) if sample else b"")
        if not self.chain:
            req.parents = list(block.parents)
            if sample:
                req.q_rows = [encode_q_row(self.tree.node(ROOT if i < 0 else block.nodes[i]).dist.q)
                              for i in Tree.parse(block.ids, block.parents).branching()]
        return req

    def refused(self) -> None:
        """This worker verifies chains only: chains from now on."""
        self.chains_only, self.block = True, None

    # ------------------------------------------------------------------------------------ the verdict
    def apply(self, v: P.Verdict) -> list[int]:
        s, block, tree = self.s, self.block, self.tree
        n = v.n_accepted
        if self.chain:
            if n > len(block.ids) or v.node is not None:
                raise InvalidRequest(f"n_accepted {n} exceeds the draft length {len(block.ids)}", field="n_accepted")
            path = block.nodes[:n]
        elif v.node is None:
            self.refused()
            raise TreesRefused(f"the worker answered session {s.sid}'s tree as a chain (it predates token trees): "
                               "re-OPEN and send chains")
        else:
            if not -1 <= v.node < len(block.nodes):
                raise InvalidRequest(f"node {v.node} is not one of the tree's {len(block.nodes)} nodes", field="node")
            path = tree.path(block.nodes[v.node]) if v.node >= 0 else []
            if len(path) != n:
                raise InvalidRequest(f"node {v.node} is at depth {len(path)}, n_accepted is {n}", field="n_accepted")
        self.block = None
        self._count(block, tree, path)
        s._hint, s.prefill_due = v.load, 0
        start = len(s.generated)
        s._commit([tree.nodes[u].token for u in path])
        if v.next_token >= 0:
            s._commit([v.next_token])
            s.cloud_len = len(s.tokens) if not s.done else s.cloud_len
        elif not s.done:  # a one-child node's sampled rejection: the edge, holding its q', finishes the draw
            s.cloud_len = len(s.tokens)
            q = tree.node(path[-1] if path else ROOT).dist.q
            s._rejection = Rejection(q, s.drafter.shared_mask, s.config.seed, len(s.tokens), v.seq, s.sid,
                                     s.config.resample)
            s._resolve(s._rejection.step(v))
        return s.generated[start:]

    def _count(self, block: TreeBlock, tree, path: list[int]) -> None:
        """Stats per depth (a depth counts as tested when the walk reached a node with children there), and the
        rank acceptance of every node the walk reached."""
        st, n = self.s.stats, len(path)
        sent = set(block.nodes)
        walk = [ROOT] + path
        kids = [[c for c in tree.node(w).kids if c in sent] for w in walk]
        st.cloud_calls += 1
        st.accepted_tokens += n
        st.record_tree(self.shape.depth if self.shape else 0, n, n + 1 if kids[-1] else n)
        acc = self.edge().ranks
        acc.decay()
        for i, (w, sent_kids) in enumerate(zip(walk, kids)):
            dist = tree.node(w).dist
            if sent_kids and dist is not None:
                acc.observe(dist.bucket, len(sent_kids), sent_kids.index(walk[i + 1]) if i + 1 < len(walk) else None)
        spine = _spine(tree, sent)
        same = next((k for k, (u, p) in enumerate(zip(spine, path)) if u != p), min(len(spine), n))
        self.s.policy.observe_block(len(spine), same, opening=self.s._prefilled, tree=not self.chain)

    # ------------------------------------------------------------------------------------ pre-drafting
    def predraft_job(self) -> TreePreDraft | None:
        """While the tree is in flight: guesses of its verdict and the next tree under each (OutcomePlan)."""
        s, block = self.s, self.block
        if block is None or s.done or s._pending is not None or self.tree is not s.state.tree:
            return None
        remaining = s.config.max_new_tokens - len(s.generated) - 1
        shape = self.next_shape(remaining)
        self.planned = (s.seq, shape) if not s._prefilled else None  # job takes it if the verdict leaves room
        if shape is None or shape.depth == 0 or remaining <= 1:
            return None
        chunks = self._chunks(shape)
        if chunks <= 0:
            return None
        c = s.config
        width = max(4, min(PREDRAFT_WIDTH, PREDRAFT_COLUMNS // max(1, round(self.edge().rows.value))))  # a batch's
        plan = OutcomePlan(block.nodes, shape, chunks, width)                                      # sessions share a chunk's forward
        wait = self._wait()
        return TreePreDraft(TreeJob(s.state, list(s.tokens), self.shape, s.mode, c.params, c.seed,
                                    self.edge().ranks, plan, self._rows_left()),
                            None if wait is None else PREDRAFT_SHARE * wait)

    def _wait(self) -> float | None:
        """The expected seconds from sending the tree to its VERDICT (None: nothing measured yet)."""
        edge = self.edge()
        return edge.wait(len(self.block.ids)) if edge.cloud.known or edge.latency.known else None

    def _chunks(self, shape: TreeShape) -> int:
        """Forwards worth pre-drafting: the guesses, then the next tree's levels (the time budget may stop it
        sooner); none when not even one chunk fits PREDRAFT_SHARE of the expected wait."""
        wait = self._wait()
        if wait is not None and self.edge().draft.known:
            if PREDRAFT_SHARE * wait < self.edge().step(PREDRAFT_WIDTH / 2):
                return 0
        return shape.depth + 1


def _spine(tree, sent: set[int]) -> list[int]:
    """The sent tree's first-ranked path from the root: the chain the draft drafts alone (each node's first child
    is its likeliest candidate), so a tree round is an acceptance sample of chains: its first `same` tokens were
    accepted, then the chain's next one rejected (the positions' rates price chains and scale trees' E)."""
    out, at = [], ROOT
    while (kid := next((c for c in tree.node(at).kids if c in sent), None)) is not None:
        out.append(kid)
        at = kid
    return out
