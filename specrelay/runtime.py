"""Process plumbing for the command line: the event loop (uvloop when installed), torch's thread count and
SIGHUP (several services of one process run together with common.transport.serve_all)."""

from __future__ import annotations

import asyncio
import os
import signal


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
