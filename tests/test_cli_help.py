"""`specrelay bench --help` reaches every benchmark (it used to list only `rest`)."""

from __future__ import annotations

import pytest

from specrelay.cli import main


def test_bench_help_lists_every_benchmark(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for name in ("sweep", "stress", "calls", "wire", "kv", "fuzz", "xvdraft", "draft", "report"):
        assert f"    {name} " in out, name
