"""The only cloud worker killed mid-generation, through the real CLI and a real edge-worker process: the edge
says so once (one "retrying" warning, not one per attempt), fails with "no live cloud worker" within the retry
budget, and hands the caller the tokens already committed, which are the target's own greedy tokens: `generate
--json` prints them with the error, `Client`'s exception carries them, an HTTP stream ends with an error event
after the committed text."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specrelay.cluster import LocalCluster, free_port

ROOT = Path(__file__).resolve().parent.parent
TARGET, DRAFT = ROOT / "models" / "demo-target", ROOT / "models" / "demo-draft"
PROMPT = "def fibonacci(n):\n"
MAX_NEW = 900  # far more than is generated before the kill (the demo target's context is 1024)
BUDGET_S = "2"  # --retry-budget: a short one keeps the case under 10 s after the kill

pytestmark = [pytest.mark.process, pytest.mark.demo, pytest.mark.timeout(300)]


def kill_after_some_rounds(cluster: LocalCluster, rounds: int = 3, timeout: float = 120) -> float:
    """SIGKILL the only worker once it has verified `rounds` requests; returns the time of the kill."""
    deadline = time.monotonic() + timeout
    while cluster.metrics(cluster.health_ports[0]).get("specrelay_cloud_verify_requests_total", 0) < rounds:
        assert time.monotonic() < deadline, "the generation never reached the worker"
        time.sleep(0.05)
    cluster.kill(cluster.worker_procs[0])
    return time.monotonic()


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", SPECRELAY_THREADS="1")


def test_generate_prints_the_committed_tokens_with_one_line_naming_no_live_worker(demo_greedy):
    with LocalCluster(str(TARGET), workers=1, threads=1) as cluster:
        gen = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "generate", "--broker", cluster.frontend,
                                "--draft-model", str(DRAFT), "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW),
                                "--retry-budget", BUDGET_S, "--json"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env())
        killed = kill_after_some_rounds(cluster)
        out, err = gen.communicate(timeout=60)
        after_kill = time.monotonic() - killed
    assert gen.returncode == 1, err[-3000:]
    (result,) = [json.loads(line) for line in out.splitlines()]
    assert "no live cloud worker" in result["error"], result["error"]
    committed = result["token_ids"]
    assert 0 < len(committed) < MAX_NEW
    assert committed == demo_greedy(PROMPT, len(committed))  # the target's own tokens, none lost or invented
    assert err.count('"retrying"') == 1, err[-3000:]  # once, not once per attempt
    assert after_kill <= 10, f"{after_kill:.1f} s after the kill"


def test_plain_output_keeps_the_committed_text(capsys):
    from specrelay.generate import print_result

    args = type("Args", (), {"json": False})()
    print_result(args, {"prompt": "p:", "error": "Overloaded: no live cloud worker", "text": " done", "token_ids": [1]})
    out, err = capsys.readouterr()
    assert out == "p: done\n"
    assert err == "--- failed after 1 committed tokens: Overloaded: no live cloud worker\n"


def test_client_exception_carries_the_committed_tokens(tmp_path, demo_greedy):
    from specrelay.client import Client
    from specrelay.common.errors import RequestError

    listen = f"ipc://{tmp_path / 'edge.sock'}"
    with LocalCluster(str(TARGET), workers=1, threads=1) as cluster:
        health = free_port()
        edge = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "edge-worker", "--broker", cluster.frontend,
                                 "--draft-model", str(DRAFT), "--listen", listen, "--retry-budget", BUDGET_S,
                                 "--health-port", str(health)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=env())
        try:
            cluster._wait_healthy(health, edge, "edge worker")

            async def run():
                async with Client(listen, timeout=30) as client:
                    pieces, started = [], None
                    with pytest.raises(RequestError) as info:
                        async for piece in client.stream(PROMPT, max_new_tokens=MAX_NEW):
                            pieces.append(piece)
                            if started is None:
                                started = asyncio.create_task(asyncio.to_thread(kill_after_some_rounds, cluster))
                    await started
                    return info.value, "".join(pieces)

            exc, streamed = asyncio.run(run())
        finally:
            edge.send_signal(signal.SIGTERM)
            _, err = edge.communicate(timeout=60)
    assert "no live cloud worker" in str(exc)
    committed = exc.committed
    assert committed.text == streamed and 0 < len(committed.token_ids) < MAX_NEW
    assert committed.token_ids == demo_greedy(PROMPT, len(committed.token_ids))
    assert err.count('"retrying"') == 1, err[-3000:]


def test_http_stream_ends_with_an_error_event_after_the_committed_text(demo_greedy):
    import threading
    import urllib.request

    from transformers import AutoTokenizer

    port, health = free_port(), free_port()
    with LocalCluster(str(TARGET), workers=1, threads=1) as cluster:
        edge = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "edge-worker", "--broker", cluster.frontend,
                                 "--draft-model", str(DRAFT), "--target-tokenizer", str(TARGET), "--http",
                                 f"127.0.0.1:{port}", "--retry-budget", BUDGET_S, "--health-port", str(health)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
        try:
            cluster._wait_healthy(health, edge, "edge worker")
            body = json.dumps({"model": "specrelay", "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0,
                               "stream": True}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"content-type": "application/json"})
            events, killer = [], threading.Thread(target=kill_after_some_rounds, args=(cluster,))
            with urllib.request.urlopen(request, timeout=120) as reply:
                for raw in reply:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        if len(events) == 1:
                            killer.start()
            killer.join()
        finally:
            edge.send_signal(signal.SIGTERM)
            edge.wait(timeout=60)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert "no live cloud worker" in error["error"]["message"], error
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    reference = tokenizer.decode(demo_greedy(PROMPT, 64))  # the target's own text: the committed text is its prefix
    assert text and (reference.startswith(text) or text.startswith(reference)), (text, reference)
