"""In-process speculative decoding: the edge core and the cloud core wired by function calls, no network.

`speculative_generate` is the reference the distributed path is tested against (same cores, same counters,
so the same tokens for the same seed) and the in-process baseline of the benchmarks.
`target_generate` is target-alone decoding with the same sampling transform and counters: greedy, plain
sampling, or Gumbel-coupled sampling — what speculative output must equal (coupled) or match in law.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from .cloud_worker.verifier import Verifier
from .common import protocol as P
from .common.rng import Purpose, gumbel, sample_index, uniform
from .common.runner import Decoder, ModelRunner
from .common.sampling import SamplingParams, probs_from_logits
from .edge_worker.drafter import Drafter
from .edge_worker.session import EdgeSession, SessionConfig


def speculative_generate(draft: ModelRunner | Drafter, target: ModelRunner | Verifier, prompt_ids: list[int],
                         config: SessionConfig | None = None, **kwargs) -> tuple[list[int], dict]:
    """Generate with draft + target in one process. Returns (generated target ids, stats).

    `kwargs` build a SessionConfig when none is given (max_new_tokens, params, mode, seed, draft_len, resample).
    """
    config = config or SessionConfig(**kwargs)
    verifier = target if isinstance(target, Verifier) else Verifier(target)
    drafter = draft if isinstance(draft, Drafter) else Drafter(draft, verifier.runner.vocab_size)
    session = EdgeSession(list(prompt_ids), config, drafter)
    t0 = time.perf_counter()
    verifier.open(session.open_message())
    while not session.done:
        request = session.next_request()
        session.stats.uplink_bytes += sum(map(len, P.encode(request)))
        reply = verifier.verify([request])[0] if isinstance(request, P.Verify) else verifier.resample_request(request)
        session.stats.downlink_bytes += sum(map(len, P.encode(reply)))
        session.apply(reply)
    verifier.close(session.sid)
    stats = asdict(session.stats) | {"wall_s": time.perf_counter() - t0}
    return session.generated, stats


@torch.no_grad()
def target_generate(target: ModelRunner, prompt_ids: list[int], max_new_tokens: int,
                    params: SamplingParams = SamplingParams(), mode: str = "greedy", seed: int = 0) -> list[int]:
    """Target-alone decoding with the KV cache: greedy, `sample` (inverse CDF with Purpose.TARGET uniforms),
    or `coupled` (argmax(log p + g_t), the same noise the coupled speculative mode uses)."""
    decoder = Decoder(target)
    tokens, out = list(prompt_ids), []
    while len(out) < max_new_tokens:
        logits = decoder.next_logits(tokens)
        pos = len(tokens)
        if mode == "greedy":
            x = int(logits.argmax())
        elif mode == "coupled":
            p = probs_from_logits(logits, params)
            x = int((p.double().log() + gumbel(seed, pos, p.shape[0])).argmax())
        else:
            x = sample_index(probs_from_logits(logits, params), uniform(seed, pos, Purpose.TARGET))
        tokens.append(x)
        out.append(x)
        if x in target.eos_ids:
            break
    return out
