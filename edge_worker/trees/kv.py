"""A token tree's draft K/V on the edge: the nodes' K/V kept beside a session's history, and which columns of a
lockstep batch each tree node may attend to.

A session's history (`draft.kv.SessionKV`) is one line of positions. A draft tree's nodes do not belong to it until
a verdict commits their path, so their K/V live beside it in a `NodeKV`, keyed by the tree's node ids: a later batch
gathers the nodes it extends (pre-drafting goes on a level at a time), and after a verdict the accepted path's
columns are appended to the history (`adopt`), the rest dropped, without re-running anything.

In a lockstep batch (`draft.kv.LockstepKV` with `trees=True`) the columns after the gathered history form a region
whose visibility `TreeColumns` keeps per row: a history column (the session's catch-up tokens) is seen by every
later column of its row at a position not before it; a node column by itself and its descendants only (the tree
attention mask). Siblings share positions (a node at depth k stands at the root's position + k), so the causal
rule by positions cannot tell them apart: the mask must.
"""

from __future__ import annotations

import numpy as np
import torch

HISTORY, NODE = 1, 2  # kinds of a region column (0: padding or a hole)


class NodeKV:
    """Draft K/V of tree nodes: buf [layers, 2, kv_heads, capacity, head_dim]; slot[node id] = its column."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.slot: dict[int, int] = {}

    def __contains__(self, node: int) -> bool:
        return node in self.slot

    def __len__(self) -> int:
        return len(self.slot)

    def add(self, nodes: list[int], kv: torch.Tensor) -> None:  # kv: [layers, 2, kv_heads, n, head_dim]
        start = max(self.slot.values(), default=-1) + 1
        end = start + len(nodes)
        if self.buf is None or end > self.buf.shape[3]:
            shape = list(kv.shape)
            shape[3] = max(32, 2 * end)
            grown = kv.new_empty(shape)
            if self.buf is not None and start:
                grown[:, :, :, :start] = self.buf[:, :, :, :start]
            self.buf = grown
        self.buf[:, :, :, start:end] = kv
        self.slot.update({node: start + i for i, node in enumerate(nodes)})

    def get(self, nodes: list[int]) -> torch.Tensor:  # -> [layers, 2, kv_heads, len(nodes), head_dim]
        index = torch.tensor([self.slot[n] for n in nodes], device=self.buf.device)
        return self.buf.index_select(3, index)

    def keep(self, nodes: set[int]) -> None:
        """Forget every node but `nodes` (a verdict chose a subtree); compacts when most columns are dead."""
        self.slot = {n: s for n, s in self.slot.items() if n in nodes}
        if not self.slot:
            self.clear()
        elif self.buf is not None and 4 * len(self.slot) < max(self.slot.values()) + 1:
            order = sorted(self.slot, key=self.slot.get)
            kv = self.get(order)
            self.slot = {}
            self.add(order, kv)

    def clear(self) -> None:
        self.buf, self.slot = None, {}


class TreeColumns:
    """Visibility among the region columns of a lockstep batch: vis [rows, R, R] (query column, key column),
    kind [rows, R] (HISTORY, NODE, or 0), col[row][node id] = the region column of that node. numpy: one row's
    bookkeeping is a few element writes, which torch indexing makes ~10x dearer."""

    def __init__(self, rows: int, region: int) -> None:
        self.vis = np.zeros((rows, region, region), dtype=bool)
        self.kind = np.zeros((rows, region), dtype=np.int8)
        self.col: list[dict[int, int]] = [{} for _ in range(rows)]

    def history(self, row: int, col: int) -> None:
        """A catch-up token of the row's history: it sees the row's earlier history columns and itself."""
        self.kind[row, col] = HISTORY
        self.vis[row, col] = self.kind[row] == HISTORY  # the region's history columns come before this one

    def node(self, row: int, col: int, node: int, parent: int | None) -> None:
        """A tree node whose parent is node `parent` (None: a child of the row's last history token)."""
        if parent is None:
            self.vis[row, col] = self.kind[row] == HISTORY
        else:
            self.vis[row, col] = self.vis[row, self.col[row][parent]]
        self.vis[row, col, col] = True
        self.kind[row, col] = NODE
        self.col[row][node] = col

    def hole(self, row: int, col: int) -> None:
        """A padded query: it sees itself only (finite attention; no later column ever sees it)."""
        self.vis[row, col, col] = True

    def select(self, index: list[int]) -> None:
        self.vis, self.kind = self.vis[index], self.kind[index]
        self.col = [self.col[i] for i in index]

    def grow(self, region: int) -> None:
        rows, old = self.kind.shape
        vis = np.zeros((rows, region, region), dtype=bool)
        vis[:, :old, :old] = self.vis
        kind = np.zeros((rows, region), dtype=np.int8)
        kind[:, :old] = self.kind
        self.vis, self.kind = vis, kind

    def visible(self, start: int, width: int, end: int) -> torch.Tensor:  # -> [rows, width, end] bool
        """Which region columns [0, end) the queries at region columns [start, start + width) see."""
        return torch.from_numpy(np.ascontiguousarray(self.vis[:, start:start + width, :end]))
