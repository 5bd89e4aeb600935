"""The draft policy's one objective rule and its candidates (chains d = 0..top, trees), and the per-session
policy the edge's session asks each round (edge_worker/policy/__init__.py states the model). Pure."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from functools import lru_cache
from itertools import accumulate

from ...common.protocol import MAX_DRAFT, LoadHint, Objective
from ..trees.tree import TreeShape
from .estimates import CLIP, PREDRAFT_SHARE, PRIOR_WEIGHT, AcceptanceCounts, EdgeEstimates

MAX_LEN = 32           # the longest chain, the deepest tree auto drafts (past it a demo pair's reach is ~0)
TREE_FILL = (1.5, 2, 3, 4)  # tree candidates per depth D: ceil(f x D) nodes (up to MAX_BRANCH per level on average)
TOLERANCE = {Objective.SPEED: 0.0, Objective.BALANCED: 0.10, Objective.CLOUD: 1.0}  # share of the best modelled
                       # rate given up for more tokens a call (balanced's promise: within 10 %; cloud: any)
EXPLORE_SHARE = 0.03   # at d = 0, a round drafts d = 1 (an acceptance sample) once the rounds since the last took
                       # 1 / EXPLORE_SHARE x its draft's cost (its catch-up): where drafting does not pay, ~3 %
MIN_VALUE = 0.01       # a draft token (a chain's, a tree node) less likely than this to be accepted is never
                       # drafted: it adds under 1 % of a token per call


def pick(rows: list[tuple[float, float]], objective: Objective) -> int:
    """The one objective rule, for chains and trees: of the candidates (E, T) whose rate E / T is within the
    objective's tolerance of the best, the most tokens per call E (ties: the first; order them cheapest first)."""
    rates = [e / max(t, 1e-12) for e, t in rows]
    floor = (1 - TOLERANCE[objective]) * max(rates) * (1 - 1e-9)
    return max((i for i, r in enumerate(rates) if r >= floor), key=lambda i: (rows[i][0], -i))


def chain_rows(est: EdgeEstimates, a: list[float], top: int, cut: bool = True,
               switch: float = 0.0) -> list[tuple[float, float]]:
    """(E(d), T(d)) for d = 0..top at acceptance a_0..a_top (docs/policy.md): T(d) = D(F(d + lookahead - the
    pre-drafted start: P_{d+1} x what fits the wait, x 1 - `switch` x E(d))) + R + V(d) + H (F: est.steps, D:
    est.draft_line). `switch`: after a tree round 1 / tokens left (a fresh chain's extra time paid once), opening: 1."""
    rows, e, p, line, h = [(1.0, est.wait(0) + est.handled[0].value)], 1.0, a[0], est.draft_line(), est.handled[1].value
    share = PREDRAFT_SHARE / max(est.per_token(), 1e-12) if est.predraft and est.draft.known else 0.0
    (f0, f1), (w0, w1), ahead = est.steps.fit(), est.wait_line(), est.lookahead  # F(x) = f0 + f1 x (x > 0 tokens)
    for d in range(1, top + 1):
        if cut and p < MIN_VALUE:  # the d-th token's chance to be accepted (P_d) under MIN_VALUE: no longer drafted
            break
        e, p, wait = e + p, p * a[d], w0 + w1 * (d + 1)
        saved = p * min(d, max(0, int(share * wait) - 1)) * (1 - min(1.0, e * switch))  # the guess, the next start
        rows.append((e, wait_for(line, f0 + f1 * x if (x := d + ahead - saved) > 0 else 0.0) + wait + h))
    return rows


