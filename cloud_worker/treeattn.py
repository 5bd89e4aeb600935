"""Token trees in the packed forward: where a tree row's tokens sit, what each may see, and which slots a
deterministic forward reads for it.

A tree row (`attention.Row` with `parents`) is m committed tokens the span does not hold yet (the last committed
one, and any tail) followed by the n tree nodes in wire order. Storage: every new token takes the span's next slot
(node i at past + m + i), so a node's slot is not its position. Position: node i stands at past + m - 1 + depth(i),
which RoPE and sliding windows use. A node sees the session's history, the row's committed tokens and its own
ancestors (itself included): the tree mask; a committed token sees what it sees in a chain.

The deterministic numerics (cloud_worker/detattn.py) read each token's keys in its CHAIN layout: blocks wholly
before the first node's block are the span's own, shared by every token; the last `tail_blocks` are gathered per
token, with its ancestors moved right after the committed tokens, exactly where its root-to-node chain verified
alone would hold them. Slot = position in that layout, so a node's logits are that chain's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class TreeLayout:
    """One tree row: m committed tokens then the nodes; pos [m + n] the position of every new token; seen
    [m + n, m + n] bool: new token j is new token i's ancestor, or i itself (a committed token: j <= i);
    paths: each node's ancestors-or-self, as node indices from the root's child down."""

    m: int
    pos: torch.Tensor
    seen: torch.Tensor
    paths: list[list[int]]

    @classmethod
    def of(cls, parents: Sequence[int], new: int, past: int) -> "TreeLayout":
        """parents of the row's last len(parents) tokens (-1: the committed token before them); new = m + n."""
        n = len(parents)
        m = new - n
        seen = torch.tril(torch.ones(new, new, dtype=torch.bool))
        seen[m:, m:] = False
        paths: list[list[int]] = []
        for i, parent in enumerate(parents):
            paths.append((paths[parent] if parent >= 0 else []) + [i])
            seen[m + i, [m + a for a in paths[i]]] = True
        depth = torch.tensor([len(path) for path in paths], dtype=torch.long)
        pos = torch.cat([past + torch.arange(m), past + m - 1 + depth])
        return cls(m, pos, seen, paths)

    @property
    def max_depth(self) -> int:
        return max(map(len, self.paths), default=0)

    def fast_mask(self, past: int, first: int, window: int | None, device) -> torch.Tensor:
        """[m + n, past + m + n - first] bool over the span's slots first..: history slot k (its position) is
        visible within the window (k > pos - window); new token j where `seen`, within the window by position."""
        pos = self.pos.to(device)[:, None]                                   # [new, 1]
        history = torch.arange(first, past, device=device)[None, :]          # [1, past - first]
        old = torch.ones(len(self.pos), past - first, dtype=torch.bool, device=device)
        new = self.seen.to(device)
        if window:
            old &= history > pos - window
            new = new & (self.pos.to(device)[None, :] > pos - window)
        return torch.cat([old, new], 1)

    def chain_slots(self, past: int, block: int) -> tuple[int, torch.Tensor]:
        """(shared blocks b, gather [m + n, tail_blocks * block]): slot b * block + c of token t's chain layout
        is read from span slot gather[t, c]: its own slot, except that node t's ancestors-or-self, in depth
        order, sit from the first node's slot S = past + m on. Slots past a token's position are masked."""
        start = past + self.m                     # S: the first node's slot
        shared = start // block
        tail = -(-(start - shared * block + self.max_depth) // block)
        gather = (shared * block + torch.arange(tail * block)).repeat(len(self.pos), 1)  # [new, tail * block]
        for i, path in enumerate(self.paths):
            offset = start - shared * block
            gather[self.m + i, offset:offset + len(path)] = start + torch.tensor(path)
        return shared, gather


def visible_slots(pos: torch.Tensor, slots: torch.Tensor, window: int | None) -> torch.Tensor:
    """pos [r] positions, slots [s] chain-layout slots (slot = position) -> [r, s] bool: slot <= pos, and
    slot > pos - window under a sliding window."""
    seen = slots[None, :] <= pos[:, None]
    return seen & (slots[None, :] > pos[:, None] - window) if window else seen
