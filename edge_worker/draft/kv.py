"""The draft model's K/V on the edge, kept without copying every session's past at every draft step.

A session's draft K/V live in one growable buffer (`SessionKV`): appending writes in place, a rollback only
shortens it. A lockstep draft batch (`LockstepKV`) gathers its rows' pasts once, left-padded into one reused
workspace; the model then writes each step's K/V in place (`BufferLayer`), and when the batch ends or a row
leaves it, each row's new positions go back to its session's buffer. Before, every step restacked every
session's past, and the cache and the per-session append concatenated it twice more: at 16 sessions that was
~60 % of the edge's draft time (docs/policy.md).

Layout: a batch holds [layers, 2 (keys, values), rows, kv_heads, capacity, head_dim]. Row i's past sits right-
aligned before column `past`; the columns after it are the batch's steps, where a row fed fewer tokens than
the step's width leaves a hole that the attention mask hides. `position` records each column's absolute
position (-1: padding or a hole). transformers builds a sliding window over columns, which holes would stretch;
for a model with sliding windows the batch passes its own 4-D masks, built from positions with transformers'
rule (a query at p sees keys k with p - w < k <= p), one per layer type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ...common.runner import ModelRunner
from ..trees.kv import NodeKV, TreeColumns

NodeRef = tuple[int, "int | None", int]  # a tree node in a feed: (node id, parent node id or None = the root, position)


class SessionKV:
    """One session's draft K/V: buf [layers, 2, kv_heads, capacity, head_dim], the first `length` positions valid;
    `nodes`: the K/V of its draft tree's nodes, beside the history (edge_worker/trees/kv.py)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.length = 0
        self.nodes = NodeKV()

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
        self.nodes.clear()


