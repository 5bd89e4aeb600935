from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import pytest
import torch
import zmq.asyncio

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"

torch.set_num_threads(1)
# child processes (LocalCluster, CLI runs) too: idle OpenMP threads spin, and oversubscribed cores make every
# timing in the suite erratic
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SPECRELAY_THREADS", "1")

# Tiers (`make test-fast` runs `unit` only): `demo`, tests that load the trained demo pair (marked by hand, or
# through the demo_runners fixture);
# `process`, every test of a module that starts processes (found in its source, so a new module cannot forget;
# or marked by hand where a helper starts them);
# `unit` is the rest: pure cores and sockets inside the test process.
# `extended` (marked by hand, pyproject.toml): a slow case whose behaviour a default-run sibling covers, named beside
# it; `make test` and `make test-fast` leave it out, `make test-all` runs it.
_STARTS_PROCESSES = re.compile(r"LocalCluster|subprocess|Popen|multiprocessing")


def pytest_collection_modifyitems(config, items):
    sources: dict[Path, bool] = {}
    for item in items:
        path = Path(item.fspath)
        if path not in sources:
            sources[path] = bool(_STARTS_PROCESSES.search(path.read_text()))
        if "demo_runners" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.demo)
        if item.get_closest_marker("demo") is None and item.get_closest_marker("process") is None:
            item.add_marker(pytest.mark.process if sources[path] else pytest.mark.unit)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir): tiny random Llama checkpoints sharing a byte-level BPE tokenizer."""
    from tiny import make_pair

    return make_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_runners(tiny_pair):
    from specrelay.common.runner import ModelRunner

    target, draft = tiny_pair
    return ModelRunner.load(str(target)), ModelRunner.load(str(draft))


def demo_available() -> bool:
    return all((MODELS / name / "config.json").exists() for name in ("demo-target", "demo-draft"))


@pytest.fixture(scope="session")
def demo_runners():
    if not demo_available():
        pytest.skip("demo models not trained yet (scripts/train_demo_models.py)")
    from specrelay.common.runner import ModelRunner

    return ModelRunner.load(str(MODELS / "demo-target")), ModelRunner.load(str(MODELS / "demo-draft"))


@pytest.fixture(scope="session")
def demo_greedy(demo_runners):
    """demo_greedy(prompt, n) -> the demo target's own HF greedy continuation, computed once per session: several
    demo tests check the same held-out prompts against it (about 5 s of `generate` each time otherwise)."""
    from tiny import hf_greedy

    target, cache = demo_runners[0], {}

    def reference(prompt: str, n: int) -> list[int]:
        if (prompt, n) not in cache:
            cache[prompt, n] = hf_greedy(target.model, target.tokenizer, prompt, n)
        return cache[prompt, n]

    return reference


@pytest.fixture(scope="session")
def heldout_prompts() -> list[str]:
    path = MODELS / "heldout_prompts.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
async def zctx():
    """A context whose sockets must all be closed by the end of the test: term() hangs on a leak."""
    ctx = zmq.asyncio.Context()
    yield ctx
    try:
        await asyncio.wait_for(asyncio.to_thread(ctx.term), 5)
    except asyncio.TimeoutError:
        ctx.destroy(linger=0)
        pytest.fail("a ZeroMQ socket was left open")


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> Path:
    """The project's wheel, built offline from a clean copy of the tree (no stale build/ can leak into it)."""
    import shutil
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("dist")
    source = tmp_path_factory.mktemp("src") / "specrelay"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                                ".train", ".pytest_cache", "bench_results", "dist"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = out.glob("specrelay-*.whl")
    return path
