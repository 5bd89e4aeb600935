"""The goodput-driven draft length (edge_worker/draftlen.py) and the pre-draft chain (edge_worker/predraft.py),
as pure cores: no sockets, no clocks."""

from __future__ import annotations

import pytest

from specrelay.common.protocol import LoadHint, Objective
from specrelay.edge_worker.draftlen import AcceptanceCounts, EdgeEstimates, EWLine, FixedDraftLen, GoodputController
from specrelay.edge_worker.drafter import DraftBlock, DraftJob
from specrelay.edge_worker.predraft import DraftChain
from specrelay.edge_worker.session import SessionStats


def trained(alpha: float, rtt: float, draft_per_token: float, forward: tuple[float, float], batch: int = 1,
            rounds: int = 200, predraft: bool = False, prefill: int = 0,
            objective: Objective = Objective.SPEED, busy: int = 0) -> GoodputController:
    """A controller that has seen `rounds` rounds of a world with per-position acceptance alpha, the given link
    RTT and draft cost, and a cloud whose forward pass costs f0 + f1 * tokens, with `batch` rows as wide as ours
    and `prefill` prompt tokens besides, `busy` per mille utilised; `objective`: what the controller optimises (the model tests: speed)."""
    edge = EdgeEstimates(predraft=predraft)
    ctl = GoodputController(edge, objective=objective)
    f0, f1 = forward
    for i in range(rounds):
        d = 1 + i % 8  # varied draft lengths, so slopes are identifiable
        n = 0
        while n < d and (i * 7919 + n * 104729) % 1000 < alpha * 1000:  # deterministic "coin flips"
            n += 1
        ctl.observe_block(d, n)
        tokens = batch * (d + 1) + prefill
        fwd = f0 + f1 * tokens
        edge.observe_steps(d, draft_per_token * d)
        ctl.observe_round(d, draft_per_token * d, rtt + fwd, d + 1, d,
                          LoadHint(batch, d + 1, int(fwd * 1e6), 0, tokens, prefill, busy))
    return ctl


def goodput(a: list[float], d: int, t: float) -> float:
    e, p = 1.0, 1.0
    for j in range(d):
        p *= a[j]
        e += p
    return e / t


def test_speed_picks_the_shortest_draft_within_1_percent_of_the_best_rate():
    ctl = trained(0.8, rtt=0.05, draft_per_token=0.002, forward=(0.01, 0.0005))
    a = ctl.cautious_rates(33)  # what speed chooses on (its own estimate, bounded by the evidence)
    rates = [goodput(a, d, ctl.edge.round_time(d, 0.0)) for d in range(31)]
    chosen = ctl.choose(31)
    assert rates[chosen] >= 0.99 * max(rates) and all(r < 0.99 * max(rates) for r in rates[:chosen])
    assert chosen >= 4  # a 50 ms link makes long drafts pay


def test_longer_drafts_on_a_slower_link():
    near = trained(0.8, rtt=0.0, draft_per_token=0.004, forward=(0.01, 0.0005)).choose(64)
    far = trained(0.8, rtt=0.1, draft_per_token=0.004, forward=(0.01, 0.0005)).choose(64)
    assert 1 <= near < far


def test_shorter_drafts_when_the_cloud_is_loaded():
    # a compute-bound cloud (the pass costs per token): every rejected token of 16 rows is paid for
    idle = trained(0.85, rtt=0.01, draft_per_token=0.001, forward=(0.01, 0.001), batch=1).choose(64)
    busy = trained(0.85, rtt=0.01, draft_per_token=0.001, forward=(0.01, 0.001), batch=16).choose(64)
    assert busy < idle


def test_forward_cost_is_learnt_per_token_from_the_hints():
    ctl = trained(0.8, rtt=0.0, draft_per_token=0.002, forward=(0.012, 0.0003), batch=10, prefill=20)
    f0, f1 = ctl.edge.forward.fit()
    assert f0 == pytest.approx(0.012, rel=0.1) and f1 == pytest.approx(0.0003, rel=0.1)
    # F(d) if all 10 rows drafted d: their 10 (d + 1) tokens and the prompt chunks beside them
    assert ctl.edge.forward_time(3) == pytest.approx(0.012 + 0.0003 * (40 + 20), rel=0.05)


