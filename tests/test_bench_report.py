"""What `bench sweep` draws and prints says what it measured (issue 21): time per output token rather than the
gaps between commits, bars (not lines) across configurations, "1 session", and the calls-vs-theory bar as a
ratio with its meaning rather than a bare `false`."""

from __future__ import annotations

import pytest

from specrelay.bench import plots
from specrelay.bench.report import bar_lines, markdown
from specrelay.bench.runs import SessionRun

pytest.importorskip("matplotlib")


def row(d, tokens_per_s: float, sessions: int = 1, objective=None, rtt: float = 10.0, **extra) -> dict:
    return {"draft_len": d, "objective": objective, "predraft": d != 0, "link": f"{rtt:g} ms", "link_rtt_ms": rtt,
            "link_rate_mbit": None, "sessions": sessions, "tokens_per_s": tokens_per_s, "mean_draft_len": 3.2,
            "cloud_calls_per_token": 1.0 if d == 0 else 0.4, "acceptance_per_position": [] if d == 0 else [0.8, 0.6],
            **extra}


SWEEP = {"bench": "sweep", "rows": [row(0, 10.0), row(4, 25.0), row("auto", 27.0, objective="balanced")],
         "bars": {"calls_vs_theory_max": 1.034, "calls_le_1.02x_theory": False}}


def two_links(sessions: int = 16, prompts: int = 6) -> dict:
    """A sweep over 0 and 50 ms that asked for 16 sessions where 6 prompts ran (6 in flight)."""
    rows = [row(d, 10.0 + i, rtt=rtt, objective="balanced" if d == "auto" else None, sessions=sessions,
                prompts=prompts, sessions_in_flight=min(sessions, prompts))
            for rtt in (0.0, 50.0) for i, d in enumerate((0, 2, 4, "auto"))]
    result = {"bench": "sweep", "rows": rows, "bars": {}}
    result["tpot_ms_samples"] = {plots.sample_key(r): [20.0 + i, 25.0, 30.0] for i, r in enumerate(rows)}
    return result


@pytest.fixture
def ax():
    plt = plots._pyplot()
    fig, axes = plt.subplots()
    yield axes
    plt.close(fig)


def test_throughput_is_bars_per_link_one_colour_per_configuration_without_lines(ax):
    plots.tokens_per_s(ax, SWEEP)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["RTT 10 ms\n1 session in flight"]
    assert sorted(round(p.get_height()) for p in ax.patches) == [10, 25, 27]
    assert not [line for line in ax.get_lines() if len(line.get_xdata()) > 1]  # no line joins two configurations
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["target alone", "d=4", "auto (balanced)"]


def test_every_auto_objective_gets_its_star(ax):
    result = {**SWEEP, "rows": SWEEP["rows"] + [row("auto", 26.0, objective="speed")]}
    plots.cloud_calls(ax, result)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "auto (balanced)" in labels and "auto (speed)" in labels
    stars = [line for line in ax.get_lines() if line.get_marker() == "*"]
    assert {line.get_color() for line in stars} == {plots.FIXED_COLOURS["auto (balanced)"],
                                                    plots.FIXED_COLOURS["auto (speed)"]}


def _colour_of(artist) -> str:
    from matplotlib.colors import to_hex
    return to_hex(artist.get_facecolor() if hasattr(artist, "get_height") else artist.get_color())


def test_one_colour_per_configuration_in_every_plot():
    result = two_links()
    plt = plots._pyplot()
    seen: dict[str, set[str]] = {}
    for make in (plots.tokens_per_s, plots.cloud_calls, plots.acceptance, plots.tpot_cdf):
        fig, ax = plt.subplots()
        make(ax, result)
        for handle, text in zip(ax.get_legend().legend_handles, ax.get_legend().get_texts()):
            if text.get_text() in {plots.configuration(r) for r in result["rows"]}:
                seen.setdefault(text.get_text(), set()).add(_colour_of(handle))
        drawn = [a for a in ax.patches + ax.get_lines() if _colour_of(a) != "#808080"]  # grey: theory, keys
        assert {_colour_of(a) for a in drawn} <= {c for cs in seen.values() for c in cs}, make.__name__
        plt.close(fig)
    assert set(seen) == {"target alone", "d=2", "d=4", "auto (balanced)"}
    assert all(len(colours) == 1 for colours in seen.values()), seen  # the same colour in all four plots
    assert len({c for cs in seen.values() for c in cs}) == len(seen)  # and a different one per configuration


