"""The fallback for a model the KV store cannot serve (no transformers AttentionInterface: Falcon, Bloom with
ALiBi): each session's K/V live in the model's own cache, and a batch runs one forward per session.

Exact (the model's own forward and cache, as `generate` uses them) but slower: R sessions in a batch cost R
forwards instead of one. `OwnCacheStore` keeps the KV store's accounting (spans, lengths, admission, eviction,
rollback as a length change) without its buffer, so the verifier runs unchanged; a session's cache is cropped
to its span's length before each forward, which is how a rollback reaches it.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import structlog
import torch
from transformers import DynamicCache

from ..common.errors import FatalError
from ..common.runner import KVShape
from .attention import Row
from .kvcache import KVStore

log = structlog.get_logger("specrelay.cloud")


class OwnCacheStore(KVStore):
    """Token-slot accounting of a KV store (sized by the model's K/V bytes per token) with no buffer; each
    session's K/V is a `DynamicCache` in `caches`."""

    def __init__(self, shape: KVShape, capacity_tokens: int, device: torch.device | str = "cpu",
                 block: int = 32) -> None:
        super().__init__(replace(shape, layers=0), capacity_tokens, device, block)  # 0 rows per token: no buffer
        self.model_shape = shape
        self.caches: dict[object, DynamicCache] = {}

    @property
    def nbytes(self) -> int:
        return self.capacity * self.model_shape.bytes_per_token

    def reserve(self, key: object, tokens: int):
        self.caches.pop(key, None)
        return super().reserve(key, tokens)

    def free(self, key: object) -> None:
        super().free(key)
        self.caches.pop(key, None)

    def clear(self) -> None:
        super().clear()
        self.caches.clear()


@torch.no_grad()
def forward_own_cache(model, store: OwnCacheStore, rows: list[Row], *, deterministic: bool = False
                      ) -> list[torch.Tensor]:
    """`attention.forward_packed` through the model's own cache: per row, one forward of its new tokens on top
    of its session's cache. Returns per row the logits [keep, V] (float32, CPU) of its last `keep` tokens."""
    device = next(model.parameters()).device
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    for r in rows:
        span = store.ensure(r.key, store.span(r.key).length + len(r.ids))
        cache = store.caches.setdefault(r.key, DynamicCache())
        extra = cache.get_seq_length() - span.length
        if extra > 0:  # rejected drafts were truncated from the span
            cache.crop(-extra)  # negative: remove that many (transformers 4.x and 5.x)
        ids = torch.tensor([list(r.ids)], dtype=torch.long, device=device)  # [1, n]
        positions = torch.arange(span.length, span.length + len(r.ids), device=device)[None]
        logits = model(input_ids=ids, position_ids=positions, use_cache=True, **{cache_kw: cache}).logits[0]
        span.length += len(r.ids)
        out.append(logits[len(r.ids) - r.keep:].float().cpu())
    return out


def announce_fallback(model, deterministic: bool) -> None:
    """Say at start-up that (and why) this worker serves through the fallback, and what it costs; refuse the
    deterministic numerics, which need the KV store's fixed-shape products."""
    kind = getattr(model.config, "model_type", "?")
    reason = f"{type(model).__name__} ({kind}) does not take a custom attention function (transformers' AttentionInterface)"
    if deterministic:
        raise FatalError(f"{reason}, so --deterministic (batch-invariant numerics over the KV store) is not "
                         "available for it; run without --deterministic")
    log.warning("fallback", reason=reason, served_by="the model's own cache",
                cost="one forward per session per batch instead of one per batch")
