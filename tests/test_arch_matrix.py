"""The architecture matrix (specrelay/bench/archmatrix.py): tiny random models of every architecture in
specrelay/archs.py, each as a target behind a real broker and cloud worker (one child process for the cloud
side) and as a draft on a real edge (this process), greedy output equal to transformers' `generate` of the
target on held-out prompts; cross-vocabulary pairs included. Falcon and Bloom are served by the fallback."""

from __future__ import annotations

import pytest

from specrelay.bench import archmatrix as M
from specrelay.archs import ARCHS

FALLBACK = {"falcon", "bloom"}  # no AttentionInterface: the model's own cache


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    """The result of `specrelay bench archs` (2 held-out prompts, 8 new tokens per pair)."""
    return M.run(tmp_path_factory.mktemp("archs"))


def test_the_matrix_covers_enough_architectures():
    chosen = M.pairs()
    assert len(ARCHS) >= 25
    assert {p.target.model_type for p in chosen} == {p.draft.model_type for p in chosen if not p.cross_vocab}
    assert sum(p.cross_vocab for p in chosen) >= 2


def test_every_architecture_starts_on_its_path(matrix):
    cloud = {row["architecture"]: row["cloud"] for row in matrix["table"]}
    assert {a for a, path in cloud.items() if path.startswith("fallback")} == FALLBACK
    assert {a for a, path in cloud.items() if path.startswith("supported")} == {a.model_type for a in ARCHS} - FALLBACK


def test_greedy_through_broker_worker_and_edge_equals_generate(matrix):
    failed = [(r["pair"], r["error"]) for r in matrix["pairs"] if not r["exact"]]
    assert not failed
    assert all(r["drafted"] > 0 for r in matrix["pairs"])  # every draft model drafted through the edge's K/V path
    assert all(row["target"] == row["draft"] == "✓" for row in matrix["table"])
