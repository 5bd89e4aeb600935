"""Pre-drafting, the load hint and the speculation metrics over real sockets: a Broker and a CloudWorker in this
process, an emulated 60 ms link (bench/link.Relay) in front of the broker, an EdgeWorker behind it.

The draft is a second copy of the tiny target, so drafts are accepted and the chain drafted while a VERIFY is in
flight gets reused; SAMPLE mode at a low temperature makes the draft's guess for the bonus token hit often.
In SAMPLE mode the drafted tokens decide the output, so a wrong reuse would change it: the outputs must equal
those without pre-drafting and the in-process reference.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
import torch

from specrelay.bench.link import LinkSpec, Relay
from specrelay.common import protocol as P
from specrelay.broker.server import Broker
from specrelay.cloud_worker.config import WorkerConfig
from specrelay.cloud_worker.server import CloudWorker
from specrelay.cloud_worker.verifier import Verifier
from specrelay.common.runner import ModelRunner
from specrelay.common.sampling import SamplingParams
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.edge_worker.server import EdgeHealth
from specrelay.edge_worker.server import EdgeConfig, EdgeWorker
from specrelay.edge_worker.policy import EdgeEstimates
from specrelay.edge_worker.session import EdgeSession, SessionConfig
from specrelay.speculative import next_request, speculative_generate

pytestmark = pytest.mark.timeout(120)

ANY_PORT = "tcp://127.0.0.1:0"
PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in"]


@pytest.fixture(scope="module")
def twin_drafter(tiny_pair):
    """A drafter holding its own copy of the tiny TARGET: every greedy draft is accepted."""
    target = ModelRunner.load(str(tiny_pair[0]))
    return Drafter(target, target.vocab_size)


@pytest.fixture
async def linked(zctx, tiny_runners):
    """(relay endpoint, cloud worker): broker + worker in-process, a 60 ms link in front of the broker (the
    edge pre-drafts while a VERIFY goes up the link: 30 ms here)."""
    async with Broker(ANY_PORT, ANY_PORT, context=zctx, linger_ms=0) as broker:
        config = WorkerConfig(max_wait_ms=1.0, linger_ms=0, health_port=0, heartbeat_interval=0.5)
        async with CloudWorker(broker.backend, tiny_runners[0], config, context=zctx) as worker:
            relay = await Relay(broker.frontend, LinkSpec(0.06)).start()
            try:
                yield relay.endpoint, worker
            finally:
                await relay.close()


def edge(zctx, endpoint: str, drafter, tokenizer, predraft: bool = True, **config) -> EdgeWorker:
    config = EdgeConfig(predraft=predraft, request_timeout_s=20.0, linger_ms=0, **config)
    return EdgeWorker(endpoint, drafter, tokenizer, config, context=zctx)


async def generate_all(worker: EdgeWorker, configs: list[SessionConfig]) -> list[tuple[list[int], dict]]:
    tok = worker.tokenizer
    return await asyncio.gather(*(worker.generate(tok(p).input_ids, c) for p, c in zip(PROMPTS, configs)))


def hf_greedy(runner: ModelRunner, prompt: str, n: int) -> list[int]:
    ids = runner.tokenizer(prompt).input_ids
    out = runner.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                pad_token_id=runner.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


async def test_greedy_with_predrafting_equals_hf_and_reuses_drafts(zctx, linked, twin_drafter, tiny_runners):
    endpoint, _ = linked
    target = tiny_runners[0]
    async with edge(zctx, endpoint, twin_drafter, target.tokenizer) as running:
        # a fixed length: with a draft the target always accepts, auto drafts the whole generation in one or two
        # blocks (the draft costs what the target does: long blocks), leaving no next block to pre-draft
        results = await generate_all(running, [SessionConfig(max_new_tokens=48, draft_len=4)] * len(PROMPTS))
    for prompt, (out, stats) in zip(PROMPTS, results):
        assert out == hf_greedy(target, prompt, 48), prompt
    assert sum(s["predraft_tokens"] for _, s in results) > 0  # the chain was reused
    # the hit rate's two counters count over the same chain rounds: a hit is a try whose pre-draft was used
    assert sum(s["predraft_tries"] for _, s in results) > 0
    assert sum(s["predraft_rounds"] for _, s in results) > 0
    assert all(s["predraft_rounds"] <= s["predraft_tries"] < s["cloud_calls"] for _, s in results), \
        [(s["predraft_rounds"], s["predraft_tries"], s["cloud_calls"]) for _, s in results]


async def test_seeded_sampling_identical_with_and_without_predrafting(zctx, linked, twin_drafter, tiny_runners):
    endpoint, _ = linked
    target = tiny_runners[0]
    configs = [SessionConfig(max_new_tokens=24, params=SamplingParams(0.2), seed=seed, draft_len=3)
               for seed in (1, 2, 3)]
    runs = {}
    for predraft in (True, False):
        async with edge(zctx, endpoint, twin_drafter, target.tokenizer, predraft=predraft) as running:
            runs[predraft] = await generate_all(running, configs)
    assert [out for out, _ in runs[True]] == [out for out, _ in runs[False]]
    assert sum(s["predraft_tokens"] for _, s in runs[True]) > 0
    assert sum(s["predraft_tokens"] for _, s in runs[False]) == 0
    assert all(s["predraft_rounds"] <= s["predraft_tries"] for _, s in runs[True])
    assert sum(s["predraft_tries"] + s["predraft_rounds"] for _, s in runs[False]) == 0  # no pre-draft, no try
    for prompt, config, (out, _) in zip(PROMPTS, configs, runs[True]):
        ids = target.tokenizer(prompt).input_ids
        assert out == speculative_generate(twin_drafter, Verifier(target), ids, config)[0]


async def test_sampling_with_a_different_draft_identical_with_and_without_predrafting(zctx, linked, tiny_runners):
    endpoint, _ = linked
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    configs = [SessionConfig(max_new_tokens=20, params=SamplingParams(1.0), seed=seed, draft_len=2)
               for seed in (4, 5, 6)]
    outs = []
    for predraft in (True, False):
        async with edge(zctx, endpoint, drafter, target.tokenizer, predraft=predraft) as running:
            outs.append([out for out, _ in await generate_all(running, configs)])
    assert outs[0] == outs[1]


def metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


async def test_speculation_metrics_and_load_hints(zctx, linked, twin_drafter, tiny_runners):
    endpoint, worker = linked
    # the worker's own measure of a verified token is timer noise on a tiny model (0 on a busy machine): a known
    # value shows that the hint carries it and the edge's cost line takes it as its slope
    worker.verifier.token_us = 4321
    worker.verifier.curve_us = [1000, 2000, 2500, 4000]  # and of a VERIFY at each of P.CURVE_WIDTHS tokens
    async with (edge(zctx, endpoint, twin_drafter, tiny_runners[0].tokenizer) as running,
                EdgeHealth(running, None, "127.0.0.1", 0) as health):
        results = await generate_all(running, [SessionConfig(max_new_tokens=16, draft_len=3)] * len(PROMPTS))
        text = await asyncio.to_thread(metrics, health.port)
        ready = await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{health.port}/readyz")
        assert ready.status == 200
        # VERDICTs carried the worker's load hint, with its measure of a verified token
        assert running.estimates.cloud.slope == 4321e-6
        assert running.estimates.curve == pytest.approx([1e-3, 2e-3, 2.5e-3, 4e-3])
        assert running.estimates.draft.known and running.estimates.step() > 0  # the draft thread was timed
        assert running.estimates.handled[1].count and running.estimates.handled[1].value > 0  # and the edge's own time
    drafts = sum(s["cloud_calls"] for _, s in results)
    accepted = sum(s["accepted_tokens"] for _, s in results)
    assert f"specrelay_edge_spec_decode_num_drafts_total {float(drafts)}" in text
    assert f"specrelay_edge_spec_decode_num_accepted_tokens_total {float(accepted)}" in text
    assert 'specrelay_edge_spec_decode_num_accepted_tokens_per_pos_total{position="2"}' in text
    assert "specrelay_edge_verify_latency_seconds_bucket" in text and "specrelay_edge_sessions_open 0.0" in text
    cloud = await asyncio.to_thread(metrics, worker.health_port)
    assert f"specrelay_cloud_spec_decode_num_accepted_tokens_total {float(accepted)}" in cloud
    assert "specrelay_cloud_forward_seconds_count" in cloud


@pytest.mark.parametrize("hit", [True, False])
def test_exploring_at_d_0_samples_by_the_pre_drafts_guess_off_the_critical_path(tiny_runners, hit):
    """Where drafting does not pay, an acceptance sample is due once in a while: a greedy session that pre-drafts
    then verifies a row of 1 and, while its VERDICT is awaited, pre-drafts one token (the draft's guess at the next
    token, after catching up on what it had not seen); the VERDICT's token scores the guess (position 0). The draft
    caught up, the next round drafts, and its wait is timed as a clean round's (at d = 0 nothing else times one).
    A guess that missed is rolled back and the draft realigns first: that round is a catch-up, not timed (across
    vocabularies such rounds ran 1.7 more draft forwards than their tokens: timed, they lift the cost lines)."""
    target, draft = tiny_runners
    est = EdgeEstimates(predraft=True)
    est.observe_draft(1, [(1, 0.010)])  # the draft is timed: a pre-draft may run
    for _ in range(50):
        est.acceptance.observe(4, 0)  # drafts are rejected: the session verifies rows of 1
    drafter = Drafter(draft, target.vocab_size)
    session = EdgeSession(target.tokenizer("def add(a, b):").input_ids, SessionConfig(max_new_tokens=16), drafter,
                          estimates=est)
    first = next_request(session)
    session.apply(P.Verdict(session.sid, first.seq, 0, 5))  # the opening: no sample
    session.policy.idle = 10**6  # its rounds at d = 0 since its last sample: exploring is due
    request = next_request(session)
    assert request.draft == [] and session.policy.guessing and not session.policy.exploring
    job = session.predraft_job()
    assert job is not None and job.d == 1 and not session.policy.guessing
    (guess,) = drafter.draft_batch([job])
    session.take_predraft(guess)
    reached, accepted = sum(est.acceptance.reached), est.acceptance.accepted[0]
    token = guess.ids[0] if hit else (guess.ids[0] + 1) % target.vocab_size
    session.apply(P.Verdict(session.sid, request.seq, 0, token))
    assert sum(est.acceptance.reached) == pytest.approx(reached * 0.995 + 1)
    assert est.acceptance.accepted[0] == pytest.approx(accepted * 0.995 + hit)
    assert session.policy.idle == 0
    # a guess that hit caught the draft up: the next round drafts (once), a clean round whose wait the draft line
    # learns; one that missed: the same round, a catch-up
    after = next_request(session)
    assert after.draft and session.policy.timing == 2 and session._catchup == (not hit)
    waited = est.waited.count
    session.record_timing(0.01, 0.02)
    assert est.waited.count == waited + hit and session.policy.timing == 0
    sampled = EdgeSession([1, 2, 3], SessionConfig(max_new_tokens=16, mode="sample", seed=1,
                                                     params=SamplingParams(1.0)), drafter, estimates=est)
    assert not sampled.policy.guesses  # in sample mode the bonus is drawn from p: a match is no acceptance
