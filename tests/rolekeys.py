"""Key pairs for the CURVE tests (tests/test_security*.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from specrelay.common import auth


def role_keys(root: Path) -> tuple[Path, Path, Path]:
    """Key pairs in root/secrets (broker, edge, worker, rogue), and the public keys the broker admits: edge.key in
    root/edges, worker.key in root/workers."""
    secrets, edges, workers = root / "secrets", root / "edges", root / "workers"
    for name in ("broker", "edge", "worker", "rogue"):
        auth.generate(secrets, name)
    edges.mkdir()
    workers.mkdir()
    shutil.copy(secrets / "edge.key", edges)
    shutil.copy(secrets / "worker.key", workers)
    return secrets, edges, workers
