"""Where the demo model pair is: `--models-dir` / SPECRELAY_MODELS, else the copy shipped inside the package
(package data `specrelay.models`; in a source checkout that is `models/`), else ./models."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .cliargs import UsageError

DEMO_PAIR = ("demo-target", "demo-draft")


def packaged_models() -> Path | None:
    """The package's own models directory (the wheel's specrelay/models, or the checkout's models/)."""
    spec = importlib.util.find_spec("specrelay.models")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def candidates(explicit: str | None = None) -> list[Path]:
    """Directories to look in, in order."""
    if explicit:
        return [Path(explicit).expanduser()]
    found = [p for p in (packaged_models(), Path.cwd() / "models") if p is not None]
    return list(dict.fromkeys(p.resolve() for p in found))


def has_pair(directory: Path) -> bool:
    return all((directory / name / "config.json").is_file() for name in DEMO_PAIR)


def models_dir(explicit: str | None = None) -> Path:
    """The first candidate that holds the demo pair; UsageError listing where it looked otherwise."""
    looked = candidates(explicit)
    for directory in looked:
        if has_pair(directory):
            return directory
    where = ", ".join(str(p) for p in looked)
    raise UsageError(f"the demo models ({' and '.join(DEMO_PAIR)}) are not in {where}; pass --models-dir DIR or "
                     "set SPECRELAY_MODELS to a directory that holds them (a source checkout's models/)")


def demo_model(name: str) -> str:
    """A demo model's directory for a flag's default (the packaged copy; a path that may not exist)."""
    root = packaged_models() or Path.cwd() / "models"
    return str(root / name)
