"""docs/protocol.md's wire table is `specrelay bench wire`'s, so it cannot drift from the protocol."""

from __future__ import annotations

import argparse
from pathlib import Path

from specrelay.bench.legacy import bench_wire, wire_markdown

PROTOCOL_MD = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def test_the_protocol_pages_wire_table_is_the_benchmark_output():
    table = wire_markdown(bench_wire(argparse.Namespace()))
    assert table in PROTOCOL_MD.read_text(), f"docs/protocol.md's wire table is stale; `specrelay bench wire` prints:\n{table}"
