"""The built wheel works on its own: installed (non-editable) into a fresh venv, run from a directory that is not
the checkout, `specrelay demo --max-new-tokens 8` finds the packaged demo pair and succeeds.

To stay fast and offline the fresh venv gets only the wheel (`pip install --no-deps --no-index`); the
dependencies (torch, transformers, ...) come from this venv's site-packages through a .pth line, which does not
run this venv's editable-install hook, so `import specrelay` can only find the wheel's copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.demo  # the wheel carries the demo pair and `specrelay demo` runs it


@pytest.fixture(scope="module")
def wheel(built_wheel) -> Path:
    return built_wheel


@pytest.fixture(scope="module")
def fresh(wheel, tmp_path_factory) -> Path:
    """A new venv holding the wheel; returns its bin/ directory."""
    home = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "--no-cache-dir", str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return home / "bin"


def test_wheel_carries_the_packages_and_the_demo_pair(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("specrelay", "specrelay/common", "specrelay/broker", "specrelay/edge_worker",
                    "specrelay/cloud_worker"):
        assert f"{package}/__init__.py" in names, package
    # every module of the source folders, subpackages included: pyproject.toml lists packages one by one, and a
    # subpackage missing there is missing from the wheel
    folders = {"specrelay": "specrelay", "common": "specrelay/common", "broker": "specrelay/broker",
               "edge_worker": "specrelay/edge_worker", "cloud_worker": "specrelay/cloud_worker"}
    missing = [f"{package}/{path.relative_to(ROOT / folder)}" for folder, package in folders.items()
               for path in (ROOT / folder).rglob("*.py")
               if f"{package}/{path.relative_to(ROOT / folder).as_posix()}" not in names]
    assert not missing, f"modules the wheel lacks (a package missing from pyproject.toml's list?): {missing}"
    for model in ("demo-target", "demo-draft"):
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            assert f"specrelay/models/{model}/{f}" in names
    assert not any(n.startswith(("tests/", "common/", "scripts/")) for n in names)


@pytest.mark.timeout(300)
def test_specrelay_demo_from_the_installed_wheel(fresh, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECRELAY_", "PYTHONPATH"))}
    where = subprocess.run([fresh / "python", "-c", "import specrelay, sys; print(specrelay.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert where.stdout.startswith(str(fresh.parent)), where.stdout + where.stderr
    version = subprocess.run([fresh / "specrelay", "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("specrelay ")
    demo = subprocess.run([fresh / "specrelay", "demo", "--max-new-tokens", "8", "--json", str(tmp_path / "demo.json")],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=280)
    assert demo.returncode == 0, demo.stderr[-3000:]
    out = demo.stdout
    assert "identical to target alone" in out and "tokens/s" in out
    assert "loading the draft model" in demo.stderr  # progress while the models load
    assert str(fresh.parent) in demo.stderr  # the demo pair came from the installed package
    # what a first-time reader sees (the one real demo run of `make test`; test_demo_output.py checks the pieces)
    assert "tiny" in out and "nonsense" in out
    assert "==== prompt 1 " in out and "---- completion (8 tokens) " in out
    record = json.loads((tmp_path / "demo.json").read_text())
    assert len(record["load_average"]) == 3
    if len(os.sched_getaffinity(0)) >= 2:
        assert record["placement"]["pinned"]
    if len(os.sched_getaffinity(0)) == 2:  # the line names the CPUs
        assert "the edge runs on CPU 0, the broker and the cloud worker on CPU 1" in " ".join(out.split())


def test_demo_says_where_it_looked(fresh, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECRELAY_")} | {"SPECRELAY_MODELS": str(tmp_path)}
    demo = subprocess.run([fresh / "specrelay", "demo"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=60)
    lines = demo.stderr.strip().splitlines()
    assert demo.returncode == 2 and len(lines) == 1 and str(tmp_path) in lines[0] and "--models-dir" in lines[0]
