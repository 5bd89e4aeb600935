"""Committed target ids -> streamed text pieces whose concatenation is exactly `tokenizer.decode(all ids)`.

`tokenizers.decoders.DecodeStream` does the incremental work (it holds back a token that ends inside a UTF-8
character); `flush` adds what it still holds at the end of a generation (an incomplete character, which
`decode` spells as U+FFFD).
"""

from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream


class TextStream:
    """Feed committed ids with `push`; it returns the newly complete text ('' while a character is split)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        piece = "".join(filter(None, (self._stream.step(self._backend, i) for i in ids)))
        self.text += piece
        return piece

    def flush(self) -> str:
        """The rest of `decode(all ids)` not yet emitted (empty unless the stream held something back)."""
        full = self._tokenizer.decode(self.ids)
        tail = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += tail
        return tail
