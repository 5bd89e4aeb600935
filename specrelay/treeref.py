"""The in-process token-tree reference: a small tree drafter and the loop that drives a `Verifier` with tree
VERIFYs by function calls, so that tree verification is shown exact apart from (and before) the edge's own tree
drafting. Tests and benchmarks use it; the wire contract it follows is docs/exactness.md's.

The drafter branches where the draft is unsure: at a node whose top draft probability is below `unsure` it takes
`branch` children, else one, level by level down to `depth`, at most `nodes` nodes. Children per mode (the edge's
obligations):
  greedy   the draft's top logits;
  coupled  the top of log q + g_t with the SHARED Gumbel noise of their position (the first is the draft's own
           coupled token);
  sample   drawn from q without replacement (common/tree.py `draw_children`), every branching node's q row sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cloud_worker.verifier import Verifier
from .common import protocol as P
from .common.packing import f32
from .common.protocol import Mode, Strategy
from .common.resample import Rejection
from .common.rng import gumbel
from .common.runner import ModelRunner
from .common.sampling import SamplingParams, probs_from_logits
from .common.tree import Tree, draw_children, encode_q_row


@dataclass(frozen=True)
class TreeShape:
    depth: int = 4        # the deepest node
    branch: int = 2       # children of a node where the draft is unsure
    nodes: int = 16       # node budget (<= protocol.MAX_DRAFT)
    unsure: float = 0.75  # branch where the draft's top probability is below this


@dataclass
class DraftTree:
    """tokens / parents as on the wire; q [n] each node's q at its parent; dists: node (-1 = root) -> the q
    row its children were drawn from ([V]; sent for branching nodes, kept for the edge's own rejection draws)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: list[float] = field(default_factory=list)
    dists: dict[int, torch.Tensor] = field(default_factory=dict)


class TreeDrafter:
    def __init__(self, runner: ModelRunner, vocab_size: int, shape: TreeShape = TreeShape()) -> None:
        self.runner, self.vocab_size, self.shape = runner, vocab_size, shape

    def _logits(self, context: list[int]) -> torch.Tensor:  # -> [V_target]
        """The draft's logits after `context`: a plain forward each (a reference: simple before fast)."""
        logits = self.runner.forward(context, self.runner.new_cache(), 0)[-1][: self.vocab_size]
        pad = self.vocab_size - logits.shape[0]
        return torch.cat([logits, logits.new_full((pad,), float("-inf"))]) if pad else logits

    def draft(self, context: list[int], mode: Mode, params: SamplingParams, seed: int) -> DraftTree:
        """A tree after `context`, level by level; node u's children stand at position len(context) + depth(u)."""
        tree, frontier = DraftTree(), [-1]
        for depth in range(self.shape.depth):
            below = []
            for node in frontier:
                room = self.shape.nodes - len(tree.tokens)
                if room <= 0:
                    break
                path = [tree.tokens[i] for i in Tree.parse(tree.tokens, tree.parents).path(node)]
                logits = self._logits(context + path)
                q = probs_from_logits(logits, params)  # [V]; greedy: the one-hot of the argmax
                tree.dists[node] = q
                sure = float((logits.softmax(-1) if params.greedy else q).max()) >= self.shape.unsure
                kids = self._children(logits, q, 1 if sure else self.shape.branch, mode, seed,
                                      len(context) + depth)[:room]
                for x in kids:
                    tree.tokens.append(x)
                    tree.parents.append(node)
                    tree.q.append(float(q[x]))
                    below.append(len(tree.tokens) - 1)
            frontier = below
        return tree

    @staticmethod
    def _children(logits: torch.Tensor, q: torch.Tensor, k: int, mode: Mode, seed: int, position: int) -> list[int]:
        if mode == Mode.GREEDY:
            return logits.topk(k).indices.tolist()
        if mode == Mode.SAMPLE:
            return draw_children(q, k, seed, position)
        keys = torch.where(q > 0, q.double().log() + gumbel(seed, position, q.shape[0]),
                           torch.tensor(float("-inf"), dtype=torch.float64))
        return keys.topk(min(k, int((q > 0).sum()))).indices.tolist()


def tree_request(session: int, seq: int, context: list[int], cloud_len: int, t: DraftTree, mode: Mode) -> P.Verify:
    """The tree VERIFY: q per node and the branching nodes' q rows in sample mode only."""
    req = P.Verify(session, seq, len(context), context[cloud_len:], list(t.tokens), parents=list(t.parents))
    if mode == Mode.SAMPLE and t.tokens:
        req.q = f32(t.q)
        req.q_rows = [encode_q_row(t.dists[u]) for u in Tree.parse(t.tokens, t.parents).branching()]
    return req


def tree_generate(drafter: TreeDrafter, verifier: Verifier, prompt: list[int], max_new_tokens: int,
                  params: SamplingParams = SamplingParams(), mode: Mode = Mode.GREEDY, seed: int = 0,
                  resample: Strategy = Strategy.FULL, key: P.SessionKey = (b"ref", 1)) -> tuple[list[int], dict]:
    """Generate with token trees through `verifier` in-process. Returns (generated target ids, stats)."""
    sid = key[1]
    verifier.open(key, P.Open(sid, list(prompt), mode, params.temperature, params.top_k, params.top_p, seed, resample))
    context, cloud_len, out, seq = list(prompt), len(prompt), [], 0
    stats = {"cloud_calls": 0, "nodes": 0, "accepted": 0, "uplink_bytes": 0, "downlink_bytes": 0}
    while len(out) < max_new_tokens:
        seq += 1
        t = drafter.draft(context, mode, params, seed)
        req = tree_request(sid, seq, context, cloud_len, t, mode)
        verdict = verifier.verify([(key, req)])[0]
        if not isinstance(verdict, P.Verdict):
            raise RuntimeError(f"the verifier refused a tree: {verdict.message}")
        path = Tree.parse(t.tokens, t.parents).path(verdict.node) if t.tokens else []
        assert len(path) == verdict.n_accepted, (path, verdict)
        new, token = [t.tokens[i] for i in path], verdict.next_token
        stats = _count(stats, req, verdict, len(t.tokens), len(new))
        cloud_len = len(context) + len(new) + (token >= 0)
        if token < 0:  # a one-child node's sampled rejection: the edge finishes the draw with that node's q
            rejection = Rejection(t.dists[verdict.node], None, seed, len(context) + len(new), seq, sid, resample)
            reply: P.Verdict | P.Resampled = verdict
            while not isinstance(token := rejection.step(reply), int):
                reply = verifier.resample(key, token)
        for x in new + [token]:
            context.append(x)
            out.append(x)
            if x in verifier.runner.eos_ids or len(out) == max_new_tokens:
                verifier.close(key)
                return out, stats
    verifier.close(key)
    return out, stats


def _count(stats: dict, req: P.Verify, verdict: P.Verdict, nodes: int, accepted: int) -> dict:
    stats["cloud_calls"] += 1
    stats["nodes"] += nodes
    stats["accepted"] += accepted
    stats["uplink_bytes"] += sum(map(len, P.encode(req)))
    stats["downlink_bytes"] += sum(map(len, P.encode(verdict)))
    return stats
