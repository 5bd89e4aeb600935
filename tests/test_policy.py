"""The draft policy (edge_worker/policy), pure: no sockets, no models. Each test feeds the estimators what an edge
would measure and checks the choice the model implies."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from specrelay.common.protocol import LoadHint, Objective
from specrelay.edge_worker.policy import MAX_LEN, TOLERANCE, DraftPolicy, EdgeEstimates, chain_rows, pick, tree_rows
from specrelay.edge_worker.policy import choose
from specrelay.edge_worker.policy.choose import EXPLORE_SHARE, TREE_FILL, tree_compute, tree_table, wait_for
from specrelay.edge_worker.policy.estimates import PRIOR_WEIGHT, AcceptanceCounts
from specrelay.edge_worker.trees.tree import TreeShape

ROOT = Path(__file__).resolve().parents[1]


def edge(draft_s: float, rtt_s: float, forward_s: float = 0.010, per_token_s: float = 0.0002,
         accept: float = 0.8, predraft: bool = False) -> EdgeEstimates:
    """An edge that measured: draft forwards of draft_s, a link of rtt_s, a worker forward of forward_s (+ per
    token), and acceptance `accept` at every position (40 full blocks of 8)."""
    est = EdgeEstimates(predraft)
    for rows in (1, 2):
        for _ in range(8):
            est.observe_draft(rows, [(rows, draft_s)] * 4)
    for tokens in (2, 9, 17):
        for _ in range(8):
            hint = LoadHint(batch=1, forward_us=int(1e6 * (forward_s + per_token_s * tokens)), tokens=tokens)
            est.observe_round(tokens, rtt_s + forward_s + per_token_s * tokens, hint)
    for i in range(200):  # acceptance `accept` per position: n accepted with the geometric law, deterministic
        n, p = 0, 1.0
        while n < 8 and (i * 0.6180339887) % 1.0 < (p := p * accept):
            n += 1
        est.acceptance.observe(8, n)
    return est


def test_a_draft_slower_than_the_verify_it_saves_picks_d_0():
    """The swapped demo pair: a draft forward (30 ms) costs more than a verify (10 ms) on loopback."""
    est = edge(draft_s=0.030, rtt_s=0.0002)
    for objective in (Objective.SPEED, Objective.BALANCED):
        assert DraftPolicy(est, objective).choose(48) == 0


def test_a_cheap_draft_drafts_and_longer_with_the_rtt():
    chosen = [DraftPolicy(edge(draft_s=0.002, rtt_s=rtt), Objective.SPEED).choose(48) for rtt in (0.0, 0.05, 0.2)]
    assert chosen[0] >= 1 and chosen[0] <= chosen[1] <= chosen[2] and chosen[0] < chosen[2]


def test_balanced_is_within_its_tolerance_of_the_best_rate_with_more_tokens_per_call():
    est = edge(draft_s=0.002, rtt_s=0.05)
    policy = DraftPolicy(est, Objective.BALANCED)
    rows = chain_rows(est, policy.rates(33), 32)
    rates = [e / t for e, t in rows]
    d, fast = policy.choose(48), DraftPolicy(est, Objective.SPEED).choose(48)
    assert rates[d] >= (1 - TOLERANCE[Objective.BALANCED]) * max(rates)
    assert rates[fast] == max(rates) and rows[d][0] >= rows[fast][0]
    assert DraftPolicy(est, Objective.CLOUD).choose(48) >= d


def test_pick_is_one_rule():
    rows = [(1.0, 1.0), (2.0, 1.05), (3.0, 1.6), (4.0, 3.0)]  # rates 1, 1.905, 1.875, 1.333
    assert pick(rows, Objective.SPEED) == 1 and pick(rows, Objective.BALANCED) == 2


def explored(est: EdgeEstimates, rounds: int, explore_s: float) -> int:
    policy = DraftPolicy(est, Objective.BALANCED)
    chosen = []
    for _ in range(rounds):
        d = policy.choose(48)
        chosen.append(d)
        policy.observe_block(d, d)  # d = 0 rounds teach nothing
        policy.observe_round(d + 1, est.wait(d), None, explore_s if d else None)
    assert chosen.count(1) + chosen.count(0) == rounds
    return chosen.count(1)


def test_d_0_explores_at_a_small_share_of_the_time():
    """Exploring costs ~EXPLORE_SHARE of the time at d = 0: as often as a round's time allows, less often when
    the measured exploring round (its catch-up) costs more."""
    cheap = explored(edge(draft_s=0.030, rtt_s=0.0002), 400, 0.0)
    dear = explored(edge(draft_s=0.030, rtt_s=0.0002), 400, 0.2)
    assert 1 <= dear < cheap <= 400 // 30


def test_where_a_pre_draft_can_guess_the_next_token_d_0_explores_by_that_guess():
    """The same acceptance samples, as often, without a catch-up on the critical path: a session whose pre-draft can
    guess the next token (greedy, pre-drafting, the draft timed) stays at d = 0 and pre-drafts the guess during the
    wait; the draft then caught up, its next round drafts once (at the best d > 0), a clean round that is timed."""
    drafted = DraftPolicy(edge(draft_s=0.030, rtt_s=0.0002, predraft=True), Objective.BALANCED)
    guessed = DraftPolicy(edge(draft_s=0.030, rtt_s=0.0002, predraft=True), Objective.BALANCED, guesses=True)
    samples, timed = [0, 0], []
    for _ in range(400):
        d = drafted.choose(48)
        samples[0] += d
        drafted.observe_block(d, d)
        g = guessed.choose(48)
        assert not guessed.exploring and (g == 0) == (guessed.timing != 2)
        timed += [g] if g else []
        samples[1] += guessed.guessing
        guessed.observe_block(g, 0, True if guessed.guessing else None)
        guessed.guessing = False  # the session takes it with its pre-draft
        guessed.observe_round(g + 1, guessed.edge.wait(g), None, None)
    assert 1 <= samples[1] and abs(samples[1] - samples[0]) <= 1 and len(timed) in (samples[1], samples[1] - 1)


def test_an_edge_at_d_0_on_a_dear_start_retimes_its_draft_and_drafts_again():
    """Costs measured at a start (8 sessions opening at once, catching up) made drafting look dear: at d = 0 with
    pre-drafted guesses nothing timed a draft again, so the edge kept d = 0 for ever (a cross-vocabulary
    `specrelay generate` run at 0.686 cloud calls per token against 0.33-0.38). The round after a guess is
    timed: the draft wait line learns what drafting costs now, and drafting comes back."""
    est = edge(draft_s=0.002, rtt_s=0.05, predraft=True)
    for _ in range(8):
        est.observe_waited(4, 0.5)  # a dear start: 4 fresh forwards waited for at up to 3x the line each time
    policy = DraftPolicy(est, Objective.BALANCED, guesses=True)
    assert policy.choose(48) == 0
    chosen = []
    for _ in range(600):
        d = policy.choose(48)
        chosen.append(d)
        policy.observe_block(d, d, True if policy.guessing else None)
        policy.guessing = False
        policy.observe_round(d + 1, est.wait(d), None, 0.002 * d + 0.001 if d else None, steps=d)
    assert est.waited.count > 8 and min(chosen[-100:]) > 0


def test_a_fixed_length_is_kept():
    assert DraftPolicy(EdgeEstimates(), fixed=5).choose(48) == 5 and DraftPolicy(fixed=5).choose(3) == 2


def test_trees_pay_over_a_link_and_auto_keeps_chains_when_nodes_cost():
    slow = edge(draft_s=0.002, rtt_s=0.05)
    assert DraftPolicy(slow, Objective.SPEED).shape(48, "auto", None, None) is not None  # a tree beats chains
    assert DraftPolicy(slow, Objective.SPEED).shape(48, "on", None, None).nodes > 1
    dear = edge(draft_s=0.030, rtt_s=0.0002)
    assert DraftPolicy(dear, Objective.SPEED).shape(48, "auto", None, None) is None  # d = 0 wins: a chain's


def test_tree_rounds_that_wait_more_than_their_compute_price_trees_not_chains():
    """Trees were priced at their forwards' compute, chains at their measured wait: on loopback with 16 sessions
    `--trees auto` drafted 10-12 deep trees, 151 ms a round waiting for them against the chains' 41 ms (0.60x the
    chain policy's tokens/s). A tree round's wait over its forwards' compute now prices trees; chains' rounds do
    not move it, nor trees' rounds the chains' price."""
    est = edge(draft_s=0.002, rtt_s=0.05)
    policy = DraftPolicy(est, Objective.SPEED)
    shape = policy.shape(48, "auto", None, None)
    assert shape is not None and not shape.is_chain  # a tree beats chains at the compute price
    per_token, compute, before = est.per_token(), tree_compute(est, shape, shape.depth), tree_time(est, shape)
    for _ in range(30):  # the tree engine's rounds wait 4x their forwards' compute (their wait line unchanged)
        policy.observe_round(est.widths.value, est.waits.value, None, 4 * compute, shape.depth, tree=shape)
    assert est.per_token() == per_token  # the chains' draft price
    assert tree_time(est, shape) > before + 2 * compute
    assert policy.shape(48, "auto", None, None) is None  # a chain wins
    price = est.tree_line()
    for _ in range(5):  # a chain round does not move the trees' price
        policy.observe_round(est.widths.value, est.waits.value, None, 0.004, 8)
    assert est.tree_line() == price


def test_a_tree_pays_for_the_chain_jobs_that_wait_behind_it():
    """With 16 sessions over 50 ms a few trees among the chains ran 0.91-0.93x the chain policy's tokens/s: another
    session's chain job that comes in while a tree batch drafts cannot join it and waits for its end (72-130 ms,
    against 42-44 ms behind chains). A tree's price carries that wait (est.blocking: chain jobs a second x its draft
    time squared / 2, as many as come in during any draft batch); where none come in (one session) trees are priced
    as before, and once the others are gone they are again."""
    est = edge(draft_s=0.002, rtt_s=0.05)
    policy = DraftPolicy(est, Objective.SPEED)
    shape = policy.shape(48, "auto", None, None)
    assert shape is not None and not shape.is_chain
    for _ in range(10):  # a lone session's draft batches: no other chain job came in
        est.observe_draft(0, [], 0.0)
    assert policy.shape(48, "auto", None, None).widths == shape.widths
    for _ in range(200):  # 15 other sessions drafting chains, each a round of ~100 ms
        est.observe_draft(0, [], 150.0)
    fresh = EdgeEstimates()
    fresh.observe_draft(0, [], 150.0)
    assert fresh.blocking(0.02) == pytest.approx(150 * 0.02 ** 2 / 2)
    assert policy.shape(48, "auto", None, None) is None  # a chain wins
    assert not DraftPolicy(est, Objective.SPEED).shape(48, "on", None, None).is_chain  # `on` still drafts trees
    for _ in range(200):  # the others ended: chain batches see no job come in
        est.observe_draft(1.5, [(1, 0.002), (2, 0.002)], 0.0)
    assert policy.shape(48, "auto", None, None) is not None


def test_the_chain_jobs_wait_behind_a_trees_catch_up_too():
    """A tree job after the prompt runs the draft's catch-up on it alone, as its first forward: the other sessions'
    chain jobs that come in meanwhile wait behind it as behind its levels. Priced on the levels alone (the chain at
    an opening priced with nothing pre-drafted), 16 sessions over 50 ms opened with trees in 0-4 % of rounds at
    0.963x the chain policy's tokens/s (mean of 5) against 0.989x; priced on both, 0-2 % at 1.001x (mean of 4)."""
    est = edge(draft_s=0.002, rtt_s=0.05)
    policy = DraftPolicy(est, Objective.SPEED)
    assert policy.shape(48, "auto", None, None, opening=True, stretch=100) is not None  # alone: a tree pays
    chain = [e for e, _ in chain_rows(est, policy.rates(17), 16, cut=False)]
    for _ in range(200):  # 15 other sessions drafting chains
        est.observe_draft(0, [], 150.0)
    catchup = est.step(100)
    levels = tree_rows(est, chain, 16, None, None, switch=1.0)
    both = tree_rows(est, chain, 16, None, None, switch=1.0, catchup=catchup)
    for (w, e, t, *_), (w2, e2, t2, *_) in zip(levels, both):
        assert w == w2 and e == e2 and t2 - t > catchup + est.blocking(catchup)  # the levels' blocking grows too
    assert policy.shape(48, "auto", None, None, opening=True, stretch=100) is None  # a chain wins


