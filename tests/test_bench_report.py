"""What `bench sweep` draws and prints says what it measured (issue 21): time per output token rather than the
gaps between commits, bars (not lines) across configurations, "1 session", and the calls-vs-theory bar as a
ratio with its meaning rather than a bare `false`."""

from __future__ import annotations

import pytest

from specrelay.bench import plots
from specrelay.bench.report import bar_lines, markdown
from specrelay.bench.runs import SessionRun

pytest.importorskip("matplotlib")


def row(d, tokens_per_s: float, sessions: int = 1, objective=None) -> dict:
    return {"draft_len": d, "objective": objective, "predraft": d != 0, "link": "10 ms", "link_rtt_ms": 10.0,
            "link_rate_mbit": None, "sessions": sessions, "tokens_per_s": tokens_per_s, "mean_draft_len": 3.2,
            "cloud_calls_per_token": 1.0 if d == 0 else 0.4, "acceptance_per_position": [] if d == 0 else [0.8, 0.6]}


SWEEP = {"bench": "sweep", "rows": [row(0, 10.0), row(4, 25.0), row("auto", 27.0, objective="balanced")],
         "bars": {"calls_vs_theory_max": 1.034, "calls_le_1.02x_theory": False}}


@pytest.fixture
def ax():
    plt = plots._pyplot()
    fig, axes = plt.subplots()
    yield axes
    plt.close(fig)


def test_throughput_is_bars_per_configuration_without_lines(ax):
    plots.tokens_per_s(ax, SWEEP)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["target alone", "d=4", "auto (balanced)"]
    assert sorted(round(p.get_height()) for p in ax.patches) == [10, 25, 27]
    assert not [line for line in ax.get_lines() if len(line.get_xdata()) > 1]  # no line joins two configurations
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["RTT 10 ms, 1 session"]


def test_every_auto_objective_gets_its_star(ax):
    result = {**SWEEP, "rows": SWEEP["rows"] + [row("auto", 26.0, objective="speed")]}
    plots.cloud_calls(ax, result)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("auto (balanced)" in t for t in labels) and any("auto (speed)" in t for t in labels)


def test_the_sweep_plots_time_per_output_token_not_commit_gaps(tmp_path):
    files = plots.draw(tmp_path, "sweep", {**SWEEP, "tpot_ms_samples": {"d=4": [20.0, 22.0]},
                                           "itl_ms_samples": {"d=4": [80.0, 90.0]}})
    assert {f.name for f in files} == {"sweep_tokens_per_s.png", "sweep_cloud_calls.png", "sweep_acceptance.png",
                                       "sweep_tpot_cdf.png"}


def test_tpot_is_e2e_minus_ttft_over_tokens_after_the_first():
    run = SessionRun("p", ids=list(range(7)), commits=[(0.1, 3), (0.2, 2), (0.3, 2)])
    assert run.tpot_ms() == pytest.approx(200 / 6)
    assert SessionRun("p", ids=[1], commits=[(0.1, 1)]).tpot_ms() is None


def test_the_calls_bar_prints_its_ratio_and_meaning():
    lines = bar_lines(SWEEP["bars"])
    assert len(lines) == 1 and "1.034x" in lines[0] and "bar <= 1.02x: not met" in lines[0]
    assert "false" not in lines[0].lower()
    assert bar_lines({"a_new_bar": [1]}) == ["a_new_bar: [1]"]  # unknown: its JSON
    assert "1.034x" in markdown("sweep", {**SWEEP, "rows": []})
