"""The shared-vocabulary bitmap once: its wire forms (common/bitmap.py), the worker's bounded, expiring cache keyed
by content hash (cloud_worker/bitmaps.py), the OPEN that names it by hash only after an edge's first, and the
edge's re-OPEN with the bitmap when a worker lacks it."""

from __future__ import annotations

import zlib

import msgspec
import numpy as np
import pytest

from specrelay.cloud_worker.bitmaps import BitmapCache
from specrelay.cloud_worker.verifier import Verifier
from specrelay.common import bitmap
from specrelay.common import protocol as P
from specrelay.common.errors import ErrorCode, InvalidRequest, UnknownSession, UnknownVocab, from_wire
from specrelay.common.runner import ModelRunner
from specrelay.edge_worker.loading import load_drafter
from specrelay.edge_worker.session import EdgeSession, SessionConfig
from specrelay.speculative import speculative_generate, target_generate
from synthetic import make_synthetic_pair

V = 262_144  # gemma-3's vocabulary: the size that made the bitmap worth caching


def runs_mask(v: int = V, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.random(v) < 0.2


def test_wire_forms_round_trip_and_a_compressed_bomb_is_refused():
    mask = np.zeros(V, dtype=bool)
    mask[:50_000] = True  # runs compress well
    wire, key = bitmap.pack(mask)
    assert len(wire) < V // 8 and len(key) == bitmap.DIGEST_BYTES
    packed = bitmap.unpack(wire, V)
    assert len(packed) == V // 8 and bitmap.digest(packed) == key
    assert (bitmap.to_mask(packed, V) == mask).all()
    noise = runs_mask()
    wire, _ = bitmap.pack(noise)
    assert (bitmap.to_mask(bitmap.unpack(wire, V), V) == noise).all()
    raw = np.packbits(noise, bitorder="little").tobytes()
    assert bitmap.unpack(raw, V) == raw  # the packed form as older edges send it
    bombs = (b"\x00" * 10, zlib.compress(b"\xff" * (V // 8 + 1)), zlib.compress(raw)[:-3], zlib.compress(raw) + b"x")
    for bad in bombs:
        with pytest.raises(InvalidRequest) as info:
            bitmap.unpack(bad, V)
        assert info.value.field == "shared_vocab"


def test_cache_refuses_an_unknown_hash_by_name_then_serves_it_once_sent():
    now = [0.0]
    cache = BitmapCache(V, lambda: now[0], entries=2, ttl_s=60)
    mask = runs_mask()
    wire, key = bitmap.pack(mask)
    assert cache.mask(b"", b"") is None  # same vocabulary
    with pytest.raises(UnknownVocab, match=key.hex()) as info:
        cache.mask(b"", key)
    assert info.value.code == ErrorCode.UNKNOWN_VOCAB and info.value.field == "shared_vocab_hash"
    assert isinstance(info.value, UnknownSession) and info.value.retryable  # re-OPEN at once, no back-off
    got = cache.mask(wire, key)
    assert (got.numpy() == mask).all() and cache.mask(b"", key) is got
    with pytest.raises(InvalidRequest, match="is not its bitmap's"):  # a hash must be its bitmap's
        cache.mask(wire, bytes(16))
    with pytest.raises(InvalidRequest, match="16 bytes"):
        cache.mask(b"", b"abc")
    assert cache.stats == {"bitmap_hits": 1, "bitmap_misses": 1, "bitmap_stored": 1}


def test_cache_is_bounded_least_recently_used_out_and_expires():
    now = [0.0]
    cache = BitmapCache(V, lambda: now[0], entries=2, ttl_s=60)
    keys = []
    for seed in range(3):
        wire, key = bitmap.pack(runs_mask(seed=seed))
        cache.mask(wire, key)
        keys.append(key)
        if seed == 1:
            cache.mask(b"", keys[0])  # used again: the second is now the oldest
    assert len(cache) == 2 and keys[0] in cache and keys[1] not in cache and keys[2] in cache
    now[0] = 61.0
    with pytest.raises(UnknownVocab):
        cache.mask(b"", keys[2])
    assert len(cache) == 0


def test_open_keeps_old_messages_readable_and_carries_the_hash():
    old = msgspec.msgpack.encode([5, [1, 2], 1, 0.0, 0, 1.0, 0, 1, b"\x01", 9])  # an OPEN from before the hash
    msg = P.decode_body(P.MsgType.OPEN, old)
    assert msg.shared_vocab == b"\x01" and msg.shared_vocab_hash == b"" and msg.vocab_size == 9
    new = P.Open(5, [1, 2], vocab_size=9, shared_vocab_hash=bytes(range(16)))
    assert P.decode(P.encode(new)) == new
    assert from_wire(ErrorCode.UNKNOWN_VOCAB, "x").__class__ is UnknownVocab


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    target_dir, draft_dir = make_synthetic_pair(tmp_path_factory.mktemp("synthetic"))
    target = ModelRunner.load(str(target_dir))
    drafter, target_tok = load_drafter(str(draft_dir), str(target_dir))
    return target, drafter, target_tok("ab").input_ids


def test_edge_sends_the_bitmap_once_and_again_only_when_a_worker_lacks_it(synthetic):
    target, drafter, prompt = synthetic
    drafter._bitmap_sent = False
    verifier = Verifier(target)
    config = SessionConfig(max_new_tokens=4)
    first = EdgeSession(list(prompt), config, drafter, sid=1).open_message()
    assert first.shared_vocab and first.shared_vocab_hash == bitmap.digest(bitmap.unpack(first.shared_vocab,
                                                                                          target.vocab_size))
    verifier.open((b"e", 1), first)
    second = EdgeSession(list(prompt), config, drafter, sid=2)
    opened = second.open_message()
    assert opened.shared_vocab == b"" and opened.shared_vocab_hash == first.shared_vocab_hash
    verifier.open((b"e", 2), opened)  # a hit: the worker holds it
    assert verifier.sessions[(b"e", 2)].shared is verifier.sessions[(b"e", 1)].shared
    fresh = Verifier(target)  # another worker: it never saw the bitmap
    with pytest.raises(UnknownVocab) as info:
        fresh.open((b"e", 2), second.open_message())
    with pytest.raises(UnknownVocab):  # the ERROR reaches the session: its retry's OPEN carries the bitmap
        second.apply(P.Error(2, 0, info.value.code, str(info.value)))
    again = second.open_message()
    assert again.shared_vocab == first.shared_vocab
    fresh.open((b"e", 2), again)
    assert second.open_message().shared_vocab == b""  # once


def test_in_process_generation_with_a_reused_drafter_is_still_exact(synthetic):
    target, drafter, prompt = synthetic  # the drafter has sent its bitmap; each call below makes a new Verifier
    config = SessionConfig(max_new_tokens=12)
    for _ in range(2):
        ids, _ = speculative_generate(drafter, target, list(prompt), config)
        assert ids == target_generate(target, list(prompt), 12)


@pytest.mark.demo
@pytest.mark.timeout(600)
def test_demo_cross_pair_sessions_after_the_first_stay_under_1_kbit_per_token():
    """Through a real broker and worker: run_edge's warm-up is the edge's first session with the pair (it sends
    the bitmap); every session after it names the bitmap by hash, <= 1 kbit/token uplink for 48 tokens."""
    import asyncio

    from specrelay.bench import run_edge
    from specrelay.cluster import LocalCluster
    from specrelay.bench.runs import DEMO_DRAFT_XV, DEMO_TARGET

    prompts = ["def add(a, b):\n", "class Point:\n", "import os\n"]
    with LocalCluster(str(DEMO_TARGET)) as cluster:
        out, _ = asyncio.run(run_edge(cluster.frontend, str(DEMO_DRAFT_XV), prompts, 1, str(DEMO_TARGET),
                                      max_new_tokens=48))
    for ids, stats in out:
        assert stats["generated_tokens"] == len(ids) and 8 * stats["uplink_bytes"] / len(ids) <= 1000, stats