def test_the_candidates_table_prices_each_tree_as_tree_time_does():
    """shape() prices ~60 candidates a round from a cached table (0.54 ms a call in a busy 16-session edge when
    each candidate was a TreeShape priced by tree_time): the table's T must be tree_time's, including a first-n-nodes
    tree shallower than its nominal depth and levels a pre-draft saved, its side nodes on the worker's curve."""
    est = edge(draft_s=0.002, rtt_s=0.05)
    chain = [e for e, _ in chain_rows(est, DraftPolicy(est).rates(17), 16, cut=False)]
    for saved, curve in ((0, []), (1, []), (3, []), (0, CURVE), (3, CURVE)):
        saved_levels(est, saved)
        est.curve = curve
        rows = tree_rows(est, chain, 16, None, None)
        p = est.ranks.key()
        assert any(len(row[0]) < row[1] for row in tree_table(p, saved, None, None))  # shallower than its d
        for widths, _, t, *_ in rows:
            assert t == pytest.approx(tree_time(est, TreeShape(widths)), rel=1e-12)


CURVE = [0.0086, 0.0124, 0.0152, 0.0265]  # the demo target's VERIFY at 1, 4, 16, 64 tokens (one thread), seconds


def tree_time(est: EdgeEstimates, shape: TreeShape) -> float:
    """T(S) as tree_rows states it, for one shape: the wait for the level forwards a pre-draft did not do, the
    others' chain jobs' wait behind them, R + V over its spine at the wait line and its side nodes on the worker's
    curve, H (the oracle the cached table is checked against)."""
    (w0, w1), x = est.wait_line(), tree_compute(est, shape, shape.depth - min(shape.depth, round(est.tree_saved.value)))
    rv = w0 + w1 * (shape.depth + 1) + est.more_wait(shape.depth + 1, shape.nodes - shape.depth)
    return wait_for(est.tree_line(), x) + est.blocking(x) + rv + est.handled[1].value


def saved_levels(est: EdgeEstimates, levels: float) -> None:
    """What a tree engine measured: its pre-draft had grown `levels` levels when each VERDICT came."""
    est.tree_saved = type(est.tree_saved)(clip=float("inf"))
    for _ in range(10):
        est.tree_saved.observe(levels)


def test_after_a_chain_round_a_tree_pays_its_fresh_levels_once_over_the_tokens_left():
    """A tree round's pre-draft grows the next tree (est.tree_saved); a chain round's grows a chain, so a tree right
    after a chain round drafts every level fresh. Priced as if grown, `--trees auto` over 50 ms, 1 session flapped
    (47 % tree rounds, 58.6 tok/s against 60.0 for chains, 65.3 for trees alone); priced as fresh every round, it
    never left chains for trees that win in steady state (63.2 tok/s against d = 16 trees' 68.4). The switch is
    paid once: 1 / tokens left of a fresh tree's extra time per token."""
    est = edge(draft_s=0.002, rtt_s=0.05)
    chain = [e for e, _ in chain_rows(est, DraftPolicy(est).rates(17), 16, cut=False)]
    saved_levels(est, 0)
    unsaved = tree_rows(est, chain, 16, None, None)
    saved_levels(est, 3)
    grown, fresh = tree_rows(est, chain, 16, None, None), tree_rows(est, chain, 16, None, None, switch=1.0)
    once = tree_rows(est, chain, 16, None, None, switch=1 / 48)
    assert [g[0] for g in grown] == [f[0] for f in fresh] == [o[0] for o in once] == [u[0] for u in unsaved]
    assert all(f[1:] == pytest.approx(u[1:], rel=1e-12) for f, u in zip(fresh, unsaved))
    assert all(g[2] <= o[2] <= f[2] for g, o, f in zip(grown, once, fresh))
    assert any(g[2] < o[2] < f[2] for g, o, f in zip(grown, once, fresh))
    for g, o, f in zip(grown, once, fresh):
        assert o[2] == pytest.approx(g[2] + g[1] / 48 * (f[2] - g[2]), rel=1e-9)


