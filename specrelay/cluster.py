"""Brokers and cloud workers as child processes on 127.0.0.1 (demo, benchmarks, end-to-end tests), placed on the
cloud side's cores and the calling process (the in-process edge) on the edge side's (specrelay/placement.py)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from .cloud_worker.config import WorkerConfig
from .placement import CLOUD, EDGE, Placement


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody holds now, below the kernel's ephemeral range: the caller binds it a
    little later, and a port from inside that range can meanwhile become the source port of any outgoing
    connection (a worker dialing its broker, a health poll), which makes the later bind fail. Never the same port
    twice in one process."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 16384), low)
        if port not in _HANDED_OUT and bindable(port):
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:  # a crowded range: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def bindable(port: int) -> bool:
    """Whether a TCP port on 127.0.0.1 can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _exit_on_sigterm() -> bool:
    """While a cluster runs, SIGTERM to this process (a `timeout`, a CI job's end, `kill`) raises SystemExit, so
    `__exit__` stops the children: with the default action the process died and left its broker, workers and relay
    running. Only from the main thread, and only where SIGTERM still has its default action (True: installed)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _terminated)
    return True


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


class LocalCluster:
    """`with LocalCluster(model) as c:` starts `brokers` x `specrelay broker` and `workers` x `specrelay
    cloud-worker` (each given every broker), waits until every process answers /healthz, and stops them all
    (SIGTERM, then SIGKILL) on exit. `frontend` / `backend` / `broker` are the first broker's; `frontends`, ...
    every broker's, in order (an edge given `frontends` spreads its sessions over them).

    `pin` (default; `--no-pin` of the commands turns it off): the children run on the cloud side's CPUs and, from
    `__enter__` to `stop`, this process (the edge that uses the cluster) on the edge side's, as on two machines;
    `spawn_edge` starts an edge-worker process on the edge side. `threads` None: torch threads follow the
    placement (one per core of the process's side)."""

    def __init__(self, target_model: str, workers: int = 1, max_batch: int = WorkerConfig.max_batch,
                 threads: int | None = None, extra_worker_args: tuple[str, ...] = (), startup_timeout: float = 120.0,
                 extra_broker_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 launcher: tuple[str, ...] = (), brokers: int = 1, pin: bool = True) -> None:
        self.target_model, self.workers, self.max_batch = target_model, workers, max_batch
        self.threads, self.extra, self.startup_timeout = threads, extra_worker_args, startup_timeout
        self.broker_extra = extra_broker_args
        self.env = env or {}  # extra environment of the children (e.g. SPECRELAY_LOG_LEVEL)
        self.launcher = launcher  # a command prefix for the children, e.g. ("valgrind",)
        self.placement = Placement.choose(pin)
        self._edge_side = None  # this process's placement on the edge side while the cluster runs
        self._sigterm = False  # _exit_on_sigterm installed its handler
        self.frontends = [f"tcp://127.0.0.1:{free_port()}" for _ in range(brokers)]
        self.backends = [f"tcp://127.0.0.1:{free_port()}" for _ in range(brokers)]
        self.broker_health_ports = [free_port() for _ in range(brokers)]
        self.broker_procs: list[subprocess.Popen | None] = [None] * brokers
        self.procs: list[subprocess.Popen] = []
        self.worker_procs: list[subprocess.Popen] = []
        self.health_ports: list[int] = []

    @property
    def frontend(self) -> str:
        return self.frontends[0]

    @property
    def backend(self) -> str:
        return self.backends[0]

    @property
    def broker_health_port(self) -> int:
        return self.broker_health_ports[0]

    @property
    def broker(self) -> subprocess.Popen | None:
        return self.broker_procs[0]

    def _spawn(self, *args: str, side: str = CLOUD) -> subprocess.Popen:
        env = dict(os.environ) | self.placement.env(side, self.threads) | self.env
        quiet = subprocess.DEVNULL if os.environ.get("SPECRELAY_QUIET_CHILDREN") else None  # never an unread pipe
        proc = subprocess.Popen([*self.launcher, sys.executable, "-m", "specrelay.cli", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=quiet)
        self.placement.place(proc.pid, side)  # before its interpreter starts a thread: they all inherit it
        self.procs.append(proc)
        return proc

    def spawn_edge(self, *args: str) -> subprocess.Popen:
        """`specrelay edge-worker ARGS` on the edge side's CPUs (stopped with the cluster)."""
        return self._spawn("edge-worker", *args, side=EDGE)

    def place_cloud(self, pid: int) -> None:
        """Another process of the cloud side (a link relay) on the cloud side's CPUs."""
        self.placement.place(pid, CLOUD)

    def place_caller(self) -> None:
        """This process on the edge side (CPUs, torch threads) until `stop`. `__enter__` calls it; call it first
        from the thread that will run the edge when `__enter__` runs on another (torch counts threads per
        thread)."""
        if self._edge_side is None:
            self._edge_side = self.placement.here(EDGE, self.threads)
            self._edge_side.__enter__()

    def start_worker(self) -> subprocess.Popen:
        proc, port = self._spawn_worker()
        self._wait_healthy(port, proc, "cloud worker")
        return proc

    def _spawn_worker(self) -> tuple[subprocess.Popen, int]:
        port = free_port()
        self.health_ports.append(port)
        proc = self._spawn("cloud-worker", "--broker", ",".join(self.backends), "--model", self.target_model,
                           "--max-batch", str(self.max_batch), "--health-port", str(port), *self.extra)
        self.worker_procs.append(proc)
        return proc, port

    def start_broker(self, index: int = 0) -> subprocess.Popen:
        """Broker `index` on this cluster's fixed endpoints (so a restarted broker is found by everyone)."""
        proc = self.broker_procs[index] = self._spawn(
            "broker", "--frontend", self.frontends[index], "--backend", self.backends[index],
            "--health-port", str(self.broker_health_ports[index]), *self.broker_extra)
        self._wait_healthy(self.broker_health_ports[index], proc, "broker")
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL: no goodbye, no drain (a crash or a lost node)."""
        proc.kill()
        proc.wait()

    def metrics(self, port: int) -> dict[str, float]:
        """A process's /metrics as {name: value} (labelled samples summed under their bare name)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                name = name.split("{", 1)[0]
                values[name] = values.get(name, 0.0) + float(value)
        return values

    def _wait_healthy(self, port: int, proc: subprocess.Popen, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode} during start-up")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{what} not healthy after {self.startup_timeout:.0f}s")

    def catch_sigterm(self) -> None:
        """From here until `stop`, SIGTERM to this process raises SystemExit (_exit_on_sigterm). Call it from the main
        thread where the cluster starts in another (bench sweep's `started`): there `__enter__` cannot install it."""
        self._sigterm = self._sigterm or _exit_on_sigterm()

    def __enter__(self) -> "LocalCluster":
        self.catch_sigterm()
        try:
            self.place_caller()
            for index in range(len(self.frontends)):
                self.start_broker(index)
            started = [self._spawn_worker() for _ in range(self.workers)]  # they load their models side by side
            for proc, port in started:
                self._wait_healthy(port, proc, "cloud worker")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self._sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._sigterm = False
        if self._edge_side is not None:
            self._edge_side.__exit__(None, None, None)
            self._edge_side = None
