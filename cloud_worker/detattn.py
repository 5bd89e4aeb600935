"""The packed forward's deterministic (batch-invariant) attention: every matrix product has a fixed shape whatever
the batch (the layers outside attention: cloud_worker/detlayers.py). Attention runs on `QUERY_TILE`-row query
tiles against `block`-sized key blocks, [QUERY_TILE, d] x [d, block] and [QUERY_TILE, block] x [block, d]. Softmax
takes an exact max; the blocks' partial sums (with the denominator as an extra column) are added pairwise in a
fixed order. A masked block contributes exact zeros, so extra blocks (a longer span) never change a result, nor
does the number of tiles or sessions in the forward: a token's attention depends only on its own session's tokens.

`attend` serves a chain row (keys read in place); `attend_tree` a token tree row, whose every token reads its keys
in its chain layout (cloud_worker/treeattn.py), so a node's logits equal its root-to-node chain's, bit for bit.
"""

from __future__ import annotations

import torch

from .treeattn import visible_slots

QUERY_TILE = 8   # query rows per attention product
QT = QUERY_TILE


def block_mask(positions: torch.Tensor, g: int, nb: int, block: int, window: int | None) -> torch.Tensor:
    """[tiles, 1, nb, QT, block] bool: True where slot k (= position) is visible to query row i, the rows being
    the g*n (group, token) pairs padded to whole tiles: k <= pos(i % n) (and > pos(i % n) - window).
    positions: [n] of the row's new tokens. Blocks cover whole blocks, so a block view never needs a copy."""
    n = positions.shape[0]
    tiles = -(-g * n // QT)
    position = positions[torch.arange(tiles * QT, device=positions.device) % n]  # padded rows: any valid one
    visible = visible_slots(position, torch.arange(nb * block, device=positions.device), window)
    return visible.view(tiles, QT, nb, block).transpose(1, 2)[:, None]


def _padded(q: torch.Tensor, h: int, tiles: int, f) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [Hq, n, d] -> query rows [h, tiles * QT, d] (row i = group i // n, token i % n; query heads j*g..j*g+g-1
    share K/V head j) and each row's sink [h, tiles * QT] (None without sinks)."""
    hq, n, d = q.shape
    g, rows = hq // h, hq // h * n
    qp = q.new_zeros(h, tiles * QT, d)
    qp[:, :rows] = q.reshape(h, rows, d)
    if f.sinks is None:
        return qp, None
    sinks = qp.new_zeros(h, tiles * QT)
    sinks[:, :rows] = f.sinks.to(qp.dtype).view(h, g, 1).expand(h, g, n).reshape(h, rows)
    return qp, sinks


def _scores(a: torch.Tensor, keys: torch.Tensor, scale: float, f) -> torch.Tensor:
    """a [B, QT, d], keys [B, block, d] -> scores [B, QT, block], scaled and soft-capped."""
    scores = torch.bmm(a, keys.transpose(1, 2)) * scale
    return f.softcap * torch.tanh(scores / f.softcap) if f.softcap is not None else scores


def _partials(e: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """e [B, QT, block] exponents, values [B, block, d] -> [B, QT, d + 1]: sum of e * v, and of e."""
    return torch.cat([torch.bmm(e, values), e.sum(-1, keepdim=True)], -1)


def _finish(total: torch.Tensor, top: torch.Tensor, sink: torch.Tensor | None, d: int) -> torch.Tensor:
    """total [h, QT, d + 1], top [h, 1, QT, 1] -> [h, QT, d]; a sink adds exp(sink - max) to the denominator."""
    denominator = total[..., d:]
    if sink is not None:
        denominator = denominator + torch.exp(sink - top).view(top.shape[0], QT, 1)
    return total[..., :d] / denominator


def _top(top: torch.Tensor, sinks: torch.Tensor | None, t: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A tile's row maxima [h, 1, QT, 1] joined with its rows' sinks (which join the max), and those sinks."""
    if sinks is None:
        return top, None
    sink = sinks[:, t * QT:(t + 1) * QT].view(-1, 1, QT, 1)
    return torch.maximum(top, sink), sink


def attend(q: torch.Tensor, kv: torch.Tensor, r, scale: float, block: int, f) -> torch.Tensor:
    """q [Hq, n, d] -> [Hq, n, d] for a chain row over kv [2, h, capacity, d] (its span, one layer)."""
    hq, n, d = q.shape
    h, cap = kv.shape[1], kv.shape[2]
    g, nb = hq // h, cap // block
    if f.window not in r.masks:
        r.masks[f.window] = block_mask(r.past + torch.arange(n, device=q.device), g, nb, block, f.window)
    masks = r.masks[f.window]
    qp, sinks = _padded(q, h, masks.shape[0], f)
    keys = kv[0].reshape(h * nb, block, d)    # views: a span's blocks are contiguous per head
    values = kv[1].reshape(h * nb, block, d)
    outs = []
    for t, mask in enumerate(masks):
        tile = qp[:, t * QT:(t + 1) * QT].repeat_interleave(nb, 0)  # [h*nb, QT, d]
        scores = _scores(tile, keys, scale, f).view(h, nb, QT, block).masked_fill(~mask, float("-inf"))
        top, sink = _top(scores.amax(dim=(1, 3), keepdim=True), sinks, t)   # exact, whatever the order
        part = _partials(torch.exp(scores - top).view(h * nb, QT, block), values)  # [h*nb, QT, d+1]
        outs.append(_finish(pairwise_sum(part.view(h, nb, QT, d + 1)), top, sink, d))
    return torch.cat(outs, 1)[:, :g * n].reshape(hq, n, d)


def attend_tree(q: torch.Tensor, kv: torch.Tensor, r, scale: float, block: int, f) -> torch.Tensor:
    """`attend` for a tree row, every token in its chain layout. The blocks before the first node's (`shared`)
    are read in place by tiles of all tokens' rows, as `attend` reads them (products over the span's blocks,
    partial sums of the first `shared` kept); the tail blocks, gathered per token, by tiles of one token's query
    heads. A row's max spans both before any exponent, so its partial sums are the ones its chain computes."""
    hq, n, d = q.shape
    h, cap = kv.shape[1], kv.shape[2]
    g, nb = hq // h, cap // block
    key = ("tree", f.window)
    if key not in r.masks:
        r.masks[key] = _tree_masks(r, g, nb, block, f.window)
    shared, moved, masks, tail_mask, index = r.masks[key]
    tail_sums, tail_top = _tail(q, kv, shared, moved, tail_mask, scale, block, f)  # top -> parts; [h, n*gp]
    qp, sinks = _padded(q, h, masks.shape[0], f)
    keys, values = kv[0].reshape(h * nb, block, d), kv[1].reshape(h * nb, block, d)
    top = tail_top[:, index].clone()            # [h, tiles*QT]: every row's max, over the tail ...
    for t, mask in enumerate(masks):             # ... and the shared blocks
        tile = qp[:, t * QT:(t + 1) * QT].repeat_interleave(nb, 0)
        scores = _scores(tile, keys, scale, f).view(h, nb, QT, block).masked_fill(~mask, float("-inf"))
        top[:, t * QT:(t + 1) * QT] = torch.maximum(top[:, t * QT:(t + 1) * QT], scores.amax(dim=(1, 3)))
    rows = g * n
    tail_parts = tail_sums(_token_top(top, tail_top, index[:rows], sinks))[:, :, index]  # [h, tb, tiles*QT, d+1]
    outs = []
    for t, mask in enumerate(masks):
        tile = qp[:, t * QT:(t + 1) * QT].repeat_interleave(nb, 0)
        scores = _scores(tile, keys, scale, f).view(h, nb, QT, block).masked_fill(~mask, float("-inf"))
        row_top, sink = _top(top[:, t * QT:(t + 1) * QT].view(h, 1, QT, 1), sinks, t)
        part = _partials(torch.exp(scores - row_top).view(h * nb, QT, block), values).view(h, nb, QT, d + 1)
        total = pairwise_sum(torch.cat([part[:, :shared], tail_parts[:, :, t * QT:(t + 1) * QT]], 1))
        outs.append(_finish(total, row_top, sink, d))
    return torch.cat(outs, 1)[:, :rows].reshape(hq, n, d)


def _token_top(top: torch.Tensor, tail_top: torch.Tensor, index: torch.Tensor, sinks) -> torch.Tensor:
    """The rows' maxima (sinks joined) in the token layout [h, n*gp]; padded token rows keep their own."""
    out = tail_top.clone()
    out[:, index] = top[:, :len(index)] if sinks is None else torch.maximum(top, sinks)[:, :len(index)]
    return out


def _tree_masks(r, g: int, nb: int, block: int, window: int | None) -> tuple:
    """(shared, moved: (token, tail slot, span slot) of every slot a token's chain layout reads from elsewhere,
    shared-block masks [tiles, 1, nb, QT, block] (blocks >= shared: none), tail mask [1, n, 1, tb, 1, block],
    index [tiles*QT]: each padded row's row in the token layout)."""
    lay = r.tree
    device = r.span.kv.device
    shared, gather = lay.chain_slots(r.past, block)
    n, pos = gather.shape[0], lay.pos.to(device)
    masks = block_mask(pos, g, nb, block, window)
    masks[:, :, shared:] = False
    tb = gather.shape[1] // block
    slots = shared * block + torch.arange(tb * block, device=device)
    tail_mask = visible_slots(pos, slots, window).view(1, n, 1, tb, 1, block)
    gp = -(-g // QT) * QT
    i = torch.arange(masks.shape[0] * QT, device=device)
    index = (i % n) * gp + torch.clamp(i // n, max=g - 1)  # row i = (group i // n, token i % n)
    own = shared * block + torch.arange(tb * block)
    token, slot = (gather != own).nonzero(as_tuple=True)
    moved = tuple(x.to(device) for x in (token, slot, gather[token, slot]))
    return shared, moved, masks, tail_mask, index


def _tail(q, kv, shared: int, moved: tuple, tail_mask, scale: float, block: int, f):
    """The tail blocks in the token layout: per token t, tiles of its g query heads (padded to gp rows) against
    its chain-layout blocks (the span's own tail blocks, a node's ancestors moved in). Returns (parts: top
    [h, n*gp] -> partial sums [h, tb, n*gp, d+1], the rows' own maxima over the tail [h, n*gp])."""
    hq, n, d = q.shape
    h = kv.shape[1]
    g, tb = hq // h, tail_mask.shape[3]
    tg = -(-g // QT)
    qt = q.new_zeros(h, n, tg * QT, d)
    qt[:, :, :g] = q.view(h, g, n, d).transpose(1, 2)
    token, slot, source = moved
    k, v = (_chain_tail(kv[i], shared * block, tb * block, n, token, slot, source)
            .view(h, n, 1, tb, block, d).expand(h, n, tg, tb, block, d).reshape(-1, block, d) for i in (0, 1))
    a = qt.view(h, n, tg, 1, QT, d).expand(h, n, tg, tb, QT, d).reshape(-1, QT, d)
    scores = _scores(a, k, scale, f).view(h, n, tg, tb, QT, block).masked_fill(~tail_mask, float("-inf"))

    def parts(top: torch.Tensor) -> torch.Tensor:
        e = torch.exp(scores - top.view(h, n, tg, 1, QT, 1)).view(-1, QT, block)
        p = _partials(e, v).view(h, n, tg, tb, QT, d + 1)
        return p.permute(0, 3, 1, 2, 4, 5).reshape(h, tb, n * tg * QT, d + 1)

    return parts, scores.amax(dim=(3, 5)).reshape(h, n * tg * QT)


def _chain_tail(x: torch.Tensor, start: int, width: int, n: int, token, slot, source) -> torch.Tensor:
    """x [h, capacity, d] -> [h, n, width, d]: the span's slots start.. for every token (one broadcast copy),
    then each token's moved slots (its ancestors) written in."""
    out = x[:, start:start + width].unsqueeze(1).expand(-1, n, -1, -1).clone()
    out[:, token, slot] = x[:, source]
    return out


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 as a balanced tree over a power-of-two count (zero-padded): the tree over fewer blocks
    is a subtree of the one over more, so trailing zero blocks never change the sum."""
    nb = x.shape[1]
    width = 1 << (nb - 1).bit_length()
    if width != nb:
        x = torch.cat([x, x.new_zeros(x.shape[0], width - nb, *x.shape[2:])], 1)
    while x.shape[1] > 1:
        x = x[:, 0::2] + x[:, 1::2]
    return x[:, 0]
