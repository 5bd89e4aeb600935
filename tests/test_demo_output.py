"""What `specrelay demo` prints for a first-time reader: that the demo models are tiny and write nonsense, each
prompt apart from its completion, and why speculation's speed on loopback differs from a link's (the edge and
the cloud on separate cores, said so)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import MODELS, demo_available
from specrelay import demo
from specrelay.placement import Placement

RESULTS = [{"prompt": "def f(x):\n", "text": "\n    return x", "token_ids": [1, 2, 3]},
           {"prompt": "class A:\n", "text": "    pass", "token_ids": [4, 5]}]
SPEC, ALONE = {"tokens_per_s": 60.0}, {"tokens_per_s": 100.0}


def test_each_prompt_is_set_apart_from_its_completion():
    lines = demo.completion_lines(RESULTS)
    assert lines[:4] == [lines[0], "def f(x):", lines[2], "\n    return x"]
    assert lines[0].startswith("==== prompt 1 ") and lines[2].startswith("---- completion (3 tokens) ")
    assert lines[4].startswith("==== prompt 2 ") and lines[-1] == "=" * 72


@pytest.mark.skipif(not demo_available(), reason="demo models not trained")
def test_the_intro_says_the_models_are_tiny_and_write_nonsense():
    text = " ".join(demo.intro_lines(MODELS / "demo-target", MODELS / "demo-draft"))
    assert "demo-target: 8.4 M parameters" in text and "demo-draft: 1.6 M" in text
    assert "tiny" in text and "nonsense" in text


def test_why_loopback_differs_names_the_cores_and_the_round_trip():
    pinned = Placement((0,), (1,), True)
    text = " ".join(demo.why_lines(SPEC, ALONE, pinned, 5.1))
    assert "the edge runs on CPU 0, the broker and the cloud worker on CPU 1, as on two machines" in text
    assert "no round trip" in text and "5x its draft's size" in text and "(0.60x here)" in text
    assert "specrelay bench first" in text
    shared = " ".join(demo.why_lines(SPEC, ALONE, Placement((0, 1), (0, 1), False), 5.1))
    assert "share every core (--no-pin)" in shared


# `extended`: the default run's sibling is tests/test_packaging.py::test_specrelay_demo_from_the_installed_wheel, which
# runs the whole demo (every prompt, the link too) from the installed wheel and asserts all of this but the --limit
@pytest.mark.demo
@pytest.mark.extended
@pytest.mark.timeout(240)
@pytest.mark.skipif(not demo_available() or len(os.sched_getaffinity(0)) < 2, reason="demo models, 2 cores")
def test_demo_prints_it_all_from_a_real_run(tmp_path):
    run = subprocess.run([sys.executable, "-m", "specrelay.cli", "demo", "--limit", "1", "--max-new-tokens", "8",
                          "--link-ms", "0", "--json", str(tmp_path / "demo.json")],
                         capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "tiny" in out and "nonsense" in out
    assert "==== prompt 1 " in out and "---- completion (8 tokens) " in out
    assert "the edge runs on CPU 0, the broker and the cloud worker on CPU 1" in " ".join(out.split())
    assert "identical to target alone" in out
    import json

    record = json.loads((tmp_path / "demo.json").read_text())
    assert record["placement"]["pinned"] and len(record["load_average"]) == 3
