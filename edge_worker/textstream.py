"""Committed target ids -> streamed text pieces whose concatenation is exactly `tokenizer.decode(all ids)`.

A token can end in the middle of a UTF-8 character (byte-level BPE splits '🙂' into four byte tokens), and
decoding such a prefix yields U+FFFD. Pieces are therefore cut only where the decoded text does not end in
U+FFFD, and each step decodes a short window that starts at the previous cut (vLLM's incremental
detokenisation: `prefix` = ids already turned into text, `read` = end of the last emitted piece), so a
generation costs O(n) decoding, not O(n^2), and the window's text is diffed against its own prefix, which
keeps tokenizer quirks at a window start (SentencePiece dropping a leading space) out of the pieces.
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Feed committed ids with `push`; it returns the newly complete text ('' while a character is split).
    `flush` returns what is held back at the end (a genuinely invalid tail included)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0   # window start: ids before it are settled text
        self._read = 0     # ids before it have been emitted
        self.text = ""     # everything emitted so far

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        settled = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) <= len(settled) or (window.endswith(REPLACEMENT) and not final):
            return ""  # hold back: the last character is still incomplete
        piece = window[len(settled):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids)) if ids else ""
