"""The cloud worker's KV store: one preallocated buffer holding every session's keys and values.

The buffer is `capacity` token slots of `bytes_per_token` each. A session owns a `Span`: `capacity`
consecutive slots from `start` (both multiples of `block`), laid out as

    span.kv: [layers, 2 (keys, values), kv_heads, span.capacity, head_dim]

of which positions [0, span.length) hold its cached K/V. A forward pass writes only the new positions, in
place (`cloud_worker.attention`), and attention reads a session's K/V as a view of its span: nothing is
stacked, concatenated or copied per step. Rolling back rejected draft positions is `truncate` (a length
change); a token tree's verdict keeps its accepted path (`keep`: the path's few positions move next to the
committed history); closing or evicting a session is `free`.

A span that must grow moves once to a larger range (capacity grows by half each time, so a session's moves
copy O(its length) in total); when free space is fragmented the store compacts (moves spans towards the
start). Both are rare whole-span copies, never per-step ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.errors import Overloaded
from ..common.runner import KVShape

GROWTH = 1.5  # a span that must move grows to this multiple of what it needs now


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`: on an accelerator through pinned memory, without waiting for the copy."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(eq=False)
class Span:
    start: int     # first slot, a multiple of the block size
    capacity: int  # slots reserved, a multiple of the block size
    length: int = 0  # positions holding valid K/V (the cached prefix)
    kv: torch.Tensor | None = None  # [layers, 2, kv_heads, capacity, head_dim], a view of the store

    @property
    def end(self) -> int:
        return self.start + self.capacity


class KVFull(Overloaded):
    """The store has no room for this many tokens (UNAVAILABLE: retry later or elsewhere)."""


class KVStore:
    """Preallocated K/V for all sessions of a worker, addressed by session key."""

    def __init__(self, shape: KVShape, capacity_tokens: int, device: torch.device | str = "cpu",
                 block: int = 32) -> None:
        if block < 1 or capacity_tokens < block:
            raise ValueError(f"the KV store needs room for at least one block of {block} tokens, "
                             f"got {capacity_tokens}")
        self.shape, self.block = shape, block
        self.capacity = capacity_tokens // block * block
        self.rows_per_token = shape.layers * 2 * shape.kv_heads  # head_dim-sized rows one token slot holds
        # zeroed (so committed) here: the budget is taken at start-up, not page by page as the bump allocator
        # walks the store (which looked like a leak in `bench stress`: RSS climbing to the budget over minutes)
        self.data = torch.zeros(self.capacity * self.rows_per_token, shape.head_dim, dtype=shape.dtype,
                                device=device)  # [rows, head_dim]
        self.spans: dict[object, Span] = {}
        self.reserved = 0  # slots held by spans: a counter, so other threads (heartbeats) read it safely
        self._top = 0      # every slot from here on is free
        self.stats = {"moves": 0, "compactions": 0, "moved_tokens": 0, "path_tokens": 0}
        # Deterministic attention reads whole key blocks past a span's length (masked: weight exactly 0), so a
        # new span's slots must hold finite values: zeros. Fast attention reads only [0, length): it can skip
        # the memset, a cost per OPEN that grows with the prompt, on the worker's event loop (issue 18).
        self.zero_reserved = True

    @classmethod
    def from_budget(cls, shape: KVShape, budget_bytes: int, device: torch.device | str = "cpu",
                    block: int = 32) -> "KVStore":
        return cls(shape, max(block, budget_bytes // shape.bytes_per_token), device, block)

    # ---- accounting ---------------------------------------------------------------------------------

    @property
    def free_tokens(self) -> int:
        return self.capacity - self.reserved

    @property
    def nbytes(self) -> int:
        return self.capacity * self.shape.bytes_per_token

    def round_up(self, tokens: int) -> int:
        return -(-max(tokens, 1) // self.block) * self.block

    # ---- spans ----------------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self.spans

    def span(self, key: object) -> Span:
        return self.spans[key]

    def reserve(self, key: object, tokens: int) -> Span:
        """A new, empty span with room for `tokens` (replacing any span `key` had). Raises KVFull."""
        self.free(key)
        need = self.round_up(tokens)
        start = self._find(need)
        if start is None and need <= self.free_tokens:
            self._compact()
            start = self._find(need)
        if start is None:
            raise KVFull(f"the worker's KV store has {self.free_tokens} free token slots, {need} needed")
        self.spans[key] = span = Span(start, need)
        self.reserved += need
        self._place(span)
        if self.zero_reserved:
            span.kv.zero_()
        return span

    def ensure(self, key: object, tokens: int) -> Span:
        """Make `key`'s span hold at least `tokens` positions, moving it (once) if it must grow."""
        span = self.spans[key]
        if tokens <= span.capacity:
            return span
        need = self.round_up(tokens)
        if need - span.capacity > self.free_tokens:
            raise KVFull(f"the worker's KV store has {self.free_tokens} free token slots; the session needs "
                         f"{need - span.capacity} more")
        want = min(self.round_up(int(need * GROWTH)), span.capacity + self.free_tokens)
        start = self._find(want, exclude=span)
        if start is not None:
            self._move(span, start, want)
            return span
        # fragmented: set this span aside, pack the others towards slot 0, put it after them
        saved = span.kv[:, :, :, :span.length].clone()
        del self.spans[key]
        self._compact()
        self.spans[key] = span
        self._move(span, self._find(want, exclude=span), want, saved)
        return span

    def truncate(self, key: object, length: int) -> None:
        """Forget positions >= length (rejected drafts): a length change, nothing is copied."""
        span = self.spans[key]
        span.length = min(span.length, max(0, length))

    def keep(self, key: object, start: int, offsets) -> None:
        """Keep positions start + offsets[i] at start + i (ascending offsets: a token tree's accepted path) and
        forget every position past them: the path's K/V moves next to the committed history (at most
        len(offsets) positions are copied, the history never); the rejected branches are dropped."""
        moved = [(start + j, start + i) for i, j in enumerate(offsets) if j != i]
        if moved:
            span = self.spans[key]
            source, target = (to_device(torch.tensor(side), span.kv.device) for side in zip(*moved))
            span.kv.index_copy_(3, target, span.kv.index_select(3, source))  # index_select copies first
            self.stats["path_tokens"] += len(moved)
        self.truncate(key, start + len(offsets))

    def free(self, key: object) -> None:
        span = self.spans.pop(key, None)
        if span is not None:
            self.reserved -= span.capacity

    def clear(self) -> None:
        self.spans.clear()
        self.reserved = self._top = 0

    def row_offset(self, span: Span) -> int:
        """Index in `data` of the span's first row (layer 0, keys, head 0, position 0)."""
        return span.start * self.rows_per_token

    # ---- internals --------------------------------------------------------------------------------------

    def _place(self, span: Span) -> None:
        self._top = max(self._top, span.end)
        s = self.shape
        rows = self.data[self.row_offset(span):self.row_offset(span) + span.capacity * self.rows_per_token]
        span.kv = rows.view(s.layers, 2, s.kv_heads, span.capacity, s.head_dim)

    def _ordered(self, exclude: Span | None = None) -> list[Span]:
        return sorted((s for s in self.spans.values() if s is not exclude), key=lambda s: s.start)

    def _find(self, need: int, exclude: Span | None = None) -> int | None:
        """Where `need` free slots start (`exclude`'s slots count as free): above every span when there is room
        (O(1)), else the lowest hole that fits (first fit)."""
        if self.capacity - self._top >= need:
            return self._top
        cursor, top = 0, 0
        for s in self._ordered(exclude):
            if s.start - cursor >= need:
                return cursor
            cursor = max(cursor, s.end)
            top = max(top, s.end)
        self._top = top if exclude is None else self._top
        return cursor if self.capacity - cursor >= need else None

    def _move(self, span: Span, start: int, capacity: int, saved: torch.Tensor | None = None) -> None:
        """Re-home the span at [start, start + capacity): its valid K/V is copied (the one copy a move costs).
        saved: its K/V when the caller already set it aside."""
        n = span.length
        if saved is None:
            saved = span.kv[:, :, :, :n].clone()  # the old and new ranges may overlap
        self.reserved += capacity - span.capacity
        span.start, span.capacity = start, capacity
        self._place(span)
        span.kv[:, :, :, :n] = saved
        if self.zero_reserved:
            span.kv[:, :, :, n:].zero_()
        self.stats["moves"] += 1
        self.stats["moved_tokens"] += n

    def _compact(self) -> None:
        """Move every span towards slot 0, in address order, so that the free slots form one range at the end."""
        self.stats["compactions"] += 1
        cursor = 0
        for s in self._ordered():
            if s.start != cursor:
                self._move(s, cursor, s.capacity)
            cursor = s.end
        self._top = cursor