@dataclass
class TreeFeed:
    """A row's tree nodes in one feed: per fed token its NodeRef; `gather`, at the batch's first feed only: nodes
    already in the session's NodeKV (topological order) to place before them, so the new ones can see them."""

    nodes: list[NodeRef]
    gather: list[NodeRef] = field(default_factory=list)


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
    new positions to its session. Rows are identified by the caller's keys (job indices). With `trees`, rows may
    feed tree nodes (`TreeFeed`): their K/V go to the session's NodeKV, and every forward takes 4-D masks."""

    def __init__(self, runner: ModelRunner, workspace: "Workspace", trees: bool = False) -> None:
        self.runner, self.workspace = runner, workspace
        self.trees: TreeColumns | None = None      # the region's visibility (tree batches), from the first feed
        self.tree_batch = trees
        self.base = 0                               # first region column (the gathered histories end there)
        self.node_pending: dict[int, list[tuple[int, int]]] = {}  # key -> (node id, column) fed in this batch
        self.rows: list[int] = []                  # caller's keys, in buffer order
        self.sessions: dict[int, SessionKV] = {}
        self.pending: dict[int, list[int]] = {}   # key -> buffer columns holding its new positions, in order
        self.buf: torch.Tensor | None = None       # [layers, 2, rows, kv_heads, capacity, head_dim]
        self.position: torch.Tensor | None = None  # [rows, capacity] long: each column's position, -1 = none
        self.windows = attention_windows(runner.model.config)
        self.cache: Cache | None = None
        self.cur = 0                                # columns in use

    @torch.no_grad()
    def feed(self, keys: list[int], sessions: list[SessionKV], lengths: list[int], tokens: list[list[int]],
             room: int, trees: list[TreeFeed | None] | None = None) -> torch.Tensor:
        """Run `tokens[i]` (possibly none) for row keys[i] whose session holds `lengths[i]` positions so far;
        `room` = columns to reserve for the steps still to come; `trees[i]` (a tree batch): None when the tokens
        extend the row's history, else their TreeFeed. Returns logits [rows, width, V] in `keys` order."""
        trees = trees or [None] * len(keys)
        width = max(len(t) for t in tokens)
        if self.buf is None:
            self._gather(keys, sessions, width + room, trees)
        else:
            self._keep(keys)
            self._reserve(width)
        b = len(keys)
        ids = torch.zeros(b, width, dtype=torch.long)
        positions = torch.zeros(b, width, dtype=torch.long)
        for i, (key, n, toks, tree) in enumerate(zip(keys, lengths, tokens, trees)):
            ids[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            positions[i] = n + torch.arange(width)  # a padded tail keeps counting: harmless, masked
            cols = range(self.cur, self.cur + len(toks))
            if tree is None:
                self.pending[key].extend(cols)
            else:  # a node at depth k stands at the root's position + k: siblings share positions
                positions[i, :len(toks)] = torch.tensor([pos for _, _, pos in tree.nodes], dtype=torch.long)
                self.node_pending[key].extend((node, c) for (node, _, _), c in zip(tree.nodes, cols))
            self.position[i, self.cur:self.cur + len(toks)] = positions[i, :len(toks)]
            if self.trees is not None:
                self._register(i, len(toks), tree, width)
        device = self.runner.device
        out = self.runner.model(input_ids=ids.to(device), position_ids=positions.to(device),
                                attention_mask=self._mask(positions, self.cur + width), use_cache=True,
                                **{self.runner._cache_kw: self.cache})
        self.cur += width
        return out.logits.float()

    def join(self, keys: list[int], sessions: list[SessionKV]) -> None:
        """Rows for jobs that join a chain batch under way (before its next `feed`): each row's past right-aligned
        before the next step's column, as the first rows' were; the columns shift right when a past is longer."""
        if self.tree_batch:
            raise ValueError("a tree batch takes no rows once it has started")
        self._shift(max(s.length for s in sessions) - self.cur)
        shape = list(self.buf.shape)
        shape[2] = len(keys)
        rows = self.buf.new_zeros(shape)  # zeros: padding, never seen, finite all the same
        position = self.position.new_full((len(keys), shape[4]), -1)
        for i, s in enumerate(sessions):
            if s.length:
                rows[:, :, i, :, self.cur - s.length:self.cur] = s.buf[:, :, :, :s.length]
                position[i, self.cur - s.length:self.cur] = torch.arange(s.length)
        self.buf, self.position = torch.cat([self.buf, rows], dim=2), torch.cat([self.position, position])
        self.rows += keys
        self.sessions.update(zip(keys, sessions))
        self.pending.update((key, []) for key in keys)
        self.node_pending.update((key, []) for key in keys)
        self._attach()

    def close(self) -> None:
        """Every row's new positions back to its session's buffer."""
        for i, key in enumerate(self.rows):
            self._return(i, key)
        self.rows = []

    # ------------------------------------------------------------------ internals
    def _gather(self, keys: list[int], sessions: list[SessionKV], extra: int, trees: list[TreeFeed | None]) -> None:
        gathers = [tree.gather if tree is not None else [] for tree in trees]
        past, nodes = max(s.length for s in sessions), max(map(len, gathers))
        self.rows, self.base, self.cur = list(keys), past, past + nodes
        self.sessions = dict(zip(keys, sessions))
        self.pending = {key: [] for key in keys}
        self.node_pending = {key: [] for key in keys}
        self.position = torch.full((len(keys), past + nodes + extra), -1, dtype=torch.long)
        for i, s in enumerate(sessions):
            self.position[i, past - s.length:past] = torch.arange(s.length)
        kv = self.runner.kv_shape
        shape = (kv.layers, 2, len(keys), kv.kv_heads, past + nodes + extra, kv.head_dim)
        self.buf = self.workspace.take(shape, kv.dtype, self.runner.device)
        for i, s in enumerate(sessions):
            pad = past - s.length
            if pad:
                self.buf[:, :, i, :, :pad].zero_()
            if s.length:
                self.buf[:, :, i, :, pad:past] = s.buf[:, :, :, :s.length]
        if self.tree_batch:
            self.trees = TreeColumns(len(keys), nodes + extra)
            for i, (s, placed) in enumerate(zip(sessions, gathers)):
                self._place(i, s, placed, nodes)
        self.cache = Cache(layers=[BufferLayer(self.buf[li, 0], self.buf[li, 1], self.cur) for li in range(kv.layers)])

    def _place(self, row: int, session: SessionKV, nodes: list[NodeRef], width: int) -> None:
        """A row's gathered tree nodes at region columns 0.. (the rest of the `width` gathered columns: zeros)."""
        at = self.base
        if nodes:
            self.buf[:, :, row, :, at:at + len(nodes)] = session.nodes.get([node for node, _, _ in nodes])
            self.position[row, at:at + len(nodes)] = torch.tensor([pos for _, _, pos in nodes])
            for j, (node, parent, _) in enumerate(nodes):
                self.trees.node(row, j, node, parent)
        if len(nodes) < width:
            self.buf[:, :, row, :, at + len(nodes):at + width].zero_()  # never seen; finite all the same

    def _register(self, row: int, fed: int, tree: TreeFeed | None, width: int) -> None:
        """The region visibility of the columns this feed writes for `row` (a tree batch)."""
        start = self.cur - self.base
        for j in range(width):
            if j >= fed:
                self.trees.hole(row, start + j)
            elif tree is None:
                self.trees.history(row, start + j)
            else:
                node, parent, _ = tree.nodes[j]
                if parent is not None and parent not in self.trees.col[row]:
                    raise ValueError(f"tree node {node}: its parent {parent} is not in this draft batch")
                self.trees.node(row, start + j, node, parent)

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
        self.position = self.position.index_select(0, keep.cpu())
        if self.trees is not None:
            self.trees.select([index[key] for key in keys])
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
        position = self.position.new_full((self.position.shape[0], shape[4]), -1)
        position[:, :self.cur] = self.position[:, :self.cur]
        self.buf, self.position = grown, position
        if self.trees is not None:
            self.trees.grow(shape[4] - self.base)
        self._attach()

    def _shift(self, n: int) -> None:
        """n more columns of padding before every row (n <= 0: none needed)."""
        if n <= 0:
            return
        shape = list(self.buf.shape)
        shape[4] += n
        grown = self.buf.new_zeros(shape)
        grown[..., n:, :] = self.buf
        position = self.position.new_full((self.position.shape[0], shape[4]), -1)
        position[:, n:] = self.position
        self.buf, self.position = grown, position
        self.base, self.cur = self.base + n, self.cur + n
        self.pending = {key: [col + n for col in cols] for key, cols in self.pending.items()}
        self._attach()

    def _mask(self, queries: torch.Tensor, columns: int):
        """The attention mask of a forward whose queries sit at `queries` [rows, width]: the 2-D padding mask
        [rows, columns], or for a sliding-window model or a tree batch the 4-D masks [rows, 1, width, columns]
        (a dict by layer type for a model with `layer_types`)."""
        keys = self.position[:, :columns]
        device = self.runner.device
        if self.windows is None and self.trees is None:
            return (keys >= 0).long().to(device)
        q, k = queries[:, None, :, None], keys[:, None, None, :]
        if self.trees is None:
            visible = (k >= 0) & (k <= q)  # causal by position; -1: padding or a hole
        else:
            width = queries.shape[1]
            past = (keys[:, :self.base] >= 0)[:, None, :].expand(-1, width, -1)
            region = self.trees.visible(self.cur - self.base, width, columns - self.base)
            visible = torch.cat([past, region], dim=-1)[:, None]

        def mask(window: int | None) -> torch.Tensor:
            seen = visible & (k > q - window) if window else visible
            if self.runner.model.config._attn_implementation in ("sdpa", "flex_attention"):
                return seen.to(device)  # flex takes a bool mask too when given one
            dtype = self.runner.model.dtype  # eager: an additive float mask
            return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min).to(device)

        if isinstance(self.windows, dict):
            return {kind: mask(window) for kind, window in self.windows.items()}
        return mask(self.windows)

    def _attach(self) -> None:
        for li, layer in enumerate(self.cache.layers):
            layer.attach(self.buf[li, 0], self.buf[li, 1], self.cur)

    def _return(self, i: int, key: int) -> None:
        cols = self.pending.pop(key, [])
        if cols:
            index = torch.tensor(cols, device=self.buf.device)
            self.sessions[key].append(self.buf[:, :, i].index_select(3, index))
        nodes = self.node_pending.pop(key, [])
        if nodes:
            index = torch.tensor([col for _, col in nodes], device=self.buf.device)
            self.sessions[key].nodes.add([node for node, _ in nodes], self.buf[:, :, i].index_select(3, index))


