"""One packed forward pass over many sessions whose K/V live in the `KVStore`, and the attention it uses.

The batch's new tokens travel as ONE row of the model ([1, T]: each session's tokens one after another,
no padding), with per-token position ids. The linear layers see T rows; attention is a function registered
in transformers' `AttentionInterface` that, per layer, (1) writes the T new keys and values into their
sessions' spans in place (one `index_copy_` each) and (2) attends each session's queries to a view of its
span. Nothing of a session's history is copied.

Attention features of the layer (the keyword arguments transformers passes to an attention function) are honoured
in both numerics, with transformers' own semantics (masking_utils, the models' eager attention):
- `sliding_window` w: a query at position p sees keys k with p - w < k <= p (w keys, itself included);
  per layer, as each layer passes its own (None on full-attention layers of a `layer_types` pattern);
- `softcap` c: scores = c * tanh(scores / c), after scaling, before masking (Gemma 2);
- `s_aux` (sinks, gpt-oss): one extra logit per query head in the softmax's denominator that carries no value.

Two numerics:
- fast (default): `scaled_dot_product_attention` per session. A session's attention never sees another
  session, but the linear layers' results may depend on how many rows the batch has (BLAS picks kernels by
  shape), so logits can differ in the last bits with batch composition.
- deterministic (batch-invariant): every matrix product has a fixed shape whatever the batch: the linear
  layers run on tiles of `TILE` rows, attention on `QUERY_TILE`-row query tiles against `block`-sized key
  blocks whose partial sums are added in a fixed pairwise order. A token's logits then depend only on its own
  session's tokens — not on the other sessions in the batch, nor on how its context was split into forward
  passes (chunked prefill, a re-prefill after failover) — so seeded sampling repeats exactly.

The model keeps working for everyone else: the registered function hands any call made outside
`forward_packed` (another thread, `generate`, a plain forward) to the implementation the model had.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ..common.errors import FatalError
from .kvcache import KVStore, Span

PREFIX = "specrelay_"
TILE = 16                      # rows per matrix product of a linear layer in deterministic mode
QUERY_TILE = 8                 # query rows per attention product in deterministic mode
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # a 4-D mask makes transformers skip building one
_local = threading.local()


@dataclass
class Row:
    """One session in a packed forward: its new token ids, and how many trailing positions need logits."""

    key: object
    ids: Sequence[int]
    keep: int = 0


@dataclass
class _Features:
    """What a layer's attention adds to plain causal softmax attention (see the module docstring)."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [Hq]

    @classmethod
    def of(cls, module, kwargs: dict) -> "_Features":
        sinks = kwargs.get("s_aux")
        return cls(kwargs.get("sliding_window") or None, kwargs.get("softcap") or None,
                   sinks if sinks is not None else getattr(module, "sinks", None))


@dataclass
class _RowPlan:
    span: Span
    q0: int             # first of its tokens in the packed row
    n: int              # new tokens
    length: int         # K/V positions after this forward (past + n)
    keys: torch.Tensor | None = None    # fast: [layers, h, length, d], a view of the span
    values: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)  # window -> mask, the same for every layer with that window

    @property
    def past(self) -> int:
        return self.length - self.n


@dataclass
class _Plan:
    store: KVStore
    rows: list[_RowPlan]
    write_base: torch.Tensor  # [kv_heads, T] row in store.data of each new token's layer-0 keys, per head
    write_step: torch.Tensor  # [T] rows between one (layer, keys|values) plane and the next, per token
    deterministic: bool
    layers_done: int = 0


# ---- installing the attention function ------------------------------------------------------------------

def install(model) -> bool:
    """Route the model's attention through `_attention`, and its linear layers through `_linear` (idempotent).
    Calls outside `forward_packed` go to the implementation the model had, with the masks it had. Returns
    False, changing nothing, when the model does not take a custom attention function (transformers'
    AttentionInterface: Falcon, Bloom), which the KV store needs."""
    current = model.config._attn_implementation or "eager"
    if current.startswith(PREFIX):
        return True
    name = PREFIX + current
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _dispatcher(current))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    try:
        model.set_attn_implementation(name)
    except (ValueError, NotImplementedError):
        pass
    if model.config._attn_implementation != name:
        return False
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = _linear.__get__(module)
    return True


