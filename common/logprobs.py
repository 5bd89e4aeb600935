"""Log-probabilities of the target model in OpenAI's shapes, and their compact wire form.

The numbers are the log-softmax of the target's raw logits (before temperature, top-k, top-p, penalties and the
grammar mask), as vLLM returns them by default. The cloud computes them from the logits rows of the forward it
already runs (`token_logprobs`: the verified positions; `prompt_logprobs`: the prefill), packs them into a
`LogprobsWire` (float32 / int32 arrays, sent only for sessions that asked), and the edge turns them into
OpenAI's `completions` shape (`completion_logprobs`) or chat shape (`chat_logprobs`) with the token strings
and bytes of the target's tokenizer (`token_byte_table`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import msgspec

from .errors import InvalidRequest

if TYPE_CHECKING:
    import torch

MAX_TOP = 20  # OpenAI's top_logprobs limit (and vLLM's default max_logprobs)


class Rows(NamedTuple):
    """n positions: the chosen token's logprob [n], the top k ids [n, k] and their logprobs [n, k]."""

    chosen: torch.Tensor      # float32 [n]; NaN where there is no value (a prompt's first token)
    top_ids: torch.Tensor     # int64 [n, k]
    top_logprobs: torch.Tensor  # float32 [n, k]


def token_logprobs(logits: torch.Tensor, chosen: Sequence[int] | torch.Tensor, k: int) -> Rows:
    """logits [n, V] (row i is the distribution chosen[i] was drawn from), chosen [n] -> Rows with top k."""
    import torch

    if not 0 <= k <= MAX_TOP:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP}]", field="logprobs")
    logp = logits.float().log_softmax(-1)
    ids = torch.as_tensor(chosen, dtype=torch.long).reshape(-1)
    if ids.shape[0] != logp.shape[0]:
        raise ValueError(f"{ids.shape[0]} chosen tokens for {logp.shape[0]} logits rows")
    picked = logp.gather(-1, ids[:, None])[:, 0]
    top = logp.topk(k, dim=-1) if k else None
    top_ids = top.indices if top else torch.zeros(len(ids), 0, dtype=torch.long)
    top_lp = top.values if top else torch.zeros(len(ids), 0)
    return Rows(picked, top_ids, top_lp)


def prompt_logprobs(prefill_logits: torch.Tensor, prompt: Sequence[int], k: int) -> Rows:
    """Prompt scoring (echo): prefill logits [L, V] of prompt [L] -> Rows for each prompt token.

    Row i of the prefill predicts token i + 1, so the first token has no logprob (NaN here, null on the wire's
    JSON, as OpenAI and vLLM return it) and no top list.
    """
    import torch

    return concat([no_row(k), token_logprobs(prefill_logits[:-1], list(prompt)[1:], k)])


def no_row(k: int) -> Rows:
    """The row of a position without a logprob (a prompt's first token): NaN, no alternatives (ids -1)."""
    import torch

    return Rows(torch.full((1,), float("nan")), torch.full((1, k), -1, dtype=torch.long),
                torch.full((1, k), float("nan")))


def concat(parts: Sequence[Rows]) -> Rows:
    import torch

    return Rows(*(torch.cat([getattr(r, f) for r in parts]) for f in Rows._fields))


# --------------------------------------------------------------------------------------------------- the wire

class LogprobsWire(msgspec.Struct, array_like=True, frozen=True):
    """A trailing field of a VERDICT (and of a prefill's reply for echo): n positions with k alternatives each.

    chosen: float32[n] little-endian; top_ids: int32[n * k]; top_logprobs: float32[n * k]. For a chain VERDICT
    the n positions are the accepted drafted tokens followed by the recovered / bonus token when the cloud
    picked it; sessions that did not ask for logprobs leave the VERDICT's field None (nothing on the wire).
    """

    k: int
    chosen: bytes
    top_ids: bytes
    top_logprobs: bytes


def pack(rows: Rows) -> LogprobsWire:
    import torch

    k = rows.top_ids.shape[1]
    return LogprobsWire(k, rows.chosen.float().numpy().astype("<f4").tobytes(),
                        rows.top_ids.to(torch.int32).numpy().astype("<i4").tobytes(),
                        rows.top_logprobs.float().numpy().astype("<f4").tobytes())


