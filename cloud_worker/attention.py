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
- fast (default): `scaled_dot_product_attention` per session, or (`batched=True`, cloud_worker/batchattn.py) one
  call per layer for the whole step over a padded batch with one mask. A session's attention never sees another
  session, but the linear layers' results may depend on how many rows the batch has (BLAS picks kernels by
  shape), so logits can differ in the last bits with batch composition.
- deterministic (batch-invariant; attention in cloud_worker/detattn.py, the other layers in
  cloud_worker/detlayers.py): every matrix product has a fixed shape whatever the batch, and no element-wise
  function's result depends on where its tensor ends. A token's logits then depend only on its own session's
  tokens — not on the other sessions in the batch, nor on how its context was split into forward passes
  (chunked prefill, a re-prefill after failover) — so seeded sampling repeats exactly.

Token trees (cloud_worker/treeattn.py): a row with `parents` ends in a tree's nodes; each node is stored in the
span's next slot but stands at position past + depth, and attends to the history and its own ancestors only.

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
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ..common.errors import FatalError
from . import batchattn, detattn, detlayers
from .batchattn import eager, visible
from .kvcache import KVStore, Span, to_device
from .treeattn import TreeLayout

PREFIX = "specrelay_"
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # a 4-D mask makes transformers skip building one
_local = threading.local()


@dataclass
class Row:
    """One session in a packed forward: its new token ids, how many trailing positions need logits, and for a
    token tree the parent of each of its last len(parents) ids (-1: the id before them; cloud_worker/treeattn.py)."""

    key: object
    ids: Sequence[int]
    keep: int = 0
    parents: Sequence[int] = ()


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
    tree: TreeLayout | None = None             # a token tree's positions and mask

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
    batched: bool = False  # one attention call per layer for every row (cloud_worker/batchattn.py)
    batch: object = None   # batchattn.Batch, built at the first layer
    layers_done: int = 0


# ---- installing the attention function ------------------------------------------------------------------

def install(model) -> bool:
    """Route the model's attention through `_attention`, and its products (linear layers, experts) through
    cloud_worker/detlayers.py's fixed-shape ones inside a deterministic forward (idempotent).
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
    detlayers.install(model, _deterministic)
    return True


def _deterministic() -> bool:
    """Whether this thread is inside a deterministic `forward_packed`."""
    plan = getattr(_local, "plan", None)
    return plan is not None and plan.deterministic


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
def forward_packed(model, store: KVStore, rows: list[Row], *, deterministic: bool = False,
                   batched: bool = False) -> list[torch.Tensor]:
    """Run every row's new tokens in one forward pass; their K/V are appended to the rows' spans (which must
    exist). Returns per row the logits [keep, V] (float32, on the CPU, where the acceptance rules run) of its
    last `keep` tokens. batched: one attention call per layer for all rows (cloud_worker/batchattn.py) instead
    of one per row; deterministic numerics keep their own attention (cloud_worker/detattn.py) either way."""
    spans = [store.ensure(r.key, store.span(r.key).length + len(r.ids)) for r in rows]  # may move spans
    plan, positions = _plan(store, rows, spans, deterministic)
    plan.batched = batched and not deterministic
    device = store.data.device
    ids = to_device(torch.tensor([t for r in rows for t in r.ids], dtype=torch.long)[None], device)  # [1, T]
    keep, q = [], 0
    for r in rows:
        q += len(r.ids)
        keep.extend(range(q - r.keep, q))
    _local.plan = plan
    try:
        out = model(input_ids=ids, position_ids=positions[None], attention_mask=to_device(_NO_MASK, device),
                    use_cache=False, logits_to_keep=to_device(torch.tensor(keep, dtype=torch.long), device))
    finally:
        _local.plan = None
    if plan.layers_done != store.shape.layers:
        raise FatalError(f"{type(model).__name__} ran {plan.layers_done} of {store.shape.layers} attention "
                         "layers through the KV store; this model is not supported by the cloud worker")
    for r, s in zip(rows, spans):
        s.length += len(r.ids)
    logits = _to_host(out.logits[0].float())  # [sum(keep), V]: the step's one wait on an accelerator
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
    slots = past[owner] + torch.arange(len(owner)) - first[owner]       # [T] slot in its span
    positions = slots.clone()                                            # [T]: a tree node's is past + depth
    # row in store.data of (layer 0, keys, head j, slot s) = offset + j * capacity + s
    cap = capacity[owner]
    write_base = offset[owner] + torch.arange(h)[:, None] * cap + slots  # [h, T]
    plans = []
    for row, span, q0, k in zip(rows, spans, first.tolist(), n.tolist()):
        length = span.length + k
        kv = span.kv[:, :, :, :length]
        tree = TreeLayout.of(row.parents, k, span.length) if row.parents else None
        if tree is not None:
            positions[q0:q0 + k] = tree.pos
        plans.append(_RowPlan(span, q0, k, length, kv[:, 0], kv[:, 1], tree=tree))
    plan = _Plan(store, plans, to_device(write_base, device), to_device(h * cap, device), deterministic)
    return plan, to_device(positions, device)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor in (pinned) host memory: one copy, then the one wait for the step's results."""
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