def _dispatcher(original: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        plan = getattr(_local, "plan", None)
        if plan is not None:
            return _attention(plan, module, query, key, value, **kwargs)
        fallback = ALL_ATTENTION_FUNCTIONS.get(original) or sys.modules[type(module).__module__].eager_attention_forward
        return fallback(module, query, key, value, attention_mask, **kwargs)
    return attention


# ---- the packed forward ----------------------------------------------------------------------------------

@torch.no_grad()
def forward_packed(model, store: KVStore, rows: list[Row], *, deterministic: bool = False) -> list[torch.Tensor]:
    """Run every row's new tokens in one forward pass; their K/V are appended to the rows' spans (which must
    exist). Returns per row the logits [keep, V] (float32, on the CPU, where the acceptance rules run) of its
    last `keep` tokens."""
    spans = [store.ensure(r.key, store.span(r.key).length + len(r.ids)) for r in rows]  # may move spans
    plan, positions = _plan(store, rows, spans, deterministic)
    device = store.data.device
    ids = torch.tensor([t for r in rows for t in r.ids], dtype=torch.long, device=device)[None]  # [1, T]
    keep, q = [], 0
    for r in rows:
        q += len(r.ids)
        keep.extend(range(q - r.keep, q))
    _local.plan = plan
    try:
        out = model(input_ids=ids, position_ids=positions[None], attention_mask=_NO_MASK.to(device),
                    use_cache=False, logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device))
    finally:
        _local.plan = None
    if plan.layers_done != store.shape.layers:
        raise FatalError(f"{type(model).__name__} ran {plan.layers_done} of {store.shape.layers} attention "
                         "layers through the KV store; this model is not supported by the cloud worker")
    for r, s in zip(rows, spans):
        s.length += len(r.ids)
    logits = out.logits[0].float().cpu()  # [sum(keep), V]: one transfer per step on an accelerator
    return list(logits.split([r.keep for r in rows]))


def _plan(store: KVStore, rows: list[Row], spans: list[Span], deterministic: bool) -> tuple[_Plan, torch.Tensor]:
    """The attention plan of a forward, and the new tokens' positions [T]."""
    h, device = store.shape.kv_heads, store.data.device
    n = torch.tensor([len(r.ids) for r in rows])                       # [R]
    past = torch.tensor([s.length for s in spans])                      # [R]
    capacity = torch.tensor([s.capacity for s in spans])                # [R]
    offset = torch.tensor([store.row_offset(s) for s in spans])         # [R]
    owner = torch.repeat_interleave(torch.arange(len(rows)), n)         # [T] row of each new token
    first = torch.cumsum(n, 0) - n                                      # [R] its first token in the packed row
    positions = past[owner] + torch.arange(len(owner)) - first[owner]   # [T]
    # row in store.data of (layer 0, keys, head j, position p) = offset + j * capacity + p
    cap = capacity[owner]
    write_base = offset[owner] + torch.arange(h)[:, None] * cap + positions  # [h, T]
    plans = []
    for span, q0, k in zip(spans, first.tolist(), n.tolist()):
        length = span.length + k
        kv = span.kv[:, :, :, :length]
        plans.append(_RowPlan(span, q0, k, length, kv[:, 0], kv[:, 1]))
    plan = _Plan(store, plans, write_base.to(device), (h * cap).to(device), deterministic)
    return plan, positions.to(device)


# ---- attention ----------------------------------------------------------------------------------------------

def _attention(plan: _Plan, module, query, key, value, scaling=None, **kwargs):
    """query [1, Hq, T, d]; key, value [1, h, T, d] (the new tokens, position-encoded). Returns [1, T, Hq, d]."""
    layer = module.layer_idx
    features = _Features.of(module, kwargs)
    _write(plan, layer, key[0], value[0])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if plan.deterministic:
        outs = [_attend_deterministic(query[0, :, r.q0:r.q0 + r.n], r.span.kv[layer], r, scale, plan.store.block,
                                      features) for r in plan.rows]  # each [Hq, n, d]
        out = torch.cat(outs, 1)[None]
    else:
        out = torch.cat([_attend_fast(query[:, :, r.q0:r.q0 + r.n], layer, r, scale, features)
                         for r in plan.rows], 2)
    plan.layers_done += 1
    return out.transpose(1, 2), None  # [1, T, Hq, d]


