"""The edge's draft K/V (edge_worker/draft/kv.py): a lockstep batch gathers its rows' pasts once and the model
writes each step in place; rows roll back, leave the batch and come back in other batches. Every draft must
be what the draft model drafts for that context alone (common.runner.Decoder: one sequence, HF's own cache)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from specrelay.common.protocol import Mode
from specrelay.common.runner import Decoder
from specrelay.common.sampling import SamplingParams
from specrelay.edge_worker.draft.kv import LockstepKV, SessionKV, Workspace
from specrelay.edge_worker.draft.drafter import DraftBlock, Drafter, DraftJob
from specrelay.edge_worker.draft.batcher import _rows_per_forward


def alone(runner, context: list[int], d: int) -> list[int]:
    """The draft model's greedy continuation of `context`, one sequence at a time."""
    decoder, ctx, out = Decoder(runner), list(context), []
    for _ in range(d):
        out.append(int(decoder.next_logits(ctx).argmax()))
        ctx.append(out[-1])
    return out


def test_lockstep_drafts_equal_each_context_drafted_alone(tiny_runners):
    """16 sessions over 12 rounds: each round a changing subset drafts a different length, then keeps a random
    prefix of its draft plus one other token (a rejection), so caches roll back, rows leave and rejoin."""
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    rng = random.Random(3)
    texts = ["def add(a, b):\n", "class Point:\n", "for i in", "    return a + b\n"]
    contexts = [draft.tokenizer(texts[i % 4] * (1 + i % 3)).input_ids for i in range(16)]
    states = [drafter.new_state(c) for c in contexts]
    drafted = 0
    for rnd in range(12):
        members = sorted(rng.sample(range(16), rng.randint(1, 16)))
        jobs = [DraftJob(states[i], contexts[i], len(contexts[i]), rng.choice([1, 2, 4, 7]) - (i % 2),
                         Mode.GREEDY, SamplingParams(), 0) for i in members]
        for i, job, block in zip(members, jobs, drafter.draft_batch(jobs)):
            assert block.ids == alone(draft, contexts[i], job.d), (rnd, i)
            drafted += len(block.ids)
            keep = rng.randint(0, len(block.ids))
            contexts[i] += block.ids[:keep] + [rng.randrange(1, draft.vocab_size)]
    assert drafted > 200
    for state in states:  # the cache holds exactly the ids it says it holds
        assert state.kv.length == len(state.ids) > 0


def test_a_job_is_handed_over_when_it_leaves_the_batch(tiny_runners):
    """`ready(index, block)` hands each block over as soon as its job stops drafting, with the forwards its
    session waited for; the blocks are those of a batch without it, and the states stay consistent."""
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    contexts = [draft.tokenizer(t).input_ids for t in ("def add(a, b):\n", "class Point:\n", "for i in")]
    lengths = [1, 6, 3]
    states = [drafter.new_state(c) for c in contexts]
    forwards = []
    real = draft.model.forward

    def counting(*args, **kwargs):
        forwards.append(1)
        return real(*args, **kwargs)

    draft.model.forward = counting
    try:
        handed = []
        jobs = [DraftJob(s, c, len(c), d, Mode.GREEDY, SamplingParams(), 0)
                for s, c, d in zip(states, contexts, lengths)]
        blocks = drafter.draft_batch(jobs, lambda i, block: handed.append((i, block, len(forwards))))
    finally:
        draft.model.forward = real
    assert [i for i, _, _ in handed] == [0, 2, 1]  # in the order they finished, the longest last
    for i, block, at in handed:
        assert block is blocks[i] and block.ids == alone(draft, contexts[i], lengths[i])
        assert block.steps == at == lengths[i]  # it waited for its own forwards only
    for state, context, block in zip(states, contexts, blocks):
        assert state.kv.length == len(state.ids) and state.ids[:len(context)] == context


def test_a_batch_that_fails_half_way_starts_its_sessions_over(tiny_runners, monkeypatch):
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    contexts = [draft.tokenizer(t).input_ids for t in ("def add(a, b):\n", "class Point:\n")]
    states = [drafter.new_state(c) for c in contexts]

    def jobs() -> list[DraftJob]:
        return [DraftJob(s, c, len(c), 4, Mode.GREEDY, SamplingParams(), 0) for s, c in zip(states, contexts)]

    drafter.draft_batch(jobs())  # the states now hold K/V
    real, calls = draft.model.forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(draft.model, "forward", flaky)
    contexts = [c + [5, 6] for c in contexts]
    with pytest.raises(RuntimeError, match="out of memory"):
        drafter.draft_batch(jobs())
    assert all(s.ids == [] and s.kv.length == 0 for s in states)
    blocks = drafter.draft_batch(jobs())
    assert [b.ids for b in blocks] == [alone(draft, c, 4) for c in contexts]


