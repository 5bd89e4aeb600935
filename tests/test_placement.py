"""Edge and cloud on separate cores wherever this machine stands in for two (specrelay/placement.py): the
processes a LocalCluster starts, the edge in this process and its draft thread, as the kernel reports them
(/proc/PID/task/TID/status Cpus_allowed_list), and what `--no-pin` changes."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch

from specrelay.cluster import LocalCluster, free_port
from specrelay.placement import CLOUD, EDGE, Placement, stamp

CPUS = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CPUS) < 2, reason="placement needs a machine of >= 2 CPUs")


def allowed(pid: int, tid: int | None = None) -> list[int]:
    """Cpus_allowed_list of a process (or one of its threads) as the kernel writes it, e.g. "0-1,3"."""
    path = Path(f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status")
    text = next(line for line in path.read_text().splitlines() if line.startswith("Cpus_allowed_list"))
    cpus = []
    for part in text.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def threads_allowed(pid: int) -> set[tuple[int, ...]]:
    """The distinct CPU sets of every thread of a process."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(tuple(allowed(pid, int(tid))))
        except (OSError, StopIteration):
            pass  # a thread that ended meanwhile
    return out


def child_env(pid: int) -> dict[str, str]:
    """A started child's environment. Popen returns when the child's close-on-exec pipe closes, a moment before
    the kernel points the new image at its environment: until then /proc/PID/environ reads empty, so wait."""
    deadline = time.monotonic() + 10
    while True:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        if raw or time.monotonic() > deadline:
            return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)
        time.sleep(0.01)


@two_cores
def test_choose_splits_the_cores_and_no_pin_shares_them():
    pinned = Placement.choose()
    assert pinned.pinned and pinned.edge_cpus == (CPUS[0],) and pinned.cloud_cpus == tuple(CPUS[1:])
    assert pinned.threads(EDGE) == 1 and pinned.threads(CLOUD) == len(CPUS) - 1  # one torch thread per core
    shared = Placement.choose(pin=False)
    assert not shared.pinned and shared.edge_cpus == shared.cloud_cpus == tuple(CPUS)
    assert shared.threads(EDGE) == shared.threads(CLOUD) == max(1, len(CPUS) // 2)  # half each, no oversubscribing
    row = stamp({"x": 1}, pinned)
    assert row["placement"]["edge_cpus"] == [CPUS[0]] and len(row["load_average"]) == 3 and row["x"] == 1


@two_cores
def test_here_pins_every_thread_and_torch_and_restores_them():
    before_threads = torch.get_num_threads()
    placement = Placement.choose()
    with placement.here(EDGE):
        assert threads_allowed(os.getpid()) == {(CPUS[0],)}
        assert torch.get_num_threads() == 1
        assert Placement.choose() == placement  # inside, the machine is still seen whole
    assert threads_allowed(os.getpid()) == {tuple(CPUS)}
    assert torch.get_num_threads() == before_threads


@two_cores
@pytest.mark.timeout(180)
def test_cluster_children_on_the_cloud_cores_the_edge_and_its_draft_thread_on_the_edge_core(tiny_pair):
    from specrelay.bench.runs import run_edge

    target, draft = tiny_pair
    with LocalCluster(str(target), workers=1) as cluster:
        edge_cpus, cloud_cpus = [CPUS[0]], CPUS[1:]
        for proc in cluster.procs:  # broker and cloud worker: every thread, as the kernel reports it
            assert threads_allowed(proc.pid) == {tuple(cloud_cpus)}, proc.args
        worker_env = child_env(cluster.worker_procs[0].pid)
        assert worker_env["SPECRELAY_THREADS"] == worker_env["OMP_NUM_THREADS"] == str(len(cloud_cpus))
        seen: dict = {}

        async def generate_and_look():
            from specrelay.edge_worker.server import load_edge
            from specrelay.edge_worker.config import SessionConfig

            async with await load_edge(cluster.frontend, str(draft)) as edge:
                await edge.generate(edge.tokenizer("def add(a, b):\n").input_ids, SessionConfig(max_new_tokens=8))
                seen["threads"] = threads_allowed(os.getpid())  # the draft thread included: it has drafted
                seen["draft_torch_threads"] = await asyncio.get_running_loop().run_in_executor(
                    edge._pool, torch.get_num_threads)

        asyncio.run(generate_and_look())
        assert seen["threads"] == {tuple(edge_cpus)}
        assert seen["draft_torch_threads"] == 1
        out, _ = asyncio.run(run_edge(cluster.frontend, str(draft), ["class Point:\n"], 1, max_new_tokens=4))
        assert out[0][1]["generated_tokens"] == 4
        edge = cluster.spawn_edge("--broker", cluster.frontend, "--draft-model", str(draft), "--listen",
                                  f"tcp://127.0.0.1:{free_port()}")
        assert threads_allowed(edge.pid) == {tuple(edge_cpus)}
        assert child_env(edge.pid)["SPECRELAY_THREADS"] == "1"
    assert threads_allowed(os.getpid()) == {tuple(CPUS)}  # the test process gets its cores back


@two_cores
@pytest.mark.timeout(120)
def test_no_pin_leaves_every_process_on_every_core(tiny_pair):
    target, _ = tiny_pair
    with LocalCluster(str(target), pin=False) as cluster:
        for proc in cluster.procs:
            assert threads_allowed(proc.pid) == {tuple(CPUS)}
        assert threads_allowed(os.getpid()) == {tuple(CPUS)}
        assert child_env(cluster.worker_procs[0].pid)["SPECRELAY_THREADS"] == str(max(1, len(CPUS) // 2))
