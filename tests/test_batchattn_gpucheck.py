"""scripts/gpu_check.sh end to end on the CPU (`--device cpu`: the same program at small sizes), so the device
check cannot rot before a GPU runs it: its exit status, and the JSON it writes, row by row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    run = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--out", str(tmp_path),
                          "--real", str(tmp_path / "no-real-models")], env={**os.environ, "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "verify step vs bare forward" in run.stdout and "throughput" in run.stdout
    exact = {(r["dtype"], r["attention"]): r for r in result["exactness"]}
    assert set(exact) == {(d, a) for d in ("float32", "bfloat16") for a in ("per-session", "batched")}
    assert all(r["exact"] for (dtype, _), r in exact.items() if dtype == "float32")
    assert all(r["equal_to_first_tie"] and r["prompts"] >= 2 for r in exact.values())
    steps = {(r["context"], r["batch"]) for r in result["steps"]}
    assert steps == {(64, 1), (64, 4), (96, 1), (96, 4), ("64-96", 4)}  # "64-96": contexts spread over a batch
    assert all(r[k] > 0 for r in result["steps"] for k in ("per-session_ms", "batched_ms"))
    assert all((r["forward_ms"] is None) == isinstance(r["context"], str) for r in result["steps"])
    assert all(r["forward_ms"] > 0 for r in result["steps"] if r["forward_ms"] is not None)
    layers = 8  # the demo target's
    assert all(r["batched_sdpa_calls"] == layers and r["per-session_sdpa_calls"] == layers * r["batch"]
               for r in result["steps"])
    tp = result["throughput"]
    assert tp["attention"] == "per-session" and tp["sessions"] == 4 and tp["tokens_per_s_1"] > 0 < tp["ratio"]
    assert result["real_models"] == [] and result["device"].startswith("cpu")


def test_a_part_of_the_check_that_fails_is_recorded_in_one_line_and_the_rest_runs():
    from specrelay.bench.gpucheck import _guarded

    assert _guarded(lambda: 1 // 0, lambda e: {"error": e}) == {"error": "ZeroDivisionError: integer division or modulo by zero"}
    assert _guarded(lambda: [1], lambda e: e) == [1]
