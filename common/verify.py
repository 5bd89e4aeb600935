"""The acceptance rule, one pure function per mode (Leviathan et al. 2023; Chen et al. 2023; Daliri et al. 2024).

Vocabulary used everywhere in specrelay:
  p           target (cloud) distribution, q draft (edge) distribution, both from `probs_from_logits`
              (q' when the draft has another vocabulary: q restricted to the shared vocabulary V_c).
  draft       x_1..x_d proposed by the edge; the target scores d+1 positions in one forward pass.
  accepted    the longest prefix of the draft that passes the test (n_accepted = its length, 0..d).
  recovered   the replacement token at the first rejection (greedy: target argmax; sampled: drawn
              from norm(max(0, p - q)), resolved with the edge by common/resample.py; coupled: argmax(log p + g)).
  bonus       the extra target token after a fully accepted block (position d+1).
A step always commits n_accepted + 1 tokens: the accepted prefix and one recovered-or-bonus token.
Randomness comes in as arguments (drawn by common/rng.py from seed, position and purpose), so every rule is pure.

Token trees (common/tree.py): the same three modes walk from the root, following at each node the child the rule
accepts; the accepted path is the deepest node reached (`TreeOutcome.node`), n_accepted its depth. Row u + 1 of a
tree's logits / p is the target's distribution after node u (row 0: after the last committed token); draws are
indexed by depth (the decision at node u is about absolute position pos + depth(u)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .rng import sample_index
from .tree import Tree


class Outcome(NamedTuple):
    n_accepted: int
    token: int | None  # recovered or bonus token; None: a sampled rejection the edge resolves (common/resample.py)


def _first_false(ok: torch.Tensor) -> int:  # ok: [d] bool
    bad = (~ok).nonzero()
    return int(bad[0]) if len(bad) else ok.shape[0]


def greedy(draft: torch.Tensor, logits: torch.Tensor) -> Outcome:
    """draft [d] ids; logits [d+1, V] target logits. Accept while draft == target argmax (first index on ties);
    the target's argmax at the first mismatch (or at d+1) is the recovered (or bonus) token."""
    target_ids = logits.argmax(-1)  # [d+1]
    n = _first_false(draft == target_ids[: draft.shape[0]])
    return Outcome(n, int(target_ids[n]))


def coupled(draft: torch.Tensor, logp: torch.Tensor, noise: torch.Tensor) -> Outcome:
    """Gumbel coupling. draft [d]; logp [d+1, V] log p; noise [d+1, V] the shared g_t(x).

    The target's token at each position is argmax(log p + g), an exact sample of p; accept while equal.
    """
    return greedy(draft, logp.double() + noise)


