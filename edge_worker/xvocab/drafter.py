"""Cross-vocabulary drafting (X-CoSD TLI): the draft model has its own tokenizer.

Sampled modes: the draft samples from q' = q restricted to the shared vocabulary V_c (tokens of both
vocabularies that spell the same bytes) and renormalised; its tokens travel as target ids, with q'(x) for the
acceptance test. Greedy mode needs no q', so the draft writes freely in its own vocabulary and the drafted TEXT
is re-tokenised with the target tokenizer: the block lands on the target's own token boundaries (a draft that
spells '\n    def' as '\n', ' ', ' ', ' ', ' def' proposes the target's '\n   ', ' def', which the target can
accept; TLI could only propose tokens the target never emits there). Any proposal is exact in greedy mode: the
cloud accepts a token only if it is the target's argmax.

Both: the committed target tokens become bytes (the target tokenizer's decode table — the edge loads the target
TOKENIZER, never the target model) and only the affected tail of the text is re-tokenised in the draft
vocabulary (edge_worker.xvocab.textsync.DraftContext).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import codecs

from ...common import bitmap
from ...common.protocol import Mode
from ...common.runner import ModelRunner
from ..draft.drafter import DraftBlock, Drafter, DraftJob, DraftState
from .textsync import DraftContext, text_encoder
from .mapping import build_shared_vocab, target_bytes_table, token_bytes


@dataclass
class CrossVocabState(DraftState):
    text: DraftContext | None = None
    synced: int = 0  # target tokens already appended to `text`


class CrossVocabDrafter(Drafter):
    """retokenize: greedy blocks are drafted as text and re-tokenised with the target tokenizer (default);
    False drafts greedy blocks on V_c like the sampled modes (TLI). Chains only (README "Token trees")."""

    trees = False
    masks_grammar = False  # a constrained session drafts nothing (d = 0): the cloud's mask keeps it exact
    penalises = False  # its logits are over its own ids: the cloud's penalties alone make the output exact

    def __init__(self, runner: ModelRunner, target_tokenizer, target_vocab_size: int | None = None,
                 retokenize: bool = True) -> None:
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
        self._bitmap, self._bitmap_hash = bitmap.pack(self.shared_mask.numpy())  # common/bitmap.py
        self._bitmap_sent = False
        self.retokenize = retokenize
        self._draft_table = token_bytes(runner.tokenizer)
        self._draft_eos = runner.eos_ids
        self._target_encoder = text_encoder(target_tokenizer)

    def open_vocab(self, resend: bool = False) -> tuple[bytes, bytes]:
        """(shared_vocab, shared_vocab_hash) for an OPEN: the bitmap itself with this edge's first OPEN for the pair
        and after a worker answered UNKNOWN_VOCAB (`resend`), its hash alone otherwise (the worker cached it)."""
        first, self._bitmap_sent = not self._bitmap_sent, True
        return (self._bitmap if first or resend else b""), self._bitmap_hash

    def new_state(self, prompt_ids: list[int]) -> CrossVocabState:
        return CrossVocabState(text=DraftContext(self.runner.tokenizer, self.table))

    def draft_context(self, state: CrossVocabState, target_tokens: list[int]) -> list[int]:
        """Draft-vocabulary ids of the committed text; only the new target tokens are converted."""
        if state.synced < len(target_tokens):
            state.text.append_target_tokens(target_tokens[state.synced:])
            state.synced = len(target_tokens)
        return state.text.draft_ids

    def extend_context(self, job: DraftJob, ids: list[int]) -> list[int] | None:
        """Greedy text drafting: the draft ids of the committed text plus the bytes of the job's unverified
        tokens and `ids`, re-tokenised as `draft_context` will once they are committed (mapped token by token,
        a target token outside V_c has no draft id). TLI (sampled modes): `ids` lie in V_c and a block goes on
        from its own mapped tokens, as a fresh draft does."""
        if job.mode == Mode.GREEDY and self.retokenize:
            text, base = job.state.text, job.position - len(job.unverified)
            if job.state.synced == base:
                return text.extended_ids([*job.unverified, *ids])
            if job.state.synced == base + len(job.unverified) + len(ids):  # committed since (a reuse check)
                return text.draft_ids
            return None
        mapped = [self.to_draft(x) for x in ids]
        return None if any(x < 0 for x in mapped) else job.context + mapped

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

    # ------------------------------------------------------------------ greedy: draft text, target segmentation
    def step(self, job: DraftJob, block: DraftBlock, context: list[int]) -> bool:
        if job.mode != Mode.GREEDY or not self.retokenize:
            return super().step(job, block, context)
        token = int(job.state.last_logits.argmax())  # the draft's own argmax, over its whole vocabulary
        block.drafted.append(token)
        context.append(token)
        block.formed.append(len(self._retokenized(block.drafted)))
        if token in self._draft_eos or len(block.drafted) >= 3 * job.d + 3:
            return False
        return block.formed[-1] <= job.d  # one more than needed: the last may still grow

    def finish(self, job: DraftJob, block: DraftBlock) -> None:
        if not block.drafted:
            return
        ended = block.drafted[-1] in self._draft_eos
        ids = self._retokenized(block.drafted)
        if not ended:
            ids = ids[:-1]  # the text may continue this token: not final yet
        block.ids = ids[:job.d]
        if ended and len(block.ids) < job.d:
            block.ids += sorted(self.eos_ids)[:1]

    @staticmethod
    def forwards_by_tokens(block: DraftBlock, asked: int) -> list[tuple[int, int]]:
        """(x, draft forwards until the block's text held x target tokens) for x = 1..asked + 1 (it drafts one past
        the block), each draft token after the first drafted by a forward of its own; a count its text never
        reached (a draft stops at 3d + 3) ends the list as (asked + 1, every forward the block ran)."""
        points, last = [], len(block.formed) - 1
        for i, n in enumerate(block.formed):  # one pass: x reached at draft token i, after steps - (last - i)
            points += [(x, block.steps - (last - i)) for x in range(len(points) + 1, min(n, asked + 1) + 1)]
        return points if len(points) > asked else points + [(asked + 1, block.steps)]

    def _retokenized(self, drafted: list[int]) -> list[int]:
        """Target ids of the drafted text: complete UTF-8 characters up to the first invalid byte."""
        data = b"".join(self._draft_table[t] or b"" for t in drafted if t not in self._draft_eos)
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        try:
            text = decoder.decode(data)  # an incomplete last character is held back
        except UnicodeDecodeError as exc:
            text = data[:exc.start].decode("utf-8", "ignore")
        return self._target_encoder.encode(text, add_special_tokens=False).ids if text else []