def test_a_batch_longer_than_it_reserved_grows_its_buffer(tiny_runners):
    """A cross-vocabulary draft may run more steps than d: the batch buffer grows and nothing is lost."""
    _, draft = tiny_runners
    contexts = [draft.tokenizer(t).input_ids for t in ("def add(a, b):\n", "for i in range(10):\n")]
    sessions = [SessionKV(), SessionKV()]
    batch = LockstepKV(draft, Workspace())
    lengths, feeds = [0, 0], [list(c) for c in contexts]
    with torch.no_grad():
        for _ in range(12):  # room=0: every step past the first needs more columns
            logits = batch.feed([0, 1], sessions, lengths, feeds, room=0)
            nxt = [int(logits[i, len(f) - 1].argmax()) for i, f in enumerate(feeds)]
            for i in range(2):
                lengths[i] += len(feeds[i])
                contexts[i].append(nxt[i])
            feeds = [[x] for x in nxt]
    batch.close()
    for i, ctx in enumerate(contexts):
        start = len(ctx) - 12
        assert ctx[start:] == alone(draft, ctx[:start], 12)
        assert sessions[i].length == len(ctx) - 1  # everything fed is back in the session's buffer


def test_edges_sharing_a_drafter_draft_in_parallel_threads(tiny_runners):
    """Two edges in one process may share a Drafter, each with its own draft thread: their batches must not
    share a buffer (each thread gets its own workspace)."""
    from concurrent.futures import ThreadPoolExecutor

    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    texts = ["def add(a, b):\n", "class Point:\n", "for i in range(10):\n", "    return a + b\n"]

    def edge(k: int) -> list[bool]:
        contexts = [draft.tokenizer(t * (k + 1)).input_ids for t in texts]
        states = [drafter.new_state(c) for c in contexts]
        ok = []
        for rnd in range(15):
            jobs = [DraftJob(s, c, len(c), 3 + k, Mode.GREEDY, SamplingParams(), 0) for s, c in zip(states, contexts)]
            for ctx, job, block in zip(contexts, jobs, drafter.draft_batch(jobs)):
                ok.append(block.ids == alone(draft, ctx, job.d))
                ctx += block.ids[:rnd % 3] + [7 + rnd]
        return ok

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(edge, [0, 1]))
    assert all(all(r) for r in results) and sum(map(len, results)) == 120


def test_jobs_that_join_a_batch_under_way_draft_what_they_would_alone(tiny_runners):
    """Jobs arriving while a chain batch drafts join it at its next step (`admit`): one with a longer past than
    the batch's columns (they shift right), one after a rejection (its cache rolls back first), one after every
    row the batch started with has left (its K/V are gathered again). Every block is the draft alone's, counts
    the forwards since it joined, and every cache holds exactly the ids it says."""
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    texts = ["def add(a, b):\n", "class Point:\n", "for i in range(10):\n" * 4, "x = 1\n", "import os\n" * 2]
    contexts = [draft.tokenizer(t).input_ids for t in texts]
    states = [drafter.new_state(c) for c in contexts]
    drafter.draft_batch([DraftJob(s, c, len(c), 2, Mode.GREEDY, SamplingParams(), 0)
                         for s, c in zip(states, contexts)])  # every state holds K/V, as a joiner's must
    contexts = [c + [17] if i != 3 else c + [23] for i, c in enumerate(contexts)]  # 3: its draft rejected
    lengths = [2, 4, 5, 3, 4]
    job = [DraftJob(s, c, len(c), d, Mode.GREEDY, SamplingParams(), 0) for s, c, d in zip(states, contexts, lengths)]
    joins = {1: [job[2]], 3: [job[3]], 5: [job[4]]}  # step -> jobs joining before it
    asked, handed = [], []

    def admit(rows: int) -> list[DraftJob]:
        asked.append(rows)
        return joins.get(len(asked) - 1, [])

    jobs, forwards = job[:2], []
    blocks = drafter.draft_batch(jobs, lambda i, b: handed.append(i), forwards, admit)
    assert jobs == job and len(blocks) == 5  # the joiners were appended, in order
    assert sorted(handed) == [0, 1, 2, 3, 4]
    for i, (context, d, block) in enumerate(zip(contexts, lengths, blocks)):
        assert block.ids == alone(draft, context, d), i
        assert block.steps == d, i  # the forwards since it joined
    for state, context in zip(states, contexts):
        assert state.kv.length == len(state.ids) and state.ids[:len(context)] == context
    assert asked[:2] == [2, 2] and asked[5] == 2  # rows at each step: job 4 joined once rows 0 and 1 had left
    rows = [asked[k] + len(joins.get(k, [])) for k in range(len(forwards))]  # each forward's rows, joiners in
    assert len(forwards) == len(asked) and _rows_per_forward(blocks, forwards) == sum(rows) / len(rows) < 3


