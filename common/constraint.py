"""Structured outputs: a grammar constraint in the TARGET's token space, driven by llguidance.

`spec_from_request` turns a request's `response_format` (OpenAI) or its vLLM-style fields (`guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, or the newer `structured_outputs` object) into a
`ConstraintSpec`: two strings, small enough to travel in an OPEN, checked without loading any engine. The side
that holds the target's tokenizer compiles it once per session into a `Constraint`:

    allowed()        -> bool [V]: the tokens the grammar allows next (EOS only once the grammar is complete)
    advance(tokens)  -> how many of `tokens` were allowed, consumed in order (stops at the first refused one)
    rollback(n)      un-consumes the last n tokens (a rejection at verification)
    masks_along(d)   the masks a verifier needs at each position of a drafted block, and how many were allowed
    is_terminated()  EOS was consumed: the generation is over
    sync(tokens)     roll back to the common prefix with `tokens` and advance over the rest (the edge's drafts)

The per-session state is the matcher and one preallocated bitmask of ceil(V / 32) int32 words. Masking is
`logits.masked_fill(~mask, -inf)` before `sampling.probs_from_logits`, as a Hugging Face logits processor does
before the temperature / top-k / top-p warpers: greedy picks the argmax of the masked logits, sampling draws from
the masked, renormalised distribution. The engine is an optional dependency (`pip install specrelay[structured]`);
importing this module loads neither it nor torch.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Sequence

import msgspec

from .errors import InvalidRequest

if TYPE_CHECKING:
    import torch

MAX_SPEC_BYTES = 64 * 1024  # a schema or grammar larger than this is not a request, it is an attack on the compiler
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
VLLM_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}


class ConstraintSpec(msgspec.Struct, array_like=True, frozen=True):
    """kind: one of KINDS; text: the JSON schema (JSON), the regex, the JSON list of choices, or the grammar
    (Lark or GBNF). json_object's text is empty: any JSON object."""

    kind: str
    text: str


def _spec(kind: str, value, field: str) -> ConstraintSpec:
    if kind == "json_object":
        return ConstraintSpec("json_object", "")
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidRequest(f"{field} is not valid JSON", field=field) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequest(f"{field} must be a JSON schema object", field=field)
        text = json.dumps(value)
    elif kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(f"{field} must be a non-empty list of non-empty strings", field=field)
        text = json.dumps(value)
    else:
        if not (isinstance(value, str) and value):
            raise InvalidRequest(f"{field} must be a non-empty string", field=field)
        text = value
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise InvalidRequest(f"{field} is larger than {MAX_SPEC_BYTES} bytes", field=field)
    return ConstraintSpec(kind, text)


def _response_format(rf) -> ConstraintSpec | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidRequest("response_format must be an object with a type", field="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("json_object", None, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise InvalidRequest("response_format.json_schema must be an object with a schema",
                                 field="response_format.json_schema")
        return _spec("json_schema", js["schema"], "response_format.json_schema.schema")
    raise InvalidRequest(f"response_format.type {kind!r} is not one of text, json_object, json_schema",
                         field="response_format.type")


def spec_from_request(body: dict) -> ConstraintSpec | None:
    """A request body -> its constraint (None: unconstrained). At most one constraint field may be set."""
    found: list[tuple[str, ConstraintSpec | None]] = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    for field, kind in VLLM_FIELDS.items():
        if body.get(field) is not None:
            found.append((field, _spec(kind, body[field], field)))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequest("structured_outputs must be an object", field="structured_outputs")
        for key, value in so.items():
            if key not in STRUCTURED_KEYS:
                raise InvalidRequest(f"structured_outputs.{key} is not supported", field=f"structured_outputs.{key}")
            if value is not None and value is not False:
                found.append((f"structured_outputs.{key}",
                              _spec(STRUCTURED_KEYS[key], value, f"structured_outputs.{key}")))
    found = [(f, s) for f, s in found if s is not None]
    if len(found) > 1:
        names = ", ".join(f for f, _ in found)
        raise InvalidRequest(f"only one structured-output field may be set (got {names})", field=found[1][0])
    return found[0][1] if found else None


def tool_call_spec(tools: Sequence[tuple[str, dict | None]]) -> ConstraintSpec:
    """(name, parameters schema) of the tools a call may name -> the JSON schema of one call,
    {"name": <one of the names>, "arguments": <that tool's parameters>} (an anyOf over several tools)."""
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                               "arguments": parameters or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for name, parameters in tools]
    return _spec("json_schema", calls[0] if len(calls) == 1 else {"anyOf": calls}, "tools")


# ------------------------------------------------------------------------------------------ the engine side

class TokenVocab:
    """The target tokenizer as llguidance sees it: built once per process (about 1 s per 100k tokens), shared by
    every session's Constraint. vocab_size is the target's logits width (>= the tokenizer's: padded ids are never
    allowed)."""

    def __init__(self, tokenizer, vocab_size: int | None = None) -> None:
        try:
            import llguidance.hf
        except ImportError:
            raise InvalidRequest("structured outputs need the grammar engine: pip install 'specrelay[structured]'",
                                 field="response_format") from None
        self.vocab_size = vocab_size or len(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:200]


def _grammar(spec: ConstraintSpec) -> str:
    import llguidance

    if spec.kind in ("json_object", "json_schema"):  # compact JSON: no whitespace runs for a model to loop in
        schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if spec.kind == "grammar":
        return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
    return llguidance.grammar_from(spec.kind, spec.text)


