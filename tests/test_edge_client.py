"""The edge worker and the client over real sockets on 127.0.0.1 random ports.

The test plays "broker + cloud" itself: a ROUTER the edge's DEALER connects to, answering with a real
`Verifier` over the tiny target model, so the whole edge path runs with real models and real sockets.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq
import zmq.asyncio

from specrelay import Client
from specrelay.cloud_worker.verifier import Verifier
from specrelay.common import protocol as P
from specrelay.common.errors import GenerationTimeout, InvalidRequest, RequestError
from specrelay.common.sampling import SamplingParams
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.common.errors import ErrorCode
from specrelay.edge_worker.server import serve
from specrelay.edge_worker.server import EdgeConfig, EdgeWorker
from specrelay.edge_worker.session import SessionConfig
from specrelay.edge_worker.http.textstream import TextStream
from specrelay.speculative import speculative_generate

pytestmark = pytest.mark.timeout(60)

ANY_PORT = "tcp://127.0.0.1:0"
PROMPTS = ["def add(a, b):\n", "class Point:\n", "for i in", "    self.x = x\n"]
N_NEW = 24
STATS = {"generated_tokens", "draft_tokens", "accepted_tokens", "cloud_calls", "uplink_bytes", "downlink_bytes",
         "wall_s"}


class FakeCloud:
    """Broker + cloud worker in one ROUTER: OPEN/VERIFY/RESAMPLE/CLOSE answered by a real Verifier.

    faults: {n: code} makes the n-th VERIFY (1-based) drop its session first; UNKNOWN_SESSION then comes from
    the Verifier itself, any other code is answered directly. silent: receive and never answer."""

    def __init__(self, ctx: zmq.asyncio.Context, runner) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(ANY_PORT)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.verifier = Verifier(runner)
        self.seen: list[tuple[str, int]] = []     # (message type, session) of every request
        self.opens: dict[int, list[list[int]]] = {}
        self.closed: dict[int, int] = {}          # session -> tokens the cloud held when CLOSE came
        self.faults: dict[int, ErrorCode] = {}
        self.silent = False
        self.delay = 0.0                          # seconds before answering each VERIFY
        self.slow: dict[int, float] = {}          # {n: seconds} for the n-th VERIFY only
        self.verifies = 0
        self.heartbeats = 0

    async def run(self) -> None:
        while True:
            edge, *frames = await self.sock.recv_multipart()
            msg = P.decode(frames)
            if isinstance(msg, P.Heartbeat):  # the edge's liveness signal to its broker
                self.heartbeats += 1
                continue
            reply = await self.handle(msg, edge)
            if reply is not None:
                await self.sock.send_multipart([edge, *P.encode(reply)])

    async def handle(self, msg: P.Base, edge: bytes) -> P.Base | None:
        self.seen.append((type(msg).__name__, msg.session))
        key = (edge, msg.session)
        if self.silent:
            return None
        try:
            if isinstance(msg, P.Open):
                self.opens.setdefault(msg.session, []).append(list(msg.tokens))
                self.verifier.open(key, msg)
            elif isinstance(msg, P.Close):
                held = self.verifier.sessions.get(key)
                self.closed[msg.session] = len(held.tokens) if held else -1
                self.verifier.close(key)
            elif isinstance(msg, P.Verify):
                return await self._verify(key, msg)
            elif isinstance(msg, P.Resample):
                return self.verifier.resample(key, msg)
        except RequestError as exc:
            return P.Error(msg.session, getattr(msg, "seq", 0), exc.code, str(exc))
        return None

    async def _verify(self, key, msg: P.Verify) -> P.Base:
        self.verifies += 1
        await asyncio.sleep(self.slow.pop(self.verifies, self.delay))
        code = self.faults.pop(self.verifies, None)
        if code is not None:
            self.verifier.close(key)  # the worker lost the session
            if code != ErrorCode.UNKNOWN_SESSION:
                return P.Error(msg.session, msg.seq, code, "injected fault")
        return self.verifier.verify([(key, msg)])[0]

    def types(self, session: int) -> list[str]:
        return [t for t, s in self.seen if s == session]


@pytest.fixture
async def cloud(zctx, tiny_runners):
    fake = FakeCloud(zctx, tiny_runners[0])
    task = asyncio.create_task(fake.run())
    yield fake
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    fake.sock.close(linger=0)


@pytest.fixture
def drafter(tiny_runners):
    target, draft = tiny_runners
    return Drafter(draft, target.vocab_size)


def edge_worker(zctx, cloud, drafter, tokenizer, **config) -> EdgeWorker:
    config = {"listen": ANY_PORT, "request_timeout_s": 10.0, "linger_ms": 0} | config
    return EdgeWorker(cloud.endpoint, drafter, tokenizer, EdgeConfig(**config), context=zctx)


@pytest.fixture
async def edge(zctx, cloud, drafter, tiny_runners):
    async with edge_worker(zctx, cloud, drafter, tiny_runners[0].tokenizer) as running:
        yield running


@pytest.fixture(scope="module")
def greedy_refs(tiny_runners):
    """prompt -> (prompt ids, target-alone greedy continuation)."""
    target = tiny_runners[0]
    refs = {}
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt).input_ids
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False)
        refs[prompt] = (ids, out[0, len(ids):].tolist())
    return refs


async def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------------------------------- EdgeWorker


async def test_greedy_concurrent_sessions_equal_target(edge, cloud, greedy_refs):
    chunks: dict[str, list[list[int]]] = {p: [] for p in PROMPTS}

    async def run(prompt: str):
        ids, _ = greedy_refs[prompt]
        return await edge.generate(ids, SessionConfig(max_new_tokens=N_NEW), chunks[prompt].append)

    results = await asyncio.gather(*(run(p) for p in PROMPTS))
    for prompt, (out, stats) in zip(PROMPTS, results):
        assert out == greedy_refs[prompt][1], prompt
        assert [t for c in chunks[prompt] for t in c] == out  # every committed token once, in order
        assert STATS <= stats.keys() and stats["generated_tokens"] == len(out)
        assert stats["uplink_bytes"] > 0 and stats["downlink_bytes"] > 0 and stats["cloud_calls"] >= 1
    await wait_until(lambda: len(cloud.closed) == len(PROMPTS))
    assert not edge._routes


@pytest.mark.parametrize("mode,resample", [("sample", "hr"), ("sample", "srdv"), ("sample", "full"),
                                           ("coupled", "hr")])
async def test_sampled_equals_in_process(edge, cloud, drafter, tiny_runners, mode, resample):
    target = tiny_runners[0]
    ids = target.tokenizer("class Point:\n").input_ids
    # a fixed draft length: with `auto` the block boundaries follow measured timings, and a SAMPLE-mode draw
    # depends on where a block ends (exact in law, not run to run; coupled mode is drafter-invariant)
    configs = [SessionConfig(max_new_tokens=20, params=SamplingParams(1.0, top_p=0.95), mode=mode, seed=seed,
                             resample=resample, draft_len=3) for seed in (0, 3, 6)]
    results = await asyncio.gather(*(edge.generate(ids, c) for c in configs))
    for config, (out, stats) in zip(configs, results):
        ref, ref_stats = speculative_generate(drafter, Verifier(target), ids, config)
        assert out == ref, config
        assert stats["resample_calls"] == ref_stats["resample_calls"]
    if resample == "srdv":  # seeds 0 and 6 need a second SR-DV round: RESAMPLE travels over the socket
        assert any(t == "Resample" for t, _ in cloud.seen)


@pytest.mark.parametrize("code", [ErrorCode.UNKNOWN_SESSION, ErrorCode.WORKER_LOST, ErrorCode.INTERNAL])
async def test_lost_session_reopens_with_full_history(zctx, cloud, drafter, tiny_runners, greedy_refs, code):
    ids, ref = greedy_refs[PROMPTS[0]]
    cloud.faults = {3: code}
    async with edge_worker(zctx, cloud, drafter, tiny_runners[0].tokenizer, retry_backoff_s=0.01) as edge:
        out, stats = await edge.generate(ids, SessionConfig(max_new_tokens=N_NEW, draft_len=2))
    assert out == ref
    assert stats["retries"] == 1
    (sid, opens), = cloud.opens.items()
    assert len(opens) == 2 and opens[0] == ids
    reopened = opens[1]
    assert len(reopened) > len(ids) and reopened == ids + ref[:len(reopened) - len(ids)]


async def test_late_verdict_is_dropped_after_a_retry(zctx, cloud, drafter, tiny_runners, greedy_refs):
    ids, ref = greedy_refs[PROMPTS[1]]
    cloud.slow = {2: 0.4}  # answered after the edge gave up on it and re-OPENed
    async with edge_worker(zctx, cloud, drafter, tiny_runners[0].tokenizer, request_timeout_s=0.2,
                           retry_backoff_s=0.01) as edge:
        chunks = []
        out, stats = await edge.generate(ids, SessionConfig(max_new_tokens=N_NEW, draft_len=3), chunks.extend)
    assert out == ref and chunks == ref  # nothing lost, nothing committed twice
    assert stats["retries"] == 1


async def test_silent_cloud_times_out(zctx, cloud, drafter, tiny_runners, greedy_refs):
    cloud.silent = True
    ids, _ = greedy_refs[PROMPTS[0]]
    async with edge_worker(zctx, cloud, drafter, tiny_runners[0].tokenizer, request_timeout_s=0.2,
                           retry_budget_s=0.3, retry_backoff_s=0.01) as edge:
        t0 = time.monotonic()
        with pytest.raises(GenerationTimeout, match="no reply from the cloud"):
            await edge.generate(ids, SessionConfig(max_new_tokens=8))
        assert time.monotonic() - t0 < 2.0
        async with Client(edge.endpoint, context=zctx) as client:  # the edge relays it as ERROR TIMEOUT
            with pytest.raises(GenerationTimeout):
                await client.generate("def add", max_new_tokens=8)
    (sid,) = {s for _, s in cloud.seen[:1]}
    assert cloud.types(sid)[:3] == ["Open", "Verify", "Open"]  # re-OPEN before the retry
    assert cloud.types(sid)[-1] == "Close"


# ---------------------------------------------------------------------------------------- Client


async def test_client_greedy_concurrent_over_tcp(zctx, edge, greedy_refs, tiny_runners):
    tokenizer = tiny_runners[0].tokenizer
    async with Client(edge.endpoint, context=zctx) as client:
        results = await asyncio.gather(*(client.generate(p, max_new_tokens=N_NEW) for p in PROMPTS))
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == greedy_refs[prompt][1], prompt
        assert result.text == tokenizer.decode(result.token_ids)
        assert STATS <= result.stats.keys()


async def test_client_objective_reaches_the_edge(zctx, edge, greedy_refs, monkeypatch):
    """`objective=` (like the HTTP field and --objective) picks what auto optimises for this request; None
    leaves the edge's default; a wrong name fails here, naming the field. The output never depends on it."""
    seen, generate = [], edge.generate

    async def spy(ids, config, on_tokens=None):
        seen.append(config.objective)
        return await generate(ids, config, on_tokens)

    monkeypatch.setattr(edge, "generate", spy)
    prompt = PROMPTS[0]
    async with Client(edge.endpoint, context=zctx) as client:
        for objective in ("speed", "cloud", None):
            result = await client.generate(prompt, max_new_tokens=N_NEW, objective=objective)
            assert result.token_ids == greedy_refs[prompt][1]
        with pytest.raises(InvalidRequest) as err:
            await client.generate(prompt, objective="fastest")
    assert err.value.field == "objective"
    assert seen == [P.Objective.SPEED, P.Objective.CLOUD, edge.config.default_objective]


