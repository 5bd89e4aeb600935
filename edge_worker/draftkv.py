"""The draft model's K/V on the edge, kept without copying every session's past at every draft step.

A session's draft K/V live in one growable buffer (`SessionKV`): appending writes in place, a rollback only
shortens it. A lockstep draft batch (`LockstepKV`) gathers its rows' pasts once, left-padded into one reused
workspace; the model then writes each step's K/V in place (`BufferLayer`), and when the batch ends or a row
leaves it, each row's new positions go back to its session's buffer. Before, every step restacked every
session's past, and the cache and the per-session append concatenated it twice more: at 16 sessions that was
~60 % of the edge's draft time (docs/draftlen.md).

Layout: a batch holds [layers, 2 (keys, values), rows, kv_heads, capacity, head_dim]. Row i's past sits right-
aligned before column `past`; the columns after it are the batch's steps, where a row fed fewer tokens than
the step's width leaves a hole that the attention mask hides.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..common.runner import ModelRunner


class SessionKV:
    """One session's draft K/V: buf [layers, 2, kv_heads, capacity, head_dim], the first `length` positions valid."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.length = 0

    def truncate(self, length: int) -> None:
        self.length = max(0, min(self.length, length))

    def append(self, new: torch.Tensor) -> None:  # new: [layers, 2, kv_heads, n, head_dim]
        end = self.length + new.shape[3]
        if self.buf is None or end > self.buf.shape[3]:
            shape = list(new.shape)
            shape[3] = max(64, 2 * end)
            grown = new.new_empty(shape)
            if self.buf is not None:
                grown[:, :, :, :self.length] = self.buf[:, :, :, :self.length]
            self.buf = grown
        self.buf[:, :, :, self.length:end] = new
        self.length = end

    def clear(self) -> None:
        self.buf, self.length = None, 0


class BufferLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views of a preallocated [rows, kv_heads, capacity, head_dim] buffer:
    `update` writes the new positions in place instead of concatenating the whole past."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.is_initialized, self.device = True, keys.device
        self.attach(keys, values, length)

    def attach(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.buf_k, self.buf_v, self.length = keys, values, length
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.buf_k.shape[2]:
            raise RuntimeError(f"lockstep K/V buffer full ({self.buf_k.shape[2]} positions, {end} needed)")
        self.buf_k[:, :, self.length:end] = key_states
        self.buf_v[:, :, self.length:end] = value_states
        self.attach(self.buf_k, self.buf_v, end)
        return self.keys, self.values


class LockstepKV:
    """The K/V of one lockstep draft batch. `feed` runs one forward over its rows; `close` returns every row's
    new positions to its session. Rows are identified by the caller's keys (job indices)."""

    def __init__(self, runner: ModelRunner, workspace: "Workspace") -> None:
        self.runner, self.workspace = runner, workspace
        self.rows: list[int] = []                  # caller's keys, in buffer order
        self.sessions: dict[int, SessionKV] = {}
        self.pending: dict[int, list[int]] = {}   # key -> buffer columns holding its new positions, in order
        self.buf: torch.Tensor | None = None       # [layers, 2, rows, kv_heads, capacity, head_dim]
        self.mask: torch.Tensor | None = None      # [rows, capacity] long
        self.cache: Cache | None = None
        self.cur = 0                                # columns in use

    @torch.no_grad()
    def feed(self, keys: list[int], sessions: list[SessionKV], lengths: list[int], tokens: list[list[int]],
             room: int) -> torch.Tensor:
        """Run `tokens[i]` (possibly none) for row keys[i] whose session holds `lengths[i]` positions so far;
        `room` = columns to reserve for the steps still to come. Returns logits [rows, width, V] in `keys` order."""
        width = max(len(t) for t in tokens)
        if self.buf is None:
            self._gather(keys, sessions, width + room)
        else:
            self._keep(keys)
            self._reserve(width)
        b = len(keys)
        ids = torch.zeros(b, width, dtype=torch.long)
        positions = torch.zeros(b, width, dtype=torch.long)
        for i, (key, n, toks) in enumerate(zip(keys, lengths, tokens)):
            ids[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            positions[i] = n + torch.arange(width)  # a padded tail keeps counting: harmless, masked
            self.mask[i, self.cur:self.cur + len(toks)] = 1
            self.pending[key].extend(range(self.cur, self.cur + len(toks)))
        device = self.runner.device
        out = self.runner.model(input_ids=ids.to(device), position_ids=positions.to(device),
                                attention_mask=self.mask[:, :self.cur + width].to(device), use_cache=True,
                                **{self.runner._cache_kw: self.cache})
        self.cur += width
        return out.logits.float()

    def close(self) -> None:
        """Every row's new positions back to its session's buffer."""
        for i, key in enumerate(self.rows):
            self._return(i, key)
        self.rows = []

    # ------------------------------------------------------------------ internals
    def _gather(self, keys: list[int], sessions: list[SessionKV], extra: int) -> None:
        past = max(s.length for s in sessions)
        self.rows, self.cur = list(keys), past
        self.sessions = dict(zip(keys, sessions))
        self.pending = {key: [] for key in keys}
        self.mask = torch.zeros(len(keys), past + extra, dtype=torch.long)
        for i, s in enumerate(sessions):
            self.mask[i, past - s.length:past] = 1
        kv = self.runner.kv_shape
        shape = (kv.layers, 2, len(keys), kv.kv_heads, past + extra, kv.head_dim)
        self.buf = self.workspace.take(shape, kv.dtype, self.runner.device)
        for i, s in enumerate(sessions):
            pad = past - s.length
            if pad:
                self.buf[:, :, i, :, :pad].zero_()
            if s.length:
                self.buf[:, :, i, :, pad:past] = s.buf[:, :, :, :s.length]
        self.cache = Cache(layers=[BufferLayer(self.buf[li, 0], self.buf[li, 1], past) for li in range(kv.layers)])

    def _keep(self, keys: list[int]) -> None:
        """Drop the rows not in `keys` (their new positions go back to their sessions first)."""
        if keys == self.rows:
            return
        index = {key: i for i, key in enumerate(self.rows)}
        for key in self.rows:
            if key not in keys:
                self._return(index[key], key)
        keep = torch.tensor([index[key] for key in keys], device=self.buf.device)
        self.buf = self.buf.index_select(2, keep)
        self.mask = self.mask.index_select(0, keep.cpu())
        self.rows = list(keys)
        self._attach()

    def _reserve(self, width: int) -> None:
        """Grow the buffer when the next `width` columns do not fit (a cross-vocabulary draft may run long)."""
        capacity = self.buf.shape[4]
        if self.cur + width <= capacity:
            return
        shape = list(self.buf.shape)
        shape[4] = 2 * (self.cur + width)
        grown = self.buf.new_empty(shape)
        grown[..., :self.cur, :] = self.buf[..., :self.cur, :]
        mask = self.mask.new_zeros(self.mask.shape[0], shape[4])
        mask[:, :self.cur] = self.mask[:, :self.cur]
        self.buf, self.mask = grown, mask
        self._attach()

    def _attach(self) -> None:
        for li, layer in enumerate(self.cache.layers):
            layer.attach(self.buf[li, 0], self.buf[li, 1], self.cur)

    def _return(self, i: int, key: int) -> None:
        cols = self.pending.pop(key, [])
        if cols:
            index = torch.tensor(cols, device=self.buf.device)
            self.sessions[key].append(self.buf[:, :, i].index_select(3, index))


class Workspace:
    """One reused allocation for lockstep buffers: a fresh multi-megabyte tensor per batch costs page faults
    (the allocator returns large blocks to the OS) and made the edge's RSS saw-tooth."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat
        if flat is None or flat.numel() < numel or flat.dtype != dtype or flat.device != device:
            flat = self._flat = torch.empty(int(numel * 1.25) + 1, dtype=dtype, device=device)
        return flat[:numel].view(shape)
