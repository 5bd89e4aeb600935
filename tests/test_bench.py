"""CI smoke of `specrelay bench` on the tiny models (well under 60 s): the sweep's JSON lines follow the
documented schema, greedy outputs equal the target alone's, the result files and plots are written, and
`report` turns them into a markdown page."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from specrelay.bench.report import render_docs
from specrelay.bench.schema import STRESS_SUMMARY, SWEEP_ROW, validate

pytestmark = pytest.mark.timeout(120)


def bench(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specrelay.cli", "bench", *args], capture_output=True, text=True,
                          timeout=110, cwd=cwd)


def test_sweep_smoke_writes_schema_valid_rows(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "results"
    run = bench("sweep", "--target", str(target), "--draft", str(draft), "--link", "10ms", "--sessions", "2",
                "--num-prompts", "2", "--max-new-tokens", "8", "--draft-lens", "0,2,auto", "--json",
                "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["draft_len"] for r in rows] == [0, 2, "auto"]
    for row in rows:
        assert validate(row, SWEEP_ROW) == [], row
        assert row["outputs_identical_to_target_alone"] and row["errors"] == 0
        assert row["link_rtt_ms"] == 10 and row["rtt_ms_measured"] > 5
        assert row["placement"]["pinned"] == (len(os.sched_getaffinity(0)) >= 2) and len(row["load_average"]) == 3
    assert rows[0]["cloud_calls_per_token"] == 1.0  # the target alone: one VERIFY per token
    result = json.loads((out / "sweep.json").read_text())
    assert result["meta"]["command"].startswith("specrelay bench sweep") and result["rows"] == rows
    assert {p.name for p in out.glob("*.png")} >= {"sweep_tokens_per_s.png", "sweep_cloud_calls.png",
                                                   "sweep_acceptance.png", "sweep_tpot_cdf.png"}
    docs = tmp_path / "docs" / "benchmarks.md"
    render_docs(out, docs, tmp_path / "docs" / "bench")  # what `specrelay bench report` runs
    text = docs.read_text()
    assert "specrelay bench sweep" in text and "![sweep_tokens_per_s](bench/sweep_tokens_per_s.png)" in text


def test_calls_records_its_placement_and_load_and_no_pin_shares(tiny_pair, tmp_path):
    target, draft = tiny_pair
    for flags, pinned in (((), len(os.sched_getaffinity(0)) >= 2), (("--no-pin",), False)):
        run = bench("calls", "--target", str(target), "--draft", str(draft), "--num-prompts", "2",
                    "--max-new-tokens", "8", "--concurrency", "2", "--no-plots", "--out", str(tmp_path), *flags)
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads((tmp_path / "calls.json").read_text())
        assert result["placement"]["pinned"] is pinned and len(result["load_average"]) == 3
        assert result["outputs_identical_to_draft_len_0"]


def test_calls_repeats_interleaves_and_reports_medians_and_spread(tiny_pair, tmp_path):
    target, draft = tiny_pair
    run = bench("calls", "--target", str(target), "--draft", str(draft), "--num-prompts", "2", "--max-new-tokens",
                "8", "--concurrency", "2", "--no-plots", "--out", str(tmp_path), "--repeats", "3")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "calls.json").read_text())
    runs = result["runs"]
    assert len(runs) == 3 and all(r["outputs_identical_to_draft_len_0"] for r in runs)
    calls = sorted(r["cloud_calls_per_token"] for r in runs)
    assert result["cloud_calls_per_token"] == calls[1] and result["spread"]["cloud_calls_per_token"] == round(
        calls[-1] - calls[0], 4)


def test_legacy_benches_run_as_a_module_into_the_working_directory(tmp_path):
    run = subprocess.run([sys.executable, "-m", "specrelay.bench", "wire"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    wire = json.loads((tmp_path / "bench_results" / "wire.json").read_text())  # ./bench_results by default
    assert wire["any d"]["VERDICT (accepted + next token)"] == 9


def test_stress_smoke_real_processes(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "results"
    run = bench("stress", "--target", str(target), "--draft", str(draft), "--edges", "1", "--sessions-per-edge", "2",
                "--cloud-workers", "1", "--duration", "2", "--warmup", "1", "--sample-every", "0.25", "--link", "10ms",
                "--num-prompts", "3", "--max-new-tokens", "8", "--json", "--out", str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.splitlines()[-1])
    assert validate(summary, STRESS_SUMMARY) == [], summary
    assert summary["errors"] == 0 and summary["outputs_mismatched"] == 0 and summary["outputs_checked"] > 0
    assert set(summary["rss"]) == {"broker", "cloud-worker-0", "edge-0", "link-relay"}
    result = json.loads((out / "stress.json").read_text())
    assert result["bars"]["zero_errors"] and (out / "stress_rss.png").exists()


def test_draft_step_bench_compares_both_paths_on_the_same_drafts(tiny_pair, tmp_path):
    _, draft = tiny_pair
    run = bench("draft", "--draft", str(draft), "--sessions", "1", "3", "--draft-len", "3", "--rounds", "3",
                "--out", str(tmp_path), "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert [r["sessions"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["drafts_identical"] and row["in_place_ms_per_round"] > 0 and row["restack_ms_per_round"] > 0
    assert json.loads((tmp_path / "draft_step.json").read_text())["rows"] == result["rows"]


def _help(*names: str) -> str:
    from specrelay.bench.cli import parser

    ap = parser()
    for name in names:
        ap = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return " ".join(ap.format_help().split())  # one line: the wrapping of the help is the terminal's business


def test_bench_help_names_the_first_benchmark_and_subcommands_show_their_defaults(capsys):
    assert "Start with `specrelay bench first`: about a minute" in _help()
    assert "first start here: about a minute" in _help()
    assert "--sessions SESSIONS sessions in flight at once (default: 16)" in _help("sweep")
    assert "--sessions SESSIONS sessions in flight at once (default: 4)" in _help("first")
    assert "(default: 0,4,auto)" in _help("first") and "(default: bench_results/first)" in _help("first")
    assert "--concurrency CONCURRENCY sessions in flight at once (default: 8)" in _help("calls")
    assert "--duration DURATION seconds of load after the warm-up (default: 600.0)" in _help("stress")
    assert "(default: False)" not in _help("sweep") and "(default: None)" not in _help("sweep")  # switches, unset
    from specrelay.bench.cli import main

    with pytest.raises(SystemExit):
        main(["kv", "--help"])  # a benchmark with a parser of its own
    assert "(default: " in capsys.readouterr().out


def test_first_is_a_small_sweep_over_loopback_and_50ms_with_plots_and_a_header(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "first"
    run = bench("first", "--target", str(target), "--draft", str(draft), "--sessions", "2", "--num-prompts", "2",
                "--max-new-tokens", "6", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    header, rule, *lines = run.stdout.strip().splitlines()
    assert [c.strip() for c in header.strip("|").split("|")][:3] == ["link", "in flight", "configuration"]
    assert [c.strip() for c in lines[0].strip("|").split("|")][:3] == ["loopback", "2", "target alone"]
    assert [line.split("|")[1].strip() for line in lines] == ["loopback"] * 3 + ["RTT 50 ms"] * 3
    result = json.loads((out / "first.json").read_text())
    assert result["bench"] == "sweep" and result["meta"]["command"].startswith("specrelay bench first")
    assert [r["draft_len"] for r in result["rows"]] == [0, 4, "auto"] * 2
    assert all(r["outputs_identical_to_target_alone"] and r["sessions_in_flight"] == 2 for r in result["rows"])
    assert {p.name for p in out.glob("*.png")} == {"first_tokens_per_s.png", "first_cloud_calls.png",
                                                   "first_acceptance.png", "first_tpot_cdf.png"}


def test_sweep_runs_a_throwaway_edge_before_the_measured_edges_warm_up(monkeypatch):
    """The process's first drafts (torch's cold start) go to an edge of their own: taken by the first measured
    edge's warm-up, they made the edge made first run ahead of its own copy (1.014-1.049x in 7 of 7 runs)."""
    import asyncio

    from specrelay.bench import sweep
    from specrelay.bench.treesweep import Config
    from specrelay.edge_worker import server

    made, ran = [], []

    class Edge:  # the harness's order only: which edge runs which slice when
        def __init__(self, *args, **kwargs):
            made.append(self)

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            ran.append(("closed", made.index(self)))

    async def run_sessions(edge, part, config, sessions, bar=None):
        ran.append((made.index(edge), tuple(part)))
        return [], 0.0

    monkeypatch.setattr(server, "EdgeWorker", Edge)
    monkeypatch.setattr(sweep, "run_sessions", run_sessions)
    monkeypatch.setattr(sweep, "scrape", lambda ports: {})
    monkeypatch.setattr(sweep, "_cpu", lambda pids: {})
    monkeypatch.setattr(sweep.Tally, "add", lambda self, *args: None)
    args = argparse.Namespace(sessions=1, repeat=1, max_new_tokens=4, temperature=0.0, mode=None, seed=0)
    configs = [Config(0, False), Config("auto:balanced", True), Config("auto:balanced", True, copy=1)]
    asyncio.run(sweep._sweep_link(args, "tcp://127.0.0.1:1", [], [], ["a", "b"], configs, None, None))
    assert ran[:2] == [(0, ("a",)), ("closed", 0)]  # the throwaway edge: made first, run on slice 0, closed
    assert ran[2:4] == [(2, ("a",)), (3, ("a",))]  # then each auto edge's own warm-up (edge 1: the fixed lengths)
    assert all(i != 0 for i, _ in ran[4:])  # the throwaway edge measures nothing


