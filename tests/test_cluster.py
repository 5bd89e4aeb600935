"""LocalCluster (specrelay/cluster.py): its child processes stop with it, also when the process holding it is sent
SIGTERM (a `timeout` around a benchmark, a CI job's end)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_sigterm_to_the_process_holding_a_cluster_stops_its_children(tiny_pair):
    """With SIGTERM's default action the holder died and left its broker running (a killed `bench calls` left
    its broker, worker and relay up)."""
    target, _ = tiny_pair
    script = (f"import time\nfrom specrelay.cluster import LocalCluster\n"
              f"with LocalCluster({str(target)!r}, workers=0, threads=1) as c:\n"
              f"    print(' '.join(str(p.pid) for p in c.procs), flush=True)\n"
              f"    time.sleep(100)\n")
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(x) for x in holder.stdout.readline().split()]
        assert pids and all(alive(p) for p in pids)
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids)
    finally:
        holder.kill()
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)
