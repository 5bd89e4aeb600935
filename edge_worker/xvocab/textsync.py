"""Edge-side context sync across vocabularies: committed TARGET tokens -> text bytes -> DRAFT token ids.

The cloud keeps target ids; the edge's draft model needs the same text in its own vocabulary. After each
verdict the edge appends the committed target tokens' bytes and re-tokenises only the affected tail:

  pre-tokens  HF tokenizers split text into pre-tokens (words) and run the model (BPE, ...) on each word
              alone, so draft ids of a text = concatenated ids of its words.
  stable word a word whose split cannot change when text is appended. Everything before the start of the
              last `backoff` words is stable, so only text[start:] is re-tokenised (docs/vocab.md proves
              backoff=1 for Metaspace and backoff=2 for the GPT-2 byte-level regex).
  fallback    any other pre-tokenizer/normaliser: re-tokenise the whole text (exact, O(text) per step).

The result always equals draft_tok(text, add_special_tokens=False, split_special_tokens=True).input_ids:
text that spells a special token ("</s>" in HTML) stays text, the draft never sees a fake eos.
"""

from __future__ import annotations

import codecs
import json
import weakref
from typing import Sequence

import structlog
from tokenizers import Tokenizer

from ...common.runner import common_prefix

log = structlog.get_logger("specrelay.textsync")


def incremental_backoff(draft_tokenizer) -> int | None:
    """How many trailing pre-tokens to re-tokenise after an append; None when no tail rule is proven for
    this tokenizer's pipeline (then the whole text is re-tokenised)."""
    backend = draft_tokenizer.backend_tokenizer
    if backend.normalizer is not None or getattr(backend.model, "dropout", None):
        return None
    if any(not t.special for t in draft_tokenizer.added_tokens_decoder.values()):
        return None  # non-special added tokens are cut out of the raw text before pre-tokenisation
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
    if pre.get("type") == "Metaspace" and pre.get("split", True) and pre.get("prepend_scheme") in ("never", "first"):
        return 1  # words start at every '▁': appending only extends the last word
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False):
        return 2  # GPT-2 regex: a match decision reads at most 2 chars past its start or 1 past its end
    return None


def _text_encoder(tokenizer) -> Tokenizer:
    """A private copy of the backend that treats special-token strings as plain text, never truncates/pads."""
    enc = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    enc.encode_special_tokens = True
    enc.no_truncation()
    enc.no_padding()
    return enc


_ENCODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> (encoder, backoff)


def text_encoder(tokenizer) -> Tokenizer:
    """The tokenizer's text encoder (specials are text), built once per tokenizer."""
    return _encoder_and_backoff(tokenizer)[0]


def _encoder_and_backoff(draft_tokenizer) -> tuple[Tokenizer, int | None]:
    """Built once per tokenizer (a session only reads them), and the full-retokenise warning logged once."""
    key = draft_tokenizer
    if key not in _ENCODERS:
        backoff = incremental_backoff(draft_tokenizer)
        if backoff is None:
            log.warning("textsync_full_retokenize", reason="no proven tail rule for this pre-tokenizer")
        _ENCODERS[key] = (_text_encoder(draft_tokenizer), backoff)
    return _ENCODERS[key]


