"""Where the processes of a one-machine run go: the edge side (the edge process and its draft thread) on one set
of cores, the cloud side (broker, cloud workers, a link relay) on the others, as if on two machines.

On one machine the draft model's forwards and the target's otherwise take turns on the same cores, a cost that a
deployment (an edge device beside a cloud GPU) never pays: a policy that measures the draft's cost and the
cloud's would then model a world that does not exist. `Placement.choose()` splits the CPUs this process may use
(automatic on a machine of >= 2; `choose(pin=False)`, the `--no-pin` flags, shares them). A process placed on
n cores runs n torch threads; where the two sides share the cores, each runs half of them.

`LocalCluster` (cluster.py), `specrelay demo`, every `specrelay bench` that starts processes and the tests go
through this one helper; docs/single-host.md says how to place a real single-host trial the same way.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

EDGE, CLOUD = "edge", "cloud"
EDGE_CPUS = 1  # the edge side's cores: one, as an edge device gives one app; the cloud side gets all the others
_outer: list[set[int]] = []  # the CPUs before each `here()` still open (the first: what the machine allows)


def pin(pid: int | None, cpus: set[int]) -> None:
    """Restrict every thread of a process (None: this one) to `cpus`; threads it starts later inherit them."""
    base = f"/proc/{pid or os.getpid()}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return  # the process has ended
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that ended meanwhile


def allowed_cpus(pid: int | None = None) -> list[int]:
    """The CPUs a process may run on, as the kernel says (/proc/PID/status Cpus_allowed_list)."""
    return sorted(os.sched_getaffinity(pid or 0))


@dataclass(frozen=True)
class Placement:
    """Which CPUs each side runs on; `pinned` False: both sides share all of them."""

    edge_cpus: tuple[int, ...]
    cloud_cpus: tuple[int, ...]
    pinned: bool

    @classmethod
    def choose(cls, pin: bool = True) -> "Placement":
        """Edge on the first EDGE_CPUS CPUs, cloud on the rest, when `pin` and the machine has >= 2 CPUs."""
        cpus = tuple(sorted(_outer[0] if _outer else os.sched_getaffinity(0)))
        if pin and len(cpus) > EDGE_CPUS:
            return cls(cpus[:EDGE_CPUS], cpus[EDGE_CPUS:], True)
        return cls(cpus, cpus, False)

    def cpus(self, side: str) -> tuple[int, ...]:
        return {EDGE: self.edge_cpus, CLOUD: self.cloud_cpus}[side]

    def threads(self, side: str) -> int:
        """Torch threads of a process on `side`: one per core it has (half of them when the sides share)."""
        n = len(self.cpus(side))
        return n if self.pinned else max(1, n // 2)

    def describe(self) -> dict:
        """What every benchmark row records."""
        return {"pinned": self.pinned, "edge_cpus": list(self.edge_cpus), "cloud_cpus": list(self.cloud_cpus),
                "edge_threads": self.threads(EDGE), "cloud_threads": self.threads(CLOUD)}

    def env(self, side: str, threads: int | None = None) -> dict[str, str]:
        """Environment of a child process on `side`: its torch (OpenMP, MKL) thread count."""
        n = str(threads or self.threads(side))
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "SPECRELAY_THREADS": n}

    def place(self, pid: int | None, side: str) -> None:
        """Pin a started process (None: this one) to `side`'s CPUs; nothing when the sides share."""
        if self.pinned:
            pin(pid, set(self.cpus(side)))

    @contextmanager
    def here(self, side: str = EDGE, threads: int | None = None):
        """This process (every thread, and those it starts) on `side`'s CPUs with that many torch threads, until
        the block ends (then as before). Enter it on the thread that later starts the edge's draft thread: torch
        keeps a thread count per thread, and a new thread takes the last one set."""
        import torch

        before, torch_before = os.sched_getaffinity(0), torch.get_num_threads()
        _outer.append(before)
        self.place(None, side)
        torch.set_num_threads(threads or self.threads(side))
        try:
            yield self
        finally:
            _outer.pop()
            pin(None, before)
            torch.set_num_threads(torch_before)


def stamp(row: dict, placement: Placement | None) -> dict:
    """`row` with the placement it ran under and the machine's load average (1, 5, 15 min) as it ended."""
    return row | {"placement": None if placement is None else placement.describe(),
                  "load_average": [round(x, 2) for x in os.getloadavg()]}
