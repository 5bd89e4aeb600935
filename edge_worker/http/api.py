"""The OpenAI-compatible API's pure core: request bodies in, SessionConfigs and response objects out. No sockets,
no ASGI (edge_worker/http/server.py serves it).

    POST /v1/completions       prompt (a string, one string in a list, or token ids)
    POST /v1/chat/completions  messages, through the target tokenizer's chat template
    fields: model, max_tokens (max_completion_tokens), temperature, top_p, seed, stop, n = 1, stream,
            stream_options.include_usage, user; extensions: top_k, draft_len, mode, resample, objective
Responses carry `usage` and a `speculative` object with the request's stats (draft, accepted, cloud calls,
bytes). What cannot be served exactly (logprobs, penalties, logit_bias, n > 1, echo, suffix, tools,
response_format, min_tokens, ignore_eos, stop_token_ids, ... : UNSERVED) is a 400 naming the field unless its
value is the neutral one, and an unknown field is a 400 naming it (as OpenAI answers): nothing is silently ignored.

Bounded before expensive: every size a client controls has a bound checked while the body is decoded (prompt and
message characters, messages, stop strings, token ids), and a prompt is tokenised in growing prefixes that stop
once past the room in the context (`bounded_encode`), so the work is proportional to the context, not the prompt.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from ...common.errors import InvalidRequest
from ...common.protocol import MAX_CONTEXT, MAX_PROMPT_CHARS
from .. import config
from .responses import Outcome, Shape, speculative, usage  # noqa: F401 (the API's response objects)
from ..config import EdgeConfig, SessionConfig

COMPLETION_MAX_TOKENS = 16    # OpenAI's default for /v1/completions
OPENAI_TEMPERATURE = 1.0      # OpenAI's default temperature (the CLI's is 0: greedy)
CHAT_MAX_TOKENS = 1024        # the chat default: up to the target's context (OpenAI's), at most this
MAX_STOPS = 4
MAX_STOP_CHARS = 256          # a stop string: each committed piece is searched for it, so it is short (vLLM: none)
MAX_MESSAGES = 2048           # chat messages in one request (their characters together: MAX_PROMPT_CHARS)
MAX_NAME_CHARS = 64           # a message's name / tool_call_id (OpenAI's name: 64 characters)
ROLES = ("system", "user", "assistant", "tool", "developer")  # OpenAI's chat roles: the template sees nothing else
FIRST_PREFIX_CHARS_PER_TOKEN = 16  # bounded_encode's first prefix: room x 16 characters (most tokens are shorter)
PREFIX_SLACK = 64             # tokens a prefix's cut may add (a word split in two): refused only past room + this
# known fields this server cannot honour -> their neutral values (sent with one of these, the field is harmless)
UNSERVED = {"response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",),
            "parallel_tool_calls": (), "functions": ([],), "function_call": ("none",),
            "repetition_penalty": (1, 1.0), "min_tokens": (0,), "ignore_eos": (False,), "stop_token_ids": ([],),
            "min_p": (0, 0.0), "include_stop_str_in_output": (False,), "top_logprobs": (0,),
            "prompt_logprobs": (0,), "guided_json": (), "guided_regex": (), "guided_choice": (),
            "guided_grammar": (), "prediction": (), "modalities": (["text"],), "audio": (),
            "reasoning_effort": (), "length_penalty": (1, 1.0), "use_beam_search": (False,)}
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

PromptText = Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]
StopText = Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Short = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: Short
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], msgspec.Meta(max_length=MAX_STOPS)] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: Short | None = None
    top_k: int | None = None        # extensions (vLLM accepts top_k too)
    draft_len: int | None = None    # tokens per cloud call; None = the edge's default (auto)
    mode: str | None = None         # greedy | sample | coupled
    resample: str | None = None     # full | hr | srdv
    objective: str | None = None    # speed | balanced | cloud: what auto optimises; None = the edge's default
    for _name in UNSERVED:          # declared so that a neutral value is accepted and any other is refused by name
        locals()[_name] = msgspec.field(default=None)
        __annotations__[_name] = Any
    del _name


class CompletionRequest(_Request, kw_only=True):
    prompt: PromptText | Annotated[list[PromptText | int], msgspec.Meta(max_length=MAX_CONTEXT)]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Short
    text: PromptText | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Short
    content: PromptText | Annotated[list[ContentPart], msgspec.Meta(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None
    tool_call_id: Name | None = None


class ChatRequest(_Request, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def parse(body: bytes, kind: type[msgspec.Struct]):
    """JSON body -> request struct; a type error names its field (`param`)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.startswith("Object contains unknown field"):
            raise unknown_fields(body, kind, text) from None
        where = re.search(r"\$\.(\w+)", text) or re.search(r"field `(\w+)`", text)
        param = where.group(1) if where else None
        raise APIError(400, f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None


def unknown_fields(body: bytes, kind: type[msgspec.Struct], text: str) -> APIError:
    """OpenAI's answer to fields it does not know: a 400 naming every one of them (at the top level; a nested
    object's unknown field is named by its path)."""
    where = re.search(r"`\$\.(\S+)`", text)
    if where is None:  # the request's own fields: name them all
        top = msgspec.json.decode(body)
        names = [k for k in top if k not in kind.__struct_fields__] if isinstance(top, dict) else []
    else:
        names = [where.group(1) + "." + re.search(r"unknown field `([^`]*)`", text).group(1)]
    names = names or [re.search(r"unknown field `([^`]*)`", text).group(1)]
    return APIError(400, f"Unrecognized request argument{'s' if len(names) > 1 else ''} supplied: "
                    + ", ".join(names[:8]), param=names[0][:MAX_NAME_CHARS], code="unknown_field")


def check(req: _Request, served_model: str) -> None:
    """The model name, every option this server cannot honour exactly, and the chat messages."""
    if req.model != served_model:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {served_model!r}",
                       param="model", code="model_not_found")
    for param, neutral in UNSERVED.items():
        value = getattr(req, param, None)
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
            raise APIError(400, f"{param} is not supported by this server (the output is exactly the target "
                           "model's, with the sampling fields it lists)", param=param, code="unsupported_field")
    if isinstance(req, ChatRequest):
        check_messages(req.messages)
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