def unpack(wire: LogprobsWire, max_positions: int) -> Rows:
    """The edge's side: checks every length (a hostile or broken peer gets InvalidRequest, never a crash)."""
    import numpy as np
    import torch

    if not 0 <= wire.k <= MAX_TOP or len(wire.chosen) % 4:
        raise InvalidRequest("logprobs: bad k or chosen length", field="logprobs")
    n = len(wire.chosen) // 4
    if n > max_positions or len(wire.top_ids) != 4 * n * wire.k or len(wire.top_logprobs) != 4 * n * wire.k:
        raise InvalidRequest("logprobs: array lengths disagree", field="logprobs")
    chosen = torch.from_numpy(np.frombuffer(wire.chosen, "<f4").astype(np.float32))
    ids = torch.from_numpy(np.frombuffer(wire.top_ids, "<i4").astype(np.int64)).reshape(n, wire.k)
    lp = torch.from_numpy(np.frombuffer(wire.top_logprobs, "<f4").astype(np.float32)).reshape(n, wire.k)
    return Rows(chosen, ids, lp)


# --------------------------------------------------------------------------------------- tokens and shapes

def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each byte -> the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return {c: b for b, c in enumerate(chars)}


def token_byte_table(tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """id -> the bytes that token stands for in the target's tokenizer (special tokens: their text)."""
    decoder = _byte_decoder()
    special = set(getattr(tokenizer, "all_special_ids", []))
    n = vocab_size or len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(n, len(tokenizer)))))
    table = []
    for i, piece in enumerate(pieces):
        if piece is None:
            table.append(b"")
        elif i not in special and all(c in decoder for c in piece):
            table.append(bytes(decoder[c] for c in piece))
        else:
            table.append(tokenizer.decode([i]).encode("utf-8") if i not in special else piece.encode("utf-8"))
    return table + [b""] * (n - len(table))  # ids past the tokenizer (a padded embedding) stand for nothing


def _text(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


def _value(x: float) -> float | None:
    return None if x != x else float(x)  # NaN (a prompt's first token) -> null


def completion_logprobs(rows: Rows, ids: Sequence[int], table: Sequence[bytes], text_offset: int = 0) -> dict:
    """OpenAI `/v1/completions` choice.logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets, tops, pos = [], [], [], text_offset
    for i, token in enumerate(ids):
        text = _text(table[token])
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        if rows.chosen[i] != rows.chosen[i]:
            tops.append(None)
        else:
            top: dict[str, float] = {}
            for t, v in zip(rows.top_ids[i].tolist(), rows.top_logprobs[i].tolist()):
                top.setdefault(_text(table[t]), float(v))  # strings that coincide keep the likelier one
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_value(v) for v in rows.chosen.tolist()],
            "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(rows: Rows, ids: Sequence[int], table: Sequence[bytes]) -> dict:
    """OpenAI chat choice.logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for i, token in enumerate(ids):
        top = [{"token": _text(table[t]), "logprob": float(v), "bytes": list(table[t])}
               for t, v in zip(rows.top_ids[i].tolist(), rows.top_logprobs[i].tolist())]
        content.append({"token": _text(table[token]), "logprob": float(rows.chosen[i]),
                        "bytes": list(table[token]), "top_logprobs": top})
    return {"content": content}


def requested_k(body: dict, chat: bool) -> int | None:
    """How many alternatives a request asks for (None: no logprobs at all); one-line errors per field."""
    if chat:
        if not body.get("logprobs"):
            if body.get("top_logprobs"):
                raise InvalidRequest("top_logprobs needs logprobs: true", field="top_logprobs")
            return None
        k, name = body.get("top_logprobs") or 0, "top_logprobs"
    else:
        k, name = body.get("logprobs"), "logprobs"
        if k is None:
            return None
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP:
        raise InvalidRequest(f"{name} must be an integer in [0, {MAX_TOP}]", field=name)
    return k
