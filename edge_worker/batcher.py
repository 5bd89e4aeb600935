"""Batched drafting on the edge: sessions that want a draft at the same time share one lockstep batch.

The draft model runs in one worker thread; while it drafts a batch, new jobs queue up and form the next
batch, so batching grows with load and costs nothing to a lone session (no waiting).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from .drafter import DraftBlock, Drafter, DraftJob


class DraftBatcher:
    def __init__(self, drafter: Drafter, pool: Executor, max_batch: int = 64) -> None:
        self.drafter, self.pool, self.max_batch = drafter, pool, max_batch
        self._queue: list[tuple[DraftJob, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.jobs = 0

    async def draft(self, job: DraftJob) -> DraftBlock:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="edge-draft-batcher")
        future = asyncio.get_running_loop().create_future()
        self._queue.append((job, future))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            for _ in range(3):  # sessions woken by the same reply burst enqueue too
                await asyncio.sleep(0)
            batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            if self._queue:
                self._wake.set()
            batch = [(job, fut) for job, fut in batch if not fut.cancelled()]
            if not batch:
                continue
            try:
                blocks = await loop.run_in_executor(self.pool, self.drafter.draft_batch, [j for j, _ in batch])
            except Exception as exc:  # the draft model failed: fail these requests, keep serving
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.batches += 1
            self.jobs += len(batch)
            for (_, fut), block in zip(batch, blocks):
                if not fut.done():
                    fut.set_result(block)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
