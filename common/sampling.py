"""Sampling parameters and the ONE logits -> probabilities transform used identically by edge and cloud.

Speculative sampling is exact only when q (draft) and p (target) go through the same temperature /
top-k / top-p transform, so both sides call `probs_from_logits` and nothing else. Importing this module loads no
torch: the CLI checks a request's SamplingParams before any model loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import InvalidRequest

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise InvalidRequest("temperature must be a finite number in [0, 100]", field="temperature")
        if not (0 <= self.top_k <= 1_000_000):
            raise InvalidRequest("top_k must be in [0, 1e6] (0 = off)", field="top_k")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest("top_p must be in (0, 1] (1 = off)", field="top_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] in float32 after temperature, top-k, then top-p.

    Greedy params give the one-hot of the argmax (first index on ties), so greedy is a special case of p.
    """
    import torch  # loaded by then (the logits are a tensor): a dictionary look-up

    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p  # keep the token that crosses top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)