def test_after_a_tree_round_a_chain_pays_its_fresh_drafts_once_over_the_tokens_left(monkeypatch):
    """A tree round's pre-draft grows the next tree, not a chain: a chain right after a tree round drafts its whole
    block fresh, as a tree does after a chain round, so it is priced the same way (the switch paid once: 1 / tokens
    left of the extra per token). Priced as pre-drafted, a chain after a tree looked cheaper than it was; over 50 ms
    with one session that was measured to change few decisions (9 % of those after a tree round went to chains
    either way), but the two rules now price one switch alike."""
    est, bare = edge(draft_s=0.002, rtt_s=0.05, predraft=True), edge(draft_s=0.002, rtt_s=0.05)  # bare: no pre-draft
    a = DraftPolicy(est).rates(17)
    steady, fresh, once = (chain_rows(est, a, 16, False, switch) for switch in (0.0, 1.0, 1 / 48))
    assert [t for _, t in fresh] == pytest.approx([t for _, t in chain_rows(bare, a, 16, False)], rel=1e-12)
    assert all(s[1] <= o[1] <= f[1] for s, o, f in zip(steady, once, fresh))
    assert sum(s[1] < o[1] < f[1] for s, o, f in zip(steady, once, fresh)) >= 8
    for (e, s), (_, o), (_, f) in zip(steady, once, fresh):
        assert o == pytest.approx(s + min(1.0, e / 48) * (f - s), rel=1e-9)

    est = edge(draft_s=0.004, rtt_s=0.05, forward_s=0.01, accept=0.9, predraft=True)
    chain_ranks(est, second=0.5)
    saved_levels(est, 4)
    for compute in (0.002, 0.004, 0.008, 0.016):  # tree rounds waited 3 x their levels' compute
        est.tree_waited.observe(compute, 3 * compute)
    assert DraftPolicy(est).shape(12, "auto", None, None, after_tree=True) is not None
    monkeypatch.setattr(choose, "chain_rows", lambda est, a, top, cut=True, switch=0.0: chain_rows(est, a, top, cut))
    assert DraftPolicy(est).shape(12, "auto", None, None, after_tree=True) is None  # priced as pre-drafted


def test_auto_keeps_a_tree_it_would_switch_to_from_a_chain():
    """A tree grown by its predecessor's pre-draft is priced cheaper than one drafted fresh after a chain round, so
    where `auto` leaves a chain for a tree it must keep drafting trees. The nodes' value floor rose with the best
    modelled rate, so a grown tree's higher rate filtered every tree out and the chain came back: a tree after each
    chain, a chain after each tree (14 of 486 edges below)."""
    switched = 0
    for draft_s in (0.003, 0.005, 0.008, 0.012, 0.02):
        for forward_s, rtt_s in ((0.01, 0.0002), (0.02, 0.0002), (0.01, 0.01), (0.005, 0.05), (0.01, 0.05)):
            for accept in (0.5, 0.8):
                for levels in (4, 8):
                    est = edge(draft_s=draft_s, rtt_s=rtt_s, forward_s=forward_s, accept=accept, predraft=True)
                    saved_levels(est, levels)
                    after_chain, after_tree = (DraftPolicy(est, Objective.SPEED).shape(48, "auto", None, None, grown)
                                               for grown in (False, True))
                    switched += after_chain is not None
                    assert after_chain is None or after_tree is not None, (draft_s, forward_s, rtt_s, accept, levels)
    assert switched >= 20


def test_a_tree_is_drafted_as_priced_its_least_node_worth_its_min_value():
    """The tree engine drafts no node worth less than the shape's min_value (a node's seconds at the best rate),
    yet candidates were priced whole: on loopback `--trees auto` picked trees of 3-4 nodes whose side nodes the
    engine then left out, so they went out as chains of 2-3 (2.25-3.1 tokens a call against the chain policy's
    3.5). Every tree shape() returns now has its least node (at the rank chances) worth min_value or more."""
    trees = 0
    for rtt in (0.0002, 0.005, 0.05):
        for draft_s in (0.001, 0.002, 0.005):
            for objective in (Objective.SPEED, Objective.BALANCED):
                est = edge(draft_s=draft_s, rtt_s=rtt, accept=0.8)
                shape = DraftPolicy(est, objective).shape(48, "auto", None, None)
                if shape is None:
                    continue
                trees += 1
                p = est.ranks.key()
                table = tree_table(p, round(est.tree_saved.value), None, None)
                assert max(row[-1] for row in table if row[0] == shape.widths) >= shape.min_value
    assert trees >= 6


def test_a_trees_least_node_is_valued_as_its_e_is():
    """A tree's E is scaled to the chains' E(d) (the positions' acceptance), but its least node was held to the
    floor at its value at the class-averaged rank chances, unscaled: with those below the positions' (0.6-0.7 at rank
    0 against 0.8-0.9 per position), no tree deeper than ~10 levels passed. Valued as E is (the engine's min_value
    unscaled by the same factor), trees go as deep as the acceptance says. Over 50 ms, one session, `--trees auto`
    then drafted trees in 55-78 % of rounds at 1.025-1.115x the chain policy's tokens/s (4 runs), against 60-73 %
    at 1.049-1.110x (3 runs alternating): on the clock, within the noise."""
    for rtt in (0.02, 0.05):
        for objective in (Objective.SPEED, Objective.BALANCED):
            est = edge(draft_s=0.002, rtt_s=rtt, accept=0.9)  # the rank chances at their prior: 0.7 at rank 0
            shape = DraftPolicy(est, objective).shape(48, "auto", None, None)
            assert shape is not None and shape.depth >= 10  # valued unscaled: no tree, or 9 levels


def test_auto_takes_a_tree_only_where_it_beats_the_chain_pick_in_speed_and_tokens_per_call():
    """`--trees auto` under `balanced` picked the most tokens per call within 10 % of the best rate over chains and
    trees together, so on loopback it drafted trees slower than the chain `balanced` picks (0.965x the chain
    policy's tok/s). A tree now replaces the objective's chain pick only if modelled no slower and no fewer tokens
    per call; over 50 ms, where trees pay, auto still drafts them."""
    trees = 0
    for rtt in (0.0002, 0.005, 0.05):
        for draft_s in (0.001, 0.002, 0.005):
            for objective in (Objective.SPEED, Objective.BALANCED, Objective.CLOUD):
                est = edge(draft_s=draft_s, rtt_s=rtt, accept=0.8)
                policy = DraftPolicy(est, objective)
                shape = policy.shape(48, "auto", None, None)
                if shape is None:
                    continue
                trees += 1
                chains = chain_rows(est, policy.rates(48), 47)
                ec, tc = chains[pick(chains, objective)]
                priced = [(e, t) for w, e, t, *_ in tree_rows(est, [e for e, _ in chains], len(chains) - 1, None,
                                                             None) if w == shape.widths]
                assert any(e >= ec and e / t >= ec / tc * (1 - 1e-9) for e, t in priced)
    assert trees >= 6
    assert DraftPolicy(edge(draft_s=0.002, rtt_s=0.05, accept=0.8), Objective.BALANCED).shape(48, "auto", None,
                                                                                               None) is not None


def test_auto_prices_a_tree_after_the_prompt_as_the_chain_it_must_beat():
    """The block right after the prompt is priced at the openings' own acceptance and with the draft's catch-up on
    the prompt, a tree as the chain it must beat, and both are drafted fresh: no pre-draft grew either (the chain
    priced with a steady state's pre-drafted start made one session over 50 ms draft trees in 63-76 % of its rounds,
    86-90 % without it). Under `--trees auto` that block was a chain: one session over 50 ms drafted trees in 69-80 %
    of its rounds at 0.91-0.95x `--trees on`'s tokens/s. At an edge that has measured no verify yet (its first,
    unit-free prices) it stays a chain: 16 fresh sessions over 50 ms opened with trees and in about 1 run of 3 the
    edge stayed in trees (86 % of its rounds) at 0.94x the chain policy's tokens/s."""
    est = edge(draft_s=0.002, rtt_s=0.05)
    policy = DraftPolicy(est, Objective.BALANCED)
    assert policy.shape(48, "auto", None, None) is not None  # a tree beats chains later on
    assert policy.shape(48, "auto", None, None, opening=True) is None  # no stretch given: choose's opening path
    opened = policy.shape(48, "auto", None, None, opening=True, stretch=20)
    assert opened is not None and opened.nodes > opened.depth  # at 50 ms a tree pays right after the prompt too
    catchup, a = est.step(20), est.opening.rates(48, policy.rates(48))
    chains = chain_rows(est, a, 47, True, 1.0)  # nothing pre-drafted: every chain token is a fresh forward
    pre = edge(draft_s=0.002, rtt_s=0.05, predraft=True)  # where pre-drafts run, a chain there waits longer
    pairs = list(zip(chain_rows(pre, a, 47, True, 1.0), chain_rows(pre, a, 47)))
    assert all(t >= t0 for (_, t), (_, t0) in pairs) and any(t > t0 for (_, t), (_, t0) in pairs)
    fresh = [(e, t) for w, e, t, *_ in tree_rows(est, [e for e, _ in chains], len(chains) - 1, None, None, switch=1.0,
                                                 catchup=catchup) if w == opened.widths]  # fresh, with the catch-up
    opening_chains = [(e, t + catchup * (d > 0)) for d, (e, t) in enumerate(chains)]
    ec, tc = opening_chains[pick(opening_chains, Objective.BALANCED)]
    assert any(e >= ec and e / t >= ec / tc * (1 - 1e-9) for e, t in fresh)
    assert policy.shape(48, "auto", None, None, opening=True, stretch=100000) is None  # a dear catch-up: a chain
    for _ in range(20):  # openings the target rarely accepts: a shallower tree, or a chain, after the prompt
        policy.observe_block(4, 0, opening=True)
    rare = policy.shape(48, "auto", None, None, opening=True, stretch=20)
    assert rare is None or rare.depth < opened.depth
    assert policy.shape(48, "auto", None, None) is not None
    unmeasured = DraftPolicy(EdgeEstimates(), Objective.BALANCED)
    assert unmeasured.shape(48, "auto", None, None) is not None
    assert unmeasured.shape(48, "auto", None, None, opening=True, stretch=20) is None
    assert unmeasured.shape(48, "on", None, None, opening=True).nodes > 1  # `on`: trees only, the opening too


