"""The batched path of the packed forward: ONE attention call per layer for every session of the step.

The per-session path (cloud_worker/attention.py `_attend_fast`) runs one attention call per session per layer
over views of the span; on a GPU a step of 64 sessions of a 32-layer model is 2,048 small kernel launches plus
their Python. Here the step's rows become one padded batch [B, heads, Q, d] (Q: the most new tokens of a row,
C: the most keys a row reads) and each layer makes one gather of its keys and one of its values out of the KV
store (`index_select` of the rows of every span, a copy of what attention reads anyway) and ONE
`scaled_dot_product_attention` over the batch, with one boolean mask [B, 1, Q, C] that holds each row's causal
order, sliding window and token tree (the masks the per-session path builds, side by side). Softcap and sinks
take the eager formula (`eager`) over the same padded batch: still one computation per layer. So
every feature the per-session path covers is covered here; no layer falls back.

Everything that depends on the step only (gather rows, the mask, where each packed token sits in the padded
batch) is built once per forward and window, on the CPU, and reaches an accelerator with one non-blocking copy
from pinned memory each: no host sync inside the forward.

Why this and not a varlen / block-sparse kernel: FlexAttention runs eagerly on the CPU only through its
reference implementation (measured: 13x slower than SDPA with one dense mask over the same 16 sessions of 256
tokens, and its block mask took 2.3 s to build), and needs torch.compile on CUDA; PyTorch 2.13's `varlen_attn` is CUDA-only and takes
neither tree masks nor softcap nor sinks. Padded SDPA runs on both devices with the same code, is exact, and its
cost over a varlen kernel is the padding: rows shorter than the longest (keys or new tokens) compute masked
columns. docs/gpu.md has the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kvcache import to_device

ALIGN = 8  # keys per row a multiple of this: CUDA's memory-efficient SDPA wants its mask's last dim aligned


@dataclass
class _Layout:
    """One window's gather rows and mask (shared by every layer with that window)."""

    index: torch.Tensor  # [B, h, C] row of store.data holding (layer 0, keys, head j, key c) of row b
    step: torch.Tensor   # [B, 1, 1] rows from one (layer, keys|values) plane of a span to the next
    mask: torch.Tensor   # [B, 1, g * Q, C] bool, the query rows folded as in the per-session path


@dataclass
class Batch:
    """Where each packed token sits in the padded batch, and each window's layout."""

    B: int
    Q: int
    query_index: torch.Tensor  # [B * Q] packed token of (row b, query i); padding repeats the row's last
    token_index: torch.Tensor  # [T] b * Q + i of each packed token
    layouts: dict


def prepare(rows, device: torch.device) -> Batch:
    """The padded batch of a forward's rows (attention._RowPlan)."""
    n = torch.tensor([r.n for r in rows])
    q0 = torch.tensor([r.q0 for r in rows])
    B, Q = len(rows), int(n.max())
    i = torch.arange(Q)
    query_index = (q0[:, None] + torch.minimum(i[None, :], n[:, None] - 1)).flatten()
    owner = torch.repeat_interleave(torch.arange(B), n)
    token_index = owner * Q + torch.arange(int(n.sum())) - q0[owner]
    return Batch(B, Q, to_device(query_index, device), to_device(token_index, device), {})


