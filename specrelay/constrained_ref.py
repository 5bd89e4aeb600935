"""Structured outputs' exactness reference: constrained speculative decoding in-process, and the HF side.

`ConstraintLogitsProcessor` drives Hugging Face `generate` with a `common.constraint.Constraint`: the target
alone under the grammar, which every speculative run must equal (greedy: token for token; sampling: in law).
`speculative` is the rule both sides of a real session follow, with no sockets and no KV cache:

  edge:  q_i = probs(mask_d(logits_draft_i)): the draft proposes only allowed tokens, from the masked,
         renormalised draft distribution; its constraint advances over each drafted token
  cloud: masks_along(drafted) gives the target's mask at every drafted position (the target's constraint
         advanced over the drafted tokens); p_i = probs(mask_t(logits_target_i)); the usual verification
         (greedy / sampled with residual) over p and q; then both constraints roll back to the accepted prefix
         and advance over the recovered or bonus token.

Penalties (common/penalties.py) apply before the mask on both sides, per position, when given.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from transformers import LogitsProcessor

from .common import verify
from .common.constraint import Constraint, mask_logits
from .common.penalties import Penalties, apply, penalised_rows
from .common.rng import Purpose, sample_index, uniform
from .common.sampling import SamplingParams, probs_from_logits


class ConstraintLogitsProcessor(LogitsProcessor):
    """Masks a batch-of-one `generate` to the tokens `constraint` allows, advancing it over each new token."""

    def __init__(self, constraint: Constraint, prompt_len: int) -> None:
        self.constraint, self.start = constraint, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        new = input_ids[0, self.start:].tolist()
        if new and self.constraint.advance(new) != len(new):
            raise RuntimeError("generate produced a token the constraint refuses")
        self.start += len(new)
        return mask_logits(scores, self.constraint.allowed()[None]).to(scores.dtype)


class Unconstrained:
    """The Constraint interface allowing every token (penalties alone, in the reference)."""

    def __init__(self, vocab_size: int, eos: int) -> None:
        self.vocab_size, self.eos, self._ended = vocab_size, eos, False

    def allowed(self) -> torch.Tensor:
        return torch.ones(self.vocab_size, dtype=torch.bool)

    def advance(self, tokens: Sequence[int]) -> int:
        if self._ended or not len(tokens):
            return 0
        tokens = [int(t) for t in tokens]
        n = tokens.index(self.eos) + 1 if self.eos in tokens else len(tokens)
        self._ended = self.eos in tokens
        return n

    def rollback(self, n: int) -> None:
        self._ended = self._ended and n == 0

    def is_terminated(self) -> bool:
        return self._ended

    def masks_along(self, drafted: Sequence[int]) -> tuple[torch.Tensor, int]:
        m = self.advance(drafted)
        return torch.ones(m + 1, self.vocab_size, dtype=torch.bool), m


def _draft(draft, ctx: list[int], cons: Constraint, k: int, params: SamplingParams, seed: int, pen: Penalties,
           prompt_len: int, eos: int):
    """Up to k tokens from the masked, renormalised draft distribution; returns the tokens and their q rows."""
    tokens, qrows = [], []
    for _ in range(k):
        logits = draft(torch.tensor([ctx + tokens])).logits[0, -1]
        logits = apply(logits, pen, ctx[:prompt_len], ctx[prompt_len:] + tokens)
        q = probs_from_logits(mask_logits(logits, cons.allowed()), params)
        x = int(q.argmax()) if params.greedy else sample_index(q, uniform(seed, len(ctx) + len(tokens), Purpose.DRAFT))
        tokens.append(x)
        qrows.append(q)
        if cons.advance([x]) != 1 or x == eos:
            break
    return tokens, qrows


def _verify(target, ctx: list[int], drafted: list[int], qrows, cons: Constraint, params: SamplingParams, seed: int,
            pen: Penalties, prompt_len: int) -> tuple[int, int]:
    """The cloud's step: returns (accepted count, the recovered or bonus token)."""
    logits = target(torch.tensor([ctx + drafted])).logits[0, len(ctx) - 1:]  # [d + 1, V]
    logits = penalised_rows(logits, pen, ctx[:prompt_len], ctx[prompt_len:], drafted)
    masks, m = cons.masks_along(drafted)
    masks = torch.cat([masks, masks[-1:].expand(len(drafted) + 1 - len(masks), -1)])  # rows past m: never reached
    masked = mask_logits(logits, masks)
    if params.greedy:
        n, token = verify.greedy(torch.tensor(drafted), masked)
    else:
        p = probs_from_logits(masked, params)
        d, pos = len(drafted), len(ctx)
        q_draft = torch.stack([qrows[i][t] for i, t in enumerate(drafted)])
        u = torch.tensor([uniform(seed, pos + i, Purpose.ACCEPT) for i in range(d)])
        n, token = verify.sampled(torch.tensor(drafted), p, q_draft, u, uniform(seed, pos + d, Purpose.BONUS))
        if token is None:
            token = sample_index(verify.residual(p[n], qrows[n]), uniform(seed, pos + n, Purpose.RESIDUAL))
    cons.rollback(m - n)
    return n, int(token)


def speculative(target, draft, prompt: Sequence[int], make_constraint: Callable[[], Constraint] | None, max_new: int,
                k: int = 4, params: SamplingParams = SamplingParams(), seed: int = 0, eos: int = 0,
                pen: Penalties = Penalties(), stats: dict | None = None) -> list[int]:
    """Constrained speculative decoding with a same-vocabulary pair; stops after EOS or max_new tokens.
    make_constraint None: no grammar (penalties alone). stats, when given, counts "calls" (target verifications)
    and "drafted" tokens."""
    if make_constraint is None:
        v = target.config.vocab_size
        make_constraint = lambda: Unconstrained(v, eos)  # noqa: E731
    cons_t, cons_d = make_constraint(), make_constraint()
    out: list[int] = []
    prompt = list(prompt)
    with torch.no_grad():
        while len(out) < max_new and not cons_t.is_terminated():
            ctx = prompt + out
            drafted, qrows = _draft(draft, ctx, cons_d, min(k, max_new - len(out)), params, seed, pen,
                                    len(prompt), eos)
            n, token = _verify(target, ctx, drafted, qrows, cons_t, params, seed, pen, len(prompt))
            if stats is not None:
                stats["calls"] = stats.get("calls", 0) + 1
                stats["drafted"] = stats.get("drafted", 0) + len(drafted)
            if n == len(drafted) and drafted and drafted[-1] == eos:
                out += drafted  # EOS accepted: the generation ends, no bonus after it
                break
            cons_d.rollback(len(drafted) - n)  # the draft's constraint consumed every drafted token
            out += drafted[:n] + [token]
            if cons_t.advance([token]) != 1 or cons_d.advance([token]) != 1:
                raise RuntimeError("the verified token is refused by the constraint")
    return out[:max_new]