def test_the_scheduler_lets_a_job_join_only_when_none_that_cannot_waits():
    from specrelay.edge_worker.scheduler import EdgeScheduler, Phase, SessionView

    def view(key, joinable=True, phase=Phase.READY):
        return SessionView(key, phase, joinable=joinable)

    scheduler = EdgeScheduler(max_batch=4)
    assert scheduler.join([view("a"), view("b"), view("c", phase=Phase.DONE)], running=1) == ["a", "b"]
    assert scheduler.join([view("a"), view("b")], running=3) == ["a"]  # up to max_batch rows
    assert scheduler.join([view("a"), view("b")], running=4) == []
    assert scheduler.join([view("a"), view("p", joinable=False)], running=1) == []  # p would wait behind joins


@pytest.mark.parametrize("fresh", [False, True])
def test_a_draft_that_arrives_while_a_batch_drafts_joins_it_unless_it_has_no_kv_yet(tiny_runners, fresh):
    """The edge's batcher: a job queued while a chain batch drafts joins it at its next step (one batch, one
    join) when its draft K/V are held; a session's first draft (its prompt's catch-up) waits for a batch of its
    own. Both blocks are what the draft model drafts alone."""
    from concurrent.futures import ThreadPoolExecutor

    from specrelay.edge_worker.draft.batcher import DraftBatcher

    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    contexts = [draft.tokenizer(t).input_ids for t in ("def add(a, b):\n", "class Point:\n")]
    states = [drafter.new_state(c) for c in contexts]
    if not fresh:
        drafter.draft_batch([DraftJob(s, c, len(c), 1, Mode.GREEDY, SamplingParams(), 0)
                             for s, c in zip(states, contexts)])
    jobs = [DraftJob(s, c, len(c), d, Mode.GREEDY, SamplingParams(), 0) for s, c, d in zip(states, contexts, (8, 3))]

    async def main():
        batcher = DraftBatcher(drafter, ThreadPoolExecutor(1))
        return *await queued_mid_batch(draft, batcher, jobs[0], jobs[1]), batcher

    first, other, batcher = asyncio.run(main())
    assert first.ids == alone(draft, contexts[0], 8) and other.ids == alone(draft, contexts[1], 3)
    assert (batcher.batches, batcher.joins) == ((2, 0) if fresh else (1, 1))
    if not fresh:
        assert other.steps == 3  # the forwards since it joined


def test_a_chain_draft_that_waited_behind_tree_work_is_marked(tiny_runners):
    """A chain block drafted after another session's tree batch (or tree pre-draft) held the draft thread timed
    the trees' load, not a chain's: the batcher marks it (`behind_trees`), so it does not teach the chains' draft
    wait line (with 16 sessions over 50 ms, chains priced behind trees kept the edge drafting trees at 0.90-0.94x
    the chain policy's tokens/s). A chain drafted alone is not marked. Each real batch reports the chain jobs a second
    that came in while it drafted (what a tree batch holds up, which a tree's price charges: EdgeEstimates.blocking):
    the tree batch one, the chain batches after it none."""
    from concurrent.futures import ThreadPoolExecutor

    from specrelay.edge_worker.draft.batcher import DraftBatcher
    from specrelay.edge_worker.policy import RankAcceptance
    from specrelay.edge_worker.trees.drafter import TreeJob
    from specrelay.edge_worker.trees.tree import TreeShape

    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    contexts = [draft.tokenizer(t).input_ids for t in ("def add(a, b):\n", "class Point:\n")]
    states = [drafter.new_state(c) for c in contexts]
    tree = TreeJob(states[0], list(contexts[0]), TreeShape((2, 2, 2)), Mode.GREEDY, SamplingParams(), 0,
                   RankAcceptance())
    chain = lambda: DraftJob(states[1], list(contexts[1]), len(contexts[1]), 3, Mode.GREEDY,  # noqa: E731
                             SamplingParams(), 0)
    came_in = []

    async def main():
        batcher = DraftBatcher(drafter, ThreadPoolExecutor(1), on_timing=lambda _r, _f, came: came_in.append(came))
        await batcher.draft(chain())  # a process's first batch times nothing
        _, behind = await queued_mid_batch(draft, batcher, tree, chain())
        await asyncio.sleep(0.1)  # its batch ends (a block is handed back as its job leaves the batch)
        alone = await batcher.draft(chain())
        await asyncio.sleep(0.1)  # the last timing's callback
        return behind, alone

    first, alone_block = asyncio.run(main())
    assert first.ids and first.behind_trees
    assert alone_block.ids and not alone_block.behind_trees
    assert len(came_in) == 3 and came_in[0] > 0 and came_in[1:] == [0.0, 0.0]  # the tree batch, then the chains'