def layout(batch: Batch, rows, store, window: int | None, g: int, device: torch.device) -> _Layout:
    """Gather rows and the mask for `window`: a row reads its span's slots first..length-1, where a sliding
    window starts at past - window + 1 (as the per-session path reads them)."""
    h = store.shape.kv_heads
    first = [max(0, r.past - window + 1) if window else 0 for r in rows]
    width = torch.tensor([r.length - f for r, f in zip(rows, first)])     # [B] keys row b reads
    C = -(-int(width.max()) // ALIGN) * ALIGN
    cap = torch.tensor([r.span.capacity for r in rows])
    base = torch.tensor([store.row_offset(r.span) + f for r, f in zip(rows, first)])
    c = torch.minimum(torch.arange(C)[None, :], width[:, None] - 1)      # [B, C]: padding re-reads a valid key
    index = base[:, None, None] + torch.arange(h)[None, :, None] * cap[:, None, None] + c[:, None, :]
    mask = torch.zeros(batch.B, batch.Q, C, dtype=torch.bool)
    mask[:, :, 0] = True  # padding queries see one key (their output is dropped): no empty softmax
    for b, (r, f) in enumerate(zip(rows, first)):
        keys = torch.arange(f, r.length)
        mask[b, :r.n, :len(keys)] = (visible(r, window, keys) if r.tree is None
                                     else r.tree.fast_mask(r.past, f, window, "cpu"))
    mask = mask[:, None].repeat(1, 1, g, 1)  # [B, 1, g * Q, C]: query heads j*g..j*g+g-1 share K/V head j
    return _Layout(to_device(index, device), to_device(h * cap[:, None, None], device), to_device(mask, device))


def attend(plan, layer: int, query: torch.Tensor, scale: float, features) -> torch.Tensor:
    """query [1, Hq, T, d] -> [1, Hq, T, d]: the whole step's attention of one layer in one call."""
    store, rows = plan.store, plan.rows
    device = query.device
    if plan.batch is None:
        plan.batch = prepare(rows, device)
    batch = plan.batch
    _, hq, _, d = query.shape
    h = store.shape.kv_heads
    g = hq // h
    if features.window not in batch.layouts:
        batch.layouts[features.window] = layout(batch, rows, store, features.window, g, device)
    lay = batch.layouts[features.window]
    C = lay.index.shape[-1]
    where = lay.index + (2 * layer) * lay.step                                    # [B, h, C]
    keys = store.data.index_select(0, where.flatten()).view(batch.B, h, C, d)
    values = store.data.index_select(0, (where + lay.step).flatten()).view(batch.B, h, C, d)
    q = query[0].index_select(1, batch.query_index)                              # [Hq, B * Q, d]
    folded = q.view(hq, batch.B, batch.Q, d).transpose(0, 1).reshape(batch.B, h, g * batch.Q, d)
    if features.softcap is None and features.sinks is None:
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=lay.mask, scale=scale)
    else:
        out = eager(folded, keys, values, lay.mask, scale, features, g, batch.Q)
    out = out.reshape(batch.B, hq, batch.Q, d).transpose(0, 1).reshape(hq, batch.B * batch.Q, d)
    return out.index_select(1, batch.token_index)[None]                          # [1, Hq, T, d]


# ---- what both paths share: the masks of chains, and the eager formula -----------------------------------

def visible(r, window: int | None, keys: torch.Tensor) -> torch.Tensor:
    """[n, len(keys)] bool: key position k is visible to the row's i-th new token (at past + i): k <= past + i,
    and past + i - window < k under a sliding window."""
    position = r.past + torch.arange(r.n, device=keys.device)[:, None]  # [n, 1]
    seen = keys[None, :] <= position
    return seen & (keys[None, :] > position - window) if window else seen


def eager(folded, keys, values, mask, scale: float, f, g: int, n: int) -> torch.Tensor:
    """The eager formula under softcap or sinks: folded [B, h, g*n, d] over keys, values [B, h, L, d], mask
    [g*n, L] or [B, 1, g*n, L] (None: all visible) -> [B, h, g*n, d]."""
    scores = folded @ keys.transpose(-1, -2) * scale  # [B, h, g*n, L]
    if f.softcap is not None:
        scores = f.softcap * torch.tanh(scores / f.softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if f.sinks is not None:  # the sink column: one logit per query head, no value
        b, h = keys.shape[:2]
        sink = f.sinks.to(scores.dtype).view(1, h, g, 1).expand(b, h, g, n).reshape(b, h, g * n, 1)
        scores = torch.cat([scores, sink], -1)
    probs = torch.softmax(scores.float(), -1).to(values.dtype)
    if f.sinks is not None:
        probs = probs[..., :-1]
    return probs @ values
