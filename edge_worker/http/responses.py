"""The OpenAI-compatible API's response objects (edge_worker/http/api.py re-exports them): one finished generation
(`Outcome`) and the envelope of a response or a stream chunk (`Shape`), with `usage` and the `speculative` stats.
A response of several choices (n > 1, a list of prompts) sums their usage and their speculative counters."""

from __future__ import annotations

import json
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
    tool_call: bool = False  # tool_choice required or named: the text is a call {"name": ..., "arguments": ...}

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = self.created or int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def full(self, out: Outcome | list[Outcome]) -> dict:
        outs = out if isinstance(out, list) else [out]
        choices = []
        for i, o in enumerate(outs):
            calls = self.tool_calls(o)
            choice = {"index": i, "logprobs": o.logprobs, "finish_reason": "tool_calls" if calls else o.finish_reason}
            message = {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
                {"role": "assistant", "content": o.text}
            choice |= {"message": message} if self.chat else {"text": o.text}
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

    def ending(self, out: Outcome, held: str, index: int = 0) -> list[dict]:
        """A choice's last chunks in a stream: a tool call as one delta (its text was held back), or the held
        text; then the chunk with finish_reason and the speculative stats."""
        calls = self.tool_calls(out)
        if calls:
            delta = {"index": index, "delta": {"tool_calls": [{"index": 0} | c for c in calls]}, "logprobs": None,
                     "finish_reason": None}
            done = self.chunk(finish_reason="tool_calls", index=index) | {"speculative": speculative(out.stats)}
            return [self._envelope("chat.completion.chunk", [delta]), done]
        return ([self.chunk(held, index=index)] if held else []) + [self.last(out, index)]

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