def test_a_tree_round_that_first_caught_up_teaches_no_tree_price():
    """A tree round right after the prompt (or after a round at d = 0) first runs the stretch the draft has not seen:
    a one-off, as a chain's catch-up is, so its wait does not teach the tree rounds' wait line."""
    est = edge(draft_s=0.002, rtt_s=0.05)
    policy, shape = DraftPolicy(est), TreeShape((2, 2, 1))
    policy.observe_round(6, 0.06, None, 0.5, steps=3, catchup=True, tree=shape)
    assert not est.tree_waited.known
    policy.observe_round(6, 0.06, None, 0.01, steps=3, tree=shape)
    assert est.tree_waited.count == 1


def test_auto_keeps_the_chain_a_session_drafts_at_its_own_acceptance_where_that_beats_the_tree():
    """Trees are priced at the pooled rates; a session's chain at its own. A prompt the draft knows well drafts a
    chain longer than the pooled one, which the tree beat in the model: one session over 50 ms, one such prompt
    ran at 0.66-0.74x the chain policy's tokens/s under `--trees auto`. A tree must now beat that chain too."""
    for objective in (Objective.SPEED, Objective.BALANCED):
        est = edge(draft_s=0.002, rtt_s=0.05)
        known = DraftPolicy(est, objective)
        for _ in range(30):
            known.observe_block(8, 8)
        assert known.shape(48, "auto", None, None) is None and known.choose(48) > 8
        fresh = DraftPolicy(est, objective)
        assert fresh.shape(48, "auto", None, None) is not None  # a fresh session: a tree
        fresh.observe_block(0, 0, opening=True)  # one token past the prompt after an opening at d = 0: priced as
        assert fresh.shape(48, "auto", None, None) is None  # an opening (it has no stretch here: a chain)
        assert fresh.shape(48, "auto", None, None, stretch=20) is not None
        fresh.observe_block(0, 0)
        assert fresh.shape(48, "auto", None, None) is not None


def test_the_policy_stays_small():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "policy_size.py")], capture_output=True, text=True,
                         check=True).stdout
    lines, constants = (int(x.split("=")[1]) for x in out.split())
    assert lines <= 600 and constants <= 12


def test_a_prompt_prefill_first_does_not_make_a_slow_cross_vocabulary_draft_pay():
    """The real cross-vocabulary pair's rounds (gemma-3-270m target, SmolLM2-135M draft, one CPU core each): the
    first VERDICT's forward ran the prompt too (14 tokens, 354 ms); the target's forward then costs ~90 ms + ~35
    ms a token (its 262k-row head), a draft forward 77 ms, one per target token. A row of 1 (d = 0) takes
    ~125 ms: drafting never pays (acceptance 0.36 measured), and the line must not take the wide first forward
    for a row of 1's cost."""
    est = EdgeEstimates(predraft=True)
    policy = DraftPolicy(est, Objective.BALANCED)
    for i, (tokens, d, forward_ms, accepted) in enumerate(((14, 4, 354, 1), (3, 2, 159, 0), (5, 4, 267, 2),
                                                            (3, 2, 175, 0))):
        est.observe_block_steps([(d + 1, d + 1)])  # a draft forward per target token, one past the block
        est.observe_draft(1, [(1, 0.077)] * (d + 1))
        policy.observe_block(d, accepted)
        hint = LoadHint(batch=1, width=d + 1, forward_us=forward_ms * 1000, tokens=tokens, token_us=30_000)
        policy.observe_round(d + 1, forward_ms * 1e-3 + 0.002, hint, 0.077 * (d + 1), d + 1, prefilled=i == 0)
    assert est.wait(0) < 0.2  # measured: 120-160 ms for rows of 1 to 3
    for objective in (Objective.SPEED, Objective.BALANCED):
        assert DraftPolicy(est, objective).choose(32) == 0


def test_cloud_accepts_a_slower_edge_and_stops_where_a_token_adds_under_min_value():
    """`cloud`: the fewest calls whatever the edge's time. A draft slower than the verify it saves (speed and
    balanced: d = 0) still drafts, up to the last token at least MIN_VALUE likely to be accepted."""
    from specrelay.edge_worker.policy.choose import MIN_VALUE

    est = edge(draft_s=0.030, rtt_s=0.0002)
    policy = DraftPolicy(est, Objective.CLOUD)
    d = policy.choose(48)
    reach = [1.0]
    for a in policy.rates(33):
        reach.append(reach[-1] * a)
    assert d > 0 and reach[d] >= MIN_VALUE > reach[d + 1]
    assert DraftPolicy(est, Objective.BALANCED).choose(48) == 0


def test_a_fixed_alignment_forward_per_round_prices_short_cross_vocabulary_drafts():
    """The real cross-vocabulary pair over 50 ms: a d = 1 round waited 170-197 ms for 3 draft forwards to cover 2
    target tokens, a d = 4 round 4-5 forwards for 5. As a ratio (0.9-1.5 a token) d = 1-2 were modelled ~10 %
    faster than d = 0 and 23 of one run's rounds drafted d = 2 (0.845x the target alone's tok/s). Forwards
    against the tokens a block covers are a line: its intercept is the round's alignment forward."""
    est = EdgeEstimates()
    for _ in range(20):
        est.observe_block_steps([(2, 3)])  # d = 1: 3 forwards for 2 target tokens (the lookahead one included)
        est.observe_block_steps([(5, 4)])  # d = 4: ...
        est.observe_block_steps([(5, 5)])  # ... 4-5 forwards for 5
    assert est.steps.at(2) == pytest.approx(3.0, abs=0.3)
    assert est.steps.at(5) == pytest.approx(4.5, abs=0.3)
    assert est.steps.at(2) > 2 * est.steps_per_token.value + 0.5  # the ratio alone: ~2.2 forwards
    steady = EdgeEstimates()
    for _ in range(20):
        steady.observe_block_steps([(5, 4)])  # one block length only: the line keeps the ratio
    assert steady.steps.at(5) == pytest.approx(4.0, abs=0.05)


def test_a_cross_vocabulary_blocks_prefixes_price_short_blocks_where_long_ones_are_drafted():
    """31 consecutive blocks of the demo cross pair (`bench calls --xv`): 6-16 target tokens each, their forwards
    from a third to three times their tokens (a draft token that spells several target tokens; a run of
    whitespace). Fitted to each block's final point alone, the line came out flat at ~10 forwards for any block, so
    a 1-token block (2 with the lookahead) was priced at 5x its 2-3 forwards and every session stopped drafting.
    Each block's prefixes (forwards until its text held 1, 2, ... target tokens) measure the short end."""
    blocks = [(12, 6), (12, 15), (9, 8), (9, 11), (6, 18), (8, 16), (12, 6), (11, 13), (12, 14), (10, 19), (11, 10),
              (8, 2), (10, 10), (12, 6), (13, 4), (12, 10), (7, 14), (8, 4), (16, 6), (11, 13), (9, 8), (12, 12),
              (12, 14), (16, 7), (8, 16), (8, 2), (14, 4), (11, 11), (9, 11), (10, 12), (15, 4)]
    final, prefixes = EdgeEstimates(), EdgeEstimates()
    for x, y in blocks:
        final.observe_block_steps([(x, y)])
        prefixes.observe_block_steps([(k, max(1, round(k * y / x))) for k in range(1, x)] + [(x, y)])
    assert final.steps.at(2) > 6
    assert 2 <= prefixes.steps.at(2) < 3.5 and prefixes.steps.at(9) > 2 * prefixes.steps.at(2)


def test_a_wide_catch_up_forward_is_not_a_dear_draft_step():
    """A forward that first feeds a session the 40 tokens it had not seen is one wide forward: the draft line
    prices forwards by their columns, so the next steps' cost is still a narrow forward's."""
    est = EdgeEstimates()
    for _ in range(10):
        est.observe_draft(2, [(80, 0.012), (2, 0.004), (2, 0.004), (2, 0.004)])
    assert est.step(2) < 0.0045 and est.step(80) > 0.010


