"""`specrelay bench broker` drives a real broker process with fake workers and edges on the real protocol."""

from __future__ import annotations

import json

import pytest

from specrelay.bench.broker_load import main

pytestmark = pytest.mark.process  # bench broker starts a broker process


def test_bench_broker_routes_round_trips_without_errors(tmp_path, capsys):
    assert main(["--config", "2x4x2", "--warmup", "0.5", "--window", "1.5", "--broker-cpu", "-1",
                 "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "broker.json").read_text())["rows"]
    assert row["errors"] == 0 and row["round_trips_per_s"] > 50, row
    assert 0 < row["broker_cpu"] <= 1.5 and row["healthz_p99_ms"] < 5000
    assert " 2x4x2 |" in capsys.readouterr().out