def accept_prefix(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> int:
    """p_draft, q_draft [d]: p(x_i), q(x_i) of the drafted tokens; u [d] uniforms.

    Accept x_i with probability min(1, p/q), i.e. while u_i * q_i < p_i (q >= p rejects sometimes, q < p never).
    """
    ok = u.double() * q_draft.double() < p_draft.double()
    return _first_false(ok)


def sampled(draft: torch.Tensor, p: torch.Tensor, q_draft: torch.Tensor, u_accept: torch.Tensor,
            u_bonus: float) -> Outcome:
    """draft [d]; p [d+1, V] target probabilities; q_draft [d] q(x_i); u_accept [d] uniforms; u_bonus one uniform.

    All d accepted: the bonus is drawn from p[d] with u_bonus. A rejection at n < d returns token None: the
    recovered token is drawn from residual(p[n], q_n), which needs the edge's q row (common/resample.py).
    """
    d = draft.shape[0]
    p_draft = p[torch.arange(d), draft] if d else p.new_zeros(0)  # [d] p(x_i)
    n = accept_prefix(p_draft, q_draft, u_accept)
    return Outcome(n, sample_index(p[d], u_bonus) if n == d else None)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q [V] -> norm(max(0, p - q)) [V] float64: where to draw the recovered token after a rejection."""
    r = (p.double() - q.double()).clamp_(min=0.0)
    total = r.sum()
    # A rejection has probability sum(max(0, q - p)) = sum(max(0, p - q)); if that is 0 no rejection happens,
    # but float round-off can still land here: fall back to p, which is then equal to q.
    return r / total if total > 0 else p.double() / p.double().sum()


# ---------------------------------------------------------------------------------------------- token trees

class TreeOutcome(NamedTuple):
    node: int          # the deepest accepted node (-1: none); the accepted path is tree.path(node)
    n_accepted: int    # the path's length: depth(node)
    token: int | None  # recovered or bonus token; None: a sampled rejection at a one-child node (common/resample.py)


def _walk(tree: Tree, pick) -> TreeOutcome:
    """From the root, follow the child whose token is `pick(node)` (the target's token there) while there is one."""
    node = -1
    while True:
        token = pick(node)
        child = next((c for c in tree.children_of(node) if tree.tokens[c] == token), None)
        if child is None:
            return TreeOutcome(node, tree.depth_of(node), token)
        node = child


def greedy_tree(tree: Tree, logits: torch.Tensor) -> TreeOutcome:
    """logits [n+1, V]. The target's argmax at each node picks the child equal to it; the argmax at the deepest
    accepted node is the next token: every committed token is the target's own greedy token."""
    target_ids = logits.argmax(-1).tolist()  # [n+1]
    return _walk(tree, lambda node: target_ids[node + 1])


def coupled_tree(tree: Tree, logp: torch.Tensor, noise: torch.Tensor) -> TreeOutcome:
    """logp [n+1, V] log p; noise [D+1, V]: the shared g_t at t = pos + depth, depth 0..D. The target's token
    at node u is argmax(log p_u + g_{pos + depth(u)}), whatever the tree: target-alone sampling for the seed."""
    return _walk(tree, lambda node: int((logp[node + 1].double() + noise[tree.depth_of(node)]).argmax()))


def sampled_tree(tree: Tree, p: torch.Tensor, q_node: torch.Tensor, rows: dict[int, torch.Tensor],
                 u_accept: torch.Tensor, u_residual: torch.Tensor, u_bonus: torch.Tensor) -> TreeOutcome:
    """Multi-draft speculative sampling over a tree. p [n+1, V]; q_node [n] q(x) of each node under its parent
    (read where the parent has one child); rows: branching node -> [V] its q row (sums to 1); u_accept [D+1, K]
    uniforms by depth and child index; u_residual, u_bonus [D+1].

    One child: today's chain rule (accept w.p. min(1, p/q); a rejection -> token None, resolved with the edge).
    Two or more: `branch` (recursive rejection sampling without replacement), resolved here. A leaf: the bonus."""
    node = -1
    while True:
        k, kids = tree.depth_of(node), tree.children_of(node)
        if not kids:
            return TreeOutcome(node, k, sample_index(p[node + 1], float(u_bonus[k])))
        if len(kids) == 1:
            x = tree.tokens[kids[0]]
            if not float(u_accept[k, 0]) * float(q_node[kids[0]]) < float(p[node + 1, x]):
                return TreeOutcome(node, k, None)
            node = kids[0]
            continue
        chosen, token = branch(p[node + 1], rows[node], [tree.tokens[c] for c in kids], u_accept[k],
                               float(u_residual[k]))
        if chosen is None:
            return TreeOutcome(node, k, token)
        node = kids[chosen]


def branch(p: torch.Tensor, q: torch.Tensor, children: list[int], u: torch.Tensor,
           u_residual: float) -> tuple[int | None, int]:
    """p, q [V] at a node whose children x_1..x_k were drawn from q without replacement; u [>= k] uniforms.
    Returns (index of the accepted child, its token) or (None, the recovered token).

    For i = 1..k: accept x_i w.p. min(1, p(x_i)/q(x_i)); else p <- norm(max(0, p - q)) and q <- q without x_i,
    renormalised (Jeon et al. 2024). All rejected: the token is drawn from the last p (the cloud holds q, so it
    draws it itself). Each step is a standard speculative step for the current p with proposal q: exact."""
    p, q = p.double(), q.double().clone()
    for i, x in enumerate(children):
        if float(u[i]) * float(q[x]) < float(p[x]):  # q <= p: always accepted
            return i, x
        p = residual(p, q)
        if i + 1 < len(children):
            q[x] = 0.0
            q = q / q.sum()  # > 0: each later child has mass (common/tree.py from_verify)
    return None, sample_index(p, u_residual)
