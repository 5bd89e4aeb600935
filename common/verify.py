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
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .rng import sample_index


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
