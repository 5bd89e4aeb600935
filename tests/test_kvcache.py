"""The cloud worker's KV store (allocation, moves, compaction), the packed forward over it (same logits and
verdicts as Hugging Face's own forward for ragged batches with rollbacks), the deterministic mode's batch and
chunk invariance, the context limit and admission by memory. Pure: no sockets."""

from __future__ import annotations

import pytest
import torch

from specrelay.cloud_worker.attention import Row, forward_packed, install
from specrelay.cloud_worker.kvcache import KVFull, KVShape, KVStore
from specrelay.cloud_worker.config import VerifierConfig
from specrelay.cloud_worker.scheduler import ChunkedPrefill
from specrelay.cloud_worker.verifier import Verifier
from specrelay.common import protocol as P
from specrelay.common import verify
from specrelay.common.errors import ErrorCode, InvalidRequest, RequestError
from specrelay.common.sampling import SamplingParams
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.edge_worker.session import EdgeSession, SessionConfig
from specrelay.speculative import next_request, speculative_generate_batch

import packed

SHAPE = KVShape(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)


def fill(store: KVStore, key, n: int, value: float) -> None:
    """Write n positions of recognisable K/V into key's span (as a forward pass would)."""
    span = store.ensure(key, n)
    span.kv[:, :, :, span.length:n] = value + torch.arange(span.length, n, dtype=torch.float32)[:, None]
    span.length = n


def consistent(store: KVStore) -> bool:
    """Spans inside the store, not overlapping, and the reserved counter equal to their capacities."""
    spans = sorted(store.spans.values(), key=lambda s: s.start)
    return (all(a.end <= b.start for a, b in zip(spans, spans[1:])) and all(s.end <= store.capacity for s in spans)
            and store.reserved == sum(s.capacity for s in spans))


def content(store: KVStore, key) -> torch.Tensor:
    span = store.span(key)
    return span.kv[:, :, :, :span.length].clone()


# ------------------------------------------------------------------------------------------- the store

def test_spans_grow_by_moving_once_and_keep_their_kv():
    store = KVStore(SHAPE, capacity_tokens=40 * 8, block=8)
    assert store.shape.bytes_per_token == 2 * 2 * 2 * 4 * 4 and store.free_tokens == 320
    store.reserve("a", 10)
    store.reserve("b", 8)           # right after a: a cannot grow in place
    fill(store, "a", 16, 100.0)
    before, start = content(store, "a"), store.span("a").start
    fill(store, "a", 40, 100.0)     # grows: one move, to 1.5x what it needs
    span = store.span("a")
    assert span.start != start and span.capacity == 64 and store.stats["moves"] == 1
    assert torch.equal(content(store, "a")[:, :, :, :16], before)
    assert store.free_tokens == 320 - 64 - 8 and consistent(store)


def test_rollback_is_a_length_change_and_free_returns_the_slots():
    store = KVStore(SHAPE, capacity_tokens=64, block=8)
    store.reserve("a", 16)
    fill(store, "a", 12, 1.0)
    data = store.span("a").kv.data_ptr()
    store.truncate("a", 7)
    assert store.span("a").length == 7 and store.span("a").kv.data_ptr() == data
    store.free("a")
    assert store.free_tokens == 64 and "a" not in store


def test_full_store_refuses_and_fragmented_store_compacts():
    store = KVStore(SHAPE, capacity_tokens=64, block=8)
    for key in "abcd":
        store.reserve(key, 16)
        fill(store, key, 10, ord(key))
    with pytest.raises(KVFull, match="free token slots"):
        store.reserve("e", 8)
    store.free("a")
    store.free("c")                 # 32 free slots, in two holes of 16
    kept = {k: content(store, k) for k in "bd"}
    store.reserve("e", 24)          # fits only after compaction
    assert store.stats["compactions"] == 1
    assert all(torch.equal(content(store, k), v) for k, v in kept.items())
    assert consistent(store)
    with pytest.raises(KVFull):
        store.ensure("b", 64)


def test_a_span_grows_through_a_fragmented_store():
    store = KVStore(SHAPE, capacity_tokens=80, block=8)
    for key in "abcde":
        store.reserve(key, 16)
        fill(store, key, 9, 10.0 * ord(key))
    store.free("b")
    store.free("d")                 # two holes of 16; c needs 40 in one piece
    kept = {k: content(store, k) for k in "ace"}
    fill(store, "c", 40, 10.0 * ord("c"))
    assert store.span("c").capacity >= 40
    assert all(torch.equal(content(store, k)[:, :, :, :9], v) for k, v in kept.items())
    assert consistent(store) and store.free_tokens == 80 - 16 - 16 - store.span("c").capacity


