"""Resolving a rejection in `sample` mode: the edge holds q', the cloud holds p, and the recovered token must
be drawn from norm(max(0, p - q')) over the TARGET vocabulary (X-CoSD; docs/exactness.md). q' is the draft distribution
restricted to the shared vocabulary V_c (zero on target-only tokens V_o), so on V_o the residual is p itself.

Strategies (what travels down after a rejection):
  full  the verdict carries p over the whole target vocabulary; the edge draws the residual.
  hr    hybrid resampling: p on V_c plus theta_o = sum_{V_o} p. The edge computes theta_c = sum_{V_c}
        max(0, p - q'), picks V_c with probability theta_c / (theta_c + theta_o) and draws the residual there,
        else asks the cloud for one draw from p restricted to V_o.
  srdv  candidate-first (X-CoSD-E): the cloud sends K candidates z ~ p with p(z); the edge accepts z with
        probability max(0, p(z) - q'(z)) / p(z) (always when z in V_o); rejection sampling under the envelope p,
        so an accepted z is an exact residual draw. Each candidate passes with probability TV(p, q'), so a good
        draft (small TV) needs more of them: round r sends K * 2^r candidates, and only after MAX_ROUNDS rounds
        (K * (2^MAX_ROUNDS - 1) candidates, still a few KB) does it fall back to hr (p on V_c: 4 bytes a token).
With the same vocabulary V_c is everything: hr sends what full sends, with theta_o = 0.
Every draw uses counter-based uniforms at the rejected position, so a replay gives the same token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import protocol as P
from .packing import f32, from_f32
from .errors import InvalidRequest
from .protocol import ResampleKind, Strategy
from .rng import Purpose, sample_index, uniform, uniforms
from .verify import residual

SRDV_CANDIDATES = 4   # in the first round, doubled each round; chosen by measurement (bench srdv_k)
SRDV_MAX_ROUNDS = 6   # 4 + 8 + ... + 128 = 252 candidates before the hr fallback


def candidate_slots(round_: int) -> tuple[int, int]:
    """(first index, count) of round `round_`'s candidates in the position's CANDIDATE stream."""
    return SRDV_CANDIDATES * ((1 << round_) - 1), SRDV_CANDIDATES << round_


# ---------------------------------------------------------------------------------------------- cloud side

@dataclass
class Pending:
    """A sampled rejection the edge has not resolved yet: the verdict's seq, the absolute position of the
    rejected token, the target distribution there, and the rejected draft token x.

    What the edge may ask for it, each at most once and in this order (so one rejection costs the worker at
    most SRDV_MAX_ROUNDS + 1 RESAMPLEs): CANDIDATES rounds 1, 2, ... < SRDV_MAX_ROUNDS, then HR, then
    SERVER_ONLY (which ends it)."""

    seq: int
    position: int
    p: torch.Tensor  # [V_target] float32
    rejected: int
    last_round: int = 0       # the last CANDIDATES round served (the VERDICT carried round 0)
    hr_sent: bool = False
    finished: bool = False    # SERVER_ONLY drew the token: nothing more to serve

    def admit(self, kind: ResampleKind, round_: int) -> None:
        """Refuse (InvalidRequest, naming the field) a RESAMPLE that is out of order or already served."""
        if self.finished:
            raise InvalidRequest(f"the rejection at seq {self.seq} is already resolved", field="seq")
        if kind == ResampleKind.CANDIDATES:
            if round_ != self.last_round + 1 or self.hr_sent or round_ >= SRDV_MAX_ROUNDS:
                raise InvalidRequest(f"round {round_} out of order: the next candidate round for seq {self.seq} is "
                                     f"{self.last_round + 1} (rounds < {SRDV_MAX_ROUNDS}, none after hr)",
                                     field="round")
            self.last_round = round_
        elif kind == ResampleKind.HR:
            if self.hr_sent:
                raise InvalidRequest(f"the hr payload for seq {self.seq} was already sent", field="kind")
            self.hr_sent = True
        else:
            self.finished = True


def _shared_ids(mask: torch.Tensor | None, v: int) -> torch.Tensor:  # -> [V_c] sorted target ids
    return torch.arange(v) if mask is None else mask.nonzero().squeeze(1)


def _hr_payload(p: torch.Tensor, mask: torch.Tensor | None) -> tuple[bytes, float]:  # p: [V_target]
    if mask is None:
        return f32(p), 0.0
    return f32(p[mask]), float(p.double()[~mask].sum())


def _candidates(seed: int, position: int, p: torch.Tensor, round_: int, rejected: int) -> tuple[list[int], bytes]:
    """Draws z from the envelope p without the rejected token x, and p(z) once per DISTINCT candidate, in
    order of first appearance (a peaked p repeats tokens; their probabilities need not travel twice).

    x was rejected, so q'(x) > p(x) and the residual max(0, p - q') is 0 at x: leaving x out of the envelope
    keeps the rejection sampling exact (accepted z ∝ p(z) * max(0, p(z) - q'(z)) / p(z) on z != x) and raises
    each candidate's chance from TV(p, q') to TV(p, q') / (1 - p(x))."""
    first, count = candidate_slots(round_)
    u = uniforms(seed, position, Purpose.CANDIDATE, first + count)[first:]
    envelope = p.double().clone()  # [V_target]
    envelope[rejected] = 0.0
    if not envelope.sum() > 0:  # float round-off only: a rejection needs mass outside x
        envelope = p.double()
    z = _sample_many(envelope, u)
    return z, f32(p[list(dict.fromkeys(z))])


def _sample_many(probs: torch.Tensor, u) -> list[int]:  # probs: [V] float64, u: [K] uniforms
    """`sample_index(probs, x)` for every x in u, with one cumulative sum instead of K (a late SR-DV round draws
    128 candidates: at a 128k vocabulary that was 128 passes over p on the worker's event loop)."""
    p = probs.detach().cpu().numpy()
    cdf = np.cumsum(p, dtype=np.float64)
    idx = np.minimum(np.searchsorted(cdf, np.asarray(u, dtype=np.float64) * cdf[-1], side="right"), len(p) - 1)
    out = idx.tolist()
    for k, i in enumerate(out):
        while p[i] <= 0:  # landed exactly on a boundary after a zero run (as sample_index)
            i -= 1
        out[k] = i
    return out


def rejection_verdict(session: int, n_accepted: int, pending: Pending, strategy: Strategy,
                      shared: torch.Tensor | None, seed: int) -> P.Verdict:
    """The VERDICT for a rejection (next_token -1): what `strategy` sends down so the edge can finish the draw.
    shared: [V_target] bool mask of V_c, None for the same vocabulary."""
    v = P.Verdict(session, pending.seq, n_accepted)
    if strategy == Strategy.FULL:
        v.p = f32(pending.p)
    elif strategy == Strategy.HR:
        v.p, v.theta_o = _hr_payload(pending.p, shared)
    else:
        v.candidates, v.cand_p = _candidates(seed, pending.position, pending.p, 0, pending.rejected)
    return v


def serve_resample(req: P.Resample, pending: Pending, shared: torch.Tensor | None, seed: int) -> P.Resampled:
    """RESAMPLE for `pending`: hr's server-only draw, another SR-DV round, or SR-DV's fallback to the hr payload.
    Each is served once per rejection and in order (Pending.admit); anything else is an InvalidRequest."""
    out = P.Resampled(req.session, req.seq)
    if req.kind == ResampleKind.SERVER_ONLY:
        if shared is None:
            raise InvalidRequest("server_only resampling needs a cross-vocabulary session", field="kind")
        only = pending.p.double() * (~shared)  # p restricted to V_o
        if not only.sum() > 0:  # theta_o = 0: an honest edge never asks
            raise InvalidRequest("server_only resampling: p has no mass outside the shared vocabulary", field="kind")
        pending.admit(req.kind, req.round)
        out.token = sample_index(only, uniform(seed, pending.position, Purpose.SERVER_ONLY))
    elif req.kind == ResampleKind.CANDIDATES:
        pending.admit(req.kind, req.round)
        out.candidates, out.cand_p = _candidates(seed, pending.position, pending.p, req.round, pending.rejected)
    else:
        pending.admit(req.kind, req.round)
        out.p, out.theta_o = _hr_payload(pending.p, shared)
    return out


# ---------------------------------------------------------------------------------------------- edge side

class Rejection:
    """The edge's view of one rejection: q' at that position and how to finish the draw.

    `step(reply)` takes the Verdict (then each Resampled) and returns a token id, or a Resample request to send.
    """

    def __init__(self, q: torch.Tensor, shared: torch.Tensor | None, seed: int, position: int, seq: int,
                 session: int, strategy: Strategy) -> None:
        self.q, self.shared, self.seed, self.position = q, shared, seed, position  # q: [V_target] q'
        self.seq, self.session, self.strategy, self.round = seq, session, strategy, 0

    def step(self, reply: P.Verdict | P.Resampled) -> int | P.Resample:
        if isinstance(reply, P.Resampled) and reply.token >= 0:
            return reply.token                                            # hr: the cloud's V_o draw
        if reply.candidates:
            distinct = list(dict.fromkeys(reply.candidates))
            p_of = dict(zip(distinct, from_f32(reply.cand_p, len(distinct), "cand_p").double().tolist()))
            token = self._try_candidates(reply.candidates, p_of)
            if token is not None:
                return token
            self.round += 1
            if self.round < SRDV_MAX_ROUNDS:
                return P.Resample(self.session, self.seq, ResampleKind.CANDIDATES, self.round)
            return P.Resample(self.session, self.seq, ResampleKind.HR)
        return self._from_p(reply)

    def _try_candidates(self, z: list[int], p_of: dict[int, float]) -> int | None:
        base, _ = candidate_slots(self.round)
        for k, token in enumerate(z):
            p_z = p_of[token]
            u = uniform(self.seed, self.position, Purpose.CANDIDATE_ACCEPT, base + k)
            if u * p_z < p_z - float(self.q[token]):  # accept w.p. max(0, p(z) - q'(z)) / p(z)
                return token
        return None

    def _from_p(self, reply: P.Verdict | P.Resampled) -> int | P.Resample:
        ids = _shared_ids(None if self.strategy == Strategy.FULL else self.shared, self.q.shape[0])
        p_c = from_f32(reply.p, len(ids), "p")
        q_c = self.q[ids]
        theta_c = float((p_c.double() - q_c.double()).clamp(min=0).sum())
        theta_o = float(reply.theta_o)
        if theta_o > 0 and uniform(self.seed, self.position, Purpose.HYBRID) * (theta_c + theta_o) >= theta_c:
            return P.Resample(self.session, self.seq, ResampleKind.SERVER_ONLY)
        return int(ids[sample_index(residual(p_c, q_c), uniform(self.seed, self.position, Purpose.RESIDUAL))])