def test_a_slow_spell_does_not_become_the_draft_cost():
    ctl = trained(0.8, rtt=0.05, draft_per_token=0.002, forward=(0.01, 0.0005))
    before = ctl.choose(64)
    for _ in range(3):
        ctl.observe_round(4, 2.0, 0.06, 5, 4, None)  # three rounds stalled for 2 s (a GC pause, a busy core)
    assert ctl.edge.draft.value < 0.003 and abs(ctl.choose(64) - before) <= 1


def test_a_busy_edge_drafts_one_length_for_all_its_sessions():
    ctl = trained(0.8, rtt=0.01, draft_per_token=0.002, forward=(0.01, 0.0005))
    easy, hard = (GoodputController(ctl.edge, objective=Objective.SPEED) for _ in range(2))
    for _ in range(30):
        easy.observe_block(8, 8)
        hard.observe_block(8, 0)
    ctl.edge.sessions = 1
    assert easy.choose(64) > hard.choose(64)  # alone, each session follows its own acceptance
    ctl.edge.sessions = 16
    assert easy.choose(64) == hard.choose(64) == ctl.edge.shared(easy.max_len, Objective.SPEED)  # one length


def test_no_drafting_when_nothing_is_accepted():
    assert trained(0.0, rtt=0.02, draft_per_token=0.002, forward=(0.01, 0.0005)).choose(64) == 0


def test_predrafting_makes_longer_drafts_worth_it():
    without = trained(0.9, rtt=0.0, draft_per_token=0.006, forward=(0.01, 0.0005)).choose(64)
    with_pre = trained(0.9, rtt=0.0, draft_per_token=0.006, forward=(0.01, 0.0005), predraft=True).choose(64)
    assert with_pre >= without


def test_choice_respects_the_tokens_left():
    ctl = trained(0.95, rtt=0.1, draft_per_token=0.001, forward=(0.01, 0.0005))
    assert ctl.choose(3) <= 2 and ctl.choose(1) == 0
    assert FixedDraftLen(8).choose(5) == 4 and FixedDraftLen(8).choose(64) == 8


def test_untrained_controller_is_deterministic_and_drafts():
    a, b = GoodputController(), GoodputController()
    assert a.choose(64) == b.choose(64) >= 1


def test_acceptance_counts_per_position_and_bonus():
    counts = AcceptanceCounts(decay=1.0)
    counts.observe(4, 2)          # positions 0, 1 accepted, 2 rejected, 3 not reached
    counts.observe(2, 2, True)    # both accepted, and the bonus guess (position 2) matched
    counts.observe(2, 2, False)   # both accepted, bonus guess missed
    assert counts.reached == [3, 3, 3, 0] and counts.accepted == [3, 3, 1, 0]


def test_ewline_keeps_the_prior_slope_until_x_varies_then_learns_the_line():
    flat = EWLine(decay=1.0, slope_ratio=0.1)
    for _ in range(50):
        flat.observe(5, 1.5)
    c, s = flat.fit()
    assert c + 5 * s == pytest.approx(1.5, rel=0.02) and s == pytest.approx(0.1 * c, rel=0.05)
    line = EWLine(decay=1.0, slope_ratio=0.1)
    for x in range(1, 20):
        line.observe(x, 2.0 + 0.5 * x)
    c, s = line.fit()
    assert s == pytest.approx(0.5, rel=0.1) and c == pytest.approx(2.0, rel=0.15)


def test_session_stats_count_reached_and_accepted_positions():
    stats = SessionStats()
    stats.record_block(4, 2)
    stats.record_block(4, 4)
    stats.record_block(0, 0)
    assert stats.reached_per_pos == [2, 2, 2, 1] and stats.accepted_per_pos == [2, 2, 1, 1]
    assert stats.rounds_by_draft_len == {4: 2, 0: 1}


# ------------------------------------------------------------------------------------------ the chain

