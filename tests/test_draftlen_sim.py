"""The auto draft length (edge_worker/draftlen.py) on a simulated edge (tests/simworld.py): worlds with known
acceptance and costs, where every fixed length runs on the same coin flips, so "auto is within 3 % of the best
fixed length" is a property of the policy, not of a noisy machine. The real system's numbers are the
benchmarks' (`specrelay bench sweep`), not these."""

from __future__ import annotations

import pytest

from simworld import BusyWorld, World, best_fixed, simulate, simulate_busy
from specrelay.common.protocol import Objective
from specrelay.edge_worker.draftlen import EdgeEstimates

pytestmark = pytest.mark.unit

# a cross-vocabulary draft on loopback: a draft step costs a quarter of the cloud's pass, ~1.2 per target token,
# acceptance 0.6: the target alone is fastest (the demo pair's xv setting at 0 ms)
XV_LOOPBACK = World([0.6, 0.55, 0.5], step_s=0.0026, steps_per_token=1.2, forward=(0.009, 0.0003), xv=True,
                    probe_s=0.004)
XV_50MS = World([0.6, 0.55, 0.5], step_s=0.0026, steps_per_token=1.2, rtt_s=0.05, forward=(0.009, 0.0003),
                xv=True, probe_s=0.004)
SV_LOOPBACK = World([0.85, 0.8, 0.75], step_s=0.0015, forward=(0.009, 0.0003))
SV_50MS = World([0.85, 0.8, 0.75], step_s=0.0015, rtt_s=0.05, forward=(0.009, 0.0003))  # long drafts pay


@pytest.mark.parametrize("seed", [0, 1])
def test_where_the_target_alone_is_fastest_speed_stays_within_3_percent_of_it(seed):
    d, best = best_fixed(XV_LOOPBACK, seed=seed)
    assert d == 0  # the world's premise
    run = simulate(XV_LOOPBACK, Objective.SPEED, seed=seed)
    assert run.rate >= 0.97 * best
    assert run.exploring <= 0.04  # probes, exploring blocks, a lucky session's blocks: finding out d = 0 is best


@pytest.mark.parametrize("world", [XV_50MS, SV_LOOPBACK, SV_50MS], ids=["xv-50ms", "sv-0ms", "sv-50ms"])
def test_where_drafting_pays_speed_is_within_3_percent_of_the_best_fixed_length(world):
    d, best = best_fixed(world)
    assert d > 0
    assert simulate(world, Objective.SPEED).rate >= 0.97 * best


def test_where_long_drafts_pay_auto_drafts_long():
    d, _ = best_fixed(SV_50MS)
    lengths = sorted(simulate(SV_50MS, Objective.SPEED).lengths)
    assert d >= 6 and lengths[len(lengths) // 2] >= 5  # the median block is long, not a cautious 1 or 2


def test_balanced_makes_fewer_calls_than_speed_within_its_tolerance():
    for world in (SV_LOOPBACK, SV_50MS, XV_50MS):
        speed, balanced = simulate(world, Objective.SPEED), simulate(world, Objective.BALANCED)
        assert balanced.rounds / balanced.tokens < speed.rounds / speed.tokens
        assert balanced.rate >= 0.88 * speed.rate  # 10 % tolerance at the estimate, and the estimate's error


def test_probing_at_d_0_backs_off_and_a_world_that_turns_good_is_found_again():
    bad = World([0.1], step_s=0.003, rtt_s=0.02, forward=(0.009, 0.0003))   # acceptance too low to pay
    good = World([0.9], step_s=0.003, rtt_s=0.02, forward=(0.009, 0.0003))  # long drafts pay
    edge = EdgeEstimates()
    run = simulate(bad, Objective.SPEED, sessions=100, edge=edge)
    assert best_fixed(bad)[0] == 0 and run.exploring <= 0.03
    assert edge.zero.interval(4) >= 16  # probe after probe confirmed d = 0: the interval doubled
    runs = [simulate(good, Objective.SPEED, sessions=5, edge=edge, seed=1 + i) for i in range(4)]
    assert runs[-1].rate >= 0.85 * best_fixed(good)[1]  # found within 20 sessions of 48 tokens
    assert edge.zero.level == 0  # drafting by choice again: a later return to d = 0 probes soon


def test_same_coin_flips_for_every_policy():
    a, b = simulate(SV_LOOPBACK, 3, seed=5), simulate(SV_LOOPBACK, 3, seed=5)
    assert (a.tokens, a.rounds, a.seconds) == (b.tokens, b.rounds, b.seconds)


# 16 sessions over 50 ms, agreement in runs (a match follows a match 90 % of the time, a miss 40 %), the draft
# thread's wait growing with everyone's d: the setting where `balanced` drafted d ~ 12 at 0.78x the best fixed
# length on the demo pair (docs/draftlen.md "A busy edge over a link")
BUSY_50MS = BusyWorld(0.9, 0.4, sessions=16, step_s=0.003, rtt_s=0.05, forward=(0.015, 0.0004), queue_gain=0.05)


def _fixed_rates(seed: int) -> dict[int, float]:
    fixed = {d: simulate_busy(BUSY_50MS, d, seed=seed).rate for d in (2, 4, 6, 8, 12)}
    assert max(fixed, key=fixed.get) in (4, 6)  # the premise: short drafts are best, d = 12 is 20 % slower
    return fixed


def test_a_busy_edge_over_a_link_keeps_speed_near_the_best_fixed_length():
    for seed in (0, 1):
        best = max(_fixed_rates(seed).values())
        assert simulate_busy(BUSY_50MS, Objective.SPEED, seed=seed).rate >= 0.95 * best


@pytest.mark.xfail(strict=True, reason="open (issue 20): balanced drafts too long on a busy edge over a link, "
                   "docs/draftlen.md 'A busy edge over a link'")
def test_a_busy_edge_over_a_link_keeps_balanced_near_the_best_fixed_length():
    """The pooled per-position rates over-rate long blocks here: balanced drafts d ~ 11.5 at 0.755-0.775x the
    best fixed length (d = 4) over seeds 0-3, with or without the measured round times per shared length. A
    two-state E(d) (ratecurve.mixture_curve) with forced tries of a shorter length reached 0.849-0.911x in this
    world but not in the real sweep (0.79x), and cost the calls per token `balanced` promises with one
    vocabulary on loopback (docs/draftlen.md): not kept. Strict: it fails the suite once this is fixed."""
    for seed in (0, 1):
        best = max(_fixed_rates(seed).values())
        assert simulate_busy(BUSY_50MS, Objective.BALANCED, seed=seed).rate >= 0.82 * best