def check_messages(messages: list[ChatMessage]) -> None:
    """Roles from OpenAI's list (a role is spliced into the chat template: nothing else may reach it), names
    without control characters, all the text together at most MAX_PROMPT_CHARS."""
    total = 0
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", param="messages")
        for value in (m.name, m.tool_call_id):
            if value is not None and (not value.isprintable() or not value.strip()):
                raise APIError(400, f"messages[{i}]: a name must be printable, without control characters",
                               param="messages")
        total += len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or [])
    if total > MAX_PROMPT_CHARS:
        raise APIError(400, f"the messages hold {total} characters, more than {MAX_PROMPT_CHARS}", param="messages")


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

class PromptTooLong(APIError):
    """A prompt whose prefix alone is past the room in the context (refused before tokenising the rest)."""

    def __init__(self, at_least: int, room: int) -> None:
        super().__init__(400, f"the prompt has more than {at_least} tokens: past the room of {room} tokens in the "
                         "target's context (with max_tokens)", param="prompt", code="context_length_exceeded")


def bounded_encode(encode, text: str, room: int | None) -> list[int]:
    """encode(text) -> ids, refused (PromptTooLong) once a prefix already holds more than `room` tokens: prefixes
    of room x FIRST_PREFIX_CHARS_PER_TOKEN characters, then 4x longer each time, so a prompt past the context costs
    about 4 x (room + PREFIX_SLACK) tokens of work whatever its length. A prefix's cut changes only the tokens at
    the cut (a split word), hence the slack: a prompt that fits is never refused."""
    if room is not None and room < 1:
        raise APIError(400, "max_tokens leaves no room for a prompt in the target's context", param="max_tokens",
                       code="context_length_exceeded")
    size = len(text) if room is None else room * FIRST_PREFIX_CHARS_PER_TOKEN
    while True:
        ids = list(encode(text[:size]))
        if size >= len(text):
            return ids
        if len(ids) > room + PREFIX_SLACK:
            raise PromptTooLong(len(ids) - PREFIX_SLACK, room)
        size *= 4


def completion_prompt_ids(tokenizer, req: CompletionRequest, room: int | None = None) -> list[int]:
    """A string (tokenized as `specrelay generate` does), one string in a list, or a list of token ids. `room`:
    the most prompt tokens that can be served (bounded_encode); None = tokenise it all."""
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
    return bounded_encode(lambda text: tokenizer(text).input_ids, prompt, room)


def chat_prompt_ids(tokenizer, req: ChatRequest, room: int | None = None) -> list[int]:
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
    # the template wrote the special tokens
    return bounded_encode(lambda part: tokenizer(part, add_special_tokens=False).input_ids, text, room)


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