def test_the_prompt_round_stands_in_for_the_wait_only_until_a_verify_is_measured():
    """A session's first VERIFY also runs its prompt: its latency anchors the wait only while nothing else is
    known, and the first round without a prompt replaces it."""
    est = EdgeEstimates()
    est.observe_round(5, 0.400, None, prefilled=True)
    assert abs(est.wait(4) - 0.400) < 1e-9
    est.observe_round(5, 0.100, None)
    est.observe_round(5, 0.350, None, prefilled=True)  # another session's prompt round: not a verify's wait
    assert abs(est.wait(4) - 0.100) < 1e-9


def test_one_width_takes_the_workers_slope():
    """One session drafting d = 4 all along shows the edge one row width: the wait's slope is the worker's own
    measure of a token (the hint's token_us), so d = 0's wait is that much shorter, not the same."""
    est = EdgeEstimates()
    for _ in range(20):
        hint = LoadHint(batch=1, width=5, forward_us=250_000, tokens=5, token_us=40_000)
        est.observe_round(5, 0.255, hint)
    w0, w1 = est.wait_line()
    assert abs(w1 - 0.040) < 1e-6 and abs(est.wait(0) - (0.255 - 4 * 0.040)) < 1e-6
    flat = EdgeEstimates()  # a worker that sends no slope: flat, as before it
    for _ in range(20):
        flat.observe_round(5, 0.255, LoadHint(batch=1, width=5, forward_us=250_000, tokens=5))
    assert flat.wait_line()[1] == 0.0


def test_a_row_of_1_prices_d_0_only_where_our_rows_are_the_workers_only_ones():
    """A row of 1 timed at 10 ms, then rows of 8 waiting 40 ms in forwards whose tokens cost 0.5 ms each. One
    session alone in the worker's forwards (hints: 1 row): d = 0 waits what the row of 1 waited, as a slow real
    target needs, and the line's slope stays the worker's. A secant through the row of 1 ((40 - 10) / 7 a token)
    read the jump of a forward from 1 token to a few (7 to 9 ms on loopback) as a slope up to 10x too steep and
    held `--trees on` at depth 1. Beside other sessions (4 rows a forward) the row of 1 was timed under another
    load (a fresh edge's first rounds, before the others joined), so the worker's line prices d = 0 too; and a
    round that ran a prompt already says how many rows the worker runs."""
    def measured(rows: int) -> EdgeEstimates:
        est = EdgeEstimates()
        est.observe_round(3, 0.050, LoadHint(batch=rows, tokens=3 * rows, prefill=2 * rows), prefilled=True)
        est.observe_round(1, 0.010, None)
        for _ in range(30):
            est.observe_round(8, 0.040, LoadHint(batch=rows, width=8, forward_us=20_000, tokens=8 * rows,
                                                 token_us=500))
        return est

    alone, beside = measured(1), measured(4)
    assert abs(alone.wait(0) - 0.010) < 1e-9
    assert abs(alone.wait_line()[1] - 0.0005) < 1e-9  # (1 + q) c1 B: no queue, c1 0.5 ms, B 1
    w0, w1 = alone.wait_line()
    assert abs(alone.wait(1) - (w0 + 2 * w1)) < 1e-12 and abs(alone.wait(8) - 0.040) < 0.002  # the rows of 8
    assert beside.batch.count and abs(beside.wait_line()[1] - beside.cloud.fit()[1] * beside.batch.value) < 1e-12
    w0, w1 = beside.wait_line()
    assert abs(beside.wait(0) - (w0 + w1)) < 1e-12 and beside.wait(0) > 0.020


def test_a_stall_is_not_the_draft_wait():
    """A first chain round that waited 250 ms for 2 forwards (start-up, another session's catch-up) counts as at
    most CLIP forwards' compute: one stall must not price drafting out for the rest of the run."""
    from specrelay.edge_worker.policy.estimates import CLIP

    est = edge(draft_s=0.004, rtt_s=0.0)
    policy = DraftPolicy(est, Objective.BALANCED)
    policy.observe_round(3, 0.03, None, 0.250, steps=2)
    assert wait_for(est.draft_line(), 2) <= CLIP * 2 * est.step() + 1e-9


