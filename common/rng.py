"""Counter-based randomness: every draw is a pure function of (session seed, absolute position, purpose).

Replaying a step (a retry, a failover to another worker, the in-process reference loop) therefore gives
the same answer, and edge and cloud can draw the *same* noise without sending it (Gumbel coupling).
`position` is always the absolute index in the token sequence (prompt included) of the token being decided.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


class Purpose(enum.IntEnum):
    """What a draw is for; distinct purposes give independent streams at the same position."""

    DRAFT = 1        # edge samples a draft token from q
    ACCEPT = 2       # accept x with probability min(1, p(x)/q(x))
    RESIDUAL = 3     # replacement token from norm(max(0, p - q))
    BONUS = 4        # bonus token from p after a fully accepted block
    GUMBEL = 5       # shared Gumbel noise for the coupled mode
    TARGET = 6       # target-alone sampling (the reference the tests compare against)
    CANDIDATE = 7    # SR-DV: cloud draws candidates z ~ p
    CANDIDATE_ACCEPT = 8  # SR-DV: edge accepts a candidate
    HYBRID = 9       # HR: edge picks shared-vocab residual vs server-only tokens
    SERVER_ONLY = 10  # HR: cloud samples p restricted to server-only tokens
    TREE_DRAFT = 11  # edge draws a tree node's children from q without replacement (Gumbel-top-k, common/tree.py)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def counter_key(seed: int, position: int, purpose: int, index: int = 0) -> int:
    """A 63-bit key mixing the four counters; fits torch.Generator.manual_seed."""
    key = _splitmix64(seed & _MASK64)
    for part in (position, int(purpose), index):
        key = _splitmix64(key ^ (part & _MASK64))
    return key >> 1


def uniform(seed: int, position: int, purpose: int, index: int = 0) -> float:
    """One uniform draw in (0, 1) with 53 random bits, as a Python float."""
    return ((counter_key(seed, position, purpose, index) >> 10) + 0.5) / float(1 << 53)


def uniforms(seed: int, position: int, purpose: int, n: int) -> torch.Tensor:  # -> [n] float64
    """n independent uniforms in (0, 1) from one counter key."""
    gen = torch.Generator().manual_seed(counter_key(seed, position, purpose))
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return u.clamp_(min=1e-300, max=1.0 - 2**-53)


def gumbel(seed: int, position: int, vocab_size: int, purpose: int = Purpose.GUMBEL) -> torch.Tensor:  # -> [V] f64
    """Gumbel(0, 1) noise g_t(x) for every token id x at `position`: the coupled mode's, shared by edge and cloud
    (GUMBEL), or the edge's own for drawing tree children (TREE_DRAFT)."""
    u = uniforms(seed, position, purpose, vocab_size)
    return -torch.log(-torch.log(u))


def sample_index(probs: torch.Tensor, u: float) -> int:  # probs: [V] (any scale, non-negative)
    """Inverse-CDF sample: the first index whose cumulative mass exceeds u * total (float64, numpy: this runs
    once per drawn token, where torch's per-op overhead would dominate)."""
    p = probs.detach().cpu().numpy() if isinstance(probs, torch.Tensor) else np.asarray(probs)
    cdf = np.cumsum(p, dtype=np.float64)
    idx = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(p) - 1)
    while p[idx] <= 0:  # u * total landed exactly on a boundary after a zero run
        idx -= 1
    return idx