async def test_stream_pieces_concatenate_to_text(zctx, edge, tiny_runners):
    tokenizer = tiny_runners[0].tokenizer
    options = dict(max_new_tokens=40, temperature=1.5, seed=5, draft_len=2)  # fixed: see test_sampled_equals_in_process
    async with Client(edge.endpoint, context=zctx) as client:
        pieces = [piece async for piece in client.stream("for i in", **options)]
        result = await client.generate("for i in", **options)
    assert "".join(pieces) == result.text == tokenizer.decode(result.token_ids)
    assert len(pieces) > 1


async def test_leaving_a_stream_cancels_and_closes_the_session(zctx, edge, cloud):
    cloud.delay = 0.01
    async with Client(edge.endpoint, context=zctx) as client:
        async for _ in client.stream("class Point:\n", max_new_tokens=300, temperature=1.0, draft_len=1):
            break
        await wait_until(lambda: cloud.closed)
        (sid, held), = cloud.closed.items()
        assert held < len(cloud.opens[sid][0]) + 300  # closed early: the generation was cancelled
        await wait_until(lambda: not edge.frontend._requests)


async def test_cancelling_generate_sends_cancel(zctx, edge, cloud):
    cloud.delay = 0.01
    async with Client(edge.endpoint, context=zctx) as client:
        task = asyncio.create_task(client.generate("def add", max_new_tokens=300, temperature=1.0, draft_len=1))
        await wait_until(lambda: cloud.verifies >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: cloud.closed)
        await wait_until(lambda: not edge.frontend._requests)


