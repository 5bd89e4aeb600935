"""A hostile edge against one cloud worker (issue 18, items 6 and 7): RESAMPLE floods, out-of-order and
out-of-range RESAMPLEs, and OPEN + CLOSE pairs with fresh shared_vocab bitmaps. Real sockets (the test plays
the broker, tests/test_cloud_worker.FakeBroker) and the pure rules of common/resample.Pending."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specrelay.cloud_worker.config import VerifierConfig
from specrelay.cloud_worker.verifier import Verifier
from specrelay.common import protocol as P
from specrelay.common.errors import ErrorCode, InvalidRequest
from specrelay.common.packing import f32
from specrelay.common.protocol import Mode, ResampleKind, Strategy
from specrelay.common.resample import SRDV_MAX_ROUNDS, Pending, serve_resample
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.edge_worker.session import EdgeSession, SessionConfig
from test_cloud_worker import (PROMPTS, FakeBroker, drive, fake_broker, http_get, ids_of,  # noqa: F401 fixtures
                               start_worker, target_continuation, wait_until)

pytestmark = pytest.mark.timeout(120)


def pending(p: torch.Tensor) -> Pending:
    return Pending(seq=3, position=10, p=p, rejected=0)


def test_each_resample_of_a_rejection_is_served_once_and_in_order():
    p = torch.softmax(torch.randn(50), 0)
    shared = torch.ones(50, dtype=torch.bool)
    shared[40:] = False
    rejection = pending(p)
    ask = lambda kind, r=0: serve_resample(P.Resample(1, 3, kind, r), rejection, shared, seed=7)  # noqa: E731
    with pytest.raises(InvalidRequest, match="round 5 out of order"):
        ask(ResampleKind.CANDIDATES, SRDV_MAX_ROUNDS - 1)  # the flood of item 6: the last round at once
    for r in range(1, SRDV_MAX_ROUNDS):
        assert ask(ResampleKind.CANDIDATES, r).candidates
        with pytest.raises(InvalidRequest, match="out of order"):
            ask(ResampleKind.CANDIDATES, r)  # a repeat is never served twice
    assert ask(ResampleKind.HR).p
    with pytest.raises(InvalidRequest, match="already sent"):
        ask(ResampleKind.HR)
    assert ask(ResampleKind.SERVER_ONLY).token >= 40
    with pytest.raises(InvalidRequest, match="already resolved"):
        ask(ResampleKind.SERVER_ONLY)


def test_server_only_without_target_only_mass_is_a_bad_request_not_an_index_error():
    p = torch.softmax(torch.randn(50), 0)
    with pytest.raises(InvalidRequest, match="no mass outside the shared vocabulary") as info:
        serve_resample(P.Resample(1, 3, ResampleKind.SERVER_ONLY), pending(p), torch.ones(50, dtype=torch.bool), 7)
    assert info.value.field == "kind"


def bitmap(vocab: int, seed: int) -> bytes:
    """A fresh shared_vocab bitmap: every token shared but one, chosen by `seed`."""
    bits = bytearray(b"\xff" * ((vocab + 7) // 8))
    bits[seed % len(bits)] &= ~(1 << (seed // len(bits)) % 8)
    return bytes(bits)


def test_bitmap_cache_is_bounded_and_sessions_keep_their_mask(tiny_runners):
    target, _ = tiny_runners
    verifier = Verifier(target)
    cap = verifier.bitmaps.entries
    v, ids = target.vocab_size, ids_of(target, PROMPTS[0])
    for n in range(200):  # OPEN + CLOSE pairs with fresh bitmaps (item 7): the cache stays at its cap
        key = (b"e", n)
        verifier.open(key, P.Open(n, ids, shared_vocab=bitmap(v, n)))
        verifier.close(key)
        assert len(verifier.bitmaps) <= cap
    shared = bitmap(v, 3)
    verifier.open((b"e", 1), P.Open(1, ids, shared_vocab=shared))
    mask = verifier.sessions[(b"e", 1)].shared
    for n in range(cap + 1):  # a flood pushes the entry out; the admitted session keeps its own mask
        verifier.open((b"x", n), P.Open(n, ids, shared_vocab=bitmap(v, 500 + n)))
    assert verifier.sessions[(b"e", 1)].shared is mask and bool(mask.all()) is False
    small = Verifier(target, VerifierConfig(max_cache_bytes=64 * target.kv_shape.bytes_per_token))
    with pytest.raises(InvalidRequest, match="KV store holds"):  # refused after the bitmap was parsed
        small.open((b"e", 9), P.Open(9, ids, shared_vocab=bitmap(v, 9)))
    assert len(small.bitmaps) <= 1


async def rejected_verdict(broker: FakeBroker, client: bytes, sid: int, ids: list[int]) -> P.Verdict:
    """A SAMPLE / srdv session whose VERIFY is rejected: a draft token x sent with q(x) = 1 is accepted only
    with probability p(x); OPEN again with the next seed until one is rejected."""
    for seed in range(50):
        await broker.send(client, P.Open(sid, ids, Mode.SAMPLE, 1.0, seed=seed, resample=Strategy.SRDV))
        await broker.send(client, P.Verify(sid, 1, len(ids), [], [7], f32(torch.ones(1))))
        verdict = await broker.reply(client)
        if verdict.next_token < 0:
            return verdict
    raise AssertionError("no rejection in 50 seeds")


async def test_a_resample_flood_is_refused_cheaply_while_heartbeats_health_and_greedy_keep_going(
        fake_broker, start_worker, tiny_runners):
    """Item 6 in small: thousands of RESAMPLE(CANDIDATES, last round) for one rejection. Each is answered with
    a counted ERROR (out of order, or too fast), the worker keeps beating and answering /healthz, a greedy
    session alongside equals the target's own generate, and the real round 1 is still served afterwards."""
    target, draft = tiny_runners
    broker = fake_broker()
    worker = await start_worker(broker, health_port=0)
    ids = ids_of(target, PROMPTS[1])
    await rejected_verdict(broker, b"bad", 5, ids)
    flood = P.encode(P.Resample(5, 1, ResampleKind.CANDIDATES, SRDV_MAX_ROUNDS - 1))
    beats_before, n = worker.stats["heartbeats_sent"], 3000

    async def attack() -> None:
        for i in range(n):
            await broker.send(b"bad", flood)
            if i % 500 == 0:
                await asyncio.sleep(0)

    async def legit() -> list[int]:
        session = EdgeSession(ids_of(target, PROMPTS[0]), SessionConfig(max_new_tokens=12, draft_len=3),
                              Drafter(draft), sid=1)
        return await drive(broker, b"good", session)

    attacker = asyncio.create_task(attack())
    out = await legit()
    status, _ = await http_get(worker.health_port, "/healthz")
    await attacker
    assert out == target_continuation(target, ids_of(target, PROMPTS[0]), len(out))
    assert status == 200
    errors = worker.stats["errors"]
    await wait_until(lambda: errors["BAD_REQUEST"] + errors["UNAVAILABLE"] == n, 60)  # every one refused, counted
    assert errors.get("INTERNAL", 0) == 0
    queue = broker.queue(b"bad")  # what reached the "edge" (a full socket may drop replies, never the worker)
    codes = {queue.get_nowait().code for _ in range(queue.qsize())}
    assert codes <= {ErrorCode.BAD_REQUEST, ErrorCode.UNAVAILABLE}, codes
    await wait_until(lambda: worker.stats["heartbeats_sent"] > beats_before)
    await asyncio.sleep(0.2)  # the session's RESAMPLE bucket refills (burst at 200/s)
    await broker.send(b"bad", P.Resample(5, 1, ResampleKind.CANDIDATES, 1))
    reply = await broker.reply(b"bad")
    while isinstance(reply, P.Error):  # a refusal of the flood still on its way
        reply = await broker.reply(b"bad")
    assert reply.candidates  # the honest next round still works


