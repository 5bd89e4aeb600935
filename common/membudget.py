"""A process's memory budget, for what libzmq cannot bound: a multipart message is buffered whole before the
application sees its first frame (MAXMSGSIZE bounds each frame, not their number), so one peer can make a
process hold any amount of memory. A thread reads the resident set size every `interval_s`; past `limit_mb`
it logs one line and ends the process at once with EXIT_MEMORY, for its supervisor (systemd Restart=, a
Kubernetes pod) to restart it before the kernel's OOM killer picks a victim. Clients recover exactly as from any
broker restart (edges re-OPEN with the full context). Bound: limit + what arrives within one interval.
"""

from __future__ import annotations

import os
import sys
import threading

import structlog

log = structlog.get_logger("specrelay.memory")

EXIT_MEMORY = 75  # EX_TEMPFAIL: restart me
_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of a process, in MiB (Linux /proc)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE_MB


class MemoryBudget:
    """`start()` the watchdog thread; `stop()` it. `exit` is what ends the process (tests replace it)."""

    def __init__(self, limit_mb: float, interval_s: float = 0.05, exit=os._exit) -> None:
        if limit_mb <= 0 or interval_s <= 0:
            raise ValueError("limit_mb and interval_s must be > 0")
        self.limit_mb, self.interval_s, self._exit = limit_mb, interval_s, exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memory-budget", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = rss_mb()
            if rss > self.limit_mb:
                log.error("memory budget exceeded; exiting for a restart (a peer may have sent a huge multipart "
                          "message)", rss_mb=round(rss), limit_mb=self.limit_mb, exit_code=EXIT_MEMORY)
                sys.stderr.flush()
                self._exit(EXIT_MEMORY)
                return
