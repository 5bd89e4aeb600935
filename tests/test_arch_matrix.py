"""The architecture matrix (specrelay/archmatrix.py): tiny random models of every architecture in
specrelay/archs.py, each as a target behind a real broker and cloud worker (one child process for the cloud
side) and as a draft on a real edge (this process), greedy output equal to transformers' `generate` of the
target on held-out prompts; cross-vocabulary pairs included. Falcon and Bloom are served by the fallback."""

from __future__ import annotations

import asyncio
import json

import pytest

from specrelay import archmatrix as M
from specrelay.archs import ARCHS

from conftest import MODELS

FALLBACK = {"falcon", "bloom"}  # no AttentionInterface: the model's own cache


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """(rows of the result table, {target: (frontend, path, refusal)})."""
    chosen = M.pairs()
    models = M.build_models(tmp_path_factory.mktemp("archs"), chosen)
    targets = sorted({p.target.model_type for p in chosen})
    prompts = [json.loads(line)["prompt"] for line in (MODELS / "heldout_prompts.jsonl").read_text().splitlines()][:2]
    refs = M.references(models, targets, prompts, M.NEW_TOKENS)
    with M.cloud(models, targets) as endpoints:
        rows = asyncio.run(M.run_pairs(chosen, models, endpoints, refs, M.NEW_TOKENS))
    return rows, endpoints


def test_the_matrix_covers_enough_architectures():
    chosen = M.pairs()
    assert len(ARCHS) >= 25
    assert {p.target.model_type for p in chosen} == {p.draft.model_type for p in chosen if not p.cross_vocab}
    assert sum(p.cross_vocab for p in chosen) >= 2


def test_every_architecture_starts_on_its_path(matrix):
    _, endpoints = matrix
    paths = {name: path for name, (_, path, _) in endpoints.items()}
    assert {n for n, p in paths.items() if p == "own-cache"} == FALLBACK
    assert {n for n, p in paths.items() if p == "kv-store"} == {a.model_type for a in ARCHS} - FALLBACK


def test_greedy_through_broker_worker_and_edge_equals_generate(matrix):
    rows, _ = matrix
    failed = [(r["pair"], r["error"]) for r in rows if not r["exact"]]
    assert not failed
    assert all(r["drafted"] > 0 for r in rows)  # every draft model drafted through the edge's K/V path
