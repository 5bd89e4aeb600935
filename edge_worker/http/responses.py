"""The OpenAI-compatible API's response objects (edge_worker/http/api.py re-exports them): one finished generation
(`Outcome`) and the envelope of a response or a stream chunk (`Shape`), with `usage` and the `speculative` stats."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass


@dataclass
class Outcome:
    """One finished generation as the API reports it."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop (EOS or a stop string) | length
    stats: dict


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

    def full(self, out: Outcome) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason}
        choice |= {"message": {"role": "assistant", "content": out.text}} if self.chat else {"text": out.text}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return body | {"usage": usage(out), "speculative": speculative(out.stats)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, *, role: bool = False) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def last(self, out: Outcome) -> dict:
        return self.chunk(finish_reason=out.finish_reason) | {"speculative": speculative(out.stats)}

    def usage_chunk(self, out: Outcome) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", []) | {"usage": usage(out)}


def usage(out: Outcome) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def speculative(stats: dict) -> dict:
    """The per-request speculation stats (extension): drafted, accepted, cloud calls, bytes each way."""
    out = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    drafted = out.get("draft_tokens", 0)
    out["acceptance_rate"] = out.get("accepted_tokens", 0) / drafted if drafted else 0.0
    return out
