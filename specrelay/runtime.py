"""Process plumbing for the command line: the event loop (uvloop when installed) and torch's thread count."""

from __future__ import annotations

import asyncio
import os


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


def set_threads() -> None:
    """SPECRELAY_THREADS caps torch's intra-op threads (one process per core in a dense deployment)."""
    threads = os.environ.get("SPECRELAY_THREADS")
    if threads:
        import torch
        torch.set_num_threads(int(threads))
