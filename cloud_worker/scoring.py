"""A session's log-probabilities and penalties on the cloud: what an OPEN asked, the rows each forward keeps.

`Scoring.of(open)` is None for a session that asked for neither (nothing here runs for it, and its VERDICTs carry
no byte more). Otherwise, per verified block:

- penalties (common/penalties.py): row i of the logits verifying x_1..x_d is penalised with the counts of the
  generated tokens and x_1..x_{i-1}, so the acceptance rule sees the target's own penalised distribution;
- logprobs: the log-softmax of the RAW rows (before penalties, temperature, top-k, top-p) of the committed tokens,
  accepted then next, packed into the VERDICT (`LogprobsWire`);
- prompt logprobs (echo): every prompt position's logits are kept, from the prefill chunks and the first VERIFY's
  row, and the prompt's rows travel once, on the first VERDICT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..common import logprobs as L
from ..common import protocol as P
from ..common.errors import InvalidRequest
from ..common.penalties import Penalties, from_wire, penalised_rows


@dataclass
class Scoring:
    """k: the top k per committed token (None: no logprobs); prompt_len: where the generated tokens start."""

    k: int | None
    penalties: Penalties | None
    prompt_len: int
    prompt_rows: list[L.Rows] | None = None  # echo: the prompt's rows so far; None: not asked, or sent
    _sent: bool = field(default=False, repr=False)

    @classmethod
    def of(cls, msg: P.Open, vocab_size: int) -> "Scoring | None":
        """An OPEN's scoring fields, checked (InvalidRequest names the field); None for a plain session."""
        if msg.generated >= len(msg.tokens):
            raise InvalidRequest("generated must leave at least one prompt token", field="generated")
        if msg.logprobs is None and not msg.prompt_logprobs and msg.penalties is None:
            return None  # a plain (or only constrained) session: its `generated` serves the grammar alone
        if msg.prompt_logprobs and msg.logprobs is None:
            raise InvalidRequest("prompt_logprobs needs logprobs (the top k)", field="prompt_logprobs")
        if msg.logprobs is not None and msg.mode == P.Mode.SAMPLE:
            raise InvalidRequest("logprobs are served in modes greedy and coupled (the edge finishes a sample-mode "
                                 "rejection's draw itself)", field="logprobs")
        pen = from_wire(msg.penalties, vocab_size) if msg.penalties is not None else None
        prompt_len = len(msg.tokens) - msg.generated
        return cls(msg.logprobs, pen if pen is not None and pen.active else None, prompt_len,
                   [] if msg.prompt_logprobs else None)

    # ------------------------------------------------------------------ the rows a forward keeps
    def keep(self, cached: int, n: int, default: int) -> int:
        """A row of n new tokens after `cached` ones: how many trailing logits it needs (the prompt's too)."""
        if self.prompt_rows is None:
            return default
        return max(default, n) if cached < self.prompt_len - 1 else default

    def take_prompt(self, tokens: list[int], cached: int, logits: torch.Tensor) -> None:
        """logits [m, V] of positions cached..cached+m-1: keep the rows of prompt positions (each predicts the
        token after it)."""
        if self.prompt_rows is None:
            return
        n = max(0, min(logits.shape[0], self.prompt_len - 1 - cached))
        if n:
            self.prompt_rows.append(L.token_logprobs(logits[:n], tokens[cached + 1:cached + 1 + n], self.k))

    # ------------------------------------------------------------------ a verified block
    def penalise(self, logits: torch.Tensor, tokens: list[int], draft: list[int]) -> torch.Tensor:
        """logits [d+1, V] verifying `draft` after the committed `tokens` -> the rows the acceptance rule reads."""
        if self.penalties is None:
            return logits
        return penalised_rows(logits, self.penalties, tokens[:self.prompt_len], tokens[self.prompt_len:], draft)

    def fill(self, verdict: P.Verdict, raw: torch.Tensor, committed: list[int]) -> None:
        """The VERDICT's trailing fields: logprobs of `committed` (the raw rows [len, V] they were drawn from)
        and, on the first VERDICT, the prompt's."""
        if self.k is not None and committed:
            verdict.logprobs = L.pack(L.token_logprobs(raw[:len(committed)], committed, self.k))
        if self.prompt_rows is not None and not self._sent:
            empty = L.Rows(torch.zeros(0), torch.zeros(0, self.k, dtype=torch.long), torch.zeros(0, self.k))
            verdict.prompt_logprobs = L.pack(L.concat(self.prompt_rows) if self.prompt_rows else empty)
            self.prompt_rows, self._sent = None, True