async def test_errors_reach_the_client(zctx, edge):
    async with Client(edge.endpoint, context=zctx) as client:
        with pytest.raises(InvalidRequest, match="mode"):  # refused by the edge, sent back as ERROR
            await client.generate("def add", mode="coupled")
        with pytest.raises(InvalidRequest, match="max_new_tokens"):  # refused before sending
            await client.generate("def add", max_new_tokens=0)
        result = await client.generate("def add", max_new_tokens=4)  # the client still works
        assert len(result.token_ids) <= 4


async def test_client_timeout_when_nobody_answers(zctx):
    async with Client("tcp://127.0.0.1:9", timeout=0.2, context=zctx) as client:
        t0 = time.monotonic()
        with pytest.raises(GenerationTimeout, match="within 0.2 s"):
            await client.generate("def add")
        assert time.monotonic() - t0 < 1.0


async def test_local_client_embeds_the_edge(zctx, cloud, tiny_pair, greedy_refs):
    _, draft_dir = tiny_pair
    async with Client.local(broker=cloud.endpoint, draft_model=str(draft_dir), context=zctx) as client:
        results = await asyncio.gather(*(client.generate(p, max_new_tokens=N_NEW) for p in PROMPTS[:2]))
        pieces = [piece async for piece in client.stream(PROMPTS[0], max_new_tokens=N_NEW)]
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == greedy_refs[prompt][1]
    assert "".join(pieces) == results[0].text


async def test_serve_entry_point(zctx, cloud, tiny_pair, tmp_path, greedy_refs):
    """What `specrelay edge-worker --broker ... --draft-model ... --listen ipc://...` runs."""
    endpoint = f"ipc://{tmp_path}/edge.sock"
    server = asyncio.create_task(serve(cloud.endpoint, str(tiny_pair[1]), endpoint))
    try:
        async with Client(endpoint, timeout=20, context=zctx) as client:
            result = await client.generate(PROMPTS[2], max_new_tokens=N_NEW)
        assert result.token_ids == greedy_refs[PROMPTS[2]][1]
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


# ---------------------------------------------------------------------------------------- text pieces


def test_text_stream_holds_back_split_characters(tiny_runners):
    tokenizer = tiny_runners[0].tokenizer
    text = "héllo 🙂 wörld ✓\n"
    ids = tokenizer(text).input_ids
    stream = TextStream(tokenizer)
    pieces = [stream.push([t]) for t in ids] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert len(ids) > len(text.encode()) // 2  # multi-byte characters really were split across tokens