def _write(plan: _Plan, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write the new tokens' K/V (each [h, T, d]) into their spans: one index_copy_ per tensor."""
    rows = plan.store.data  # [rows, d]
    d = key.shape[-1]
    where = plan.write_base + (2 * layer) * plan.write_step  # [h, T]
    rows.index_copy_(0, where.flatten(), key.reshape(-1, d).to(rows.dtype))
    rows.index_copy_(0, (where + plan.write_step).flatten(), value.reshape(-1, d).to(rows.dtype))


def _visible(r: _RowPlan, window: int | None, keys: torch.Tensor) -> torch.Tensor:
    """[n, len(keys)] bool: key position k is visible to the row's i-th new token (at past + i): k <= past + i,
    and past + i - window < k under a sliding window."""
    position = r.past + torch.arange(r.n, device=keys.device)[:, None]  # [n, 1]
    seen = keys[None, :] <= position
    return seen & (keys[None, :] > position - window) if window else seen


def _attend_fast(q: torch.Tensor, layer: int, r: _RowPlan, scale: float, f: _Features) -> torch.Tensor:
    """q [1, Hq, n, d] -> [1, Hq, n, d] over views of the span: SDPA, or the eager formula under softcap or
    sinks. Only keys some query can see are read (a sliding window starts at past - window + 1). Grouped query
    heads are folded into the query rows, so the K/V heads are never repeated."""
    first = max(0, r.past - f.window + 1) if f.window else 0
    keys, values = r.keys[layer:layer + 1, :, first:], r.values[layer:layer + 1, :, first:]  # [1, h, L', d]
    if f.window not in r.masks:  # None when every key read is visible (one new token)
        positions = torch.arange(first, r.length, device=q.device)
        r.masks[f.window] = None if r.n == 1 else _visible(r, f.window, positions)
    mask = r.masks[f.window]
    _, hq, n, d = q.shape
    g = hq // keys.shape[1]
    folded = q.reshape(1, -1, g * n, d)  # heads j*g..j*g+g-1 share K/V head j
    if mask is not None and g > 1:
        mask = mask.repeat(g, 1)
    if f.softcap is None and f.sinks is None:
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(1, hq, n, d)
    scores = folded @ keys.transpose(-1, -2) * scale  # [1, h, g*n, L']
    if f.softcap is not None:
        scores = f.softcap * torch.tanh(scores / f.softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if f.sinks is not None:  # the sink column: one logit per query head, no value
        sink = f.sinks.to(scores.dtype).view(1, -1, g, 1).expand(1, keys.shape[1], g, n).reshape(1, -1, g * n, 1)
        scores = torch.cat([scores, sink], -1)
    probs = torch.softmax(scores.float(), -1).to(values.dtype)
    if f.sinks is not None:
        probs = probs[..., :-1]
    return (probs @ values).reshape(1, hq, n, d)


def _block_mask(r: _RowPlan, g: int, block: int, window: int | None, device) -> torch.Tensor:
    """[tiles, 1, nb, QUERY_TILE, block] bool: True where key k (absolute) is visible to query row i, the rows
    being the g*n (group, token) pairs padded to whole tiles: k <= past + i % n (and > past + i % n - window).
    Blocks cover the span's whole capacity, so a block view of the span never needs a copy."""
    rows = g * r.n
    tiles = -(-rows // QUERY_TILE)
    position = r.past + torch.arange(tiles * QUERY_TILE, device=device) % r.n  # padded rows: any valid one
    position = position.view(tiles, 1, QUERY_TILE, 1)
    nb = r.span.capacity // block
    keys = torch.arange(nb * block, device=device).view(1, nb, 1, block)
    visible = keys <= position
    if window:
        visible &= keys > position - window
    return visible[:, None]


def _attend_deterministic(q: torch.Tensor, kv: torch.Tensor, r: _RowPlan, scale: float,
                          block: int, f: _Features) -> torch.Tensor:
    """Batch-invariant attention, q [Hq, n, d] -> [Hq, n, d]. Every product has a fixed shape: a tile of
    QUERY_TILE query rows against one key block, [QUERY_TILE, d] x [d, block] and [QUERY_TILE, block] x
    [block, d]. Softmax takes an exact max; block partial sums (with the denominator as an extra column) are
    added pairwise in a fixed order. A masked block contributes exact zeros, so extra blocks (a longer span)
    never change a result, nor does the number of tiles or sessions in the forward. A sink joins the max and
    adds exp(sink - max) to the denominator."""
    hq, n, d = q.shape
    _, h, cap, _ = kv.shape
    g, nb, rows = hq // h, cap // block, hq // h * n
    if f.window not in r.masks:
        r.masks[f.window] = _block_mask(r, g, block, f.window, q.device)
    masks = r.masks[f.window]
    qp = q.new_zeros(h, masks.shape[0] * QUERY_TILE, d)
    qp[:, :rows] = q.reshape(h, rows, d)      # query heads j*g..j*g+g-1 share K/V head j
    sinks = None
    if f.sinks is not None:                   # [h, tiles * QT, 1, 1]: the sink of each padded query row
        sinks = qp.new_zeros(h, masks.shape[0] * QUERY_TILE)
        sinks[:, :rows] = f.sinks.to(qp.dtype).view(h, g, 1).expand(h, g, n).reshape(h, rows)
        sinks = sinks.view(h, -1, 1, 1)
    keys = kv[0].reshape(h * nb, block, d)    # views: a span's blocks are contiguous per head
    values = kv[1].reshape(h * nb, block, d)
    outs = []
    for t, mask in enumerate(masks):
        tile = qp[:, t * QUERY_TILE:(t + 1) * QUERY_TILE].repeat_interleave(nb, 0)  # [h*nb, QT, d]
        scores = (torch.bmm(tile, keys.transpose(1, 2)) * scale).view(h, nb, QUERY_TILE, block)
        if f.softcap is not None:
            scores = f.softcap * torch.tanh(scores / f.softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        top = scores.amax(dim=(1, 3), keepdim=True)              # exact, whatever the order
        sink = None if sinks is None else sinks[:, t * QUERY_TILE:(t + 1) * QUERY_TILE].view(h, 1, QUERY_TILE, 1)
        if sink is not None:
            top = torch.maximum(top, sink)
        e = torch.exp(scores - top).view(h * nb, QUERY_TILE, block)
        part = torch.cat([torch.bmm(e, values), e.sum(-1, keepdim=True)], -1)  # [h*nb, QT, d+1]
        total = _pairwise_sum(part.view(h, nb, QUERY_TILE, d + 1))  # [h, QT, d+1]
        denominator = total[..., d:]
        if sink is not None:
            denominator = denominator + torch.exp(sink - top).view(h, QUERY_TILE, 1)
        outs.append(total[..., :d] / denominator)
    return torch.cat(outs, 1)[:, :rows].reshape(hq, n, d)


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 as a balanced tree over a power-of-two count (zero-padded): the tree over fewer blocks
    is a subtree of the one over more, so trailing zero blocks never change the sum."""
    nb = x.shape[1]
    width = 1 << (nb - 1).bit_length()
    if width != nb:
        x = torch.cat([x, x.new_zeros(x.shape[0], width - nb, *x.shape[2:])], 1)
    while x.shape[1] > 1:
        x = x[:, 0::2] + x[:, 1::2]
    return x[:, 0]


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward; inside a deterministic `forward_packed`, as products of fixed [TILE, in] x [in, out]
    shape (one batched matmul), so that a row's result does not depend on how many rows the batch has."""
    plan = getattr(_local, "plan", None)
    if plan is None or not plan.deterministic:
        return F.linear(x, self.weight, self.bias)
    return _tiled_linear(x, self.weight, self.bias)


def _tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [R, in]
    r = rows.shape[0]
    if r == 0:
        return F.linear(x, weight, bias)
    tiles = -(-r // TILE)
    padded = rows.new_zeros(tiles * TILE, rows.shape[1])
    padded[:r] = rows
    w = weight.t().unsqueeze(0).expand(tiles, *weight.t().shape)  # [tiles, in, out], not copied
    out = torch.bmm(padded.view(tiles, TILE, -1), w).view(tiles * TILE, -1)[:r]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


# ---- the start-up self-check -----------------------------------------------------------------------------------

def self_check(model, store: KVStore, deterministic: bool, forward=forward_packed,
               path: str = "the cloud worker's packed forward over its KV store") -> None:
    """Raise FatalError (one line) unless ragged `forward`s over `store` (an empty scratch store of the worker's
    kind), with a rollback, give the model's own logits (common/selfcheck.py)."""
    from ..common import selfcheck

    a, b = selfcheck.probe(model.get_output_embeddings().weight.shape[0])

    def run(*rows):
        return forward(model, store, [Row(*r) for r in rows], deterministic=deterministic)

    def probe_path() -> list[torch.Tensor]:
        for key in (0, 1):
            store.reserve(key, 32)
        a1, b1 = run((0, a[:15], 15), (1, b[:4], 4))
        a2, b2 = run((0, a[15:19], 4), (1, b[4:12], 8))
        store.truncate(0, 17)                  # a rollback: the last two of a's positions were rejected
        b3, a3 = run((1, b[12:], 1), (0, a[17:], 4))
        return [torch.cat([a1, a2[:2], a3]), torch.cat([b1, b2, b3])]

    selfcheck.compare(model, path, probe_path)