def test_the_workers_queue_grows_the_wait_as_its_forward_does():
    """Every row of the worker's forward drafting one more token lengthens the forward (c1 B) and, when VERIFYs
    wait for the forward ahead (half a forward, the hints say), that wait too: the wait line's slope is 1.5 c1 B.
    Without a queue it is c1 B."""
    def measured(queue_us: int) -> EdgeEstimates:
        est = EdgeEstimates()
        for tokens in (3, 5, 9) * 20:
            hint = LoadHint(batch=4, width=tokens, forward_us=10_000 + 1_000 * 4 * tokens, tokens=4 * tokens,
                            queue_us=queue_us * (10 + 4 * tokens) // 10)
            est.observe_round(tokens, 0.05, hint)
        return est

    idle, queued = measured(0), measured(5_000)
    assert abs(idle.wait_line()[1] - 0.004) < 2e-4
    assert abs(queued.queue_share.value - 0.5) < 1e-6 and abs(queued.wait_line()[1] - 1.5 * idle.wait_line()[1]) < 1e-9


def test_a_session_drafts_at_its_own_acceptance_and_rests_once_its_own_samples_say_so():
    """A session drafts at its own acceptance, shrunk toward the edge's pooled rates: the prompts the draft knows
    well draft longer, those it knows badly shorter (on pooled rates they drafted 8-21 tokens, finished last, and a
    batch of 16 waited for them), and where even one token does not pay at its own rate it rests at d = 0 (`bench
    sweep --xv`, one session on loopback: with whether the pooled rates' call such a prompt drafted d = 1 at
    0.51-0.61x d = 0's tokens/s). Until its own samples weigh PRIOR_WEIGHT rounds, whether is the pooled rates'
    call: one or two bad blocks after the prompt (across vocabularies, common) must not rest a session the draft
    knows well (`bench calls --xv`: sessions at d = 0 after their first block for 13-30 rounds, then accepting as
    the others did)."""
    for rtt in (0.0002, 0.05):  # a draft forward of 8 ms against a verify of 10: on loopback d = 2 at 0.8
        est = edge(draft_s=0.008, rtt_s=rtt)
        a, b, c = DraftPolicy(est), DraftPolicy(est), DraftPolicy(est)
        for _ in range(30):
            b.observe_block(8, 8)  # a prompt the draft knows well
        for _ in range(3):
            a.observe_block(8, 0)  # a's rejections: too few to rest on
        own = pick(chain_rows(est, a.own_rates(33), 32), a.objective)
        assert 1 <= a.choose(48) < c.choose(48) == DraftPolicy(est).choose(48) < b.choose(48)
        assert a.own_rates(1)[0] < c.own_rates(1)[0] == est.acceptance.rates(1)[0] and (own == 0) == (rtt < 0.01)
        for _ in range(int(PRIOR_WEIGHT)):
            a.observe_block(8, 0)
        assert (a.choose(48) == 0) == (rtt < 0.01)  # over 50 ms one more token a call pays for its draft


def test_a_resting_session_explores_by_its_own_rounds_at_d_0_beside_a_drafting_one():
    """Its own rates decide whether a session drafts, so its own samples must come: a session resting at d = 0
    explores by its own rounds there, at about EXPLORE_SHARE, also beside a session that drafts every round (whose
    samples reset a count of the edge's rounds: the resting one would never explore)."""
    est = edge(draft_s=0.008, rtt_s=0.0002)
    good, bad = DraftPolicy(est), DraftPolicy(est)
    for _ in range(10):
        bad.observe_block(8, 0)  # a prompt the draft knows badly
    rested = explored = 0
    for _ in range(400):
        d = good.choose(48)
        good.observe_block(d, d)
        b = bad.choose(48)
        rested, explored = rested + (b == 0), explored + bad.exploring
        bad.observe_block(b, 0)
        bad.observe_round(b + 1, est.wait(b), None, None)
        assert d >= 1
    assert rested >= 350 and 1 <= explored <= 400 // 30


def test_a_round_is_priced_with_the_edges_own_time_besides_its_waits():
    """A drafting round costs the edge more than its waits: it takes the pre-draft back and applies a longer VERDICT
    (across vocabularies, retokenizing it). `bench sweep --xv`, one session on loopback: 1.1-1.4 ms a drafting round
    against 0.2 ms at d = 0, 7-10 % of a round there, and auto ran at 0.92x d = 0 drafting 2 tokens a round. Priced
    (H, by whether the round drafted), d = 0 wins where drafting won by less."""
    est = edge(draft_s=0.003, rtt_s=0.0002, forward_s=0.006, accept=0.55)
    policy = DraftPolicy(est, Objective.SPEED)
    assert policy.choose(48) > 0
    for d in (0, 2) * 20:
        policy.observe_round(d + 1, est.wait(d), None, None, handled_s=0.0013 if d else 0.0002)
    assert est.handled[0].value == pytest.approx(0.0002) and est.handled[1].value == pytest.approx(0.0013)
    assert policy.choose(48) == 0


def test_the_block_after_the_prompt_is_not_an_acceptance_sample():
    """The first block of a session starts where the prompt ends, where a draft of another tokenizer is almost
    never accepted: counted, a wave of fresh sessions took the edge to d = 0 before anything else was measured.
    After an opening at d = 0 the next block starts one token past the prompt, where the demo pair's draft is
    accepted 10 % of the time (68 % later): it opens too, else one sure rejection in a session's first few own
    samples rested it for the rest of its tokens (`bench calls --xv`: 34 of 41 sessions' first drafted block
    rejected at its first token)."""
    est = EdgeEstimates()
    policy = DraftPolicy(est)
    before = est.acceptance.rates(3)
    for _ in range(8):
        policy.observe_block(4, 0, opening=True)
    assert est.acceptance.rates(3) == before
    policy.observe_block(4, 0)
    assert est.acceptance.rates(1)[0] < before[0]
    for opening_d in (0, 4):
        est = EdgeEstimates()
        session = DraftPolicy(est)
        session.observe_block(opening_d, 0, opening=True)
        session.observe_block(4, 0)  # after an opening at d = 0: an opening too; after a drafting one: a sample
        assert (session.own.reached == []) == (opening_d == 0) and est.opening.reached[0] == 1
        session.observe_block(4, 0)
        assert session.own.reached[0] == pytest.approx(2 - (opening_d == 0), abs=0.01)


def test_the_block_after_the_prompt_is_priced_at_the_openings_own_acceptance():
    """Openings are counted apart (a draft of another tokenizer is rarely accepted where a prompt ends): once they
    are seen to fail, the block after the prompt drafts nothing while later blocks still draft; so does the block
    after an opening at d = 0, one token past the prompt."""
    est = edge(draft_s=0.03, rtt_s=0.05, forward_s=0.1, accept=0.7, predraft=True)
    policy = DraftPolicy(est, Objective.BALANCED)
    steady = policy.choose(48)
    assert steady > 0 and policy.choose(48, stretch=20, opening=True) > 0  # no opening measured: the pooled rates
    for _ in range(20):
        policy.observe_block(4, 0, opening=True)
    assert policy.choose(48, stretch=20, opening=True) == 0
    assert policy.choose(48) == steady
    policy.observe_block(0, 0, opening=True)  # at d = 0: the next block, a token past the prompt, is priced as one
    assert policy.choose(48, stretch=20) == 0  # (`bench sweep --xv`, one session: 1.04x against 1.00x unpriced)
    policy.observe_block(0, 0)
    assert policy.choose(48, stretch=20) == steady


def test_an_opening_that_must_first_catch_up_on_the_prompt_drafts_only_where_the_catch_up_pays():
    """A drafting opening first runs the prompt through the draft; d = 0 pays none of that (a pre-draft runs it
    during the wait, or a later drafting round pays it). So where drafting pays a little, the block after a
    prompt verifies a row of 1 while later blocks draft; a prompt the draft has seen costs nothing to catch up."""
    for predraft in (True, False):
        est = edge(draft_s=0.04, rtt_s=0.05, forward_s=0.1, accept=0.5, predraft=predraft)
        policy = DraftPolicy(est, Objective.BALANCED)
        assert policy.choose(48) > 0 and policy.choose(48, stretch=0, opening=True) > 0
        assert [policy.choose(48, stretch=s, opening=True) for s in (20, 40, 60)] == [0, 0, 0]


def test_a_first_wide_forward_prices_a_narrow_one_in_proportion():
    """An edge's first draft forward is often a prompt's catch-up (many columns): until widths vary, a narrow
    forward is priced in proportion to it, not at the wide one's cost (which sent fresh edges to d = 0)."""
    est = EdgeEstimates()
    est.observe_draft(8, [(160, 0.020)])
    assert est.step(8) < 0.005
    est.observe_draft(8, [(8, 0.004)] * 6)
    assert 0.003 < est.step(8) < 0.005


def test_a_slow_first_narrow_forward_does_not_price_the_draft_for_good():
    """A cold first forward of one column sets the slope prior at its whole time (10x the rest). Where widths then
    stay the same (one session's chains) the prior keeps the slope: the line through the means then crosses x = 0
    below 0, and clamping c alone priced every forward at the cold one's cost (CI's failing tree test: (0, 1.9 ms)).
    With c = 0 the fit is the least squares through the origin: the forwards measured since set the price."""
    est = EdgeEstimates()
    est.observe_draft(1, [(1, 0.050)])
    est.observe_draft(1, [(1, 0.005)] * 40)
    assert 0.004 < est.step(1) < 0.007
    est.observe_draft(2, [(1, 0.005), (3, 0.007)] * 20)  # widths vary: the data's own line (c 4 ms, s 1 ms)
    c, s = est.draft.fit()
    assert 0.003 < c < 0.005 and 0.0005 < s < 0.0015 and 0.004 < est.step(1) < 0.007


def test_a_drafting_session_resets_its_exploring_count():
    """Rounds at d = 0 scattered between its drafting rounds (the width probe) are no stretch without acceptance
    samples: they must not add up to an exploring round (d = 1) that cuts a drafting session's length."""
    est = edge(draft_s=0.002, rtt_s=0.05)
    policy = DraftPolicy(est)
    d = policy.choose(48)
    assert d > 1
    for _ in range(200):
        policy.observe_block(0, 0)  # a session's round at d = 0 ...
        policy.observe_block(d, d)  # ... between drafting ones
    assert policy.choose(48) > 1 and not policy.exploring


def test_a_mean_whose_first_observation_is_0_still_learns():
    """The clip (one stall is not a trend) is relative to the mean: at a mean of 0 it would hold it at 0 for ever
    (a first tree round with nothing pre-drafted kept every later pre-draft's saved levels out)."""
    from specrelay.edge_worker.policy.estimates import EWMean

    mean = EWMean()
    for x in (0.0, 2.0, 2.0):
        mean.observe(x)
    assert mean.value > 1.0


def test_a_rounds_fixed_draft_wait_is_priced_once_a_round_not_per_forward():
    """Demo pair, 8 sessions: rounds of 3 fresh forwards waited 32 ms for the draft, rounds of 16-32 forwards
    5.5 ms a forward (a part per round: the loop, queueing behind other sessions' batches and pre-drafts). As a
    mean per forward (10.7 ms at 3) d = 8 was priced 1.9x d = 3's draft wait, and an edge that started at d = 3-4
    stayed there. A line prices d = 8 at its measured ~64 ms, and one length alone keeps a forward's compute as
    its slope: longer chains are not priced at the short rounds' overhead per forward."""
    est = edge(draft_s=0.004, rtt_s=0.0)
    for _ in range(20):
        est.observe_waited(3, 0.032)
        est.observe_waited(16, 0.105)
    assert wait_for(est.draft_line(), 8) == pytest.approx(0.032 + 5 * 0.073 / 13, rel=0.05)
    assert wait_for(est.draft_line(), 0) == 0.0
    one = edge(draft_s=0.004, rtt_s=0.0)
    for _ in range(40):
        one.observe_waited(3, 0.032)  # one length only: its slope is a forward's compute
    assert wait_for(one.draft_line(), 3) == pytest.approx(0.032, rel=0.02)
    assert wait_for(one.draft_line(), 8) == pytest.approx(0.032 + 5 * one.step(), rel=0.02)
    assert wait_for(one.draft_line(), 8) < 0.7 * 8 * 0.032 / 3  # the mean per forward: 85 ms


def test_a_tree_rounds_fixed_draft_wait_is_priced_once_a_round_too():
    """Trees were priced at the mean of their rounds' wait over compute: a part per round (20 ms here) made small
    trees' ratio 3 and priced a deep tree's levels at 3x their compute. The tree wait line pays it once."""
    est = edge(draft_s=0.002, rtt_s=0.05)
    policy = DraftPolicy(est, Objective.SPEED)
    small, deep = TreeShape((1, 2)), TreeShape((1, 2, 2, 2, 2, 2, 2, 2))
    for _ in range(20):
        for shape in (small, deep):
            compute = tree_compute(est, shape, shape.depth)
            policy.observe_round(est.widths.value, est.waits.value, None, 0.020 + compute, shape.depth, tree=shape)
    c, k = est.tree_line()
    assert c == pytest.approx(0.020, rel=0.05) and k == pytest.approx(1.0, rel=0.05)
    compute = tree_compute(est, deep, deep.depth)
    assert wait_for(est.tree_line(), compute) == pytest.approx(0.020 + compute, rel=0.05)


def test_tree_rows_stops_early_only_where_no_candidate_reaches_the_floor():
    """shape() weighs trees every round (with 16 sessions on loopback ~6 % of the edge's time, ~40 % of it building
    rank tables for a tree none of which reached the floor). tree_rows now stops at the first candidate whose least
    node cannot reach the floor at any depth's scale, and skips the tables where every tree's side node is under it:
    what it returns must be exactly the full scan's rows at or over the floor, for falling ranks and for others."""
    for accept, ranks in ((0.8, [(0, 4, 0)] * 30), (0.5, [(0, 4, 1)] * 30), (0.8, [(1, 3, 2), (2, 4, None)] * 20)):
        est = edge(draft_s=0.004, rtt_s=0.0005, accept=accept, predraft=True)
        for bucket, children, accepted in ranks:
            est.ranks.observe(bucket, children, accepted)
        chain = [e for e, _ in chain_rows(est, est.acceptance.rates(33), 32)]
        top = len(chain) - 1
        full = tree_rows(est, chain, top, None, None, 0.0, 0.05)
        values = sorted({r[3] for r in full})
        assert len(values) > 3
        for floor in (0.0, values[0], values[len(values) // 2], values[-1], values[-1] * 1.01, 10.0):
            assert tree_rows(est, chain, top, None, None, floor, 0.05) == [r for r in full if r[3] >= floor]


def test_the_estimators_cached_reads_follow_every_observation_and_prior():
    """EWLine.fit and RankAcceptance.mean_p_rank are read tens of times a round and cached between observations:
    a new point, a new prior slope (the worker's token_us, the draft's first forward) or a tree verdict must show."""
    est = edge(draft_s=0.004, rtt_s=0.0005)
    before = est.cloud.fit()
    est.cloud.slope = 0.01  # a hint's token_us
    assert est.cloud.fit()[1] > before[1]
    est.cloud.observe(40, 1.0)
    assert est.cloud.fit() != before
    p = list(est.ranks.mean_p_rank())
    est.ranks.observe(0, 4, None)
    assert est.ranks.mean_p_rank() != p
    p = list(est.ranks.mean_p_rank())
    est.ranks.decay()
    est.ranks.observe(0, 4, 3)
    assert est.ranks.mean_p_rank() != p


def test_a_tree_table_grown_deepest_first_holds_each_depths_own_tree():
    """tree_table grows the deepest tree first and takes a shallower one as its first nodes where those fit in its
    levels (a table miss, each time the rank chances move, took ~2.5 ms: a third of shape()'s time in a short run):
    every candidate must be the tree grown for its own depth, for falling ranks and for others."""
    for p in ((0.81, 0.1, 0.03, 0.02), (0.5, 0.2, 0.1, 0.05), (0.6, 0.1, 0.2, 0.05), (0.95, 0.03, 0.01, 0.0)):
        table = tree_table(p, 0, None, None)
        assert {row[1] for row in table} == set(range(1, choose.MAX_LEN + 1))
        for w, d, r, n, *_ in table:
            totals, depths = choose.static_tree.__wrapped__(p, d, min(choose.MAX_DRAFT, 4 * d))
            assert w == tuple(depths[:n].count(k) for k in range(1, max(depths[:n]) + 1))
            assert r * sum(p[0] ** k for k in range(1, d + 1)) == pytest.approx(totals[n - 1], rel=1e-12)


def chain_ranks(est: EdgeEstimates, second: float, third: float = 0.1, rounds: int = 200) -> None:
    """Greedy chain verdicts (3 accepted, the 4th rejected) where the target took the draft's second choice in
    `second` of the rejections, its third in `third`, none of its first four in the rest."""
    for i in range(rounds):
        u = (i * 0.6180339887) % 1.0
        target = 11 if u < second else 12 if u < second + third else 99
        est.ranks.observe_chain([([10, 11, 12, 13], 3)] * 4, 3, target)


def test_a_trees_side_nodes_are_priced_on_the_workers_curve_not_the_chains_line():
    """--trees auto, 1 session over 50 ms, took trees in 60-91 % of rounds in some runs (1.12-1.18x the chain
    policy) and in 1-9 % in others (0.96-1.04x): the cloud's cost line, fitted over one session's rows of 1-13
    tokens, read 0.4-0.9 ms a token, while the worker's VERIFY costs ~0.25 ms a token past a few tokens (8.6 ms
    at 1, 13.1 at 5, 26.5 at 61): a tree of 30 nodes was priced 1.6-4x too dear, and chain rounds never showed
    otherwise. Its spine stays on the line (a chain-shaped tree costs its chain), its side nodes go on the worker's
    curve, which it measured at start (LoadHint.curve_us)."""
    est = edge(draft_s=0.002, rtt_s=0.05, forward_s=0.008, per_token_s=0.0007)
    chain_ranks(est, second=0.25)
    assert DraftPolicy(est, Objective.BALANCED).shape(48, "auto", None, None) is None  # the lock-out
    est.observe_round(9, 0.06, LoadHint(batch=1, forward_us=14_000, tokens=9, curve_us=[int(1e6 * t) for t in CURVE]))
    assert est.curve == pytest.approx(CURVE)
    shape = DraftPolicy(est, Objective.BALANCED).shape(48, "auto", None, None)
    assert shape is not None and shape.nodes > 2 * shape.depth  # a tree, not a chain
    b = est.batch.value  # the extra tokens' cost follows the curve: 4 -> 16 tokens at its slope there
    assert est.more_wait(4, 12) == pytest.approx((1 + est.queue_share.value) * (CURVE[2] - CURVE[1]) * b, rel=1e-9)
    assert est.more_wait(64, 64) == pytest.approx(est.more_wait(16, 48) * 64 / 48, rel=1e-9)  # past: its last slope
    est.observe_round(9, 0.06, LoadHint(batch=1, forward_us=14_000, tokens=9, curve_us=[1, 2]))  # malformed: kept
    assert est.curve == pytest.approx(CURVE)


def test_auto_weighs_trees_once_in_a_while_where_tree_rounds_committed_less_a_second_than_chain_rounds():
    """On loopback with one session the model took trees in 1-29 % of rounds and ran at 0.87-0.97x the chain policy
    (0.86x with trees every round): there a tree and a chain are priced within the model's own error of each other.
    What chain rounds and tree rounds committed a second is measured; where tree rounds committed less, `auto`
    weighs trees once in 1 / EXPLORE_SHARE turns (weighing costs ~0.5 ms a call), and a tree it then drafts goes on
    while the model keeps picking trees."""
    est = edge(draft_s=0.002, rtt_s=0.05, forward_s=0.008, per_token_s=0.0007)
    chain_ranks(est, second=0.25)
    est.curve = CURVE
    policy = DraftPolicy(est, Objective.BALANCED)

    def turns(n: int, after_tree: bool = False) -> int:  # the turns that drafted a tree
        return sum(policy.shape(48, "auto", None, None, after_tree) is not None for _ in range(n))

    assert turns(5) == 5  # nothing measured: the model weighs every turn (and takes trees)

    def paid(tree: bool, tokens: int, seconds: float) -> None:  # PRIOR_WEIGHT rounds (the model's inputs unmoved)
        for _ in range(int(PRIOR_WEIGHT)):
            for x, y in zip(est.paid[tree], (tokens, seconds)):
                x.observe(y)

    paid(tree=False, tokens=5, seconds=0.080)  # chains: 62.5 tokens a second
    paid(tree=True, tokens=6, seconds=0.105)   # trees: 57
    assert turns(3 * math.ceil(1 / EXPLORE_SHARE)) == 3  # once in 1 / EXPLORE_SHARE turns
    assert turns(5, after_tree=True) == 5        # a tree goes on while the model picks trees
    paid(tree=True, tokens=8, seconds=0.090)     # trees now commit more a second than chains: every turn
    assert turns(5) == 5
    for tree, prefilled in ((True, False), (False, True), (False, False)):  # what a VERDICT's round paid, by kind
        shape = TreeShape((1, 2, 2)) if tree else None  # (a round that ran its prompt too is not one)
        policy.observe_round(9, 0.064, None, 0.020, prefilled=prefilled, tree=shape, handled_s=0.001, committed=4)
    assert [x.count for pair in est.paid for x in pair] == [5, 5, 9, 9]
    assert est.paid[0][1].value == pytest.approx(0.080 + (0.085 - 0.080) / est.paid[0][1].weight)



def test_the_guard_weighs_each_rounds_yield_against_its_own_sessions_best_chain():
    """The guard compared what tree rounds and chain rounds committed a second pooled over the edge's sessions, and
    `auto` takes trees on the prompts the draft knows well: there tree rounds out-committed the chain rounds of the
    prompts it knows badly, so trees were not vetoed where they lost to the chains of their own prompts (one session
    on loopback: tree rounds 0.12-0.14 tokens a ms against 0.11-0.13). Each round's yield is now counted over its
    session's best modelled chain rate (4 runs alternating there: 0.968x the chain policy against 0.910x)."""
    est = edge(draft_s=0.002, rtt_s=0.05, forward_s=0.008, per_token_s=0.0007)
    easy, hard = DraftPolicy(est, Objective.BALANCED), DraftPolicy(est, Objective.BALANCED)
    for _ in range(10):  # the prompt the draft knows well, and one it knows badly (their own samples)
        easy.own.observe(8, 8, None), hard.own.observe(8, 1, None)

    def best(policy: DraftPolicy) -> float:  # tokens a second of its best chain at its own rates
        return max(e / max(t, 1e-12) for e, t in chain_rows(est, policy.own_rates(MAX_LEN + 1), MAX_LEN))

    assert best(easy) > 2 * best(hard)
    for _ in range(int(PRIOR_WEIGHT)):  # trees on the easy prompt at 0.8x its chains, chains on the hard at 1.0x
        easy.observe_round(9, 0.01, None, 0.01, tree=TreeShape((1, 2, 2)), handled_s=0.0,
                           committed=0.8 * best(easy) * 0.02)
        hard.observe_round(9, 0.01, None, 0.01, handled_s=0.0, committed=best(hard) * 0.02)
    (chain_n, chain_s), (tree_n, tree_s) = est.paid
    assert tree_s.value == chain_s.value == pytest.approx(0.02)  # trees committed more tokens a second, less than
    assert tree_n.value / tree_s.value == pytest.approx(0.8, rel=0.05)  # their own chains' best would have
    assert chain_n.value / chain_s.value == pytest.approx(1.0, rel=0.05)
    easy.shape(48, "auto", None, None, after_tree=False)  # so trees are vetoed
    assert est.vetoed == 1

def test_greedy_chains_teach_the_trees_rank_acceptance():
    """A tree's side branches were priced at the ranks' prior (0.35 for a later sibling) until trees had been
    drafted: on loopback, where they were taken in 5-7 % of rounds, modelled E overestimated the side branches by
    1.3-1.5 tokens a round. A greedy chain's rejection shows which of the draft's likeliest ids the target took:
    what a tree node there would have learnt. Accepted positions count as first children taken."""
    est = EdgeEstimates()
    chain_ranks(est, second=0.2, third=0.05)
    p = est.ranks.mean_p_rank()
    assert p[0] == pytest.approx(0.75, abs=0.03)  # 3 of 4 positions took the first choice
    assert p[1] == pytest.approx(0.25 * 0.2, abs=0.015) and p[2] == pytest.approx(0.25 * 0.05, abs=0.01)
    est.ranks.observe_chain([([10, 11, 12, 13], 3)], 0, 13)  # a one-token chain, rejected: the 4th choice
    assert est.ranks.reached[3][3] > 0 and est.ranks.accepted[3][3] == pytest.approx(1.0)


def test_the_rank_key_holds_within_two_percent():
    """The tree tables are cached by the rank chances to the percent (~0.9 ms a miss); chains move them a little
    every round, and a chance at a rounding edge missed the cache round after round (shape() 0.85 ms a call on
    loopback, 2 % of a round). Held within one percent, 38 of 188 table lookups still missed with one session on
    loopback (8 within two). The key holds until a chance moves more than two percent from it."""
    est = EdgeEstimates()
    chances = iter([[0.7, 0.0449, 0.02, 0.0], [0.7, 0.0451, 0.02, 0.0], [0.7, 0.058, 0.02, 0.0]] * 4
                   + [[0.7, 0.068, 0.02, 0.0]])
    est.ranks.mean_p_rank = lambda: next(chances)  # at a rounding edge, a percent and more, then past two from it
    keys = [est.ranks.key() for _ in range(12)]
    assert keys == [(0.7, 0.04, 0.02, 0.0)] * 12  # rounded, each call would miss the cache
    assert est.ranks.key() == (0.7, 0.07, 0.02, 0.0)
    est = EdgeEstimates()
    chain_ranks(est, second=0.2)
    assert est.ranks.key() == tuple(round(x, 2) for x in est.ranks.mean_p_rank())


def test_a_trees_side_nodes_add_their_reach_at_the_rank_chances_not_the_chains_scale():
    """A tree's E was its chain's E(d) - 1 scaled by the tree's value over its spine's: where the positions'
    acceptance (0.8-0.9 deep in a chain) is above the class-averaged rank-0 chance (0.6-0.75), its side nodes were
    worth up to twice their reach. Rarely drafted trees then committed far less than modelled (16 sessions over
    50 ms: side branches 3.03 tokens a tree modelled, 1.14 committed; loopback 2.26 against 0.75; one session over
    50 ms, where trees are drafted in runs, 1.06 against 0.93). Now its spine is its chain and each side node adds
    its reach at the rank chances: E(S) = E(d) + value - spine."""
    est = edge(draft_s=0.002, rtt_s=0.05, accept=0.9)
    chain_ranks(est, second=0.3)
    p = est.ranks.key()
    chain = [e for e, _ in chain_rows(est, DraftPolicy(est).rates(17), 16, cut=False)]
    rows = tree_rows(est, chain, 16, 8, None)  # trees of 8 levels: one table row per shape
    table = {row[0]: row for row in tree_table(p, round(est.tree_saved.value), 8, None)}
    assert len(rows) == len(TREE_FILL)
    for widths, e, *_ in rows:
        _, d, r, n, *_, spine, _ = table[widths]
        side = r * spine - spine  # the side nodes' reach: the tree's value less its spine's
        assert 0 < side and e == pytest.approx(chain[d] + side, rel=1e-12)
        assert e < 1.0 + r * (chain[d] - 1.0)  # what the scale made of it here (E(d) - 1 > spine)


def test_a_tree_after_a_chain_round_pays_its_fresh_levels_as_often_as_trees_switch():
    """A tree after a chain round drafts every level fresh (the chain round's pre-draft grew a chain). Paid once
    over the tokens left, that suits trees drafted in runs (one session over 50 ms: 76-90 % of rounds); where trees
    came one at a time (loopback 5-7 %, 16 sessions over 50 ms 6 %) each paid it whole and was priced at a fraction
    (16 sessions: tree rounds modelled at 226 ms, measured 280). The share of rounds that drafted a tree f says
    how often a tree round switches, 1 - f: a tree after a chain pays at least that share of its fresh levels."""
    est = edge(draft_s=0.004, rtt_s=0.01, accept=0.9)  # a short link: a tree wins by a little
    chain_ranks(est, second=0.3)
    saved_levels(est, 3)
    for compute in (0.002, 0.004, 0.008, 0.016):  # tree rounds waited 2 x their levels' compute
        est.tree_waited.observe(compute, 2 * compute)
    chain = [e for e, _ in chain_rows(est, DraftPolicy(est).rates(17), 16, cut=False)]
    grown, once = tree_rows(est, chain, 16, None, None), tree_rows(est, chain, 16, None, None, switch=1 / 48)
    whole = tree_rows(est, chain, 16, None, None, switch=1 / 48, runs=1.0)
    fresh = tree_rows(est, chain, 16, None, None, switch=1.0)
    for g, o, w, f in zip(grown, once, whole, fresh):
        assert g[2] < o[2] < w[2] == pytest.approx(f[2], rel=1e-12)
    for share, rounds in ((1.0, 40), (0.0, 40)):
        for _ in range(rounds):
            DraftPolicy(est).observe_block(8, 5, tree=bool(share))
        assert est.tree_share.value == pytest.approx(share, abs=0.5 ** (rounds / 35))
    seen = {}
    for share in (0.9, 0.05):
        est.tree_share.value = share
        for name, after in (("after_chain", False), ("after_tree", True)):
            seen[share, name] = DraftPolicy(est).shape(48, "auto", None, None, after_tree=after)
    assert seen[0.9, "after_chain"] is not None and seen[0.05, "after_tree"] is not None
    assert seen[0.05, "after_chain"] is None  # trees one at a time: a tree after a chain round is not worth it


def test_pooled_rates_are_computed_once_between_two_verdicts():
    """Every session's choices read the edge's pooled rates (a few times a round each): they are computed once until
    the next verdict's counts, which show at once; rates toward a prior (a session's own) are not cached."""
    counts, fresh = AcceptanceCounts(), AcceptanceCounts()
    first = counts.rates(8)
    assert counts.rates(8) is first and counts.rates(4) == first[:4]
    for c in (counts, fresh):
        c.observe(4, 1)
    assert counts.rates(8) == fresh.rates(8) != first
    prior = [0.5] * 8
    assert counts.rates(8, prior) != counts.rates(8) and counts.rates(8, prior) is not counts.rates(8, prior)
