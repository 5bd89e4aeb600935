"""What tests/test_deploy*.py share: where deploy/ is, and parsing a command line the way the process will (the
real CLI plus the SPECRELAY_* variables its unit or container sets)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from specrelay import cliargs
from specrelay.cli import parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
KUBE = DEPLOY / "kubernetes"
BASE = KUBE / "base"
OVERLAYS = {name: KUBE / "overlays" / name for name in ("cpu", "gpu", "shared-models")}
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
PACKAGE_DIR = {"broker": ROOT / "broker", "cloud-worker": ROOT / "cloud_worker", "edge-worker": ROOT / "edge_worker"}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet"}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


# ------------------------------------------------------------------------------------------ helpers

def parse_cli(argv: list[str], env: dict[str, str] | None = None):
    """The real parser and the process's SPECRELAY_* environment; a rejected command line fails the test with
    the CLI's own message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return cliargs.parse(parser(), argv, env or {})
    except SystemExit as exc:
        pytest.fail(f"specrelay rejects {argv} (env {env}): exit {exc.code}: {err.getvalue().strip()}")


def zmq_port(endpoint: str) -> int | None:
    if endpoint.startswith("tcp://"):
        return int(endpoint.rsplit(":", 1)[1])
    return None


def zmq_ports(args) -> set[int]:
    endpoints = [getattr(args, name, None) for name in ("frontend", "backend", "listen")]
    endpoints += list(getattr(args, "broker", None) or ())  # --broker: one endpoint per broker
    return {p for p in map(zmq_port, filter(None, endpoints)) if p is not None}
