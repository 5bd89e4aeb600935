"""Pre-drafting: while a VERIFY is in flight, the edge drafts on past the block as if every draft token and the
draft's own guess for the bonus token were accepted. After the VERDICT, the part of that chain which continues
the committed tokens exactly becomes the start of the next block.

Exactness is unchanged: a draft token is a pure function of the draft context, its absolute position and the
session seed (common/rng.py), so a reused token is the very token a fresh draft would have produced. Reuse is
checked, not assumed: the committed tokens must equal the chain's prefix AND the draft context the edge now
derives from them must equal the context the chain was drafted from (with a cross-vocabulary draft the
re-tokenised text can differ; then nothing is reused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .drafter import DraftBlock


@dataclass
class DraftChain:
    """The drafted tokens from one absolute position on: the VERIFY's block, then the pre-drafted continuation."""

    start: int             # absolute position of block.ids[0]
    context: list[int]     # draft-vocabulary context block.ids[0] was drafted after
    block: DraftBlock      # the chain (target ids, with q' in sample mode)
    sent: int              # how many of the chain's tokens the VERIFY carried

    def extend(self, more: DraftBlock) -> None:
        self.block = self.block + more

    def guess(self, index: int) -> int | None:
        """The chain's token at `index` (index `sent` is the guess for the bonus token), if drafted."""
        return self.block.ids[index] if index < len(self.block.ids) else None

    def reusable(self, tokens: list[int], context: list[int], d: int,
                 context_after: Callable[[list[int]], list[int] | None]) -> DraftBlock:
        """Up to d chain tokens that continue `tokens` (committed target ids) drafted in `context` (their draft
        context now); an empty block when the chain went another way. `context_after(ids)`: the draft context
        the chain's continuation after its first tokens `ids` was drafted in (Drafter.extend_context)."""
        m = len(tokens) - self.start
        if d <= 0 or m < 0 or m >= len(self.block.ids) or tokens[self.start:] != self.block.ids[:m]:
            return DraftBlock()
        if context != context_after(self.block.ids[:m]):
            return DraftBlock()
        return self.block.part(m, m + d)