def chain(ids: list[int]) -> DraftChain:
    return DraftChain(start=10, context=list(range(10)), block=DraftBlock(list(ids)), sent=3)


def ident(ids: list[int]) -> list[int]:
    """The chain's base context (0..9) followed by `ids`: one vocabulary."""
    return list(range(10)) + list(ids)


def test_chain_reuse_after_a_fully_accepted_block_and_matching_bonus():
    c = chain([5, 6, 7, 8, 9, 4])           # block 5 6 7, bonus guess 8, then 9 4 pre-drafted
    tokens = list(range(10)) + [5, 6, 7, 8]  # all accepted, the target's bonus was 8
    assert c.reusable(tokens, tokens, 4, ident).ids == [9, 4]
    assert c.reusable(tokens, tokens, 1, ident).ids == [9]


def test_chain_not_reused_when_the_verdict_went_another_way():
    c = chain([5, 6, 7, 8, 9, 4])
    for tokens in (list(range(10)) + [5, 1], list(range(10)) + [5, 6, 7, 3]):
        assert c.reusable(tokens, tokens, 4, ident).ids == []


def test_chain_not_reused_when_the_draft_context_differs():
    c = chain([5, 6, 7, 8, 9, 4])
    tokens = list(range(10)) + [5, 6, 7, 8]
    retokenised = list(range(10)) + [5, 67, 8]  # a cross-vocabulary draft re-tokenised the text differently
    assert c.reusable(tokens, retokenised, 4, ident).ids == []


def test_chain_continuation_job_starts_after_the_chain():
    from specrelay.edge_worker.drafter import Drafter

    c = chain([5, 6, 7])
    base = DraftJob(state=None, context=list(range(10)), position=10, d=3, mode=0, params=None, seed=1)
    job = Drafter.continue_job(Drafter.__new__(Drafter), base, c.block.ids, 4)
    assert job.context == list(range(10)) + [5, 6, 7] and job.position == 13 and job.d == 4
    assert job.unverified == (5, 6, 7)
    more = Drafter.continue_job(Drafter.__new__(Drafter), job, [8], 2)  # the next pre-draft chunk
    assert more.context == list(range(10)) + [5, 6, 7, 8] and more.position == 14 and more.unverified == (5, 6, 7, 8)


def test_controller_stuck_at_zero_explores_again():
    from specrelay.edge_worker.draftlen import EXPLORE_ROUNDS, PROBE_EVERY
    from specrelay.edge_worker.estimators import EXPLORE_GRACE

    ctl = trained(0.0, rtt=0.02, draft_per_token=0.002, forward=(0.01, 0.0005))
    assert ctl.choose(64) == 0
    for _ in range(PROBE_EVERY + EXPLORE_GRACE):
        assert ctl.choose(64) == 0
        ctl.observe_block(0, 0)          # target-alone rounds teach nothing about acceptance (no probe came)
    for _ in range(EXPLORE_ROUNDS):      # the probe is overdue: two rounds draft a token (the second is timed)
        assert ctl.choose(64) == 1
        ctl.observe_block(1, 0)
    assert ctl.choose(64) == 0 and ctl.edge.zero.interval(PROBE_EVERY) == 2 * PROBE_EVERY  # d = 0 confirmed
    for _ in range(2 * PROBE_EVERY):
        assert not ctl.probes
        ctl.observe_block(0, 0)
    assert ctl.probes                    # due again, after the doubled interval
    ctl.observe_block(0, 0, bonus_match=False)  # a pre-drafted guess is an acceptance sample: no exploring needed
    assert ctl.edge.zero.idle == 0 and ctl.edge.zero.interval(PROBE_EVERY) == 4 * PROBE_EVERY


