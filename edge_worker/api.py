"""The OpenAI-compatible API's pure core: request bodies in, SessionConfigs and response objects out. No sockets,
no ASGI (edge_worker/http.py serves it).

    POST /v1/completions       prompt (a string, one string in a list, or token ids)
    POST /v1/chat/completions  messages, through the target tokenizer's chat template
    fields: model, max_tokens (max_completion_tokens), temperature, top_p, seed, stop, n = 1, stream,
            stream_options.include_usage; extensions: top_k, draft_len, mode, resample, objective
Responses carry `usage` and a `speculative` object with the request's stats (draft, accepted, cloud calls,
bytes). What cannot be served exactly (logprobs, penalties, logit_bias, n > 1, echo, suffix) is a 400, never
silently ignored: the output is the target model's own.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass

import msgspec

from ..common.errors import InvalidRequest
from . import config
from .config import EdgeConfig, SessionConfig

COMPLETION_MAX_TOKENS = 16    # OpenAI's default for /v1/completions
OPENAI_TEMPERATURE = 1.0      # OpenAI's default temperature (the CLI's is 0: greedy)
CHAT_MAX_TOKENS = 1024        # the chat default: up to the target's context (OpenAI's), at most this
MAX_STOPS = 4
FIELD_NAMES = {"max_new_tokens": "max_tokens"}  # SessionConfig field -> the API's name


class APIError(Exception):
    """An OpenAI-style error object with its HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


# ------------------------------------------------------------------------------------------ requests

class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Request(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None        # extensions (vLLM accepts top_k too)
    draft_len: int | None = None    # tokens per cloud call; None = the edge's default (auto)
    mode: str | None = None         # greedy | sample | coupled
    resample: str | None = None     # full | hr | srdv
    objective: str | None = None    # speed | balanced | cloud: what auto optimises; None = the edge's default


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str | int]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def parse(body: bytes, kind: type[msgspec.Struct]):
    """JSON body -> request struct; a type error names its field (`param`)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        where = re.search(r"\$\.(\w+)", text) or re.search(r"field `(\w+)`", text)
        param = where.group(1) if where else None
        raise APIError(400, f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None


def check(req: _Request, served_model: str) -> None:
    """The model name, and every option this server cannot honour exactly."""
    if req.model != served_model:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {served_model!r}",
                       param="model", code="model_not_found")
    refused = {
        "n": req.n not in (None, 1), "presence_penalty": bool(req.presence_penalty),
        "frequency_penalty": bool(req.frequency_penalty), "logit_bias": bool(req.logit_bias),
        "logprobs": bool(getattr(req, "logprobs", None)), "echo": bool(getattr(req, "echo", False)),
        "suffix": getattr(req, "suffix", None) is not None, "best_of": getattr(req, "best_of", None) not in (None, 1),
    }
    for param, bad in refused.items():
        if bad:
            raise APIError(400, f"{param} is not supported: the output is exactly the target model's, one choice "
                           "per request", param=param)
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOPS:
        raise APIError(400, f"at most {MAX_STOPS} stop strings", param="stop")
    if req.temperature is not None and not 0 <= req.temperature <= 2:  # OpenAI's range
        raise APIError(400, f"temperature must be between 0 and 2, got {req.temperature}", param="temperature")
    for param in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, param, None)
        if value is not None and value < 1:
            raise APIError(400, f"{param} must be at least 1, got {value}", param=param)


def stops(req: _Request) -> list[str]:
    return [s for s in ([req.stop] if isinstance(req.stop, str) else req.stop or []) if s]


def session_config(req: _Request, max_tokens: int, edge: EdgeConfig) -> SessionConfig:
    """The request's sampling settings -> its SessionConfig (config.session_config: the edge's defaults, the mode
    rule), OpenAI's defaults where it names nothing (temperature 1, top_p 1, no seed = a random one); a refusal is
    a 400 in the API's own names."""
    try:
        return config.session_config(edge, max_new_tokens=max_tokens,
                                     temperature=OPENAI_TEMPERATURE if req.temperature is None else req.temperature,
                                     top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
                                     seed=req.seed, draft_len=req.draft_len, mode=req.mode, resample=req.resample,
                                     objective=req.objective)
    except InvalidRequest as exc:
        raise as_api_error(exc) from None


def as_api_error(exc: InvalidRequest) -> APIError:
    field = FIELD_NAMES.get(exc.field, exc.field)
    message = re.sub(r"^[A-Z]\w*\.|\s*- at `\$\[\d+\]`", "", str(exc))  # the API's names, not the wire's
    for inner, outer in FIELD_NAMES.items():
        message = message.replace(inner, outer)
    return APIError(400, message, param=field)


def completion_max_tokens(req: CompletionRequest, room: int) -> int:
    """max_tokens, else OpenAI's default of 16. `room`: tokens left in the target's context after the prompt."""
    return COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens


def chat_max_tokens(req: ChatRequest, room: int) -> int:
    """max_completion_tokens (or max_tokens), else up to the context (at most CHAT_MAX_TOKENS)."""
    value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return min(CHAT_MAX_TOKENS, max(1, room)) if value is None else value


# ------------------------------------------------------------------------------------------ prompts

def completion_prompt_ids(tokenizer, req: CompletionRequest) -> list[int]:
    """A string (tokenized as `specrelay generate` does), one string in a list, or a list of token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt) and prompt:
        if not all(0 <= p < len(tokenizer) for p in prompt):
            raise APIError(400, f"token ids must be in [0, {len(tokenizer)})", param="prompt")
        return list(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise APIError(400, "one prompt per request: a string, [string] or a list of token ids", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    return list(tokenizer(prompt).input_ids)


def chat_prompt_ids(tokenizer, req: ChatRequest) -> list[int]:
    """messages -> the target tokenizer's chat template (with the assistant's turn opened) -> token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the target tokenizer has no chat template: use /v1/completions with a plain prompt",
                       param="messages")
    if not req.messages:
        raise APIError(400, "messages is empty", param="messages")
    messages = [{"role": m.role, "content": _text(m.content)} for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template's own checks (roles must alternate, ...) raise jinja errors: their text
        raise TemplateRefused(exc) from None  # is logged (with the request id), never shown to the client
    return list(tokenizer(text, add_special_tokens=False).input_ids)  # the template wrote the special tokens


class TemplateRefused(APIError):
    """The chat template raised: a 400 whose client-facing text is generic; `cause` is for the log."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(400, "the chat template refused the messages (check the roles and their order)",
                         param="messages")
        self.cause = cause


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.type != "text" or part.text is None for part in content):
        raise APIError(400, "only text content parts are supported", param="messages")
    return "".join(part.text for part in content)


# ------------------------------------------------------------------------------------------ stop strings

class StopStrings:
    """Committed text in, text safe to show out. Text that could still become the start of a stop string is
    held back; at the first stop string the output ends before it (the stop string is never shown)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max(map(len, self.stops), default=1) - 1
        self.text, self.shown, self.hit = "", 0, False

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        self.text += piece
        found = [i for i in (self.text.find(s, self.shown) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.text = True, self.text[:min(found)]
            end = len(self.text)
        else:
            end = max(self.shown, len(self.text) - self.hold)
        out, self.shown = self.text[self.shown:end], end
        return out

    def flush(self) -> str:
        """At the end of the generation: everything still held back."""
        out, self.shown = self.text[self.shown:], len(self.text)
        return out


# ------------------------------------------------------------------------------------------ responses

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
