"""A busy edge's shared draft length, measured (edge_worker/sharedlen.py), and the two-state E(d) that
scripts/acceptance_replay.py compares with the truth (ratecurve.mixture_curve): pure, no sockets."""

from __future__ import annotations

import math

import pytest

from specrelay.common.protocol import Objective
from specrelay.edge_worker.draftlen import EdgeEstimates, GoodputController
from specrelay.edge_worker.ratecurve import mixture_curve, rate_curve
from specrelay.edge_worker.sharedlen import PROBE_EPOCHS, TREND_MAX, Epoch, LengthRates, SharedLength

pytestmark = pytest.mark.unit


def test_round_times_that_grow_with_d_faster_than_the_model_mark_longer_lengths_down():
    rates = LengthRates()
    for _ in range(200):
        rates.observe(4, 4, 0.110, 3.5, 0.100)  # ran 10 % slower than modelled
        rates.observe(12, 6, 0.240, 5.0, 0.200)  # 20 % slower
    slope, low, high = rates.slope()
    assert (low, high) == (4, 12) and 0.8 * math.log(1.2 / 1.1) / 8 < slope <= math.log(1.2 / 1.1) / 8
    fix = rates.corrections(20)
    assert fix[4] == fix[0] == 1.0 and fix[4] > fix[8] > fix[12] > fix[16]  # marked down past the shortest
    assert fix[12] == pytest.approx(math.exp(-8 * slope)) and fix[20] == fix[16]  # EXTRAPOLATE past the longest


def test_a_ratio_common_to_every_length_or_one_falling_with_d_or_one_length_alone_moves_nothing():
    common, falling = LengthRates(), LengthRates()
    common.observe(4, 4, 0.3, 3.5, 0.1)
    assert common.corrections(8) == [1.0] * 9  # one measured length: nothing to compare
    for _ in range(100):
        common.observe(4, 4, 0.15, 3.5, 0.1)
        common.observe(8, 5, 0.30, 4.5, 0.2)
        falling.observe(4, 4, 0.15, 3.5, 0.1)
        falling.observe(8, 5, 0.20, 4.5, 0.2)  # long rounds faster than modelled: no pull toward them
    assert min(common.corrections(8)) > 0.995 and falling.corrections(8) == [1.0] * 9


def test_little_evidence_moves_little_and_the_slope_is_bounded():
    few, many, huge = LengthRates(), LengthRates(), LengthRates()
    for rates, n, slower in ((few, 2, 1.3), (many, 300, 1.3), (huge, 300, 5.0)):
        for _ in range(n):
            rates.observe(2, 2, 0.1, 2.0, 0.1)
            rates.observe(10, 4, 0.1 * slower, 4.0, 0.1)  # `slower` x the model's round time at d = 10
    assert few.slope()[0] < 0.5 * many.slope()[0] and many.slope()[0] > 0.8 * math.log(1.3) / 8
    assert huge.slope()[0] == TREND_MAX


def test_an_edge_at_d_0_probes_with_a_shared_epoch_and_backs_off_while_d_0_stays_best():
    shared, curve, rates = SharedLength(), [(1.0, 0.1)] * 9, [10.0, 8.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0]
    lengths = [shared.begin(Objective.BALANCED, 0, curve, rates, i) for i in range(PROBE_EPOCHS * 3 + 1)]
    assert lengths[PROBE_EPOCHS - 1] == 2  # every session drafts the best d > 0 for one epoch
    assert lengths.count(2) == 2 and lengths[3 * PROBE_EPOCHS - 1] == 2  # then after 8 more epochs (doubled)
    shared.begin(Objective.BALANCED, 3, curve, rates, 99)  # drafting by choice: the interval is reset
    assert shared.zero_level == 0


def test_a_length_chosen_by_the_model_is_kept_epoch_after_epoch():
    shared, curve, rates = SharedLength(), [(1.0, 0.1)] * 17, [1.0] * 17
    assert [shared.begin(Objective.SPEED, 9, curve, rates, i) for i in range(12)] == [9] * 12


def test_a_busy_edge_measures_a_session_s_rounds_but_its_first_of_each_epoch_and_untimed_ones():
    edge = EdgeEstimates()
    edge.sessions = 4
    ctl = GoodputController(edge, objective=Objective.BALANCED)
    edge.epochs.epochs[Objective.BALANCED] = Epoch(3, 0, 1, (2.5, 0.05))
    for draft_s in (0.01, None, 0.01, 0.01):  # first of the epoch; a catch-up (not timed); two measured
        ctl.observe_block(3, 1)
        ctl.observe_round(3, draft_s, 0.04, 4, 3, None)
    assert edge.epochs.measured.evidence(3) == pytest.approx(2, rel=0.02)
    assert edge.epochs.measured.sums[3][1] == pytest.approx(4, rel=0.02)  # 1 accepted + 1 from the target, twice
    edge.epochs.epochs[Objective.BALANCED] = Epoch(3, 0, 2, None)  # chosen before the costs were timed
    for _ in range(3):
        ctl.observe_round(3, 0.01, 0.04, 4, 3, None)
    assert edge.epochs.measured.evidence(3) < 2


def test_the_two_state_curve_is_the_pooled_one_when_acceptance_does_not_depend_on_the_block_before():
    a = [0.8, 0.7, 0.6, 0.5, 0.5]
    flat = rate_curve(a, lambda d, p: 1.0 + d, 4)
    both = mixture_curve(a, a, lambda d, p: 1.0 + d, 4)
    assert [e for e, _ in both] == pytest.approx([e for e, _ in flat])


def test_the_two_state_curve_prices_the_runs_a_long_block_falls_into():
    miss, full = [0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], [0.9] * 9  # agreement comes in runs
    pooled = [0.7, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    two = mixture_curve(miss, full, lambda d, p: 1.0, 8)
    one = rate_curve(pooled, lambda d, p: 1.0, 8)
    assert two[8][0] / two[2][0] < one[8][0] / one[2][0]  # a long block starts after a rejection more often
