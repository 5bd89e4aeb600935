"""Test helper: one session's logits through the cloud's packed forward, fed in given chunk sizes, every forward
shared with other sessions' tokens (what batch invariance in deterministic mode is checked against)."""

from __future__ import annotations

import torch

from specrelay.cloud_worker.attention import Row, forward_packed
from specrelay.cloud_worker.kvcache import KVShape, KVStore


def store_for(model, tokens: int = 2048, dtype: torch.dtype | None = None) -> KVStore:
    """A KV store for `model` with the worker's deterministic block."""
    return KVStore(KVShape.of(model.config, dtype or model.dtype), tokens, block=128)


def chunked_logits(model, seqs: dict, key, chunks: list[int], others: list,
                   store: KVStore | None = None) -> torch.Tensor:
    """Logits of seqs[key] fed in the chunk sizes `chunks` (cycled, offset per session), every forward shared with
    `others`' tokens (fed in chunk sizes of their own), deterministic numerics. [len(seqs[key]), vocab]"""
    store = store or store_for(model)
    keys = [key] + others
    for k in keys:
        store.reserve(k, 8)
    done, out, step = dict.fromkeys(keys, 0), [], 0
    while done[key] < len(seqs[key]):
        rows = [Row(k, seqs[k][done[k]:done[k] + n], keep=n) for k in keys
                for n in [min(len(seqs[k]) - done[k], chunks[(step + len(str(k))) % len(chunks)])] if n]
        for row, logits in zip(rows, forward_packed(model, store, rows, deterministic=True)):
            out += [logits] if row.key == key else []
            done[row.key] += len(row.ids)
        step += 1
    return torch.cat(out)
