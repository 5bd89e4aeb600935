"""Rate limiting by the kernel for `--link RTT,RATE`: a veth pair into a network namespace of our own, with a
`tbf` qdisc on each end (this kernel has no `netem`, but veth, namespaces and tbf work as root).

    uplink:   edge ──► relay (127.0.0.1, delay) ──► veth host end [tbf] ──► forwarder in the namespace ──► broker
    downlink: broker ──► forwarder ──► veth namespace end [tbf] ──► relay (delay) ──► edge

One process (the link relay) holds both: the forwarder's listening socket is created inside the namespace
(`setns` on the creating thread, then back), its connection to the broker in the host namespace, so each
direction crosses exactly one tbf. Only addresses of our own veth pair (10.201.x.y/30) and 127.0.0.1 are used.
Without root, `ip`/`tc`, or namespaces, `VethTbf` raises saying why, and (`--rate-by auto`) the relay's
token bucket paces instead.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
from contextlib import contextmanager

PREFIX = "srlink-"
CLONE_NEWNET = 0x40000000


def _run(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=check)


def available() -> str | None:
    """None when a namespace with a tbf'd veth pair can be made here, else why not (a probe: one is made)."""
    try:
        with VethTbf(1e6):
            return None
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"cannot set up a namespace with tbf: {exc}"


def remove_stale() -> None:
    """Delete namespaces this module made for processes that are gone (a relay killed before its cleanup)."""
    listing = _run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(PREFIX):].split("-")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _run("ip", "netns", "del", name, check=False)


class VethTbf:
    """`with VethTbf(rate_bps) as link:` a namespace `srlink-PID-N`, a veth pair `link.host_ip` <-> `link.ns_ip`,
    tbf at `rate_bps` on both ends; `link.listen_in_ns()` gives a listening TCP socket inside the namespace."""

    _count = 0

    def __init__(self, rate_bps: float) -> None:
        VethTbf._count += 1
        pid, n = os.getpid(), VethTbf._count
        self.rate_bps = rate_bps
        self.name = f"{PREFIX}{pid}-{n}"
        self.host_if, self.ns_if = f"srh{pid}n{n}"[:15], f"srn{pid}n{n}"[:15]
        block = (pid * 8 + n) % (1 << 14)  # a /30 of 10.201.0.0/16 per (process, link)
        base = f"10.201.{block >> 6}.{(block & 63) << 2}"
        prefix = base.rsplit(".", 1)[0]
        last = int(base.rsplit(".", 1)[1])
        self.host_ip, self.ns_ip = f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"

    def __enter__(self) -> "VethTbf":
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            raise RuntimeError("not root")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"{' and '.join(missing)} not found")
        remove_stale()
        burst = max(3200, int(self.rate_bps / 8 * 0.004))  # >= rate / HZ at HZ 250, and two full frames
        steps = [
            ("ip", "netns", "add", self.name),
            ("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if),
            ("ip", "link", "set", self.ns_if, "netns", self.name),
            ("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if),
            ("ip", "link", "set", self.host_if, "up"),
            ("tc", "qdisc", "add", "dev", self.host_if, "root", "tbf", "rate", f"{int(self.rate_bps)}bit",
             "burst", str(burst), "latency", "1s"),
        ]
        in_ns = [
            ("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if),
            ("ip", "link", "set", self.ns_if, "up"),
            ("ip", "link", "set", "lo", "up"),
            ("tc", "qdisc", "add", "dev", self.ns_if, "root", "tbf", "rate", f"{int(self.rate_bps)}bit",
             "burst", str(burst), "latency", "1s"),
        ]
        try:
            for step in steps:
                _run(*step)
            for step in in_ns:
                _run(*step, ns=self.name)
        except subprocess.CalledProcessError as exc:
            self.__exit__()
            raise RuntimeError(f"{' '.join(exc.cmd)}: {exc.stderr.strip() or exc.returncode}") from None
        return self

    def __exit__(self, *exc) -> None:
        _run("ip", "netns", "del", self.name, check=False)  # takes the veth pair with it
        _run("ip", "link", "del", self.host_if, check=False)

    def listen_in_ns(self) -> socket.socket:
        """A listening TCP socket on ns_ip (any free port), created inside the namespace."""
        with _netns(self.name):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.ns_ip, 0))
            sock.listen(64)
        return sock

    def describe(self) -> str:
        return f"tbf {self.rate_bps / 1e6:g} Mbit/s each way on a veth pair into a network namespace"


@contextmanager
def _netns(name: str):
    """Run the body with this thread in namespace `name` (sockets made there stay there), then back."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the host namespace")
    finally:
        os.close(target)
        os.close(home)
