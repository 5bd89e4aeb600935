"""Normal operation says nothing alarming: a clean shutdown logs no "worker lost" WARNING, the Quick start edge's
start-up warning about an unknown context says what really happens (the generation ends with finish_reason
length), and the demo's progress lines are written once each in a log."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from specrelay.broker.routing import Router
from specrelay.cluster import free_port
from specrelay.common import protocol

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)


def cli(*argv: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", SPECRELAY_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "specrelay.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait_for_line(proc: subprocess.Popen, piece: str, timeout: float = 120) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "".join(lines)[-2000:]
        lines.append(line)
        if piece in line:
            return lines
    raise AssertionError(f"no {piece!r} within {timeout} s: " + "".join(lines)[-2000:])


def test_a_worker_that_says_goodbye_is_not_a_warning():
    router = Router()
    router.from_worker([b"w1", b"", *protocol.encode(protocol.Ready(max_sessions=0))], 0.0)
    with capture_logs() as logs:
        router.from_worker([b"w1", b"", *protocol.encode(protocol.Disconnect(reason="shutting down"))], 1.0)
    assert not [e for e in logs if e["log_level"] == "warning"], logs
    assert router.stats.live_workers == 0


def test_clean_shutdown_of_broker_and_worker_logs_no_warning(tiny_pair):
    target, _ = tiny_pair
    frontend, backend, health = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port())
    broker = cli("broker", "--frontend", frontend, "--backend", backend)
    worker = cli("cloud-worker", "--broker", backend, "--model", str(target), "--health-port", str(health))
    try:
        wait_for_line(broker, "worker ready")
        worker.send_signal(signal.SIGTERM)  # the order of a one-box or demo shutdown: the worker, then the broker
        assert worker.wait(timeout=60) == 0
        time.sleep(0.5)
        broker.send_signal(signal.SIGTERM)
        _, err = broker.communicate(timeout=60)
    finally:
        for proc in (worker, broker):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    levels = [json.loads(line)["level"] for line in err.splitlines() if line.startswith("{")]
    assert "warning" not in levels and "error" not in levels, err[-2000:]


def test_the_quick_start_edge_does_not_promise_a_failure(tmp_path):
    """Without --target-tokenizer the edge does not know the target's context; a request past it ends with
    finish_reason length (the README and the code), it does not fail after generating."""
    edge = cli("edge-worker", "--draft-model", str(ROOT / "models" / "demo-draft"), "--broker",
               f"tcp://127.0.0.1:{free_port()}", "--listen", f"ipc://{tmp_path / 'edge.sock'}")
    try:
        line = wait_for_line(edge, "context is unknown")[-1]
    finally:
        edge.send_signal(signal.SIGTERM)
        edge.communicate(timeout=60)
    assert "finish_reason length" in line and "fails" not in line, line


def test_progress_is_one_line_per_step_in_a_log():
    from specrelay.demo import Progress

    err = io.StringIO()  # not a terminal
    with contextlib.redirect_stderr(err):
        with Progress("loading the draft model"):
            time.sleep(2.3)  # longer than a step the old code announced twice
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loading the draft model ... done ("), lines
