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
