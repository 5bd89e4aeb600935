"""Key pairs for the CURVE tests (tests/test_security*.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from specrelay.common import auth


def role_keys(root: Path) -> tuple[Path, Path, Path]:
    """Key pairs in root/secrets (broker, edge, worker, app, rogue); the public keys the broker admits: edge.key in
    root/edges, worker.key in root/workers; and app.key in root/apps (an edge's --client-keys)."""
    secrets, edges, workers = root / "secrets", root / "edges", root / "workers"
    for name in ("broker", "edge", "worker", "app", "rogue"):
        auth.generate(secrets, name)
    for directory, name in ((edges, "edge"), (workers, "worker"), (root / "apps", "app")):
        directory.mkdir()
        shutil.copy(secrets / f"{name}.key", directory)
    return secrets, edges, workers
