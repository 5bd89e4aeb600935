"""Presence / frequency / repetition penalties and logit_bias: one pure transform of logits, both sides.

The edge applies it to the draft's logits and the cloud to the target's, before the grammar mask and before
`sampling.probs_from_logits` (temperature, top-k, top-p). The order inside is vLLM's: logit_bias, then the
repetition penalty (Hugging Face's rule), then frequency and presence (OpenAI's formula):

    logits[j] += bias[j]
    logits[j] = logits[j] / r  if logits[j] > 0 else logits[j] * r      for j in prompt + generated  (r > 1 damps)
    logits[j] -= c[j] * frequency + (c[j] > 0) * presence               c[j]: count of j among generated tokens
    logits[s] = -inf  for s in EOS + stop_token_ids while fewer than min_tokens tokens are generated

Exactness: the penalty at position t depends only on the tokens before t. So the row that verifies drafted
token x_i (after `generated` tokens already committed) uses the counts of generated + x_0 .. x_{i-1}:
`penalised_rows` computes exactly those rows, and a speculative run equals the target alone penalised the same
way. Importing this module loads no torch: `Penalties` is checked before any model loads.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import msgspec

from .errors import InvalidRequest

if TYPE_CHECKING:
    import torch

BIAS_LIMIT = 100.0        # OpenAI's logit_bias range is [-100, 100]
PENALTY_LIMIT = 2.0       # OpenAI's presence/frequency range is [-2, 2]
REPETITION_LIMIT = 100.0  # vLLM accepts any r > 0; past 100 every seen token is already gone, so cap there
MAX_MIN_TOKENS = 1 << 20  # past any context a model has: a larger value is a mistake, not a request


@dataclass(frozen=True)
class Penalties:
    """presence, frequency 0, repetition 1 and no bias mean off (`active` is then False and nothing runs)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # (token id, bias), sorted by id
    min_tokens: int = 0  # EOS and the stop token ids are refused until this many tokens are generated
    stop_ids: tuple[int, ...] = ()  # EOS plus the request's stop_token_ids: what min_tokens holds back

    def __post_init__(self) -> None:
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not (math.isfinite(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT):
                raise InvalidRequest(f"{name} must be a number in [-2, 2]", field=name)
        if not (math.isfinite(self.repetition) and 0.0 < self.repetition <= REPETITION_LIMIT):
            raise InvalidRequest("repetition_penalty must be a number in (0, 100] (1 = off)",
                                 field="repetition_penalty")
        if not 0 <= self.min_tokens <= MAX_MIN_TOKENS:
            raise InvalidRequest(f"min_tokens must be in [0, {MAX_MIN_TOKENS}]", field="min_tokens")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -BIAS_LIMIT <= bias <= BIAS_LIMIT):
                raise InvalidRequest(f"logit_bias[{token}] must be a number in [-100, 100]", field="logit_bias")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias
                    or (self.min_tokens and self.stop_ids))

    @classmethod
    def from_request(cls, body: dict, vocab_size: int, eos: int | None = None) -> "Penalties":
        """An OpenAI request body (plus vLLM's `repetition_penalty`, `min_tokens`, `stop_token_ids`) ->
        Penalties; a one-line error per field."""
        bias = body.get("logit_bias") or {}
        if not isinstance(bias, dict):
            raise InvalidRequest("logit_bias must be an object of token id -> bias", field="logit_bias")
        pairs = []
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise InvalidRequest(f"logit_bias key {key!r} is not a token id", field="logit_bias") from None
            if not 0 <= token < vocab_size:
                raise InvalidRequest(f"logit_bias token {token} is outside [0, {vocab_size})", field="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequest(f"logit_bias[{token}] must be a number", field="logit_bias")
            pairs.append((token, float(value)))
        stops = body.get("stop_token_ids") or []
        if not (isinstance(stops, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < vocab_size for t in stops)):
            raise InvalidRequest(f"stop_token_ids must be a list of token ids in [0, {vocab_size})",
                                 field="stop_token_ids")
        min_tokens = body.get("min_tokens") or 0
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int):
            raise InvalidRequest("min_tokens must be an integer", field="min_tokens")
        stop_ids = tuple(sorted(set(stops) | ({eos} if eos is not None else set())))
        return cls(presence=_number(body, "presence_penalty", 0.0), frequency=_number(body, "frequency_penalty", 0.0),
                   repetition=_number(body, "repetition_penalty", 1.0), logit_bias=tuple(sorted(pairs)),
                   min_tokens=min_tokens, stop_ids=stop_ids if min_tokens else ())