# ---- attention ----------------------------------------------------------------------------------------------

def _attention(plan: _Plan, module, query, key, value, scaling=None, **kwargs):
    """query [1, Hq, T, d]; key, value [1, h, T, d] (the new tokens, position-encoded). Returns [1, T, Hq, d]."""
    layer = module.layer_idx
    features = _Features.of(module, kwargs)
    _write(plan, layer, key[0], value[0])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if plan.deterministic:
        outs = [(detattn.attend if r.tree is None else detattn.attend_tree)(
            query[0, :, r.q0:r.q0 + r.n], r.span.kv[layer], r, scale, plan.store.block, features)
            for r in plan.rows]  # each [Hq, n, d]
        out = torch.cat(outs, 1)[None]
    elif plan.batched:
        out = batchattn.attend(plan, layer, query, scale, features)
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


def _attend_fast(q: torch.Tensor, layer: int, r: _RowPlan, scale: float, f: _Features) -> torch.Tensor:
    """q [1, Hq, n, d] -> [1, Hq, n, d] over views of the span: SDPA, or the eager formula under softcap or
    sinks. Only keys some query can see are read (a sliding window starts at past - window + 1). Grouped query
    heads are folded into the query rows, so the K/V heads are never repeated."""
    first = max(0, r.past - f.window + 1) if f.window else 0
    keys, values = r.keys[layer:layer + 1, :, first:], r.values[layer:layer + 1, :, first:]  # [1, h, L', d]
    if f.window not in r.masks:  # None when every key read is visible (one new token)
        positions = torch.arange(first, r.length, device=q.device)
        r.masks[f.window] = (None if r.n == 1 else visible(r, f.window, positions) if r.tree is None
                             else r.tree.fast_mask(r.past, first, f.window, q.device))
    mask = r.masks[f.window]
    _, hq, n, d = q.shape
    g = hq // keys.shape[1]
    folded = q.reshape(1, -1, g * n, d)  # heads j*g..j*g+g-1 share K/V head j
    if mask is not None and g > 1:
        mask = mask.repeat(g, 1)
    if f.softcap is None and f.sinks is None:
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(1, hq, n, d)
    return eager(folded, keys, values, mask, scale, f, g, n).reshape(1, hq, n, d)


# ---- the start-up self-check -----------------------------------------------------------------------------------

