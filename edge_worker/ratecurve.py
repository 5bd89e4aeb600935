"""The rate curve of the auto draft length (edge_worker/draftlen.py): E(d) and T(d) for every candidate d, and
each objective's pick on it (docs/draftlen.md "Objectives"). Pure functions of numbers."""

from __future__ import annotations

from ..common.protocol import Objective

TIE = 0.01                   # speed: a shorter draft within 1 % of the best rate wins (the rate is flat near its
                             # top and its estimate noisy; a shorter draft wastes less of the cloud)
TOLERANCE = {Objective.SPEED: 0.0, Objective.BALANCED: 0.10}  # share of the best rate given up for fewer calls
SATURATED = 0.40             # speed's and balanced's tolerance when the cloud is saturated (utilisation >= BUSY_FULL)
BUSY_KNEE, BUSY_FULL = 0.85, 0.98  # the cloud's utilisation from which the price of a call rises, and where it tops


def best_length(a: list[float], round_time, top: int, tolerance: float = 0.0) -> int:
    """At acceptance a_0..a_top, 0 <= d <= top: with tolerance 0 (speed) the shortest d within TIE of the best
    rate E(d) / T(d); else the longest d (the fewest cloud calls per token, 1 / E(d)) within `tolerance` of it."""
    return pick([e / max(t, 1e-9) for e, t in rate_curve(a, round_time, top)], tolerance)


def rate_curve(a: list[float], round_time, top: int) -> list[tuple[float, float]]:
    """(E(d), T(d)) for d = 0..top at acceptance a_0..a_top."""
    curve, expected, p = [], 0.0, 1.0  # p = P_d, expected = E(d)
    for d in range(top + 1):
        expected += p
        p_next = p * a[d]
        curve.append((expected, round_time(d, p_next)))
        p = p_next
    return curve


def mixture_curve(after_miss: list[float], after_full: list[float], round_time, top: int) -> list[tuple[float, float]]:
    """(E(d), T(d)) for d = 0..top when a block's acceptance depends on how the block before it ended (agreement
    comes in runs): rates a_j after a rejected block (`after_miss`) and after a fully accepted one (`after_full`).
    Blocks of d form a two-state chain: from state s the block is fully accepted with P^s_d, so the share of
    blocks that follow a full acceptance is pi = P^miss_d / (1 - P^full_d + P^miss_d), and E(d) = (1 - pi)
    E_miss(d) + pi E_full(d). A long block is rejected more often, so more of its blocks start after a rejection,
    where acceptance is lower: per-position rates pooled over one length overstate E at a longer one. The policy
    prices the pooled curve (rate_curve): this one, tried as a busy edge's E(d), shortened its drafts past the
    calls it promises with one vocabulary (docs/draftlen.md); scripts/acceptance_replay.py prints it."""
    curve, e_m, e_f, p_m, p_f = [], 0.0, 0.0, 1.0, 1.0  # E and P_d from each state
    for d in range(top + 1):
        e_m, e_f = e_m + p_m, e_f + p_f
        share = p_m / max(1e-9, 1.0 - p_f + p_m) if d else 0.0
        p_m, p_f = p_m * after_miss[d], p_f * after_full[d]
        curve.append(((1 - share) * e_m + share * e_f, round_time(d, (1 - share) * p_m + share * p_f)))
    return curve


def pick(rates: list[float], tolerance: float) -> int:
    """With tolerance 0 (speed) the shortest d within TIE of the best rate; else the longest within tolerance."""
    best = max(rates)
    if tolerance <= 0:
        return next(d for d, rate in enumerate(rates) if rate >= (1 - TIE) * best)
    return max(d for d, rate in enumerate(rates) if rate >= (1 - tolerance) * best)


def cloud_length(a: list[float], row_share, top: int) -> int:
    """The longest d within TIE of the least cloud time per committed token, row_share(d) / E(d): a longer draft
    saves calls (E grows) until the rejected tokens it makes the cloud verify cost more than the calls saved."""
    costs, expected, p = [], 0.0, 1.0  # p = P_d, expected = E(d)
    for d in range(top + 1):
        expected += p
        p *= a[d]
        costs.append(row_share(d) / expected)
    least = min(costs)
    return max(d for d, cost in enumerate(costs) if cost <= (1 + TIE) * least)


def tolerance(objective: Objective, busy: float) -> float:
    """The share of the best rate an objective gives up for fewer cloud calls, at the cloud's utilisation `busy`
    (0..1): its own below BUSY_KNEE, rising linearly to SATURATED at BUSY_FULL."""
    own = TOLERANCE.get(objective, SATURATED)
    pressure = min(1.0, max(0.0, (busy - BUSY_KNEE) / (BUSY_FULL - BUSY_KNEE)))
    return own + max(0.0, SATURATED - own) * pressure
