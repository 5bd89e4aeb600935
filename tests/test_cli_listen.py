"""Listening endpoints through the real CLI: a second edge worker refuses the ipc:// path a live one holds (ZeroMQ
would silently take the file over, and the first edge could no longer be reached), an edge removes its socket
file when it stops, and a taken TCP port is one line naming the flag that moves it, before any model loads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DRAFT = ROOT / "models" / "demo-draft"

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]


def cli(*argv: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", SPECRELAY_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "specrelay.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


def finished(proc: subprocess.Popen, timeout: float = 10) -> tuple[int, list[str], float]:
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.strip().splitlines(), time.monotonic() - t0


def test_second_edge_refuses_a_held_ipc_path_and_the_first_removes_its_file(tmp_path):
    path = tmp_path / "edge.sock"
    broker = f"tcp://127.0.0.1:{free_port()}"  # nothing there: the edge only warns
    first = cli("edge-worker", "--draft-model", str(DRAFT), "--broker", broker, "--listen", f"ipc://{path}")
    try:
        deadline = time.monotonic() + 120
        while not path.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-2000:]
            time.sleep(0.2)
        inode = path.stat().st_ino
        code, lines, seconds = finished(cli("edge-worker", "--draft-model", str(DRAFT), "--broker", broker,
                                            "--listen", f"ipc://{path}"))
        assert code == 2 and len(lines) == 1, lines
        assert "another process is listening on it" in lines[0] and "pass --listen" in lines[0], lines
        assert path.stat().st_ino == inode and first.poll() is None  # the first edge still owns its endpoint
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
        assert not path.exists()  # removed on exit
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_a_stale_ipc_file_is_taken_over(tmp_path):
    """A file left by a process that died (nobody listens on it) is not a reason to refuse."""
    from specrelay.common.ipc import refuse_held

    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # bound, never listening, then closed: the file stays
    assert path.exists()
    refuse_held(f"ipc://{path}", "--listen")  # no error


@pytest.mark.parametrize("command", [["broker", "--frontend", "tcp://127.0.0.1:{port}"],
                                     ["broker", "--backend", "tcp://*:{port}"],
                                     ["broker", "--health-port", "{port}"],
                                     ["cloud-worker", "--model", str(ROOT / "models" / "demo-target"),
                                      "--health-port", "{port}"],
                                     ["edge-worker", "--draft-model", str(DRAFT), "--listen", "tcp://127.0.0.1:{port}"]],
                         ids=lambda c: " ".join(c[:2]) + " " + c[-2])
def test_port_in_use_names_the_flag_that_moves_it(command):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines, seconds = finished(cli(*(a.format(port=port) for a in command)))
    flag = command[-2]
    assert code == 2 and len(lines) == 1, lines  # no stats line before it
    assert f"{flag}: cannot listen on" in lines[0] and f"pass {flag} with another port" in lines[0], lines
    assert seconds <= 10


def free_port() -> int:
    from specrelay.cluster import free_port as free

    return free()


def test_free_ports_stay_out_of_the_range_outgoing_connections_take():
    """A port handed out here is bound a few seconds later by a child; one from the kernel's ephemeral range can
    meanwhile become the source port of a worker's connection to its broker (the edge then exits 2, "cannot
    listen": a CI run lost a whole module to it). Never twice the same one."""
    from specrelay.cluster import _ephemeral_low

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(1024 <= p < _ephemeral_low() for p in ports)