async def test_server_only_on_an_all_shared_session_gets_a_counted_bad_request(fake_broker, start_worker,
                                                                             tiny_runners):
    target, _ = tiny_runners
    broker = fake_broker()
    worker = await start_worker(broker)
    ids = ids_of(target, PROMPTS[2])
    shared = b"\xff" * ((target.vocab_size + 7) // 8)
    for seed in range(50):
        await broker.send(b"e", P.Open(3, ids, Mode.SAMPLE, 1.0, seed=seed, resample=Strategy.HR, shared_vocab=shared))
        await broker.send(b"e", P.Verify(3, 1, len(ids), [], [7], f32(torch.ones(1))))
        if (await broker.reply(b"e")).next_token < 0:
            break
    await broker.send(b"e", P.Resample(3, 1, ResampleKind.SERVER_ONLY))
    error = await broker.reply(b"e")
    assert (error.code, error.seq) == (ErrorCode.BAD_REQUEST, 1) and "no mass outside" in error.message
    assert worker.stats["errors"]["BAD_REQUEST"] == 1


def test_candidates_drawn_with_one_cumulative_sum_equal_one_draw_each():
    """SR-DV candidates: one cdf for a round's K draws (was K passes over p), token for token the same."""
    from specrelay.common.resample import _sample_many
    from specrelay.common.rng import Purpose, sample_index, uniforms

    p = torch.softmax(3 * torch.randn(5000, generator=torch.Generator().manual_seed(0)), 0).double()
    p[100:900] = 0  # zero runs: a draw that lands on their boundary steps back to mass
    u = uniforms(3, 7, Purpose.CANDIDATE, 252)
    assert _sample_many(p, u) == [sample_index(p, float(x)) for x in u]
