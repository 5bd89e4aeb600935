"""The worker's cache of shared-vocabulary bitmaps, keyed by their content hash (common/bitmap.py).

An edge sends its pair's bitmap once and names it by hash in every later OPEN; the worker keeps the parsed mask
here. Any peer may fill it, so it is bounded the way the Security section asks of anything a peer can grow: at most
`BITMAP_ENTRIES` masks (least recently used out first), each dropped after `BITMAP_TTL_S` unused, and a hash it
does not hold is refused with UNKNOWN_VOCAB naming the hash (the edge re-OPENs with the bitmap). Entries are keyed
by content, so sharing them across peers leaks nothing and a forged one cannot exist: the hash is recomputed here.
A session holds its own reference to its mask, so an entry pushed out never changes a session already admitted.
Worst case: BITMAP_ENTRIES * V bytes (4 MiB for a 262k vocabulary), and a peer flooding fresh bitmaps costs
another edge one extra round trip and its bitmap's bytes on its next OPEN.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from ..common import bitmap
from ..common.errors import InvalidRequest, UnknownVocab

BITMAP_ENTRIES = 16    # distinct draft/target pairs one worker serves at once; a mask is 1 byte per target id
BITMAP_TTL_S = 3600.0  # an edge that has not opened a session in an hour pays one round trip and the bitmap again


class BitmapCache:
    def __init__(self, vocab_size: int, clock: Callable[[], float], entries: int = BITMAP_ENTRIES,
                 ttl_s: float = BITMAP_TTL_S) -> None:
        self.vocab_size, self.clock, self.entries, self.ttl_s = vocab_size, clock, entries, ttl_s
        self._masks: OrderedDict[bytes, tuple[torch.Tensor, float]] = OrderedDict()  # hash -> (mask, last use)
        self.stats = {"bitmap_hits": 0, "bitmap_misses": 0, "bitmap_stored": 0}

    def __len__(self) -> int:
        return len(self._masks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._masks

    def mask(self, wire: bytes, key: bytes) -> torch.Tensor | None:
        """The [V_target] bool mask of an OPEN's (shared_vocab, shared_vocab_hash); None: same vocabulary.
        Raises InvalidRequest naming the field, or UnknownVocab naming the hash."""
        if not wire and not key:
            return None
        if key and len(key) != bitmap.DIGEST_BYTES:
            raise InvalidRequest(f"shared_vocab_hash must be {bitmap.DIGEST_BYTES} bytes, got {len(key)}",
                                 field="shared_vocab_hash")
        now = self.clock()
        self._expire(now)
        if not wire:
            if key not in self._masks:
                self.stats["bitmap_misses"] += 1
                raise UnknownVocab(f"shared_vocab_hash {key.hex()} is not in this worker's bitmap cache; re-OPEN "
                                   "with shared_vocab", field="shared_vocab_hash")
            self.stats["bitmap_hits"] += 1
            return self._use(key, self._masks[key][0], now)
        packed = bitmap.unpack(wire, self.vocab_size)
        actual = bitmap.digest(packed)
        if key and key != actual:
            raise InvalidRequest(f"shared_vocab_hash {key.hex()} is not its bitmap's ({actual.hex()})",
                                 field="shared_vocab_hash")
        if actual in self._masks:
            return self._use(actual, self._masks[actual][0], now)
        self.stats["bitmap_stored"] += 1
        mask = self._use(actual, torch.from_numpy(bitmap.to_mask(packed, self.vocab_size)), now)
        while len(self._masks) > self.entries:
            self._masks.popitem(last=False)
        return mask

    def _use(self, key: bytes, mask: torch.Tensor, now: float) -> torch.Tensor:
        self._masks[key] = (mask, now)
        self._masks.move_to_end(key)
        return mask

    def _expire(self, now: float) -> None:
        while self._masks:
            key, (_, used) = next(iter(self._masks.items()))
            if now - used <= self.ttl_s:
                return
            del self._masks[key]