def test_legends_beside_the_data_and_the_sessions_in_flight_as_run():
    result = two_links(sessions=16, prompts=6)
    plt = plots._pyplot()
    for make in (plots.tokens_per_s, plots.cloud_calls, plots.acceptance, plots.tpot_cdf):
        fig, ax = plt.subplots()
        make(ax, result)
        fig.canvas.draw()
        legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend.x0 >= axes.x1, make.__name__  # the legend is right of the axes, over no data
        words = " ".join(t.get_text() for t in ax.get_legend().get_texts()) + " ".join(
            t.get_text() for t in ax.get_xticklabels())
        assert "6 sessions in flight" in words and "16 session" not in words, make.__name__
        plt.close(fig)


def test_theory_lines_lie_under_the_measured_points_which_do_not_overlap(ax):
    plots.cloud_calls(ax, two_links())
    lines = [line for line in ax.get_lines() if len(line.get_xdata()) > 1]
    points = [line for line in ax.get_lines() if len(line.get_xdata()) == 1]
    assert len(lines) == 2 and len(points) == 8  # a theory line per link, a point per row
    assert max(line.get_zorder() for line in lines) < min(p.get_zorder() for p in points)
    assert {line.get_linestyle() for line in lines} == {"-", "--"}  # 0 and 50 ms told apart where they coincide
    at_d4 = [p.get_xdata()[0] for p in points if abs(p.get_xdata()[0] - 4) < 0.5]
    assert len(at_d4) == 2 and at_d4[0] != at_d4[1]  # the two links' d = 4 points side by side, not on top


def test_tpot_cdf_starts_at_zero_and_names_tpot_not_inter_token_latency(ax):
    plots.tpot_cdf(ax, two_links())
    assert ax.get_ylim()[0] == 0
    assert min(min(line.get_ydata()) for line in ax.get_lines() if len(line.get_xdata()) > 1) == 0
    text = (ax.get_xlabel() + ax.get_title()).lower()
    assert "time per output token" in text and "inter-token" not in text


def test_saved_plots_keep_the_legend_and_the_labels_whole(tmp_path):
    from matplotlib.image import imread

    files = plots.draw(tmp_path, "sweep", two_links())
    for f in files:
        height, width = imread(f).shape[:2]
        assert width > 640, f.name  # 6.4 in at 100 dpi plus the legend beside it: nothing cut at the edge


def test_console_rows_have_a_header_and_whole_link_names():
    from specrelay.bench.report import console_lines

    rows = [row(0, 10.0, rtt=25.0, prompts=6, sessions_in_flight=6, link="userspace TCP relay: RTT 25 ms (12.5 ms "
                "each way), unlimited rate", speedup_vs_target_alone=1.0, outputs_identical_to_target_alone=True)]
    lines = console_lines(rows)
    assert [h.strip() for h in lines[0].strip("|").split("|")][:4] == ["link", "in flight", "configuration",
                                                                      "tokens/s"]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:3] == ["RTT 25 ms", "6", "target alone"]  # the link named whole, the sessions as run


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


def test_each_objective_is_held_to_its_own_bar_and_the_slices_are_compared_pairwise():
    from specrelay.bench.sweep import evaluate

    def sweep_row(d, tps, slices, objective=None):
        return row(d, tps, objective=objective, calls_vs_theory=1.0, trees="off", tree_nodes=None, shape="chain",
                   speedup_vs_target_alone=tps / 10, tokens_per_s_slices=slices)

    rows = [sweep_row(0, 10.0, [10.0, 10.0]), sweep_row(4, 20.0, [16.0, 24.0]),
            sweep_row("auto", 19.0, [17.6, 21.6], "speed"), sweep_row("auto", 18.5, [16.0, 21.0], "balanced")]
    bars = evaluate(rows)["auto_vs_best_fixed"]
    speed, balanced = (bars[f"10 ms predraft=True objective={o}"] for o in ("speed", "balanced"))
    assert (speed["bar"], speed["auto_ge_bar"], balanced["bar"], balanced["auto_ge_bar"]) == (0.97, False, 0.9, True)
    assert speed["paired_ratios"] == {"median": 1.0, "min": 0.9, "max": 1.1, "slices": 2}
    lines = "\n".join(bar_lines({"auto_vs_best_fixed": bars}))
    assert "0.950x d=4 (bar >= 0.97x: not met; slice by slice 1.000x median, 0.900-1.100x over 2 slices)" in lines
    assert "0.925x d=4 (bar >= 0.90x: met;" in lines
    trees = sweep_row("auto", 18.0, [16.0, 23.0], "speed") | {"trees": "auto", "tree_round_share": 0.0}
    bars = evaluate(rows + [trees])["trees_auto_vs_chain_policy"]
    assert list(bars) == ["10 ms sessions=1 predraft=True objective=speed"]
    line = bar_lines({"trees_auto_vs_chain_policy": bars})[0]
    assert "0.947x its tokens/s (bar >= 1.0x: not met; slice by slice 0.987x median, 0.909-1.065x" in line


