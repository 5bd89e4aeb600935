"""In-process speculative decoding: the edge core and the cloud core wired by function calls, no network.

`speculative_generate` is the reference the distributed path is tested against (same cores, the same edge
scheduler, same counters, so the same tokens for the same seed) and the in-process baseline of the benchmarks.
`target_generate` is target-alone decoding with the same sampling transform and counters: greedy, plain
sampling, or Gumbel-coupled sampling — what speculative output must equal (coupled) or match in law.
"""

from __future__ import annotations

import time

import torch

from .cloud_worker.config import VerifierConfig
from .cloud_worker.verifier import Verifier
from .common import protocol as P
from .common.errors import UnknownVocab
from .common.packing import enum_value
from .common.protocol import Mode
from .common.rng import Purpose, gumbel, sample_index, uniform
from .common.runner import Decoder, ModelRunner
from .common.sampling import SamplingParams, probs_from_logits
from .edge_worker.config import SessionConfig
from .edge_worker.draft.drafter import Drafter
from .edge_worker.session import EdgeSession
from .edge_worker.policy import EdgeEstimates
from .edge_worker.scheduler import EdgeScheduler, Phase, SessionView


def speculative_generate(draft: ModelRunner | Drafter, target: ModelRunner | Verifier, prompt_ids: list[int],
                         config: SessionConfig | None = None, **kwargs) -> tuple[list[int], dict]:
    """Generate with draft + target in one process. Returns (generated target ids, stats).

    `kwargs` build a SessionConfig when none is given (max_new_tokens, params, mode, seed, draft_len, resample).
    """
    config = config or SessionConfig(**kwargs)
    return speculative_generate_batch(draft, target, [list(prompt_ids)], [config])[0]


def speculative_generate_batch(draft: ModelRunner | Drafter, target: ModelRunner | Verifier,
                               prompts: list[list[int]], configs: list[SessionConfig],
                               observe=None) -> list[tuple[list[int], dict]]:
    """Many sessions in lockstep: one batched draft forward per draft position, one batched target forward per
    verification round, exactly as an edge and a cloud worker batch them. `observe(request, reply)` sees every
    exchange (benchmarks classify rejections with it)."""
    verifier = target if isinstance(target, Verifier) else Verifier(
        target, VerifierConfig(max_sessions=max(VerifierConfig.max_sessions, len(prompts)),
                               client_kv_share=1.0))  # in-process: one client, the whole store is its share
    drafter = draft if isinstance(draft, Drafter) else Drafter(draft, verifier.runner.vocab_size)
    estimates = EdgeEstimates()  # shared, as on an edge; no timings in-process, so `auto` is deterministic
    sessions = [EdgeSession(list(p), c, drafter, sid=i + 1, estimates=estimates)
                for i, (p, c) in enumerate(zip(prompts, configs))]
    t0 = time.perf_counter()
    for s in sessions:
        try:
            verifier.open((b"", s.sid), s.open_message())
        except UnknownVocab:  # this verifier never saw the drafter's bitmap: the edge's re-OPEN, in-process
            verifier.open((b"", s.sid), s.open_message(resend_vocab=True))
    live, scheduler = list(sessions), EdgeScheduler()  # in-process: every ready session in one lockstep batch
    while live:
        verifies, resamples = lockstep_requests(live, drafter, scheduler)
        replies = verifier.verify([((b"", v.session), v) for v in verifies]) if verifies else []
        pairs = list(zip(verifies, replies))
        pairs += [(req, verifier.resample((b"", req.session), req)) for req in resamples]
        for request, reply in pairs:
            session = sessions[request.session - 1]
            session.stats.uplink_bytes += sum(map(len, P.encode(request)))
            session.stats.downlink_bytes += sum(map(len, P.encode(reply)))
            if observe is not None:
                observe(request, reply)
            session.apply(reply)
        live = [s for s in live if not s.done]
    wall = time.perf_counter() - t0
    for s in sessions:
        verifier.close((b"", s.sid))
    # vars, not asdict: the sessions end here, so their stats need no deep copy (asdict was 15% of 20,000 seeds)
    return [(s.generated, vars(s.stats) | {"wall_s": wall} | ({"scores": s.scores()} if s.config.scored else {}))
            for s in sessions]


def lockstep_requests(sessions: list[EdgeSession], drafter: Drafter,
                      scheduler: EdgeScheduler) -> tuple[list[P.Verify], list[P.Resample]]:
    """One lockstep step of the edge scheduler's actions (edge_worker/scheduler.py), in-process: the VERIFYs of the
    sessions it drafts (one batched draft forward per draft position) and the RESAMPLEs it sends."""
    by_sid = {s.sid: s for s in sessions}
    actions = scheduler.step([session_view(s) for s in sessions])
    drafting = [by_sid[sid] for sid in actions.draft]
    blocks = drafter.draft_batch([s.draft_job() for s in drafting])
    verifies = [s.request_for(b) for s, b in zip(drafting, blocks)]
    return verifies, [by_sid[sid].resample_request() for sid in actions.resample]


def session_view(session: EdgeSession) -> SessionView:
    """What the edge scheduler sees of a session between rounds: done, a RESAMPLE pending, or ready to draft."""
    if session.done:
        return SessionView(session.sid, Phase.DONE)
    return SessionView(session.sid, Phase.READY if session.resample_request() is None else Phase.RESAMPLE)


def next_request(session: EdgeSession) -> P.Verify | P.Resample:
    """One session's next message alone (tests that drive a cloud worker by hand): its pending RESAMPLE, or a VERIFY
    of a block drafted for it now."""
    verifies, resamples = lockstep_requests([session], session.drafter, EdgeScheduler())
    return (resamples + verifies)[0]


@torch.no_grad()
def target_generate(target: ModelRunner, prompt_ids: list[int], max_new_tokens: int,
                    params: SamplingParams = SamplingParams(), mode: Mode = Mode.GREEDY, seed: int = 0) -> list[int]:
    """Target-alone decoding with the KV cache: greedy, `sample` (inverse CDF with Purpose.TARGET uniforms),
    or `coupled` (argmax(log p + g_t), the same noise the coupled speculative mode uses)."""
    mode = enum_value(Mode, mode, "mode")
    decoder = Decoder(target)
    tokens, out = list(prompt_ids), []
    while len(out) < max_new_tokens:
        logits = decoder.next_logits(tokens)
        pos = len(tokens)
        if mode == Mode.GREEDY:
            x = int(logits.argmax())
        elif mode == Mode.COUPLED:
            p = probs_from_logits(logits, params)
            x = int((p.double().log() + gumbel(seed, pos, p.shape[0])).argmax())
        else:
            x = sample_index(probs_from_logits(logits, params), uniform(seed, pos, Purpose.TARGET))
        tokens.append(x)
        out.append(x)
        if x in target.eos_ids:
            break
    return out
