"""ARCHITECTURE.md names every module of the process packages and of specrelay/: a module nobody can find in the
map is a module a newcomer reads the whole tree to find."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("broker", "cloud_worker", "edge_worker", "common", "specrelay", "specrelay/bench")


def _modules() -> list[str]:
    return sorted(f"{folder}/{path.name}" for folder in FOLDERS for path in (ROOT / folder).glob("*.py")
                  if path.name not in ("__init__.py", "__main__.py"))


def test_every_module_is_named_in_architecture_md():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    missing = [m for m in _modules() if Path(m).stem not in words]
    assert not missing, f"modules not named in ARCHITECTURE.md: {missing}"


def test_the_map_names_no_module_that_is_gone():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:broker|cloud_worker|edge_worker|common|specrelay)/[\w/]+\.py)`", text))
    gone = sorted(path for path in named if not (ROOT / path).exists())
    assert not gone, f"ARCHITECTURE.md names files that do not exist: {gone}"