@lru_cache(maxsize=256)
def static_tree(p: tuple[float, ...], depth: int, nodes: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """The best tree within `depth` levels at rank chances p, grown node by node by reach: running values, depths."""
    heap, totals, depths, total = [(-p[0], 1, 0, 1.0)], [], [], 0.0
    while heap and len(totals) < nodes:
        v, k, r, up = heapq.heappop(heap)
        totals.append(total := total - v)
        depths.append(k)
        if k < depth:
            heapq.heappush(heap, (v * p[0], k + 1, 0, -v))
        if r + 1 < len(p):
            heapq.heappush(heap, (-up * p[r + 1], k, r + 1, up))
    return tuple(totals), tuple(depths)


def wait_for(line: tuple[float, float], x: float) -> float:
    """A round's wait for its draft at a wait line (c, s): c + s x (x: fresh forwards, or levels' compute; 0: none)."""
    return line[0] + line[1] * x if x > 0 else 0.0


def waited_columns(widths: tuple[int, ...], steps: int) -> int:
    """Columns of a tree's last `steps` level forwards (the root's 1, then each level's nodes above the last)."""
    return sum((1, *widths[:-1])[-steps:]) if steps > 0 else 0


def tree_compute(est: EdgeEstimates, shape: TreeShape, steps: int) -> float:
    """Seconds of draft compute in a tree's last `steps` level forwards (each t(rows x its columns): step_line)."""
    return max(0, steps) * (line := est.step_line())[0] + line[1] * est.rows.value * waited_columns(shape.widths, steps)


@lru_cache(maxsize=512)
def tree_table(p: tuple[float, ...], saved: int, depth: int | None,
               nodes: int | None) -> tuple[tuple[tuple[int, ...], int, float, int, int, int, float, float], ...]:
    """The tree candidates at rank chances p (tree_rows prices them with what changes every round): (widths, depth d,
    value / spine, nodes, level forwards waited for, their columns, spine, its least node's value: the last grown),
    the most valuable least node first. Its E is E_chain(d) + value - spine (side nodes at the rank chances)."""
    out, big = [], ((), (MAX_DRAFT + 1,))  # the last tree grown (deepest first); a sentinel as deep as none can be
    for d in [depth] if depth else [] if depth is not None else range(MAX_LEN, 0, -1):  # not by `top`: a miss costs
        if max(big[1][:(grow := min(MAX_DRAFT, nodes or 4 * d))], default=0) > d:  # ~1 ms; a deeper tree's first
            big = static_tree(p, d, grow)  # `grow` nodes within d levels are this one's (its heap popped the same)
        totals, depths = big[0][:grow], big[1][:grow]
        spine = sum(p[0] ** k for k in range(1, d + 1))  # a path's value: what the chain's E(d) - 1 scales
        for n in sorted({min(nodes, len(totals))} if nodes else {math.ceil(f * d) for f in TREE_FILL}):
            if d < n <= len(totals) or nodes:  # its first n nodes per level (a node comes after its parent)
                value, w = totals[n - 1], tuple(Counter(depths[:n]).values())
                steps = len(w) - min(len(w), saved)
                last = value - (totals[n - 2] if n > 1 else 0.0)
                out.append((w, d, value / max(spine, 1e-9), n, steps, waited_columns(w, steps), spine, last))
    return tuple(sorted(out, key=lambda row: (-row[-1], row[1], row[3])))  # ties: the shallower, the smaller first


def tree_rows(est: EdgeEstimates, chain: list[float], top: int, depth: int | None, nodes: int | None,
              floor=0.0, switch=0.0, need=0.0, runs=0.0, catchup=0.0) -> list[tuple]:
    """(widths, E, T, its least node's value x scale, scale) of the candidates where that is `floor` or more, none
    under `need` E (scale: E(d) - 1 over a path's value; `chain`: the chains' E(d)). T(S): docs/policy.md; after a
    chain round `switch` x E (1 / tokens left), at least `runs` of a fresh tree's extra time, an opening's `catchup`."""
    p = est.ranks.key()  # to the percent: the tables' cache hits
    spines = accumulate(p[0] ** k for k in range(1, top + 1))  # a path's value per depth, as tree_table's
    out, bound = [], max(((e - 1.0) / max(v, 1e-9) for e, v in zip(chain[1:], spines)), default=0.0)  # the most scale
    if not nodes and list(p) == sorted(p, reverse=True) and (p[1] + 1e-12) * bound < floor:  # more nodes than
        return out  # levels: a side node, and where ranks fall the least is worth <= p_1: none reaches floor
    (c, s), (w0, w1), h = est.step_line(), est.wait_line(), est.handled[1].value
    line, s_rows, depth = est.tree_line(), s * est.rows.value, None if depth is None else min(depth, top)
    grown, fresh = (tree_table(p, saved, depth, nodes) for saved in (round(est.tree_saved.value), 0))  # one order

    def draft(steps: int, columns: int) -> float:  # the wait for its catch-up, its level forwards not pre-drafted,
        return catchup + wait_for(line, x := steps * c + s_rows * columns) + est.blocking(catchup + x)  # others' too

    for (w, d, r, n, steps, cols, spine, last), f in zip(grown, fresh):
        if last * bound < floor:  # the least nodes only fall from here on
            break
        if d <= top and last * (scale := (chain[d] - 1.0) / max(spine, 1e-9)) >= floor:
            if (e := chain[d] + (r - 1.0) * spine) < need:  # its spine as its chain, its side nodes at the ranks
                continue
            k, t = len(w), draft(steps, cols)  # its chain of k nodes at the wait line, its side nodes on the curve
            t += w0 + h + w1 * (k + 1) + est.more_wait(k + 1, n - k) + (
                min(1.0, max(e * switch, runs)) * (draft(f[4], f[5]) - t) if switch else 0.0)
            out.append((w, e, t, last * scale, scale))
    return out


class DraftPolicy:
    """One session's draft at its own acceptance (shrunk toward the edge's pooled rates); whether it explores."""

    def __init__(self, edge: EdgeEstimates | None = None, objective: Objective = Objective.BALANCED,
                 fixed: int | None = None, guesses: bool = False) -> None:
        self.edge, self.objective, self.fixed = edge or EdgeEstimates(), objective, fixed
        self.guesses = guesses  # a pre-draft's guess at the next token is an acceptance sample (not in sample mode)
        self.exploring = self.guessing = False  # the round in flight samples acceptance: d = 1 / a guess at d = 0
        self.timing = 0         # 1: the next round times a draft (after a guess); 2: the round in flight does
        self.own = AcceptanceCounts()  # this session's acceptance samples (blocks, guesses; not its openings)
        self.second = False     # its next block opens too (after an opening at d = 0: one token past the prompt)
        self.idle = 0           # its rounds at d = 0 since its last sample (its own: its own rates decide whether)

    def rates(self, n: int) -> list[float]:  # a_0..a_{n-1}: the edge's pooled rates
        return self.edge.acceptance.rates(n)

    def own_rates(self, n: int) -> list[float]:  # a_0..a_{n-1}: its own counts shrunk toward the pooled rates
        return self.own.rates(n, self.rates(n))

    def choose(self, remaining: int, explore: bool = True, stretch: int = 0, opening: bool = False) -> int:
        """The chain length d in 0..min(MAX_LEN, remaining - 1): fixed; when exploring is due (EXPLORE_SHARE; not for
        a pre-draft), d = 1, or d = 0 and `guessing` where the pre-draft can guess, then a round at the fastest d > 0
        (`timing`); else the objective's pick at its own rates (whether: the pooled rates' until its own samples weigh
        PRIOR_WEIGHT), d = 0 once in 1 / EXPLORE_SHARE drafting rounds while the worker's line has seen one width."""
        top = max(0, min(MAX_LEN, remaining - 1))
        if self.fixed is not None:
            return min(self.fixed, top)
        round_s, edge = self.edge.wait(0), self.edge
        if (opening or self.second) and stretch and not edge.provisional:  # an opening is no acceptance sample
            return pick(self._chains(top, stretch)[0], self.objective)
        rows = chain_rows(edge, self.own_rates(top + 1), top)  # its own: the prompts the draft knows badly rest
        cost = edge.explore_s.value if edge.explore_s.count else edge.step(stretch * edge.steps_per_token.value)
        cost = max(round_s, cost, rows[min(1, len(rows) - 1)][1] - rows[0][1])  # >= T(1) - T(0): a timing round
        if explore and top and self.idle * round_s * EXPLORE_SHARE >= cost:
            self.idle = 0  # where a pre-draft can guess the next token, it samples off the critical path
            self.guessing = self.guesses and edge.predraft and edge.draft.known
            self.exploring, self.timing = not self.guessing, int(self.guessing)
            return int(self.exploring)
        if edge.provisional:  # the only wait measured also ran a prompt: measure a verify (a row of 1) first
            return 0
        d = pick(rows, self.objective)
        if not d and (self.own.reached or [0.0])[0] < PRIOR_WEIGHT and len(rows) > 1:  # too few samples of its own
            pooled = chain_rows(edge, self.rates(top + 1), top)  # to rest on: whether is the pooled rates' call
            d = 1 + pick(rows[1:], self.objective) if pick(pooled, self.objective) else 0
        if explore and self.timing == 1 and len(rows) > 1:  # else a d = 0 chosen at a start's costs keeps them
            self.timing = 2  # for ever: nothing at d = 0 times a draft
            return d or 1 + pick(rows[1:], Objective.SPEED)  # the fastest draft (real pair, balanced: d = 14)
        if d and explore and edge.drafting * EXPLORE_SHARE >= 1 and edge.cloud.spread < 0.5:
            edge.drafting = 0  # the rows verified have kept one width: a row of 1 shows what d = 0 waits
            return 0
        return d

    def _chains(self, top: int, stretch: int = 0, switch: float = 0.0, cut: bool = True) -> tuple[list, float]:
        """(E, T) of chains d = 0..top at the pooled rates, and a drafting block's catch-up: with `stretch`, the block
        after the prompt's, at the openings' acceptance, plus the catch-up on `stretch` tokens (d = 0: none)."""
        a, est = self.rates(top + 1), self.edge
        catchup = est.step(stretch * est.steps_per_token.value) if stretch else 0.0
        rows = chain_rows(est, est.opening.rates(top + 1, a) if stretch else a, top, cut, switch)
        return [(e, t + catchup * (d > 0)) for d, (e, t) in enumerate(rows)], catchup

    def shape(self, remaining: int, trees: str, depth: int | None, nodes: int | None, after_tree: bool = True,
              opening: bool = False, stretch: int = 0) -> TreeShape | None:
        """The tree to draft (`--trees on|auto`): the objective's pick over trees and, with `auto`, chains (None: a
        chain wins). `after_tree` False: no tree pre-draft saved a level; an `opening` priced as choose prices it."""
        top, est = max(0, min(MAX_LEN, remaining - 1)), self.edge
        if trees == "auto" and not after_tree:  # where tree rounds committed less a second than chain rounds (each
            (t0, s0), (t1, s1) = est.paid  # timed PRIOR_WEIGHT times), trees are weighed once in 1 / EXPLORE_SHARE
            lose = min(s0.count, s1.count) >= PRIOR_WEIGHT and t1.value * s0.value < t0.value * s1.value  # turns (a
            est.vetoed = est.vetoed + 1 if lose and (est.vetoed + 1) * EXPLORE_SHARE < 1 else 0  # tree then goes
            if est.vetoed:  # on while the model picks it: after_tree)
                return None
        opens = (opening or self.second) and stretch > 0 and est.waits.count > 0 and not est.provisional  # with
        if trees == "auto" and (opening or self.second) and not opens:  # its catch-up, once a verify is measured
            return None  # (at a fresh edge's unit-free prices 16 sessions opened with trees: docs/policy.md)
        fresh = 1 / max(1, remaining)  # a switch's fresh drafts, once: a tree's after a chain, a chain's after a tree
        chains, catchup = self._chains(top, stretch * opens, 1.0 if opens else fresh * after_tree, depth is None)  # an
        top = len(chains) - 1  # opening's all (none pre-drafted); no deeper than the longest worth drafting (MIN_VALUE)
        c1 = est.cloud.fit()[1] * est.batch.value if est.cloud.known else 0.0  # one more node's seconds: its verify
        node_cost = (est.more_wait(top + 1, 1) if est.curve else c1) + est.draft.fit()[1] * est.rows.value  # and draft
        offered = chains if depth is None else chains[min(depth, top):min(depth, top) + 1]  # the chains `auto` weighs
        # no node worth less than its seconds at the best rate (`auto`: the chains'): else a tree goes out smaller
        floor = node_cost * max(e / max(t, 1e-12) for e, t in offered) if trees == "auto" else 0.0
        bars = [offered[pick(offered, self.objective)]] * (trees == "auto")  # `auto`: a tree replaces the chain
        switch = 1.0 if opens else fresh * (not after_tree)  # a tree's fresh levels: paid once, at least 1 - share
        rows = tree_rows(est, [e for e, _ in chains], top, depth, nodes, floor, switch,  # (trees run ~1 / (1 - share)
                         max((e for e, _ in bars), default=0.0), 1.0 - est.tree_share.value, catchup)  # rounds)
        if rows and bars:  # the objective picks, pooled and (weighed last: mostly no tree is left) at the session's
            own = chains if opens else chain_rows(est, self.own_rates(top + 1), top, True, fresh * after_tree)  # own
            bars.append(own[pick(own, self.objective)])  # rates, only if modelled no slower and no fewer tokens
            rows = [r for r in rows if r[1] >= bars[1][0]]  # a call (`balanced` took slower trees)
        if not rows:  # no tree at all (with `auto`: none reaches the floor): `auto` drafts its chain, `on` nothing
            return None if trees == "auto" else TreeShape()
        rows = [(None, e, t, 1.0, 1.0) for e, t in offered] * (trees == "auto") + rows
        least = max(MIN_VALUE, floor or node_cost * max(e / max(t, 1e-12) for _, e, t, *_ in rows))  # `auto`: not
        rows = [r for r in rows if r[3] >= least] or rows  # at a grown tree's rate: it would filter out every tree
        if trees == "auto":
            rows = [(None, *bars[0], 1.0, 1.0)] + [r for r in rows[len(offered):]
                    if all(r[1] >= e and r[1] * t >= e * r[2] for e, t in bars)]
        best = pick([(e, t) for _, e, t, *_ in rows], self.objective)
        return None if rows[best][0] is None else TreeShape(rows[best][0], min_value=least / rows[best][4])  # unscaled

    def observe_block(self, d: int, n: int, bonus_match: bool | None = None, opening=False, tree=False) -> None:
        """A VERDICT on a block of d drafts (n accepted; the pre-drafted guess's match after a full block). `opening`:
        the block right after the prompt, counted apart, as the next after an opening at d = 0. `tree`: its spine."""
        self.edge.tree_share.observe(float(tree))
        if opening or self.second:  # counted apart: what the next opening (and the block after one at d = 0) is
            self.second = opening and not d  # priced at
            if d > 0 or bonus_match is not None:
                self.edge.opening.observe(d, n, bonus_match)
            return
        sample = d > 0 or bonus_match is not None  # an acceptance sample, the edge's and its own: nothing to explore
        if sample:
            self.edge.acceptance.observe(d, n, bonus_match)
            self.own.observe(d, n, bonus_match)
        self.idle = 0 if sample else self.idle + 1
        self.edge.drafting = self.edge.drafting + 1 if d > 0 else 0

    def observe_round(self, width: int, latency_s: float, hint: LoadHint | None, draft_s: float | None,
                      steps: int = 0, catchup: bool = False, prefilled: bool = False, after_tree: bool = False,
                      tree: TreeShape | None = None, handled_s: float | None = None, committed: int = 0) -> None:
        """The round's timings: `draft_s` the wait for its chain's (or `tree`'s) `steps` fresh forwards (None: not
        timed; `catchup`: after a stretch), `handled_s` the edge's own time besides; the tokens it `committed` (a
        chain round `after_tree` counts as the tree rounds': it pays their exit, its start drafted fresh)."""
        self.edge.observe_round(width, latency_s, hint, prefilled)
        if committed and draft_s is not None and handled_s is not None and not prefilled:  # a round's yield in units
            (n, t), spent = self.edge.paid[tree is not None or after_tree], draft_s + latency_s + handled_s  # of
            best = max(e / max(x, 1e-12) for e, x in chain_rows(self.edge, self.own_rates(MAX_LEN + 1), MAX_LEN))
            n.observe(committed / best), t.observe(spent)  # its session's best modelled chain rate: prompts apart
        if handled_s is not None:
            self.edge.handled[width > 1].observe(handled_s)
        if draft_s is not None and (self.exploring or self.timing == 2):
            self.edge.explore_s.observe(draft_s)  # exploring's cost (a timing round's also teaches the lines below)
        timed = draft_s is not None and steps > 0 and not self.exploring and not catchup
        if timed and tree is not None:  # the tree engine's rounds (paths too) price trees, as chains' rounds chains
            compute = tree_compute(self.edge, tree, steps)  # the first at most CLIP x it (as a chain's)
            self.edge.tree_waited.observe(compute, draft_s, CLIP * compute)
        elif timed:
            self.edge.observe_waited(steps, draft_s)
        self.exploring, self.timing = False, 0 if self.timing == 2 else self.timing
