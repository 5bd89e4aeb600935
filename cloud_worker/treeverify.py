"""The cloud's side of a token-tree VERIFY, pure: check the tree against the session (common/tree.py), then decide
it with the mode's tree rule (common/verify.py) and the counter-based draws of its positions (common/rng.py).

Draws: the decision made at node u is about absolute position t = pos + depth(u), so it uses the draws a chain
uses at t: GUMBEL (coupled), ACCEPT with the child's index among its siblings (index 0 is the chain's draw),
RESIDUAL (a branching node whose children were all rejected: the cloud draws the recovered token, it holds the
node's q row) and BONUS (a leaf). Only one node per depth is ever decided, so sharing a depth's draws is exact.
"""

from __future__ import annotations

import torch

from ..common import resample, verify
from ..common.errors import ChainsOnly
from ..common.protocol import Mode, Verify
from ..common.rng import Purpose, gumbel, uniform
from ..common.sampling import probs_from_logits
from ..common.tree import TreeDraft, from_verify


def admit(req: Verify, mode: Mode, vocab_size: int, room: int, trees: bool) -> TreeDraft | None:
    """The request's tree, checked and pruned to the `room` positions left in the model's context (None: a
    chain). trees: this worker verifies trees (its forward is the packed one over the KV store). Raises
    ChainsOnly for a tree it cannot verify, InvalidRequest (from_verify) for a malformed one, naming the field."""
    if not (req.parents or req.q_rows):
        return None
    if not trees:
        raise ChainsOnly("this worker serves its model through the model's own cache (no AttentionInterface) "
                         "and verifies chains only: send parents = []", field="parents")
    draft = from_verify(req, vocab_size, mode == Mode.SAMPLE)
    return draft.pruned(room)


def decide(session, seq: int, pos: int, draft: TreeDraft, q: torch.Tensor | None,
           logits: torch.Tensor) -> tuple[verify.TreeOutcome, resample.Pending | None]:
    """logits [n+1, V]: row 0 after the last committed token, row i+1 after node i; q [n] (sample mode) q(x) of
    each node. The outcome, and the pending rejection a one-child node's sampled rejection leaves the edge."""
    tree, s = draft.tree, session
    depths = range(tree.max_depth + 1)
    if s.mode == Mode.GREEDY:
        return verify.greedy_tree(tree, logits), None
    if s.mode == Mode.COUPLED:
        logp = probs_from_logits(logits, s.params).log()  # [n+1, V]
        noise = torch.stack([gumbel(s.seed, pos + k, logits.shape[-1]) for k in depths])  # [D+1, V]
        return verify.coupled_tree(tree, logp, noise), None
    p = probs_from_logits(logits, s.params)  # [n+1, V]
    u_accept = torch.tensor([[uniform(s.seed, pos + k, Purpose.ACCEPT, i) for i in range(tree.max_children)]
                             for k in depths], dtype=torch.float64)  # [D+1, K]
    u_residual = torch.tensor([uniform(s.seed, pos + k, Purpose.RESIDUAL) for k in depths], dtype=torch.float64)
    u_bonus = torch.tensor([uniform(s.seed, pos + k, Purpose.BONUS) for k in depths], dtype=torch.float64)
    out = verify.sampled_tree(tree, p, q, draft.rows, u_accept, u_residual, u_bonus)
    if out.token is not None:
        return out, None
    child = tree.children_of(out.node)[0]
    return out, resample.Pending(seq, pos + out.n_accepted, p[out.node + 1], tree.tokens[child])