async def queued_mid_batch(runner, batcher, first_job, second_job):
    """Draft `first_job` with `batcher`, queueing `second_job` during its batch's 2nd forward (in the draft thread,
    which waits until the job is in the queue); both blocks. The runner's forward is restored."""
    loop, real, calls, queued, second = asyncio.get_running_loop(), runner.model.forward, [], threading.Event(), []

    def start_second():
        second.append(asyncio.ensure_future(batcher.draft(second_job)))
        loop.call_soon(queued.set)  # after the task's first step: the job is in the queue

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            loop.call_soon_threadsafe(start_second)
            assert queued.wait(10)
        return real(*args, **kwargs)

    runner.model.forward = forward
    try:
        first = await batcher.draft(first_job)
        return first, await second[0]
    finally:
        runner.model.forward = real


def test_a_greedy_one_vocabulary_draft_picks_from_its_logits_as_from_its_probabilities(tiny_runners):
    """The greedy draft of one vocabulary skips the softmax (~10 us a row a draft step: 16 sessions drafting 8
    tokens each pay it 128 times a round): the same token, the same likeliest ids and the same confidence class."""
    from specrelay.edge_worker.trees.tree import ranked

    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    rows = [torch.randn(draft.vocab_size) * scale for scale in (0.1, 1.0, 3.0, 10.0) for _ in range(8)]
    for logits in rows:
        q = drafter.to_target(torch.softmax(logits, -1))
        job = DraftJob(drafter.new_state([1]), [1], 1, 1, Mode.GREEDY, SamplingParams(), 0)
        assert drafter.choose(logits, job, 1, DraftBlock()) == int(q.argmax())
        assert ranked(logits[:target.vocab_size], logits=True) == ranked(q)


def test_a_steps_greedy_rows_take_their_likeliest_ids_from_one_topk(tiny_runners, monkeypatch):
    """A lockstep step's greedy rows read their tokens and ranks from one topk over the step's logits
    (Drafter._tops; one call a row cost ~14-26 us a draft step, 16 sessions x 8 steps a round): the same blocks as
    each job drafted alone, where `choose` takes its own."""
    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    prompts = ["def add(a, b):\n", "The capital of", "import numpy as np\n", "for i in range("]
    contexts = [draft.tokenizer(p).input_ids for p in prompts]

    def jobs():
        return [DraftJob(drafter.new_state(c), c, len(c), 6, Mode.GREEDY, SamplingParams(), 0, ranks=i % 2 == 0)
                for i, c in enumerate(contexts)]

    alone = [drafter.draft_batch([job])[0] for job in jobs()]
    read, tops = [], Drafter._tops
    monkeypatch.setattr(Drafter, "_tops", lambda self, *args: (tops(self, *args), read.append(sum(
        job.state.last_top is not None and job.state.last_top[0] is job.state.last_logits for job in args[0]))))
    together = drafter.draft_batch(jobs())
    assert read and read[0] == len(prompts)  # every row's ids came from the one topk
    assert [b.ids for b in together] == [b.ids for b in alone]
    assert [b.ranked for b in together] == [b.ranked for b in alone] and together[0].ranked and not together[1].ranked


def test_a_greedy_job_that_asks_keeps_each_positions_likeliest_ids(tiny_runners):
    """`ranks` (a session that may draft trees): each drafted position keeps the draft's MAX_BRANCH likeliest ids,
    its own token first, and its confidence class, through a pre-draft's continuation too (DraftBlock.part / +):
    a greedy chain's rejection then shows which of them the target took (RankAcceptance.observe_chain)."""
    from specrelay.edge_worker.trees.tree import BUCKETS, MAX_BRANCH

    target, draft = tiny_runners
    drafter = Drafter(draft, target.vocab_size)
    context = draft.tokenizer("def add(a, b):\n").input_ids
    asked, plain = (DraftJob(drafter.new_state(context), context, len(context), 5, Mode.GREEDY, SamplingParams(), 0,
                             ranks=ranks) for ranks in (True, False))
    (block,), (other,) = drafter.draft_batch([asked]), drafter.draft_batch([plain])
    assert block.ids == other.ids and not other.ranked  # asking changes no draft
    assert len(block.ranked) == len(block.ids) == 5
    for x, (ids, bucket) in zip(block.ids, block.ranked):
        assert ids[0] == x and len(set(ids)) == MAX_BRANCH and 0 <= bucket <= len(BUCKETS)
    assert (block.part(0, 2) + block.part(2)).ranked == block.ranked
    rest = drafter.continue_job(asked, block.ids[:2], 3)
    assert rest.ranks