def test_reach_bound_is_a_lower_bound_that_tightens_with_evidence():
    import math

    from specrelay.edge_worker.estimators import conditional, reach_bound

    rates = [0.8, 0.7, 0.6]
    exact = [math.log(0.8), math.log(0.8 * 0.7), math.log(0.8 * 0.7 * 0.6)]
    few, many = reach_bound(rates, [4, 4, 4], 1.0), reach_bound(rates, [400, 400, 400], 1.0)
    assert all(f < m < e for f, m, e in zip(few, many, exact))
    assert reach_bound(rates, [4, 4, 4], 0.0) == pytest.approx(exact)
    assert conditional(exact) == pytest.approx(rates)
    assert all(0.0 < a <= 1.0 for a in conditional(few))


def test_a_session_moves_off_the_edge_estimate_only_once_its_own_counts_say_so():
    import math

    def reach(blocks: int, accepted: int) -> tuple[float, float, float]:
        """The chance of reaching position 3: the edge's, the session's own, what it chooses on."""
        edge = trained(0.7, rtt=0.0, draft_per_token=0.002, forward=(0.01, 0.0005)).edge  # 200 rounds of evidence
        ctl = GoodputController(edge, objective=Objective.SPEED)
        for _ in range(blocks):
            ctl.observe_block(3, accepted)  # (the edge's pooled counts learn them too)
        return tuple(math.prod(a[:3]) for a in (edge.prior_rates(4), ctl.rates(4), ctl.cautious_rates(4)))

    pooled, own, lucky = reach(2, 3)  # two fully accepted blocks: its estimate jumps; it moves part of the way
    assert own > 1.3 * pooled and pooled < lucky < pooled + 0.5 * (own - pooled)
    pooled, own, cautious = reach(1, 0)  # one rejected block: not a shorter block for one round of bad luck
    assert own < pooled and cautious == pytest.approx(pooled, rel=0.05)
    pooled, own, cautious = reach(30, 3)  # really easier: its counts take it further (a lower bound)
    assert lucky < cautious < own
    pooled, own, cautious = reach(30, 0)  # ... and a harder one too (an upper bound)
    assert own < cautious < pooled


# ------------------------------------------------------------------------------------------ pre-drafting's price

def with_penalty(penalty: float, rounds: int = 40) -> GoodputController:
    """A pre-drafting edge at 0 ms whose VERDICTs come `penalty` s later in rounds that pre-drafted (the draft
    thread, the event loop and ZeroMQ's I/O thread share a core), after the usual training."""
    ctl = trained(0.9, rtt=0.004, draft_per_token=0.002, forward=(0.008, 0.0005), predraft=True)
    for i in range(rounds):
        predrafted = i % 2 == 0
        fwd = 0.008 + 0.0005 * 5
        ctl.observe_round(4, 0.008, 0.004 + fwd + (penalty if predrafted else 0.0), 5, 4,
                          LoadHint(1, 5, int(fwd * 1e6), 0, 5, 0, 0), predrafted)
    return ctl


def test_pre_drafting_is_charged_what_it_delays_the_round():
    free, dear = with_penalty(0.0), with_penalty(0.02)
    assert free.edge.predraft_penalty() == pytest.approx(0.0, abs=1e-4)
    assert dear.edge.predraft_penalty() == pytest.approx(0.02, rel=0.1)
    assert dear.edge.link_rtt() == pytest.approx(free.edge.link_rtt(), rel=0.05)  # R of a plain round
    p_next = 0.9 ** 5
    assert free.edge.predraft_gain(4, p_next) > 0 > dear.edge.predraft_gain(4, p_next)
    # where it does not pay the model drafts without it: the round is as long as a plain one, no credit
    plain = EdgeEstimates(**{**dear.edge.__dict__, "predraft": False})
    assert dear.edge.round_time(4, p_next) == pytest.approx(plain.round_time(4, p_next))
    assert free.edge.round_time(4, p_next) < dear.edge.round_time(4, p_next)


def test_auto_pre_drafts_where_it_pays_and_rechecks_one_round_in_eight():
    from specrelay.edge_worker.draftlen import PREDRAFT_EXPLORE

    assert all(with_penalty(0.0).predrafts(4, 4) for _ in range(20))
    dear = with_penalty(0.02)
    seen = [dear.predrafts(4, 4) for _ in range(2 * PREDRAFT_EXPLORE)]
    assert seen.count(True) == 2 and seen[PREDRAFT_EXPLORE - 1]
    assert FixedDraftLen(4).predrafts(4, 4)  # a fixed length pre-drafts as the edge is configured