def self_check(model, store: KVStore, deterministic: bool, forward=forward_packed,
               path: str = "the cloud worker's packed forward over its KV store", batched: bool = False) -> None:
    """Raise FatalError (one line) unless ragged `forward`s over `store` (an empty scratch store of the worker's
    kind), with a rollback, and (packed forward) a token tree, give the model's own logits (common/selfcheck.py);
    in deterministic numerics, also unless each sequence alone, in one forward, gives the same logits bit for bit.
    batched: check the batched attention path (forward_packed only)."""
    from ..common import selfcheck

    a, b = selfcheck.probe(model.get_output_embeddings().weight.shape[0])
    batched: list[torch.Tensor] = []

    path_kw = {"batched": True} if batched else {}

    def run(*rows):
        return forward(model, store, [Row(*r) for r in rows], deterministic=deterministic, **path_kw)

    def probe_path() -> list[torch.Tensor]:
        for key in (0, 1):
            store.reserve(key, 32)
        a1, b1 = run((0, a[:15], 15), (1, b[:4], 4))
        a2, b2 = run((0, a[15:19], 4), (1, b[4:12], 8))
        store.truncate(0, 17)                  # a rollback: the last two of a's positions were rejected
        b3, a3 = run((1, b[12:], 1), (0, a[17:], 4))
        batched[:] = [torch.cat([a1, a2[:2], a3]), torch.cat([b1, b2, b3])]
        return batched

    selfcheck.compare(model, path, probe_path)
    if deterministic:
        _refuse_untiled(model)
        with selfcheck.shrunk_windows(model):  # as the probe ran
            for key in (0, 1):
                store.reserve(key, 32)
            # each alone, split where the probe did not split it: one forward of 20 rows, three of one row
            alone = [torch.cat([run((key, ids[:cut], cut))[0], run((key, ids[cut:], len(ids) - cut))[0]])
                     for key, ids, cut in ((0, a, 20), (1, b, 1))]
        if not all(torch.equal(x, y) for x, y in zip(alone, batched)):
            raise FatalError(f"{type(model).__name__} ({model.config.model_type}): --deterministic is not "
                             "batch-invariant for this architecture (a sequence alone and in a ragged batch give "
                             "different logits); serve it without --deterministic")
    if forward is forward_packed:
        _tree_self_check(model, store, deterministic, a, b, path + " with a token tree", batched)


def _refuse_untiled(model) -> None:
    """Raise FatalError (one line) for a model with products deterministic numerics do not make fixed-shape."""
    name = detlayers.untiled(model)
    if name is not None:
        raise FatalError(f"{type(model).__name__} ({model.config.model_type}): --deterministic cannot make {name} "
                         "batch-invariant (weights of 3 or more dimensions outside transformers' experts "
                         "interface); serve it without --deterministic")


def _tree_self_check(model, store: KVStore, deterministic: bool, a: list[int], b: list[int], path: str,
                     batched: bool = False) -> None:
    """A tree row after 12 tokens of `a` (a branch along a, one along b), beside another session: each node's
    logits must be the model's own after its root-to-node path (windows shrunk to 8, so the tree slides)."""
    from ..common import selfcheck

    tokens, parents = [a[12], b[0], a[13], b[1], a[14], b[2]], [-1, -1, 0, 1, 2, 3]
    paths = [[]] + [[a[12], a[13], a[14]][:k] if i % 2 == 0 else b[:k] for i, k in enumerate((1, 1, 2, 2, 3, 3))]
    try:
        with selfcheck.shrunk_windows(model):
            want = torch.stack([logits[-1] for logits in selfcheck.reference(model, [a[:12] + p for p in paths])])
            for key in (0, 1):
                store.reserve(key, 32)
            forward_packed(model, store, [Row(0, a[:11])], deterministic=deterministic, batched=batched)
            got = forward_packed(model, store, [Row(1, b[:5], 1), Row(0, a[11:12] + tokens, 7, parents)],
                                 deterministic=deterministic, batched=batched)[1]
    except Exception as exc:
        raise FatalError(f"{type(model).__name__}: {path} failed on the start-up self-check "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    selfcheck.require_close(model, path, [got], [want])