def test_a_control_copy_of_the_chain_policy_shows_the_noise_and_enters_no_other_bar():
    """`bench sweep --control`: the chain policy runs twice, each on an edge of its own. The copy's row is compared
    with the first only (the bar `control`: on loopback the same code read 0.94-1.08x of itself, as far from 1.0x as
    the `--trees auto` bar's loopback cells); it must not stand in for the chain policy in any other bar."""
    from specrelay.bench.sweep import evaluate

    def sweep_row(d, tps, slices, objective=None, **extra):
        return row(d, tps, objective=objective, calls_vs_theory=1.0, trees="off", tree_nodes=None, shape="chain",
                   speedup_vs_target_alone=tps / 10, tokens_per_s_slices=slices, **extra)

    rows = [sweep_row(0, 10.0, [10.0, 10.0]), sweep_row(4, 20.0, [16.0, 24.0]),
            sweep_row("auto", 19.0, [17.6, 21.6], "speed"),
            sweep_row("auto", 25.0, [30.0, 20.0], "speed", copy=1),
            sweep_row("auto", 18.0, [16.0, 23.0], "speed") | {"trees": "auto", "tree_round_share": 0.0}]
    bars = evaluate(rows)
    assert bars["auto_vs_best_fixed"]["10 ms predraft=True objective=speed"]["ratio"] == 0.95  # not the copy's 1.25x
    assert bars["auto_vs_best_fixed"]["10 ms predraft=True objective=speed trees=auto"]["ratio"] == 1.8  # apart
    assert bars["trees_auto_vs_chain_policy"]["10 ms sessions=1 predraft=True objective=speed"]["ratio"] == 0.947
    control = bars["control"]["10 ms sessions=1 predraft=True objective=speed"]
    assert control == {"ratio": 0.76, "paired_ratios": {"median": 0.833, "min": 0.587, "max": 1.08, "slices": 2}}
    line = bar_lines({"control": bars["control"]})[0]
    assert line.startswith("control, 10 ms sessions=1 predraft=True objective=speed: the chain policy at 0.760x")
    assert evaluate(rows[:3])["control"] == {}


def test_a_sweep_whose_every_generation_failed_reports_no_ratio_instead_of_crashing():
    """Found when an edge raised on every round: the sweep divided by a fixed length's 0 tokens/s and printed a
    ZeroDivisionError in place of its table, whose errors column says what failed."""
    from specrelay.bench.sweep import evaluate

    failed = dict(calls_vs_theory=None, trees="off", tree_nodes=None, shape="chain", speedup_vs_target_alone=None,
                  tokens_per_s_slices=[0.0], errors=8)
    rows = [row(0, 0.0, **failed), row(4, 0.0, **failed), row("auto", 0.0, objective="speed", **failed)]
    assert evaluate(rows)["auto_vs_best_fixed"] == {}


def test_report_embeds_only_the_plots_a_benchmark_writes(tmp_path):
    import json

    from specrelay.bench.report import render_docs

    out = tmp_path / "results"
    out.mkdir()
    result = {**two_links(), "meta": {"command": "specrelay bench sweep"}}
    (out / "sweep.json").write_text(json.dumps(result))
    plots.draw(out, "sweep", result)
    (out / "sweep_itl_cdf.png").write_bytes(b"left by an older sweep")
    text = render_docs(out, tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "bench").read_text()
    assert "sweep_tpot_cdf.png" in text and "itl_cdf" not in text


def test_the_benchmarks_page_embeds_no_plot_that_is_not_there():
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", (docs / "benchmarks.md").read_text())
    assert [i for i in images if not (docs / i).exists()] == []
    assert [i for i in images if re.search(r"sweep[^/]*_itl_cdf", i)] == []  # the sweep plots TPOT, not gaps