def attention_windows(config) -> dict[str, int | None] | int | None:
    """The sliding windows transformers' mask builders apply: {layer type: window or None} for a model with
    `layer_types`, else the one window of every layer; None when no layer slides."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None
    if types is None:
        return window
    return {kind: window if kind == "sliding_attention" else None for kind in set(types)}


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


def self_check(runner: ModelRunner) -> None:
    """Raise FatalError (one line) unless lockstep forwards (ragged, with holes, a second batch that a row joins
    under way after a rollback, its past longer than the batch's columns) give the draft model's own logits
    (common/selfcheck.py)."""
    from ...common import selfcheck

    a, b = selfcheck.probe(runner.vocab_size)

    def probe_path() -> list[torch.Tensor]:
        sa, sb = SessionKV(), SessionKV()
        first = LockstepKV(runner, Workspace())
        a1, b1 = first.feed([0, 1], [sa, sb], [0, 0], [a[:15], b[:4]], room=4)
        a2, b2 = first.feed([0, 1], [sa, sb], [15, 4], [a[15:19], b[4:12]], room=0)
        first.close()
        sa.truncate(17)                        # a rollback: the last two of a's positions were rejected
        second = LockstepKV(runner, Workspace())
        b3 = second.feed([1], [sb], [12], [b[12:]], room=0)[0]
        second.join([0], [sa])                 # 17 positions of past, 13 columns so far: the columns shift
        a3 = second.feed([1, 0], [sb, sa], [13, 17], [[], a[17:]], room=0)[1]
        return [torch.cat([a1[:15], a2[:2], a3[:4]]), torch.cat([b1[:4], b2[:8], b3[:1]])]

    selfcheck.compare(runner.model, "the edge's lockstep draft forward", probe_path)
