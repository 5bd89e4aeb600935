"""What speculative decoding should give at the acceptance actually measured (Leviathan et al. 2023, with the
per-position rates vLLM reports instead of one alpha).

    a_j  = accepted_j / reached_j          acceptance at draft position j, given positions 0..j-1 accepted
    E(d) = sum_{k=0..d} prod_{j<k} a_j     expected tokens one VERIFY commits when drafting d (the 1 is the
                                           recovered or bonus token)
    calls per token = rounds / sum_over_rounds E(d_round)

For a single fixed d this equals the measured rounds / tokens exactly, bar tokens cut off by EOS (the chain
rule); with `auto` the draft lengths vary and the two differ by how well pooled rates describe each round. A
cloud that runs more VERIFYs than the edge's rounds (retries, lost replies) shows up as measured > theory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def pooled(stats: Iterable[Mapping]) -> dict:
    """Sum the per-position counts and rounds-by-draft-length of many sessions' stats."""
    reached: list[int] = []
    accepted: list[int] = []
    rounds: dict[int, int] = {}
    for s in stats:
        for total, part in ((reached, s.get("reached_per_pos", [])), (accepted, s.get("accepted_per_pos", []))):
            total.extend([0] * (len(part) - len(total)))
            for j, n in enumerate(part):
                total[j] += n
        for d, n in s.get("rounds_by_draft_len", {}).items():
            rounds[int(d)] = rounds.get(int(d), 0) + n
    return {"reached_per_pos": reached, "accepted_per_pos": accepted, "rounds_by_draft_len": rounds}


def acceptance_per_position(reached: list[int], accepted: list[int]) -> list[float]:
    """a_j for every position some round reached."""
    return [accepted[j] / reached[j] if j < len(accepted) else 0.0 for j in range(len(reached)) if reached[j]]


def expected_tokens(a: list[float], d: int) -> float:
    """E(d); positions past the measured ones count as never accepted."""
    total, p = 1.0, 1.0
    for j in range(d):
        p *= a[j] if j < len(a) else 0.0
        total += p
    return total


def theoretical_calls_per_token(a: list[float], rounds_by_draft_len: Mapping[int, int]) -> float | None:
    rounds = sum(rounds_by_draft_len.values())
    tokens = sum(n * expected_tokens(a, d) for d, n in rounds_by_draft_len.items())
    return rounds / tokens if tokens else None