class DraftContext:
    """The committed text (bytes) and its draft-vocabulary ids, kept in sync as target tokens are committed.

    target_table: target id -> bytes (`vocab.target_bytes_table`); None (special tokens) adds no text.
    prefix_ids: draft ids before the text (e.g. a BOS the draft model expects); never re-tokenised.
    """

    def __init__(self, draft_tokenizer, target_table: Sequence[bytes | None],
                 prefix_ids: Sequence[int] = ()) -> None:
        self._table = target_table
        self._prefix = list(prefix_ids)
        self._enc, self._backoff = _encoder_and_backoff(draft_tokenizer)
        self._text = bytearray()  # UTF-8 of the text the draft sees: complete chars, invalid bytes -> U+FFFD
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # holds back half a char
        self._ids: list[int] = []  # draft ids of self._text
        self._word_pos: list[int] = []  # byte offset in _text where each pre-token starts
        self._word_tok: list[int] = []  # index in _ids of each pre-token's first token

    @property
    def draft_ids(self) -> list[int]:
        """prefix_ids + the draft ids of the complete committed text."""
        return self._prefix + self._ids

    @property
    def pending(self) -> bytes:
        """Bytes of an incomplete UTF-8 character waiting for the next target token."""
        return self._utf8.getstate()[0]

    def __len__(self) -> int:
        return len(self._prefix) + len(self._ids)

    def append_target_tokens(self, ids: Sequence[int]) -> tuple[int, list[int]]:
        """Commit target tokens. Returns (n_keep, new_ids): draft_ids[:n_keep] are unchanged (crop the draft
        KV cache there) and new_ids follow them."""
        return self.append_bytes(b"".join(self._table[i] or b"" for i in ids))

    def append_bytes(self, data: bytes) -> tuple[int, list[int]]:
        """Commit raw text bytes (a prompt given as text, or target token bytes); same result as above."""
        new_text = self._utf8.decode(data)
        if not new_text:  # nothing complete yet (or nothing at all): every id stays
            return len(self), []
        return self._retokenize_tail(new_text.encode("utf-8"))

    def extended_ids(self, ids: Sequence[int]) -> list[int]:
        """draft_ids as they would be after `append_target_tokens(ids)`, without committing anything: the
        context a draft continuing these (not yet verified) target tokens runs in (pre-drafting)."""
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        utf8.setstate(self._utf8.getstate())
        new = utf8.decode(b"".join(self._table[i] or b"" for i in ids)).encode("utf-8")
        if not new:
            return self.draft_ids
        start, k = self._tail_start()
        enc = self._enc.encode((self._text[start:] + new).decode("utf-8"), add_special_tokens=False)
        return self._prefix + self._ids[:k] + enc.ids

    def _tail_start(self) -> tuple[int, int]:
        """(byte offset, token index) from which an append can change the ids: the start of the last
        `backoff` words (0, 0 without a proven rule: everything)."""
        w = max(0, len(self._word_pos) - self._backoff) if self._backoff else 0
        return (self._word_pos[w], self._word_tok[w]) if w < len(self._word_pos) else (0, 0)

    def _retokenize_tail(self, new: bytes) -> tuple[int, list[int]]:
        w = max(0, len(self._word_pos) - self._backoff) if self._backoff else 0
        start, k = self._tail_start()
        self._text += new
        tail = self._text[start:].decode("utf-8")  # start is a word start, hence a char boundary
        enc = self._enc.encode(tail, add_special_tokens=False)
        same = common_prefix(self._ids[k:], enc.ids)  # re-derived ids equal to old ones keep their KV
        del self._ids[k:]
        self._ids += enc.ids
        del self._word_pos[w:], self._word_tok[w:]
        if self._backoff:
            self._record_words(tail, start, k, enc.word_ids)
        return len(self._prefix) + k + same, enc.ids[same:]

    def _record_words(self, tail: str, start: int, k: int, word_ids: Sequence[int | None]) -> None:
        """Append (byte offset, first token index) of each pre-token of `tail` that produced tokens."""
        words = self._enc.pre_tokenizer.pre_tokenize_str(tail)  # [(piece, (char_start, char_end))]
        first_tok: dict[int, int] = {}
        for t, wid in enumerate(word_ids):
            if wid is not None:
                first_tok.setdefault(wid, t)
        pos, prev = start, 0
        for wid in sorted(first_tok):
            char_start = words[wid][1][0]
            pos += len(tail[prev:char_start].encode("utf-8"))  # char offsets -> byte offsets, one pass
            prev = char_start
            self._word_pos.append(pos)
            self._word_tok.append(k + first_tok[wid])
