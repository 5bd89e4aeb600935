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


HOLDERS = {
    "with": "with LocalCluster({target!r}, workers=0, threads=1) as c:\n",
    # bench sweep starts its cluster in a pool thread while it loads the draft: there __enter__ cannot install
    # the handler, and a SIGTERM'd sweep left its broker, worker and relay running
    "sweep": "from specrelay.bench.sweep import started\nc = LocalCluster({target!r}, workers=0, threads=1)\n"
             "with started(c, {draft!r}, None):\n",
}


@pytest.mark.parametrize("how", HOLDERS)
def test_a_sigterm_to_the_process_holding_a_cluster_stops_its_children(tiny_pair, how):
    """With SIGTERM's default action the holder died and left its broker running (a killed `bench calls` left
    its broker, worker and relay up)."""
    target, draft = tiny_pair
    script = ("import time\nfrom specrelay.cluster import LocalCluster\n"
              + HOLDERS[how].format(target=str(target), draft=str(draft))
              + "    print(' '.join(str(p.pid) for p in c.procs), flush=True)\n"
              "    time.sleep(100)\n")
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
