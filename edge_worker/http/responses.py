"""The OpenAI-compatible API's response objects (edge_worker/http/api.py re-exports them): one finished generation
(`Outcome`) and the envelope of a response or a stream chunk (`Shape`), with `usage` and the `speculative` stats."""

from __future__ import annotations

import json
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
    tool_call: bool = False  # tool_choice required or named: the text is a call {"name": ..., "arguments": ...}

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = self.created or int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, out: Outcome) -> dict:
        calls = self.tool_calls(out)
        choice = {"index": 0, "logprobs": None, "finish_reason": "tool_calls" if calls else out.finish_reason}
        message = {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
            {"role": "assistant", "content": out.text}
        choice |= {"message": message} if self.chat else {"text": out.text}
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

    def tool_calls(self, out: Outcome) -> list[dict] | None:
        """A forced tool call's text -> OpenAI's `tool_calls` (arguments as a JSON string); None when this is
        not a tool call or the text is not a whole call (cut by max_tokens or a stop string: sent as content)."""
        if not (self.tool_call and self.chat and out.finish_reason == "stop"):
            return None
        try:
            call = json.loads(out.text)
            name, arguments = call["name"], call["arguments"]
        except (ValueError, KeyError, TypeError):
            return None
        return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}}]

    def ending(self, out: Outcome, held: str) -> list[dict]:
        """A stream's last chunks: a tool call as one delta (its text was held back), or the held text; then
        the chunk with finish_reason and the speculative stats."""
        calls = self.tool_calls(out)
        if calls:
            delta = {"index": 0, "delta": {"tool_calls": [{"index": 0} | c for c in calls]}, "logprobs": None,
                     "finish_reason": None}
            done = self.chunk(finish_reason="tool_calls") | {"speculative": speculative(out.stats)}
            return [self._envelope("chat.completion.chunk", [delta]), done]
        return ([self.chunk(held)] if held else []) + [self.last(out)]

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
