"""A simulated edge for the draft-length policy (edge_worker/draftlen.py): sessions of `tokens` tokens, one after
another on one edge, in a world with known per-position acceptance and costs. The policy sees only what a real
edge would (VERDICTs, its own draft waits, the round trip, load hints); the world keeps the true clock, so a
policy's tokens per second can be compared with every fixed length's on the same coin flips."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from specrelay.common.protocol import LoadHint, Objective
from specrelay.edge_worker.draftlen import EdgeEstimates, FixedDraftLen, GoodputController


@dataclass
class World:
    accept: list[float]              # true a_j per draft position (the last one repeats)
    step_s: float = 0.002            # seconds per draft-model forward
    steps_per_token: float = 1.0     # draft forwards per target token (a cross-vocabulary draft: ~1.2-2.5)
    rtt_s: float = 0.0               # link round trip
    forward: tuple[float, float] = (0.008, 0.0005)  # the cloud's pass: f0 + f1 * tokens
    probe_s: float = 0.003           # what a round that pre-drafts the guess at d = 0 costs extra (catch-up, pi)
    spread: float = 0.0              # per-session acceptance: a_j * (1 + spread * u), u uniform in [-1, 1]
    xv: bool = False                 # a cross-vocabulary draft (one target token drafted past each block)

    def a(self, j: int, scale: float) -> float:
        return min(1.0, self.accept[min(j, len(self.accept) - 1)] * scale)


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    drafting: int = 0   # rounds that drafted (d > 0)
    probes: int = 0     # rounds at d = 0 that pre-drafted the guess
    lengths: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def exploring(self) -> float:
        """Share of the rounds at d = 0 that paid for acceptance samples (probes) or drafted instead."""
        return (self.drafting + self.probes) / self.rounds


def simulate(world: World, policy: int | Objective, sessions: int = 40, tokens: int = 48, seed: int = 0,
             edge: EdgeEstimates | None = None, warmup: int = 0) -> Run:
    """`sessions` lone sessions on one edge under a fixed length (int) or auto with an objective; the first
    `warmup` sessions teach the edge and are not counted. The coin flips depend on the seed only."""
    rng, edge, run = random.Random(seed), edge or EdgeEstimates(), Run()
    for i in range(sessions + warmup):
        scale = 1.0 + world.spread * (2 * rng.random() - 1)
        ctl = (FixedDraftLen(policy, edge) if isinstance(policy, int) and not isinstance(policy, Objective)
               else GoodputController(edge, objective=policy))
        session = _session(world, ctl, edge, rng, scale, tokens)
        if i >= warmup:
            for key in ("tokens", "seconds", "rounds", "drafting", "probes"):
                setattr(run, key, getattr(run, key) + getattr(session, key))
            run.lengths += session.lengths
    return run


def _session(world: World, ctl, edge: EdgeEstimates, rng: random.Random, scale: float, tokens: int) -> Run:
    run, left = Run(), tokens
    flips = [rng.random() for _ in range(4 * tokens + 64)]  # pre-drawn: the same text for every policy
    k = 0
    while left > 0:
        d = ctl.choose(left)
        probe = d == 0 and bool(getattr(ctl, "probes", False))
        n = 0
        while n < d and flips[(k + n) % len(flips)] < world.a(n, scale):
            n += 1
        bonus = flips[(k + d) % len(flips)] < world.a(d, scale) if probe else None
        k += n + 1
        steps = world.steps_per_token * (d + (1 if world.xv else 0)) if d else 0.0
        if d and world.xv:
            edge.observe_block_steps(round(steps), d)
        draft_s = world.step_s * steps
        f0, f1 = world.forward
        fwd = f0 + f1 * (d + 1)
        latency = world.rtt_s + fwd + (world.probe_s if probe else 0.0)
        ctl.observe_round(round(steps), draft_s if d else None, latency, d + 1, d,
                          LoadHint(1, d + 1, int(fwd * 1e6), 0, d + 1, 0, 0))
        ctl.observe_block(d, n, bonus)
        got = min(left, n + 1)
        run.tokens, run.seconds, run.rounds = run.tokens + got, run.seconds + draft_s + latency, run.rounds + 1
        run.drafting, run.probes = run.drafting + (d > 0), run.probes + probe
        run.lengths.append(d)
        left -= got
    return run


def best_fixed(world: World, lengths=range(0, 9), **kw) -> tuple[int, float]:
    """(d, tokens/s) of the fastest fixed length in this world, on the same coin flips."""
    rates = {d: simulate(world, d, **kw).rate for d in lengths}
    d = max(rates, key=rates.get)
    return d, rates[d]


# ----------------------------------------------------------------------------- a busy edge: sessions at once
@dataclass
class BusyWorld:
    """Several sessions on one edge at once, each round of all of them together (a wave: one lockstep draft
    batch, one cloud pass over every row). Agreement comes in runs, as in real text: the draft's guess at text
    position k matches with probability `after_match` after a match there at k - 1, `after_miss` after a miss, so
    a block's position j is not the same place in the text at every d and per-position rates measured at one
    length mislead at another. The couplings a model of one session cannot see: a draft forward waits longer
    while sessions sit at d = 0 (`loop_gain`: the event loop handles a round per token for each of them) and as
    the draft thread's load grows (`queue_gain` per draft token of the mean block); the cloud's fixed cost rises
    while the edge drafts (`cpu_share`: edge and cloud share the cores)."""

    after_match: float
    after_miss: float
    sessions: int = 8
    step_s: float = 0.002            # seconds per draft-model forward, alone
    steps_per_token: float = 1.0
    xv: bool = False
    rtt_s: float = 0.0
    forward: tuple[float, float] = (0.008, 0.0005)
    loop_gain: float = 0.0
    queue_gain: float = 0.0
    cpu_share: float = 0.0

    def bits(self, rng: random.Random, n: int) -> list[bool]:
        out, last = [], rng.random() < 0.5
        for _ in range(n):
            last = rng.random() < (self.after_match if last else self.after_miss)
            out.append(last)
        return out


@dataclass
class _Slot:
    bits: list[bool]
    ctl: object
    k: int = 0          # text position (tokens committed)
    last_d: int = -1    # the previous round's d (-1: none since the OPEN)


def simulate_busy(world: BusyWorld, policy: int | Objective, prompts: int = 64, tokens: int = 64,
                  seed: int = 0, edge: EdgeEstimates | None = None) -> Run:
    """`prompts` generations of `tokens`, `world.sessions` at a time, under a fixed length or auto; the edge's
    tokens per second over the true clock. The text (match bits) depends on the seed only."""
    rng, edge, run = random.Random(seed), edge or EdgeEstimates(), Run()
    texts = [world.bits(rng, tokens + 64) for _ in range(prompts)]
    auto = not (isinstance(policy, int) and not isinstance(policy, Objective))
    new = lambda: _Slot(texts.pop(), GoodputController(edge, objective=policy) if auto  # noqa: E731
                        else FixedDraftLen(policy, edge))
    slots = [new() for _ in range(min(world.sessions, len(texts)))]
    while slots:
        edge.sessions = len(slots)
        run.seconds += _wave(world, slots, edge, tokens, run)
        slots = [s for s in slots if s.k < tokens] + [new() for s in slots if s.k >= tokens and texts]
    return run


def _wave(world: BusyWorld, slots: list[_Slot], edge: EdgeEstimates, tokens: int, run: Run) -> float:
    ds = [s.ctl.choose(tokens - s.k) for s in slots]
    steps = [world.steps_per_token * (d + world.xv) if d else 0.0 for d in ds]
    idle = sum(d == 0 for d in ds) / len(ds)
    per_step = world.step_s * (1 + world.loop_gain * idle) * (1 + world.queue_gain * sum(ds) / len(ds))
    f0, f1 = world.forward
    rows = sum(d + 1 for d in ds)
    fwd = f0 * (1 + world.cpu_share * (1 - idle)) + f1 * rows
    latency = world.rtt_s + fwd
    wall = 0.0
    for s, d, n_steps in zip(slots, ds, steps):
        n = 0
        while n < d and s.bits[s.k + n]:
            n += 1
        if d and world.xv:
            edge.observe_block_steps(round(n_steps), d)
        draft_s = per_step * n_steps
        timed = d > 0 and s.last_d > 0  # a block after the OPEN or a round at d = 0 catches up: not timed
        hint = LoadHint(len(slots), d + 1, int(fwd * 1e6), 0, rows, 0, 0)
        s.ctl.observe_block(d, n, None)
        s.ctl.observe_round(round(n_steps), draft_s if timed else None, latency, d + 1, d, hint,
                            opened=s.last_d < 0)
        got = min(tokens - s.k, n + 1)
        s.k, s.last_d = s.k + got, d
        run.tokens, run.rounds, run.drafting = run.tokens + got, run.rounds + 1, run.drafting + (d > 0)
        run.lengths.append(d)
        wall = max(wall, draft_s + latency)
    return wall