# --------------------------------------------------------------------------------- the packed forward

def hf_logits(runner, ids: list[int]) -> torch.Tensor:  # [len(ids), V]
    with torch.no_grad():
        return runner.model(input_ids=torch.tensor([ids])).logits[0].float()


class _Runner:
    def __init__(self, model) -> None:
        self.model, self.vocab_size = model.eval(), model.config.vocab_size


def gqa_runner() -> _Runner:
    """A tiny random Llama with grouped-query attention: 4 query heads share 2 K/V heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    return _Runner(LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=256, initializer_range=0.2)))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_packed_forward_with_rollbacks_equals_hf(tiny_runners, deterministic, gqa):
    """Ragged rows, every step a different mix, some positions rolled back and rewritten: every logit row is
    (numerically) Hugging Face's, and argmaxes agree exactly. Also with grouped-query attention."""
    target = gqa_runner() if gqa else tiny_runners[0]
    install(target.model)
    store = KVStore(KVShape.of(target.model.config, torch.float32), capacity_tokens=512, block=32)
    gen = torch.Generator().manual_seed(0)
    seqs = {k: torch.randint(1, target.vocab_size, (n,), generator=gen).tolist() for k, n in enumerate((3, 40, 17))}
    for k in seqs:
        store.reserve(k, 8)
    done = {k: 0 for k in seqs}
    for step in range(6):
        rows = []
        for k, ids in seqs.items():
            n = min(len(ids) - done[k], (1, 5, 9)[(k + step) % 3])
            if n:
                rows.append(Row(k, ids[done[k]:done[k] + n], keep=n))
        for row, logits in zip(rows, forward_packed(target.model, store, rows, deterministic=deterministic)):
            ref = hf_logits(target, seqs[row.key][:done[row.key] + len(row.ids)])[-len(row.ids):]
            assert torch.allclose(logits, ref, atol=1e-4)
            assert torch.equal(logits.argmax(-1), ref.argmax(-1))
            keep = done[row.key] + max(1, len(row.ids) // 2)  # roll back the rest: it is recomputed next step
            store.truncate(row.key, keep)
            done[row.key] = keep


def test_verifier_verdicts_equal_hf_for_ragged_batches(tiny_runners):
    """Greedy verdicts of one batched step per round equal the rule applied to Hugging Face's logits of the
    whole sequence, for ragged contexts, ragged drafts and rejections (rollbacks) in every round."""
    target, _ = tiny_runners
    v = Verifier(target)
    gen = torch.Generator().manual_seed(1)
    ctx = {sid: torch.randint(1, target.vocab_size, (n,), generator=gen).tolist() for sid, n in
           zip(range(1, 5), (4, 30, 11, 63))}
    for sid, ids in ctx.items():
        v.open((b"e", sid), P.Open(sid, ids))
    for seq, lens in enumerate([(0, 3, 5, 1), (4, 4, 2, 6), (2, 0, 7, 3)], start=1):
        reqs = []
        for (sid, ids), d in zip(ctx.items(), lens):
            guess = hf_logits(target, ids)[-1].argmax().item()
            draft = [guess] + torch.randint(1, target.vocab_size, (max(0, d - 1),), generator=gen).tolist()
            reqs.append(((b"e", sid), P.Verify(sid, seq, len(ids), [], draft[:d])))
        for (key, req), verdict in zip(reqs, v.verify(reqs)):
            logits = hf_logits(target, ctx[req.session] + list(req.draft))[-(len(req.draft) + 1):]
            n, token = verify.greedy(torch.tensor(req.draft, dtype=torch.long), logits)
            assert (verdict.n_accepted, verdict.next_token) == (n, token)
            ctx[req.session] += list(req.draft[:n]) + [token]
    assert v.stats["forward_passes"] == 3


# ----------------------------------------------------------------------------------- deterministic mode

def chunked_logits(runner, seqs: dict, key, chunks: list[int], others: list) -> torch.Tensor:
    """Logits of seqs[key] fed in the given chunk sizes, sharing every forward with `others`' tokens."""
    store = packed.store_for(runner.model, dtype=torch.float32)
    return packed.chunked_logits(runner.model, seqs, key, chunks, others, store)


@pytest.mark.parametrize("gqa", [False, True])
def test_deterministic_logits_do_not_depend_on_batch_or_chunking(tiny_runners, gqa):
    target = gqa_runner() if gqa else tiny_runners[0]
    install(target.model)
    gen = torch.Generator().manual_seed(2)
    seqs = {k: torch.randint(1, target.vocab_size, (n,), generator=gen).tolist()
            for k, n in [("me", 70), ("x", 50), ("yy", 9), ("zzz", 120)]}
    alone = chunked_logits(target, seqs, "me", [5], [])
    for chunks, others in [([5], ["x", "yy", "zzz"]), ([1, 2, 3], []), ([64, 5], ["zzz"]), ([70], ["x", "yy"])]:
        assert torch.equal(chunked_logits(target, seqs, "me", chunks, others), alone), (chunks, others)


def test_seeded_sampling_is_the_same_at_concurrency_1_8_16(tiny_runners):
    """Deterministic verifier, T = 0.8, 16 prompts in lockstep groups of 1, 8 and 16: identical outputs."""
    target, draft = tiny_runners
    texts = ["def add(a, b):\n", "class Point:\n", "for i in", "    return a + b\n"] * 4
    prompts = [target.tokenizer(t + " " * (i % 3)).input_ids for i, t in enumerate(texts)]
    config = [SessionConfig(max_new_tokens=24, params=SamplingParams(0.8), seed=7 + i) for i in range(16)]
    drafter = Drafter(draft, target.vocab_size)
    runs = {}
    for group in (1, 8, 16):
        out = []
        for lo in range(0, 16, group):
            verifier = Verifier(target, VerifierConfig(deterministic=True))
            out += [ids for ids, _ in speculative_generate_batch(drafter, verifier, prompts[lo:lo + group],
                                                                 config[lo:lo + group])]
        runs[group] = out
    assert runs[1] == runs[8] == runs[16]
    assert len({tuple(o) for o in runs[1]}) > 8  # different seeds and prompts: the outputs do differ


# ------------------------------------------------------------------------------ limits and admission

def test_open_past_the_models_context_is_refused_naming_the_limit(tiny_runners):
    target, _ = tiny_runners
    v = Verifier(target)
    limit = target.model.config.max_position_embeddings
    with pytest.raises(InvalidRequest, match=f"at most {limit}.*max_position_embeddings") as exc:
        v.open((b"e", 1), P.Open(1, [5] * (limit + 1)))
    assert exc.value.code == ErrorCode.BAD_REQUEST and not v.sessions


def test_draft_is_verified_up_to_the_context_limit(tiny_runners):
    target, _ = tiny_runners
    v = Verifier(target)
    limit = target.model.config.max_position_embeddings
    ids = [5] * (limit - 2)
    v.open((b"e", 1), P.Open(1, ids))
    verdict = v.verify([((b"e", 1), P.Verify(1, 1, len(ids), [], [7, 7, 7, 7]))])[0]
    assert isinstance(verdict, P.Verdict) and verdict.n_accepted <= 2  # positions limit-2 .. limit-1 only
    pos = len(ids) + verdict.n_accepted + 1
    while pos <= limit:
        verdict = v.verify([((b"e", 1), P.Verify(1, pos, pos, [], [7]))])[0]
        pos += verdict.n_accepted + 1
    error = v.verify([((b"e", 1), P.Verify(1, pos, pos, [], [7]))])[0]
    assert error.code == ErrorCode.CONTEXT_FULL and f"context of {limit}" in error.message


def test_admission_by_memory_and_eviction_of_idle_sessions(tiny_runners):
    target, _ = tiny_runners
    now = [0.0]
    per_token = KVShape.of(target.model.config, torch.float32).bytes_per_token
    v = Verifier(target, VerifierConfig(max_cache_bytes=256 * per_token, evict_idle_s=10.0, client_kv_share=1.0),
                 clock=lambda: now[0])
    v.open((b"e", 1), P.Open(1, [5] * 100))        # 100 + headroom -> 192 of 256 slots
    assert v.kv_free_tokens == 64
    with pytest.raises(KVFull, match="KV memory is full"):
        v.open((b"e", 2), P.Open(2, [5] * 20))     # needs 96: session 1 is not idle
    now[0] = 11.0                                   # session 1 silent for 11 s: it may go
    v.open((b"e", 2), P.Open(2, [5] * 20))
    assert list(v.sessions) == [(b"e", 2)] and v.stats["evictions"] == 1
    with pytest.raises(InvalidRequest, match="KV store holds"):
        v.open((b"e", 3), P.Open(3, [5] * 300))     # could never fit


def test_long_prompts_are_prefilled_in_chunks_beside_other_sessions(tiny_runners):
    target, _ = tiny_runners
    v = Verifier(target)
    chunks = ChunkedPrefill(v, 16)
    long_ids, short_ids = [5 + i % 50 for i in range(70)], [5, 6, 7]
    v.open((b"e", 1), P.Open(1, long_ids))
    v.open((b"e", 2), P.Open(2, short_ids))
    assert not chunks.ready((b"e", 1)) and chunks.ready((b"e", 2)) and chunks.pending
    steps = 0
    while not chunks.ready((b"e", 1)):
        verdict = v.verify([((b"e", 2), P.Verify(2, steps + 1, len(short_ids), [], []))], chunks.rows())[0]
        short_ids.append(verdict.next_token)
        steps += 1
    assert steps == 4 and v.stats["prefill_tokens"] == 4 * 16  # 70 tokens: 54 left over 16 -> ready
    verdict = v.verify([((b"e", 1), P.Verify(1, 1, len(long_ids), [], []))])[0]
    assert verdict.next_token == hf_logits(target, long_ids)[-1].argmax().item()


def test_deterministic_output_survives_a_failover_at_any_verify(tiny_runners):
    """A worker lost at any VERIFY: the edge re-OPENs on a fresh worker, which re-prefills the whole history in
    8-token chunks (the original computed it step by step). With deterministic numerics the seeded output is
    the same as without the failure, and so is every cached key and value, bit for bit."""
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    ids = target.tokenizer("def add(a, b):\n").input_ids
    config = SessionConfig(max_new_tokens=20, params=SamplingParams(0.8), seed=5)
    key = (b"e", 1)

    def fresh_worker(session: EdgeSession) -> Verifier:
        verifier = Verifier(target, VerifierConfig(deterministic=True))
        verifier.open(key, session.open_message())
        chunks = ChunkedPrefill(verifier, 8)
        while not chunks.ready(key):
            verifier.verify([], chunks.rows())
        return verifier

    def run(fail_at: int | None) -> tuple[list[int], torch.Tensor]:
        session = EdgeSession(list(ids), config, drafter)
        verifier = fresh_worker(session)
        for step in range(1, 200):
            if session.done:
                span = verifier.store.span(key)
                return session.generated, span.kv[:, :, :, :span.length].clone()
            req = next_request(session)
            if step == fail_at and isinstance(req, P.Verify):
                with pytest.raises(RequestError):
                    session.apply(P.Error(1, req.seq, ErrorCode.WORKER_LOST, "lost"))
                verifier = fresh_worker(session)
                continue
            session.apply(verifier.verify([(key, req)])[0] if isinstance(req, P.Verify) else verifier.resample(key, req))
        raise AssertionError("the session did not finish")

    reference, kv = run(None)
    assert len(reference) == 20
    for fail_at in (2, 4, 7, 10):
        out, kv_after = run(fail_at)
        assert out == reference, fail_at
        assert torch.equal(kv_after, kv), fail_at


def test_fast_attention_never_reads_a_span_past_its_length(tiny_runners):
    """The verifier skips zeroing new spans in the fast numerics (a memset per OPEN on the event loop): sound only
    if fast attention reads nothing past a span's length. Slots full of NaN (what a reused span may hold, at
    worst) must leave every logit equal to Hugging Face's."""
    target = tiny_runners[0]
    install(target.model)
    store = KVStore(KVShape.of(target.model.config, torch.float32), capacity_tokens=256, block=32)
    store.zero_reserved = False
    store.data.fill_(float("nan"))
    gen = torch.Generator().manual_seed(3)
    seqs = {k: torch.randint(1, target.vocab_size, (n,), generator=gen).tolist() for k, n in enumerate((9, 30))}
    for k in seqs:
        store.reserve(k, 8)
    done = {k: 0 for k in seqs}
    for step in range(4):
        rows = [Row(k, ids[done[k]:done[k] + 7], keep=len(ids[done[k]:done[k] + 7])) for k, ids in seqs.items()
                if done[k] < len(ids)]
        for row, logits in zip(rows, forward_packed(target.model, store, rows)):
            ref = hf_logits(target, seqs[row.key][:done[row.key] + len(row.ids)])[-len(row.ids):]
            assert torch.allclose(logits, ref, atol=1e-4)
            done[row.key] += max(1, len(row.ids) - 2)  # roll back two: their slots are rewritten next step
            store.truncate(row.key, done[row.key])
