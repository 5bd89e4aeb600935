"""Cross-vocabulary drafting (X-CoSD TLI): the draft model has its own tokenizer.

The draft samples from q' = q restricted to the shared vocabulary V_c (tokens of both vocabularies that spell
the same bytes) and renormalised; its tokens travel as target ids. The committed target tokens become bytes
(the target tokenizer's decode table — the edge loads the target TOKENIZER, never the target model) and only
the affected tail of the text is re-tokenised in the draft vocabulary (edge_worker.textsync.DraftContext).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..common.runner import ModelRunner
from .textsync import DraftContext
from .vocab import build_shared_vocab, target_bytes_table
from .drafter import Drafter, DraftState


@dataclass
class CrossVocabState(DraftState):
    text: DraftContext | None = None
    synced: int = 0  # target tokens already appended to `text`


class CrossVocabDrafter(Drafter):
    def __init__(self, runner: ModelRunner, target_tokenizer, target_vocab_size: int | None = None) -> None:
        n_target = target_vocab_size or len(target_tokenizer)
        super().__init__(runner, n_target)
        self.target_tokenizer = target_tokenizer
        vocab = build_shared_vocab(runner.tokenizer, target_tokenizer)
        if vocab.n_draft < runner.vocab_size or vocab.n_target < n_target:
            vocab = vocab.padded(max(vocab.n_draft, runner.vocab_size), max(vocab.n_target, n_target))
        self.vocab = vocab
        self.table = target_bytes_table(target_tokenizer)
        self.eos_ids = frozenset({target_tokenizer.eos_token_id} - {None})
        self.shared_mask = vocab.target_mask[:n_target]           # [V_target] bool
        self._shared_t = vocab.shared_target_ids                   # [V_c] target ids
        self._shared_d = vocab.shared_draft_ids                    # [V_c] draft ids, aligned
        self._bitmap = np.packbits(self.shared_mask.numpy(), bitorder="little").tobytes()

    def shared_bitmap(self) -> bytes:
        return self._bitmap

    def new_state(self, prompt_ids: list[int]) -> CrossVocabState:
        return CrossVocabState(text=DraftContext(self.runner.tokenizer, self.table))

    def draft_context(self, state: CrossVocabState, target_tokens: list[int]) -> list[int]:
        """Draft-vocabulary ids of the committed text; only the new target tokens are converted."""
        if state.synced < len(target_tokens):
            state.text.append_target_tokens(target_tokens[state.synced:])
            state.synced = len(target_tokens)
        return state.text.draft_ids

    def to_target(self, q: torch.Tensor) -> torch.Tensor:  # q: [V_draft] -> q' [V_target]
        """q restricted to V_c, renormalised, indexed by target id (zero on target-only tokens)."""
        out = q.new_zeros(self.target_vocab_size)
        shared = q[self._shared_d]
        total = shared.sum()
        if total <= 0:  # all of q's mass is outside V_c (e.g. top-k kept only draft-only tokens)
            shared, total = torch.ones_like(shared), float(len(shared))
        out[self._shared_t] = shared / total
        return out

    def to_draft(self, target_id: int) -> int:
        return int(self.vocab.target_to_draft[target_id])
