"""Batched drafting on the edge: sessions that want a draft at the same time share one lockstep batch.

The draft model runs in one worker thread; while it drafts a batch, new jobs queue up and form the next
batch, so batching grows with load and costs nothing to a lone session (no waiting). A job's block is handed
to its session as soon as that job leaves the batch, not when the batch's longest job ends.

Which queued jobs form the next batch and when pre-drafts (edge_worker/draft/predraft.py) run is the edge
scheduler's decision (edge_worker/scheduler.py: real drafts first, pre-drafts only while none waits, a few tokens at
a time (`chunk`), so a real draft waits for at most one chunk); this module runs its actions in the draft thread.
`collect` stops a pre-draft and hands back what it drafted so far.
A job that arrives while a chain batch drafts joins it at its next step when the scheduler lets it (`join`): it
would otherwise wait for the batch's last row, about half a batch.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor

from .drafter import DraftBlock, Drafter, DraftJob
from .predraft import TreePreDraft
from ..trees.drafter import TreeJob
from ..scheduler import EdgeScheduler, Phase, SessionView


class PreDraft:
    """A pre-draft in progress: the job it continues, what it drafted so far, whether it may go on."""

    def __init__(self, job: DraftJob, drafter: Drafter) -> None:
        self.job, self.drafter = job, drafter
        self.block = DraftBlock()
        self.stopped = False
        self.running: asyncio.Future | None = None  # the chunk in the draft thread, if any

    @property
    def finished(self) -> bool:
        ids = self.block.ids
        return self.stopped or len(ids) >= self.job.d or bool(ids and ids[-1] in self.drafter.eos_ids)

    def absorb(self, block: DraftBlock) -> None:
        self.block = self.block + block

    def next_chunk(self, chunk: int) -> DraftJob | None:
        """A job for the next `chunk` tokens after the ones drafted so far (None: the draft cannot go on)."""
        n = len(self.block.ids)
        job = self.drafter.continue_job(self.job, self.block.ids, min(chunk, self.job.d - n))
        self.stopped = self.stopped or job is None
        return job


class DraftBatcher:
    def __init__(self, drafter: Drafter, pool: Executor, max_batch: int = 64, chunk: int = 1,
                 on_timing: Callable[[float, list[tuple[int, float]], float | None], None] | None = None) -> None:
        self.drafter, self.pool, self.max_batch, self.chunk = drafter, pool, max_batch, chunk
        self.on_timing = on_timing  # _timed's (rows per chain forward, 0 for a pre-draft chunk; each (columns,
                                    # seconds); the chain jobs a second that came in meanwhile, None for a pre-draft)
        self._warm = False          # set by the first batch (only the draft thread touches it)
        self._queue: list[tuple[DraftJob, asyncio.Future]] = []  # the draft thread takes joiners from it: _lock
        self._lock = threading.Lock()
        self._pre: list[PreDraft] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.scheduler = EdgeScheduler(max_batch)  # which jobs draft, which pre-drafts run (edge_worker/scheduler)
        self.batches = 0
        self.jobs = 0
        self.batch_sizes: Counter = Counter()  # real draft batches by number of sessions (when they started)
        self.joins = 0                         # jobs that joined a batch under way
        self.predraft_chunks = 0
        self._tree_epoch = 0  # odd while the draft thread runs tree work: a chain job that waited behind it is marked
        self._chains = 0      # chain jobs queued so far: those that come in during a tree batch cannot join it

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def draft(self, job: DraftJob) -> DraftBlock:
        if job.d <= 0:
            return DraftBlock()
        self._ensure_running()
        future, epoch = asyncio.get_running_loop().create_future(), self._tree_epoch
        self._chains += not isinstance(job, TreeJob)
        with self._lock:
            self._queue.append((job, future))
        self._wake.set()
        block = await future
        if isinstance(block, DraftBlock):  # its wait measured the trees' load, not a chain's (DraftBlock.behind_trees)
            block.behind_trees = epoch % 2 == 1 or self._tree_epoch != epoch
        return block

    def predraft(self, job: DraftJob | TreePreDraft) -> PreDraft | TreePreDraft:
        """Start drafting `job` in the background, whenever the draft thread has nothing better to do (a tree's
        pre-draft comes as its TreePreDraft: one forward of its plan per chunk)."""
        pre = job if isinstance(job, TreePreDraft) else PreDraft(job, self.drafter)
        if not pre.finished:
            self._ensure_running()
            self._pre.append(pre)
            self._wake.set()
        return pre

    async def collect(self, pre: PreDraft | TreePreDraft) -> DraftBlock:
        """Stop `pre` and return what it drafted; a chunk already in the draft thread is waited for (not a tree's:
        it grows its session's draft tree in place, and the session's next draft queues behind it anyway)."""
        pre.stopped = True
        if pre.running is not None and not isinstance(pre, TreePreDraft):
            await asyncio.gather(asyncio.shield(pre.running), return_exceptions=True)
        return pre.block

    def cancel(self, pre: PreDraft) -> None:
        pre.stopped = True

    def _ensure_running(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="edge-draft-batcher")

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            for _ in range(3):  # sessions woken by the same reply burst enqueue too
                await asyncio.sleep(0)
            with self._lock:
                actions = self.scheduler.step(self._views())
                queue, pre = self._queue, self._pre
                self._queue = [queue[i] for kind, i in actions.wait if kind == "job"]
            gone = set(actions.dropped)
            self._pre = [p for i, p in enumerate(pre) if ("pre", i) not in gone]
            if actions.draft:
                await self._run_drafts([queue[i] for _, i in actions.draft])
            elif actions.predraft:
                await self._run_predrafts([pre[i] for _, i in actions.predraft])
            if self._queue or self._pre:
                self._wake.set()

    def _views(self) -> list[SessionView]:
        """The scheduler's view of what waits: each queued draft job, then each pre-draft of a VERIFY in flight."""
        return self._job_views() + [SessionView(("pre", i), Phase.DONE if pre.finished else Phase.IN_FLIGHT,
                                                predraft=True) for i, pre in enumerate(self._pre)]

    def _job_views(self) -> list[SessionView]:
        """Each queued draft job as the scheduler sees it, keyed ("job", index in the queue)."""
        return [SessionView(("job", i), Phase.DONE if fut.cancelled() else Phase.READY, joinable=_joinable(job))
                for i, (job, fut) in enumerate(self._queue)]

    async def _run_drafts(self, batch: list[tuple[DraftJob, asyncio.Future]]) -> None:
        loop = asyncio.get_running_loop()
        self.batches += 1  # counted before its blocks are handed over: `batches > 1` = not the process's first
        self.jobs += len(batch)
        self.batch_sizes[len(batch)] += 1

        def ready(i: int, block: DraftBlock) -> None:  # in the draft thread: a job left the lockstep batch
            try:
                loop.call_soon_threadsafe(_settle, batch[i][1], block)
            except RuntimeError:  # the loop closed meanwhile (shutdown)
                pass

        def admit(rows: int) -> list[DraftJob]:  # in the draft thread, before each step: jobs that join the batch
            with self._lock:
                taken = {i for _, i in self.scheduler.join(self._job_views(), rows)}
                if not taken:
                    return []
                joining = [q for i, q in enumerate(self._queue) if i in taken]
                self._queue = [q for i, q in enumerate(self._queue) if i not in taken]
            batch.extend(joining)
            self.jobs += len(joining)
            self.joins += len(joining)
            return [job for job, _ in joining]

        try:
            blocks = await self._in_thread([j for j, _ in batch], ready, admit)
        except asyncio.CancelledError:
            self._queue[:0] = batch  # closing: `close` fails them
            raise
        except Exception as exc:  # the draft model failed: fail these requests, keep serving
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), block in zip(batch, blocks):
            _settle(fut, block)

    async def _run_predrafts(self, pres: list[PreDraft | TreePreDraft]) -> None:
        """One chunk of each pre-draft the scheduler picked, in one lockstep batch."""
        chunks = [(pre, job) for pre in pres for job in [pre.next_chunk(self.chunk)] if job]
        if not chunks:
            return
        live = [pre for pre, _ in chunks]
        future = self._in_thread([job for _, job in chunks])

        def extend(done: asyncio.Future) -> None:  # runs before anyone awaiting the chunk resumes
            for pre in live:
                pre.running = None
            if done.cancelled() or done.exception() is not None:  # no head start, nothing worse
                for pre in live:
                    pre.stopped = True
                return
            for pre, block in zip(live, done.result()):
                pre.absorb(block)

        future.add_done_callback(extend)
        for pre in live:
            pre.running = future
        self.predraft_chunks += 1
        await asyncio.gather(asyncio.shield(future), return_exceptions=True)

    def _in_thread(self, jobs: list[DraftJob], ready: Callable[[int, DraftBlock], None] | None = None,
                   admit: Callable[[int], list[DraftJob]] | None = None):
        """`jobs` drafted in the draft thread: a real draft's batch with `ready` and `admit`, else a pre-draft's."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self.pool, self._timed, jobs, loop, ready, admit)

    def _timed(self, jobs: list[DraftJob], loop: asyncio.AbstractEventLoop, ready=None,
               admit=None) -> list[DraftBlock]:
        """`draft_batch`, in the draft thread; its rows and the chain jobs a second that came in meanwhile (a real
        draft's: what a tree batch would hold up, EdgeEstimates.blocking) and its forwards go to `on_timing`."""
        forwards: list[tuple[int, float]] = []
        jobs, trees = list(jobs), any(isinstance(j, TreeJob) for j in jobs)  # joiners are appended
        self._tree_epoch += trees
        chains, start = self._chains, time.perf_counter()
        try:
            blocks = self.drafter.draft_batch(jobs, ready, forwards, admit)
        finally:
            self._tree_epoch += trees
        came = (self._chains - chains) / max(time.perf_counter() - start, 1e-6) if admit else None
        warm, self._warm = self._warm, True  # the first batch of a process is slow (allocations): not a timing
        if self.on_timing is not None and warm:
            rows = _rows_per_forward(blocks, forwards) if admit is not None else 0.0
            try:
                loop.call_soon_threadsafe(self.on_timing, rows, forwards, came)
            except RuntimeError:  # the loop closed meanwhile (shutdown): nothing to learn any more
                pass
        return blocks

    async def close(self, reason: Exception | None = None) -> None:
        """Stop drafting; drafts still waiting fail with `reason`, so their generations end instead of hanging."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for _, fut in self._queue:
            if not fut.done():
                fut.set_exception(reason or RuntimeError("the draft batcher is closed"))
        self._queue.clear()


def _settle(future: asyncio.Future, block: DraftBlock) -> None:
    if not future.done():
        future.set_result(block)


def _joinable(job: DraftJob | TreeJob) -> bool:
    """Whether `job` may join a chain batch under way: a chain whose draft K/V are held (edge_worker/scheduler.py)."""
    return not isinstance(job, TreeJob) and job.state.kv.length > 0


def _rows_per_forward(blocks: list, forwards: list[tuple[int, float]]) -> float:
    """The mean rows of a lockstep chain batch's forwards: each block was a row of its `steps` forwards, so their
    sum over the forwards run (joiners make it less than the batch's jobs: a row joined late, or left early)."""
    chains = [b for b in blocks if isinstance(b, DraftBlock)]
    return sum(b.steps for b in chains) / len(forwards) if forwards else 0.0
