"""deploy/: the YAML files and the systemd units, checked against the real CLI and the processes' own code.

Every unit's `ExecStart=` is expanded as systemd does and parsed by the real CLI together with the unit's
Environment= / EnvironmentFile= variables (every flag reads SPECRELAY_*); Type=, the watchdog, timeouts, health
ports and ipc:// sockets must agree with what the processes do; `systemd-analyze verify` when installed.
Kubernetes and the Dockerfile: tests/test_deploy_kubernetes.py.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_common import BASE, DEPLOY, OVERLAYS, PACKAGE_DIR, SYSTEMD, parse_cli

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (it normally comes in with transformers)")

UNITS = {  # unit file -> the subcommand its ExecStart must run
    "specrelay-broker.service": "broker",
    "specrelay-cloud-worker@.service": "cloud-worker",
    "specrelay-edge-worker.service": "edge-worker",
}


# ------------------------------------------------------------------------------------------ YAML

def yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def test_deploy_tree_exists():
    for name in UNITS:
        assert (SYSTEMD / name).is_file(), name
    for name in ("broker.yaml", "cloud-worker.yaml", "edge-worker.yaml", "fetch-models.sh", "kustomization.yaml"):
        assert (BASE / name).is_file(), name
    for name in ("kustomization.yaml", "models-job.yaml", "models-pvc.yaml"):
        assert (BASE.parent / "components" / "shared-models" / name).is_file(), name
    for overlay in OVERLAYS.values():
        assert (overlay / "kustomization.yaml").is_file(), overlay
    assert (DEPLOY / "README.md").is_file()


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_document_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} has no YAML document"
    for doc in docs:
        assert isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc, f"{path}: {doc!r:.200}"


# ------------------------------------------------------------------------------------------ systemd

def read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """[section] -> key -> every value (repeated keys kept in order); backslash-newline continues a line."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    text = re.sub(r"\\\n", " ", path.read_text())
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path.name}:{n}: not KEY=VALUE in a section: {raw!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def specifiers(value: str, instance: str) -> str:
    def one(m: re.Match) -> str:
        if m.group(1) == "i":
            return instance
        if m.group(1) == "d":  # the credentials directory (LoadCredential=)
            return "/run/credentials/unit"
        if m.group(1) == "%":
            return "%"
        raise AssertionError(f"specifier %{m.group(1)} is not handled by this test: {value!r}")
    return re.sub(r"%(.)", one, value)


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        assert "=" in line, f"{path.name}:{n}: not KEY=VALUE: {raw!r}"
        key, value = line.split("=", 1)
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"{path.name}:{n}: bad name {key!r}"
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def unit_environment(unit: dict, instance: str) -> dict[str, str]:
    """Environment= first, then EnvironmentFile= in order (files override); /etc/specrelay/X is
    deploy/systemd/X here; an optional ("-") file that the repository does not ship is skipped."""
    service = unit["Service"]
    env: dict[str, str] = {}
    for value in service.get("Environment", []):
        for assignment in shlex.split(specifiers(value, instance)):
            key, _, val = assignment.partition("=")
            env[key] = val
    for value in service.get("EnvironmentFile", []):
        optional = value.startswith("-")
        path = Path(specifiers(value.lstrip("-"), instance))
        assert path.is_absolute() and path.parent == Path("/etc/specrelay"), f"unexpected EnvironmentFile {value}"
        local = SYSTEMD / path.name
        if not local.exists():
            assert optional, f"EnvironmentFile {path} is required but deploy/systemd/{path.name} is missing"
            continue
        env.update(read_env_file(local))
    return env


def exec_start_argv(unit: dict, instance: str = "0") -> list[str]:
    """ExecStart= expanded as systemd does: split into words (quotes respected), then ${VAR} inside a word
    is substituted, and a word that is exactly $VAR becomes zero or more words (split at whitespace).
    Unlike systemd, an undefined variable fails here instead of expanding to nothing."""
    values = unit["Service"]["ExecStart"]
    assert len(values) == 1, "one ExecStart="
    env = unit_environment(unit, instance)
    argv: list[str] = []
    for word in shlex.split(specifiers(values[0], instance)):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            assert whole.group(1) in env, f"${whole.group(1)} is not defined"
            argv += env[whole.group(1)].split()
            continue

        def sub(m: re.Match) -> str:
            assert m.group(1) in env, f"${{{m.group(1)}}} is not defined"
            return env[m.group(1)]
        word = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", sub, word)
        assert "$" not in word, f"unexpanded variable in {word!r}"
        argv.append(word)
    argv[0] = argv[0].lstrip("-@:+!|")
    return argv


def unit_args(name: str, instance: str = "0"):
    unit = read_unit(SYSTEMD / name)
    argv = exec_start_argv(unit, instance)
    assert Path(argv[0]).is_absolute() and Path(argv[0]).name == "specrelay", argv[0]
    return parse_cli(argv[1:], unit_environment(unit, instance))


def sends(package: str, state: str) -> bool:
    """Does the process's own code send this sd_notify state?"""
    return any(f'sd_notify("{state}")' in p.read_text() for p in PACKAGE_DIR[package].glob("*.py"))


def seconds(value: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "ms": 0.001, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_sections_and_keys(name):
    unit = read_unit(SYSTEMD / name)
    assert {"Unit", "Service", "Install"} <= set(unit), f"{name}: sections {sorted(unit)}"
    service = unit["Service"]
    assert unit["Unit"].get("Description"), "Description="
    assert unit["Install"].get("WantedBy") == ["multi-user.target"]
    assert service.get("ExecStart"), "ExecStart="
    assert service.get("Restart") == ["on-failure"]
    assert service.get("KillSignal") == ["SIGTERM"]
    assert service.get("TimeoutStopSec")
    user = service.get("User", ["root"])[-1]
    assert user not in ("root", "0"), "a dedicated user"
    assert service.get("NoNewPrivileges") == ["yes"]
    assert service.get("ProtectSystem") == ["strict"]
    assert service.get("PrivateTmp") == ["yes"]
    cache = unit_environment(unit, "0").get("SPECRELAY_CACHE")
    assert cache, "Environment=SPECRELAY_CACHE=..."
    writable = [Path(p.lstrip("-")) for v in service.get("ReadWritePaths", []) for p in v.split()]
    writable += [Path("/var/cache") / p for v in service.get("CacheDirectory", []) for p in v.split()]
    assert any(Path(cache).is_relative_to(w) for w in writable), \
        f"SPECRELAY_CACHE={cache} is read-only under ProtectSystem=strict (writable: {writable})"


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_exec_start_parses_with_the_real_cli(name):
    args = unit_args(name)
    assert args.command == UNITS[name]
    if UNITS[name] == "broker":
        assert args.health_port is not None
    if UNITS[name] == "cloud-worker":
        assert args.health_port is not None and args.device == "cuda:0" and args.dtype == "bfloat16"
        assert unit_args(name, "3").device == "cuda:3"
        assert all(b.endswith(":5556") for b in args.broker) and args.model.startswith("/")
    if UNITS[name] == "edge-worker":
        assert args.health_port is not None and args.http == ("127.0.0.1", 8000)
        assert all(b.endswith(":5555") for b in args.broker) and args.listen.startswith("ipc:///run/")


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_type_matches_what_the_process_notifies(name):
    """Type=notify without READY=1 would time out every start; WatchdogSec= without WATCHDOG=1 pings would
    kill a healthy process. So both follow the process's own code."""
    package = UNITS[name]
    service = read_unit(SYSTEMD / name)["Service"]
    if sends(package, "READY=1"):
        assert service.get("Type") == ["notify"] and service.get("NotifyAccess") == ["main"]
    else:
        assert service.get("Type", ["simple"]) == ["simple"], f"{package} never sends READY=1"
    if sends(package, "WATCHDOG=1"):
        assert service.get("WatchdogSec")
    else:
        assert "WatchdogSec" not in service, f"{package} never sends WATCHDOG=1"


def test_cloud_worker_unit_timing_matches_the_code():
    from specrelay.cloud_worker.server import WorkerConfig

    config = WorkerConfig()
    service = read_unit(SYSTEMD / "specrelay-cloud-worker@.service")["Service"]
    # WATCHDOG=1 is sent once per heartbeat interval: at least two pings per watchdog period
    assert config.heartbeat_interval <= seconds(service["WatchdogSec"][0]) / 2
    # SIGTERM: the running batch gets drain_timeout_s, then DISCONNECT; stopping must not SIGKILL that
    assert seconds(service["TimeoutStopSec"][0]) >= config.drain_timeout_s + 5
    assert seconds(service["TimeoutStartSec"][0]) >= 300, "model loading happens before READY=1"


def test_unit_health_ports_do_not_collide():
    ports = {"broker": unit_args("specrelay-broker.service").health_port,
             "edge-worker": unit_args("specrelay-edge-worker.service").health_port}
    for i in range(8):
        ports[f"cloud-worker@{i}"] = unit_args("specrelay-cloud-worker@.service", str(i)).health_port
    assert len(set(ports.values())) == len(ports), ports
    assert all(0 < p < 65536 for p in ports.values()), ports


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_ipc_sockets_are_visible_to_clients(name):
    """With PrivateTmp=yes, an ipc:// socket in /tmp is invisible to everyone else: it must live in the
    unit's RuntimeDirectory=."""
    unit = read_unit(SYSTEMD / name)
    args = unit_args(name)
    runtime = [Path("/run") / d for v in unit["Service"].get("RuntimeDirectory", []) for d in v.split()]
    endpoints = [getattr(args, a, None) for a in ("listen", "frontend", "backend")] + list(getattr(args, "broker", ()))
    for endpoint in filter(None, endpoints):
        if endpoint.startswith("ipc://"):
            path = Path(endpoint[len("ipc://"):])
            assert any(path.parent == r for r in runtime), f"{endpoint} is not in RuntimeDirectory= {runtime}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("name", sorted(UNITS))
def test_systemd_analyze_verify(name, tmp_path):
    """systemd's own parser: unknown keys, bad values and unknown sections are reported on stderr."""
    target = tmp_path / name.replace("@.", "@0.")
    target.write_text((SYSTEMD / name).read_text().replace("/opt/specrelay/venv/bin/specrelay",
                                                            str(Path(sys.executable).with_name("specrelay"))))
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(target)], capture_output=True,
                          text=True, timeout=60)
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if target.name in line or str(target) in line]
    assert proc.returncode == 0 and not ours, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(UNITS))