def test_a_sessions_own_prompt_is_not_a_cost_of_every_round():
    """The first VERIFY after an OPEN (always hinted: seq 1) ran with the session's prompt and waited for its
    prefill. That is paid once per session whatever d is: it must not enter the per-round extras x, p and Q
    (it made a lone session's T(0) ~3 ms too long at 0 ms, so auto drafted where the target alone was best)."""
    plain, first = trained(0.8, 0.002, 0.002, (0.008, 0.0005)), trained(0.8, 0.002, 0.002, (0.008, 0.0005))
    before = (first.edge.row_extra.value, first.edge.prefill.value, first.edge.queue.value)
    first.observe_round(4, 0.008, 0.08, 5, 4, LoadHint(1, 65, 40_000, 30_000, 65, 60, 0), opened=True)
    assert (first.edge.row_extra.value, first.edge.prefill.value, first.edge.queue.value) == before
    assert first.edge.forward.count == plain.edge.forward.count + 1  # the forward line still learns from it
    plain.observe_round(4, 0.008, 0.08, 5, 4, LoadHint(1, 65, 40_000, 30_000, 65, 60, 0))
    assert plain.edge.queue.value > first.edge.queue.value and plain.edge.prefill.value > first.edge.prefill.value


def test_a_block_that_first_catches_the_draft_up_does_not_time_drafting(tiny_runners):
    """The first block after OPEN and the first after a round at d = 0 feed the draft model a stretch it never
    saw (the prompt, the target alone's tokens): their wait is not what drafting costs, so it is not timed."""
    from specrelay.common import protocol as P
    from specrelay.edge_worker.drafter import Drafter
    from specrelay.edge_worker.session import EdgeSession, SessionConfig

    class Scripted:  # a policy that drafts the lengths given and records what the session timed
        probes = False

        def __init__(self, lengths):
            self.lengths, self.timed = list(lengths), []

        def choose(self, remaining):
            return self.lengths[0]

        def predrafts(self, sent, d):
            return False

        def observe_block(self, d, n, bonus_match=None):
            self.lengths.pop(0)

        def observe_round(self, fresh, draft_s, latency_s, width, d, hint, predrafted=False, opened=False):
            self.timed.append(draft_s is not None)

    target, draft = tiny_runners
    session = EdgeSession(target.tokenizer("def f():").input_ids, SessionConfig(max_new_tokens=16, draft_len=2),
                          Drafter(draft, target.vocab_size), sid=1)
    session.policy = policy = Scripted([2, 2, 0, 2, 2])
    session.open_message()
    for _ in range(5):
        request = session.next_request()
        session.apply(P.Verdict(1, request.seq, 0, 5))  # every draft token rejected, the target's token 5
        session.record_timing(0.01, 0.02)
    # OPEN's block, a drafting one, d = 0 (no draft: nothing to time either way), the catch-up, drafting again
    assert policy.timed == [False, True, True, False, True]


def test_an_exploring_pair_is_two_drafted_rounds_even_when_a_pre_draft_asked_first():
    from specrelay.edge_worker.draftlen import EXPLORE_ROUNDS, PROBE_EVERY
    from specrelay.edge_worker.estimators import EXPLORE_GRACE

    ctl = trained(0.0, rtt=0.02, draft_per_token=0.002, forward=(0.01, 0.0005))
    for _ in range(PROBE_EVERY + EXPLORE_GRACE):
        ctl.observe_block(0, 0)
    assert ctl.choose(63) == 1   # the shell's pre-draft asks what the next block will be, during a round at 0
    ctl.observe_block(0, 0)      # ... whose VERDICT then arrives
    drafted = []
    for _ in range(EXPLORE_ROUNDS + 1):
        drafted.append(ctl.choose(64))
        ctl.observe_block(drafted[-1], 0)
    assert drafted == [1] * EXPLORE_ROUNDS + [0]
