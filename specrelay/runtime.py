"""Process plumbing for the command line: the event loop (uvloop when installed), torch's thread count, and
running several services of one process together."""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import AsyncExitStack


def run_async(main) -> object:
    """Run a coroutine to completion on a fresh loop, uvloop when installed. Servers stop themselves on
    SIGTERM / SIGINT (common.transport.serve_until_signalled); Ctrl-C elsewhere raises KeyboardInterrupt."""
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        return runner.run(main)


def ignore_sighup() -> None:
    """Workers read their keys once, at start, so SIGHUP has nothing to reload; a terminal hang-up or a stray
    `kill -HUP` must not end them (SIGHUP's default action). The broker re-reads its key directories instead."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def set_threads() -> None:
    """SPECRELAY_THREADS caps torch's intra-op threads (one process per core in a dense deployment)."""
    threads = os.environ.get("SPECRELAY_THREADS")
    if threads:
        import torch
        torch.set_num_threads(int(threads))


async def serve_all(*services, on_started=None) -> None:
    """Start `services` in order (common.transport.Service), serve until SIGTERM / SIGINT or until any of them
    stops, then stop them in reverse order (a front end before the edge it uses, the edge before the broker).
    `on_started()` runs once all are up."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with AsyncExitStack() as stack:
            for service in services:
                await stack.enter_async_context(service)
            if on_started is not None:
                on_started()
            waits = [asyncio.create_task(stop.wait())]
            waits += [asyncio.create_task(s._stopped.wait()) for s in services]  # Service's "closed" event
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