def test_units_run_with_curve_keys(name):
    """Every unit authenticates: the secret key arrives as a systemd credential (never in the environment file),
    the broker gets both allowlists, the others the broker's public key; nobody runs --insecure."""
    unit = read_unit(SYSTEMD / name)
    args = unit_args(name)
    creds = dict(c.split(":", 1) for c in unit["Service"].get("LoadCredential", []))
    assert args.curve_secret and args.curve_secret.startswith("/run/credentials/unit/"), args.curve_secret
    assert Path(args.curve_secret).name in creds and creds[Path(args.curve_secret).name].startswith("/etc/specrelay/keys/")
    if UNITS[name] == "broker":
        assert args.edge_keys and args.worker_keys and not args.insecure
        assert any(v.startswith("/bin/kill -HUP") for v in unit["Service"].get("ExecReload", []))
    else:
        assert args.broker_key == ("/etc/specrelay/keys/broker.key",)
    assert "KEY_SECRET" not in (SYSTEMD / "specrelay.env").read_text().upper().replace("NAME.KEY_SECRET", "")


@pytest.mark.parametrize("name", sorted(UNITS))
def test_units_raise_the_open_file_limit_above_the_processes_own_caps(name):
    """LimitNOFILE well above what the process caps itself at (HTTP connections, health connections): idle
    sockets then run into the process's cap, which closes the oldest, never into EMFILE."""
    from specrelay.common.health import MAX_CONNECTIONS as HEALTH_CONNECTIONS
    from specrelay.edge_worker.http.guards import HttpLimits

    limit = int(read_unit(SYSTEMD / name)["Service"]["LimitNOFILE"][-1])
    assert limit >= 4 * (HttpLimits().max_connections + HEALTH_CONNECTIONS), f"{name}: LimitNOFILE={limit}"


def test_edge_unit_knows_the_targets_context():
    unit = read_unit(SYSTEMD / "specrelay-edge-worker.service")
    args = parse_cli(["edge-worker"], unit_environment(unit, "0"))
    assert args.max_model_len or args.target_tokenizer
