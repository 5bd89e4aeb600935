"""scripts/policy_ab.py: a patch rewrites a policy function from its source, and each run's bar lines are read from
the sweep JSON the bench writes (its bar functions on rows as the bench makes them)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from specrelay.bench import sweep, treesweep
from specrelay.edge_worker.policy import choose

AB = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "policy_ab.py"))


def test_a_patch_rewrites_a_method_from_its_source_and_refuses_a_text_it_cannot_place():
    before = choose.DraftPolicy.shape
    patched = AB["patch"](before, [("if est.vetoed:", "if False:")])
    assert patched is not before and patched.__name__ == "shape" and patched.__globals__ is before.__globals__
    with pytest.raises(SystemExit, match="occurs 0 times"):
        AB["patch"](before, [("no such text", "")])


def _row(trees: str, tps: float, calls: float, copy: int = 0, link: str = "none (loopback)") -> dict:
    return {"draft_len": "auto", "trees": trees, "copy": copy, "link": link, "sessions": 1, "predraft": True,
            "objective": "balanced", "tokens_per_s": tps, "tokens_per_call": calls, "tree_round_share":
            0.5 if trees == "auto" else 0.0, "tokens_per_s_slices": [tps], "outputs_identical_to_target_alone": True}


def test_each_runs_bar_lines_are_read_per_cell():
    rows = [_row("off", 100.0, 5.0), _row("auto", 95.0, 6.0), _row("off", 104.0, 4.0, copy=1),
            _row("off", 50.0, 5.6, link="RTT 50 ms"), _row("auto", 55.0, 7.0, link="RTT 50 ms")]
    bars = {"trees_auto_vs_chain_policy": treesweep.auto_vs_chain_policy(rows, sweep.paired),
            "control": treesweep.control(rows, sweep.paired)}
    got = AB["measures"]({"bars": bars, "rows": rows})
    loop, slow = (got[f"{link} sessions=1 predraft=True objective=balanced"] for link in ("none (loopback)",
                                                                                          "RTT 50 ms"))
    assert loop == {"auto_vs_chain_policy": 0.95, "tree_round_share": 0.5, "tokens_per_call_vs_chain_policy": 1.2,
                    "control": round(100 / 104, 3), "control_tokens_per_call": 1.25,
                    "outputs_identical": True}
    assert slow["auto_vs_chain_policy"] == 1.1 and slow["tokens_per_call_vs_chain_policy"] == 1.25
    assert slow["control"] is None


def test_the_sweeps_uneven_order_warning_reaches_the_ab_runs_output():
    # `--trees compare --control` with auto alone is 5 configurations: 10 orders (odd n: n rows and their reverses)
    assert sweep.uneven_order(10, 5) is None and sweep.uneven_order(20, 5) is None
    uneven = sweep.uneven_order(16, 5)  # 8 prompts x 2 repeats, one session: 1.6 passes
    assert uneven is not None and "multiple of 10" in uneven
    stderr = f"loading the draft\rsweep:  40%|####      | 200/500\n{uneven}\nTraceback is not here\n"
    assert AB["sweep_warnings"](stderr) == [uneven]
    assert AB["sweep_warnings"]("sweep: 100%|##########| 500/500\n") == []
    failed = "bench sweep: auto (balanced) over none (loopback): 10 generation(s) failed: timed out"  # sweep.run's
    assert AB["sweep_warnings"](f"{uneven}\n{failed}\n") == [uneven, failed]  # line for a configuration that failed