def test_sweep_orders_each_configuration_in_each_place_and_after_each_other_equally_often():
    """A plain rotation kept each configuration's predecessor: the chain policy always ran after the same one and
    read 0.92-0.99x its own copy in 8 of 8 runs (16 sessions). With 4 slice runs over 7 configurations some also ran
    first more often; the sweep warns of such counts."""
    from collections import Counter

    from specrelay.bench.sweep import orders, uneven_order

    for n in range(1, 9):
        rows = orders(n)
        assert all(sorted(row) == list(range(n)) for row in rows)
        places = Counter((row[i], i) for row in rows for i in range(n))
        after = Counter((row[i - 1], row[i]) for row in rows for i in range(1, n))
        assert len(places) == n * n and len(set(places.values())) == 1
        assert len(after) == n * (n - 1) and len(set(after.values())) <= 1
    assert len(orders(7)) == 14 and len(orders(4)) == 4 and len(orders(1)) == 1
    assert "4 slice runs" in uneven_order(4, 7) and "multiple of 14" in uneven_order(4, 7)
    assert "multiple of 10" in uneven_order(5, 5)
    assert uneven_order(14, 7) is None and uneven_order(10, 5) is None and uneven_order(8, 4) is None


def test_trees_vs_chains_weighs_the_best_tree_against_chains_only():
    """A `--trees auto` row that drafted trees in 21 % of its rounds is no chain: counted as the best chain (it was
    the fastest row by majority shape), its tree rounds lent the chains their tokens per call, and the bar read
    1.16x where the trees committed 1.29x the chain policy's (one session over 50 ms, this stop's run)."""
    from specrelay.bench.treesweep import trees_vs_chains

    def row(trees, shape, tokens_per_s, tokens_per_call, d="auto"):
        return {"draft_len": d, "objective": "balanced", "trees": trees, "tree_nodes": None, "shape": shape,
                "link": "RTT 50 ms", "sessions": 1, "predraft": True, "tokens_per_s": tokens_per_s,
                "tokens_per_call": tokens_per_call, "mean_nodes": 5.0, "predraft_hit_rate": 0.7,
                "outputs_identical_to_target_alone": True}

    rows = [row("off", "chain", 13.7, 1.0, d=0), row("off", "chain", 38.9, 5.21), row("on", "tree", 39.8, 6.72),
            row("auto", "chain", 39.6, 5.79), row("off", "chain", 36.0, 5.17, d=12)]
    bar = trees_vs_chains(rows)["RTT 50 ms sessions=1 predraft=True"]
    assert (bar["best_chain"]["trees"], bar["best_chain"]["tokens_per_s"]) == ("off", 38.9)
    assert bar["best_tree"]["trees"] == "on" and bar["tokens_per_call_ratio"] == 1.29 and bar["bar_met"]
    rows[3]["shape"] = "tree"  # an auto row that drafted trees in most rounds is a tree (the faster one here)
    assert trees_vs_chains(rows)["RTT 50 ms sessions=1 predraft=True"]["best_tree"]["trees"] == "on"
    rows[3]["tokens_per_s"] = 40.0
    assert trees_vs_chains(rows)["RTT 50 ms sessions=1 predraft=True"]["best_tree"]["trees"] == "auto"


