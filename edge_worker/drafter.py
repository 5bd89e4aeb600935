"""Drafting on the edge: d tokens from the draft model, proposed as TARGET ids from the shared vocabulary.

The draft samples from q' = q restricted to the shared vocabulary V_c and renormalised (TLI), so standard
rejection sampling against p stays exact; with the same vocabulary V_c is everything and q' = q.
Every draw uses counter-based randomness at the token's absolute position (common.rng).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.rng import Purpose, gumbel, sample_index, uniform
from ..common.runner import Decoder, ModelRunner
from ..common.sampling import SamplingParams, probs_from_logits


@dataclass
class DraftBlock:
    ids: list[int]                 # x_1..x_d as target ids
    q_tok: list[float]             # q'(x_i) (sample mode)
    q_rows: list[torch.Tensor]     # q' over the target vocabulary at each position, [V_target] each


class Drafter:
    """Holds the draft model; `draft` proposes a block for one session's context (same vocabulary)."""

    def __init__(self, runner: ModelRunner, target_vocab_size: int | None = None) -> None:
        self.runner = runner
        self.target_vocab_size = target_vocab_size or runner.vocab_size
        self.eos_ids = runner.eos_ids  # target ids that end a generation (same tokenizer)

    def new_state(self, prompt_ids: list[int]) -> Decoder:
        return Decoder(self.runner)

    def to_target(self, q: torch.Tensor) -> torch.Tensor:  # q: [V_draft] -> q' [V_target]
        """Same tokenizer, possibly a different embedding size: V_c = ids valid in both."""
        v = self.target_vocab_size
        if q.shape[0] == v:
            return q
        out = q.new_zeros(v)
        n = min(v, q.shape[0])
        out[:n] = q[:n]
        return out / out.sum()

    def draft(self, state: Decoder, context: list[int], d: int, mode: str, params: SamplingParams,
              seed: int) -> DraftBlock:
        block = DraftBlock([], [], [])
        ctx = list(context)
        for _ in range(d):
            logits = state.next_logits(ctx)  # [V_draft]
            pos = len(ctx)
            if mode == "greedy":
                x = int(self.to_target(torch.softmax(logits.float(), -1)).argmax())
            else:
                q = self.to_target(probs_from_logits(logits, params))  # [V_target]
                if mode == "coupled":  # argmax(log q' + g) with the noise the target will use
                    x = int((q.double().log() + gumbel(seed, pos, q.shape[0])).argmax())
                else:
                    x = sample_index(q, uniform(seed, pos, Purpose.DRAFT))
                    block.q_tok.append(float(q[x]))
                    block.q_rows.append(q)
            block.ids.append(x)
            ctx.append(x)
            if x in self.eos_ids:
                break
        return block


def make_drafter(draft_model: str, target_tokenizer: str | None = None, device: str = "cpu", dtype: str = "float32"):
    """Load the draft model and return (drafter, target tokenizer).

    With no target tokenizer, or one whose vocabulary equals the draft's, the pair shares a vocabulary;
    otherwise the cross-vocabulary drafter (shared vocabulary V_c, context sync by bytes) is used.
    """
    from transformers import AutoTokenizer

    runner = ModelRunner.load(draft_model, device=device, dtype=dtype)
    if target_tokenizer is None:
        return Drafter(runner), runner.tokenizer
    target_tok = AutoTokenizer.from_pretrained(target_tokenizer)
    if target_tok.get_vocab() == runner.tokenizer.get_vocab():
        return Drafter(runner), target_tok
    from .xdrafter import CrossVocabDrafter
    return CrossVocabDrafter(runner, target_tok), target_tok