class Constraint:
    """One session's grammar state over the target's tokens (see the module docstring)."""

    def __init__(self, vocab: TokenVocab, spec: ConstraintSpec) -> None:
        import llguidance
        import llguidance.torch as lt

        if spec.kind not in KINDS or len(spec.text) > MAX_SPEC_BYTES:  # a peer's spec is checked like a request's
            raise InvalidRequest(f"constraint kind {spec.kind[:32]!r} with {len(spec.text)} characters is not one of "
                                 f"{', '.join(KINDS)} within {MAX_SPEC_BYTES} bytes", field="constraint")
        try:
            grammar = _grammar(spec)
        except ValueError as e:
            raise InvalidRequest(f"{spec.kind}: {_one_line(str(e))}", field=spec.kind) from None
        self._m = llguidance.LLMatcher(vocab.info, grammar, log_level=0)
        if self._m.is_error():
            raise InvalidRequest(f"{spec.kind}: {_one_line(self._m.get_error())}", field=spec.kind)
        self.vocab_size, self.eos = vocab.vocab_size, vocab.eos
        self._bits = lt.allocate_token_bitmask(1, vocab.vocab_size)
        self._lt = lt
        self._ended = False
        self.consumed: list[int] = []  # every token consumed, in order (EOS last once ended)

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens allowed at the current state."""
        import torch

        self._lt.fill_next_token_bitmask(self._m, self._bits, 0)
        bits = (self._bits[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten()[: self.vocab_size].bool()

    def advance(self, tokens: Sequence[int]) -> int:
        """Consume tokens in order while allowed; returns how many were consumed. EOS is allowed once the
        grammar is complete and ends the constraint: nothing after it is consumed."""
        tokens = [int(t) for t in tokens]
        if self._ended or not tokens:
            return 0
        cut = tokens.index(self.eos) if self.eos in tokens else len(tokens)
        n = self._m.try_consume_tokens(tokens[:cut]) if cut else 0
        if n == cut < len(tokens) and self._m.is_accepting():
            self._ended = True
            n += 1
        self.consumed += tokens[:n]
        return n

    def rollback(self, n: int) -> None:
        if n:
            del self.consumed[-n:]
        if n and self._ended:
            self._ended, n = False, n - 1
        if n and not self._m.rollback(n):
            raise RuntimeError(f"grammar rollback of {n} failed: {self._m.get_error()[:200]}")

    def sync(self, tokens: Sequence[int]) -> bool:
        """Make the consumed tokens equal `tokens`: roll back past their common prefix, advance over the rest.
        False when the grammar refuses one of them (the state then holds the allowed prefix)."""
        tokens = list(tokens)
        lo, hi = 0, min(len(self.consumed), len(tokens))  # the common prefix's length, by bisection: list slices
        while lo < hi:                                     # compare in C, so a long output costs O(n log n)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.consumed[:mid] == tokens[:mid] else (lo, mid - 1)
        same = lo
        self.rollback(len(self.consumed) - same)
        return self.advance(tokens[same:]) == len(tokens) - same

    def is_terminated(self) -> bool:
        """EOS was consumed (the generation is over); `is_stopped` says the grammar allows EOS only."""
        return self._ended

    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    def masks_along(self, drafted: Sequence[int]) -> tuple[torch.Tensor, int]:
        """The verifier's masks for a drafted block: rows [m + 1, V] where m is how many drafted tokens are
        allowed; row i is the mask before drafted token i (row m: before the refused token, or the bonus
        position). The state is left advanced by the m allowed tokens: roll back what the verdict rejects."""
        import torch

        rows, m = [self.allowed()], 0
        for token in drafted:
            if self._ended or not bool(rows[-1][int(token)]) or self.advance([token]) != 1:
                break
            m += 1
            rows.append(rows[-1] if self._ended else self.allowed())  # after EOS: no position is verified
        return torch.stack(rows), m


    def masks_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[torch.Tensor, list[bool]]:
        """A token tree's masks (common/tree.py layout: parents in topological order, -1 = the root).

        rows [n + 1, V]: row 0 is the mask at the root, row u + 1 the mask after the path to node u (the decision
        AT u). allowed[u]: the path to u is allowed; below a refused node the rows repeat its parent's (never
        used: the target cannot pick a refused token). The state is left at the root: after the verdict, advance
        over the accepted path and the next token."""
        import torch

        rows: list[torch.Tensor | None] = [self.allowed()] + [None] * len(tokens)
        ok = [False] * len(tokens)
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
        for u, parent in enumerate(parents):
            children[parent + 1].append(u)
        stack = [(u, 0) for u in reversed(children[0])]  # (node, how many tokens the state holds below the root)
        depth_held = 0
        while stack:
            u, parent_depth = stack.pop()
            self.rollback(depth_held - parent_depth)
            depth_held = parent_depth
            parent_row = rows[parents[u] + 1]
            ok[u] = (parents[u] < 0 or ok[parents[u]]) and bool(parent_row[int(tokens[u])]) \
                and self.advance([tokens[u]]) == 1
            if ok[u]:
                depth_held += 1
                rows[u + 1] = parent_row if self._ended else self.allowed()
            else:
                rows[u + 1] = parent_row
            stack.extend((c, depth_held if ok[u] else parent_depth) for c in reversed(children[u + 1]))
        self.rollback(depth_held)
        return torch.stack(rows), ok

def mask_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [..., V'] with mask [..., V] -> float32 logits with refused tokens at -inf (V' > V: past V refused)."""
    import torch

    out = logits.float().clone()
    mask = mask.to(out.device)  # the grammar's masks are built on the CPU; a worker's logits may be on a GPU
    v = mask.shape[-1]
    out[..., :v] = out[..., :v].masked_fill(~mask, float("-inf"))
    out[..., v:] = float("-inf")
    return out
