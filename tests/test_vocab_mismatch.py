"""A draft with another tokenizer than the target's, through the real CLI: `serve` holds the target, so it uses
the target's tokenizer by itself and answers with the target's own greedy tokens; `generate` cannot know the
target before the cloud answers, and the cloud worker's refusal names the fix (`--target-tokenizer TARGET_DIR`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from specrelay.cluster import LocalCluster, free_port

ROOT = Path(__file__).resolve().parent.parent
TARGET, XV_DRAFT = ROOT / "models" / "demo-target", ROOT / "models" / "demo-draft-xv"
PROMPT = "def fibonacci(n):\n"

pytestmark = [pytest.mark.process, pytest.mark.demo, pytest.mark.timeout(300)]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", SPECRELAY_THREADS="1")


def test_generate_names_target_tokenizer_when_the_draft_has_another_tokenizer():
    with LocalCluster(str(TARGET), workers=1, threads=1) as cluster:
        out = subprocess.run([sys.executable, "-m", "specrelay.cli", "generate", "--broker", cluster.frontend,
                              "--draft-model", str(XV_DRAFT), "--prompt", PROMPT, "--max-new-tokens", "4"],
                             capture_output=True, text=True, timeout=120, env=env())
    assert out.returncode == 1
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("--- failed")]
    assert "--target-tokenizer TARGET_DIR" in line and "vocab_size" in line, line


def test_serve_uses_the_targets_tokenizer_for_a_draft_with_another(demo_greedy):
    port, health = free_port(), free_port()
    serve = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "serve", "--model", str(TARGET), "--draft-model",
                              str(XV_DRAFT), "--http", f"127.0.0.1:{port}", "--health-port", str(health)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
    try:
        deadline = time.monotonic() + 180
        while True:
            assert serve.poll() is None, serve.stderr.read()[-2000:]
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{health}/readyz", timeout=1).status == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.3)
        body = json.dumps({"model": "specrelay", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            text = json.loads(reply.read())["choices"][0]["text"]
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=60)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    assert text == tokenizer.decode(demo_greedy(PROMPT, 12))
