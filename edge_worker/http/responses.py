"""The OpenAI-compatible API's response objects (edge_worker/http/api.py re-exports them): one finished generation
(`Outcome`) and the envelope of a response or a stream chunk (`Shape`), with `usage` and the `speculative` stats.
A response of several choices (n > 1, a list of prompts) sums their usage and their speculative counters."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


@dataclass
class Outcome:
    """One finished generation as the API reports it."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop (EOS or a stop string) | length
    stats: dict
    token_ids: list[int] = field(default_factory=list)  # the generated target ids (EOS included)
    logprobs: dict | None = None  # OpenAI's choice.logprobs, when asked (common/logprobs.py)


@dataclass
class Shape:
    """The envelope of one response: chat or completion, its id, time and model."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = self.created or int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, out: Outcome | list[Outcome]) -> dict:
        outs = out if isinstance(out, list) else [out]
        choices = []
        for i, o in enumerate(outs):
            choice = {"index": i, "logprobs": o.logprobs, "finish_reason": o.finish_reason}
            choice |= {"message": {"role": "assistant", "content": o.text}} if self.chat else {"text": o.text}
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        return body | {"usage": usage(outs), "speculative": speculative(_summed(outs))}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, *, role: bool = False,
              index: int = 0, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def last(self, out: Outcome, index: int = 0) -> dict:
        return self.chunk(finish_reason=out.finish_reason, index=index) | {"speculative": speculative(out.stats)}

    def usage_chunk(self, out: Outcome | list[Outcome]) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", []) | {"usage": usage(out)}


def usage(out: Outcome | list[Outcome]) -> dict:
    outs = out if isinstance(out, list) else [out]
    prompt, completion = sum(o.prompt_tokens for o in outs), sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _summed(outs: list[Outcome]) -> dict:
    """The choices' numeric stats added up (one choice: its own)."""
    if len(outs) == 1:
        return outs[0].stats
    total: dict = {}
    for o in outs:
        for k, v in o.stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    return total


def speculative(stats: dict) -> dict:
    """The per-request speculation stats (extension): drafted, accepted, cloud calls, bytes each way."""
    out = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    drafted = out.get("draft_tokens", 0)
    out["acceptance_rate"] = out.get("accepted_tokens", 0) / drafted if drafted else 0.0
    return out