def test_sweep_bars_leave_out_a_configuration_whose_every_generation_failed():
    """A configuration whose sessions all failed (a cloud that went away, a broken policy) has 0 tokens/s: the bar
    lines that divide by it raised ZeroDivisionError after the whole sweep had run, and its rows were lost. Its bars
    are left out, and `failed` names it with its errors."""
    from specrelay.bench.sweep import evaluate

    def row(d, trees="off", tokens_per_s=40.0, copy=0, predraft=True, errors=0):
        return {"draft_len": d, "objective": None if d != "auto" else "balanced", "trees": trees, "tree_nodes": None,
                "copy": copy, "shape": "tree" if trees == "on" else "chain", "link": "none (loopback)", "sessions": 1,
                "predraft": predraft, "tokens_per_s": tokens_per_s, "tokens_per_call": 3.0, "mean_nodes": 3.0,
                "predraft_hit_rate": 0.5, "outputs_identical_to_target_alone": not errors, "calls_vs_theory": 1.0,
                "speedup_vs_target_alone": 1.5, "cloud_calls_per_token": 0.3,
                "tree_round_share": 0.1 * (trees != "off"), "tokens_per_s_slices": [tokens_per_s] * 2,
                "errors": errors, "error_samples": ["timeout"] * bool(errors)}

    rows = [row(0, predraft=False), row("auto", tokens_per_s=0.0, errors=10), row("auto", "on"), row("auto", "auto"),
            row("auto", copy=1), row("auto", predraft=False)]
    bars = evaluate(rows)
    assert bars["trees_auto_vs_chain_policy"] == {} and bars["control"] == {}
    assert bars["failed"] == [{"config": "auto (balanced)", "link": "none (loopback)", "errors": 10,
                               "error_samples": ["timeout"]}]
    rows[1].update(tokens_per_s=38.0, errors=0, error_samples=[])
    bars = evaluate(rows)
    assert bars["failed"] == [] and bars["trees_auto_vs_chain_policy"]["none (loopback) sessions=1 predraft=True "
                                                                      "objective=balanced"]["ratio"] == 1.053