class PenaltiesWire(msgspec.Struct, array_like=True, frozen=True):
    """What an OPEN carries for a penalised session (None: none). bias_ids int32[n], bias_values float32[n]."""

    presence: float
    frequency: float
    repetition: float
    bias_ids: bytes = b""
    bias_values: bytes = b""
    min_tokens: int = 0
    stop_ids: bytes = b""  # int32[m]


def to_wire(pen: Penalties) -> PenaltiesWire | None:
    if not pen.active:
        return None
    ids, values = [t for t, _ in pen.logit_bias], [b for _, b in pen.logit_bias]
    return PenaltiesWire(pen.presence, pen.frequency, pen.repetition, struct.pack(f"<{len(ids)}i", *ids),
                         struct.pack(f"<{len(values)}f", *values), pen.min_tokens,
                         struct.pack(f"<{len(pen.stop_ids)}i", *pen.stop_ids))


def from_wire(wire: PenaltiesWire, vocab_size: int) -> Penalties:
    """The cloud's side: every field checked again (InvalidRequest names it), ids inside the target's vocabulary."""
    if len(wire.bias_ids) % 4 or len(wire.bias_ids) != len(wire.bias_values) or len(wire.bias_ids) > 4 * vocab_size:
        raise InvalidRequest("logit_bias arrays disagree", field="logit_bias")
    n = len(wire.bias_ids) // 4
    ids, values = struct.unpack(f"<{n}i", wire.bias_ids), struct.unpack(f"<{n}f", wire.bias_values)
    if any(not 0 <= t < vocab_size for t in ids) or len(set(ids)) != n:
        raise InvalidRequest("logit_bias token outside the vocabulary or repeated", field="logit_bias")
    if len(wire.stop_ids) % 4 or len(wire.stop_ids) > 4 * vocab_size:
        raise InvalidRequest("stop_token_ids array has a bad length", field="stop_token_ids")
    stops = struct.unpack(f"<{len(wire.stop_ids) // 4}i", wire.stop_ids)
    if any(not 0 <= t < vocab_size for t in stops):
        raise InvalidRequest("stop_token_ids outside the vocabulary", field="stop_token_ids")
    return Penalties(wire.presence, wire.frequency, wire.repetition, tuple(sorted(zip(ids, values))),
                     wire.min_tokens, tuple(sorted(set(stops))))


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number", field=name)
    return float(value)


def apply(logits: torch.Tensor, pen: Penalties, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """logits [V] (one position) -> a new float32 [V] with the penalties of the tokens before it applied."""
    import torch

    out = logits.float().clone()
    if not pen.active:
        return out
    v = out.shape[-1]
    if pen.logit_bias:
        ids = torch.tensor([t for t, _ in pen.logit_bias], dtype=torch.long)
        out[ids] += torch.tensor([b for _, b in pen.logit_bias], dtype=torch.float32)
    if pen.repetition != 1.0:
        seen = torch.tensor(list(prompt) + list(generated), dtype=torch.long)
        seen = seen.unique() if len(seen) else seen
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / pen.repetition, vals * pen.repetition)
    if len(generated) < pen.min_tokens and pen.stop_ids:
        out[torch.tensor(pen.stop_ids, dtype=torch.long)] = float("-inf")
    if (pen.presence or pen.frequency) and len(generated):
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=v)[:v].float()
        out -= counts * pen.frequency + (counts > 0).float() * pen.presence
    return out


def penalised_rows(logits: torch.Tensor, pen: Penalties, prompt: Sequence[int], generated: Sequence[int],
                   drafted: Sequence[int]) -> torch.Tensor:
    """logits [d+1, V] verifying `drafted` (d tokens) after `generated` -> [d+1, V] float32.

    Row i is `apply(logits[i], ..., generated + drafted[:i])`: the counts of exactly the tokens before it.
    """
    import torch

    if not pen.active:
        return logits.float()
    history = list(generated)
    rows = []
    for i in range(logits.shape[0]):
        rows.append(apply(logits[i], pen, prompt, history))
        if i < len(drafted):
            history.append(int(drafted[i]))
    return torch.stack(rows)
