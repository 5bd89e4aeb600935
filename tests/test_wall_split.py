"""`bench.runs.wall_split`: how a run's wall time splits between what the edge times of a round, what it does not,
and the run's tail (sessions that ended before the slowest), from the records a sweep keeps."""

from __future__ import annotations

import pytest

from specrelay.bench.runs import SessionRun, wall_split


def session(rounds: int, round_s: float, timed_s: float, tokens_per_round: int = 2) -> SessionRun:
    """A generation of `rounds` rounds of `round_s` seconds each, `timed_s` of each timed by the edge."""
    run = SessionRun("p", ids=[1] * rounds * tokens_per_round)
    run.commits = [((i + 1) * round_s, tokens_per_round) for i in range(rounds)]
    run.stats = {"cloud_calls": rounds, "wall_s": rounds * round_s, "draft_s": rounds * timed_s / 2,
                 "verify_s": rounds * timed_s / 2}
    return run


def test_a_run_of_equal_sessions_is_all_occupied_and_the_untimed_part_is_what_the_edge_did_not_time():
    runs = [session(10, 0.1, 0.08) for _ in range(4)]
    split = wall_split([(runs, 1.0)])
    assert split["occupancy"] == 1.0
    assert split["session_ms_per_round"] == 100.0
    assert split["untimed_ms_per_round"] == 20.0
    assert split["full_house_tokens_per_s"] == 80.0  # 4 sessions x 20 tokens in 1 s
    assert split["steady_tokens_per_s"] == pytest.approx(4 * 18 / 0.9)  # after the first commits at 0.1 s


def test_a_slow_generation_leaves_the_others_idle_the_tail_is_occupancy_not_untimed_round_time():
    fast, slow = [session(5, 0.1, 0.1) for _ in range(3)], session(20, 0.1, 0.1)
    split = wall_split([([*fast, slow], 2.0)])
    assert split["untimed_ms_per_round"] == 0.0  # every round fully timed...
    assert split["occupancy"] == pytest.approx((3 * 0.5 + 2.0) / (4 * 2.0), abs=1e-4)  # ...but the run waited
    # until the first generation ended (0.5 s) all four sessions committed 10 tokens each
    assert split["full_house_tokens_per_s"] == pytest.approx(40 / 0.5)


def test_failed_generations_and_empty_runs_are_left_out():
    bad = SessionRun("p", error="GenerationTimeout: no reply")
    split = wall_split([([session(10, 0.1, 0.1), bad], 1.0), ([], 0.0)])
    assert split["session_ms_per_round"] == 100.0
    assert split["full_house_tokens_per_s"] is None  # the failed run has no commits: no full-house span
    assert split["steady_tokens_per_s"] is None
