"""deploy/: systemd units and Kubernetes manifests, checked against the real CLI and health code.

Every `specrelay ...` command line is parsed by `specrelay.cli.parser()` (systemd `ExecStart=` after the
unit's own variable and specifier expansion; container `command` + `args`), every probe must hit its
container's `--health-port` (never a ZeroMQ port), the exec probe command is run against the real health
servers, and Services, `--broker` endpoints, volumes and grace periods must agree with each other and with
the code's own timeouts. Optional: `systemd-analyze verify` and `kubectl kustomize` when installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from specrelay.cli import parser

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (it normally comes in with transformers)")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
KUBE = DEPLOY / "kubernetes"
UNITS = {  # unit file -> the subcommand its ExecStart must run
    "specrelay-broker.service": "broker",
    "specrelay-cloud-worker@.service": "cloud-worker",
    "specrelay-edge-worker.service": "edge-worker",
}
PACKAGE_DIR = {"broker": ROOT / "broker", "cloud-worker": ROOT / "cloud_worker", "edge-worker": ROOT / "edge_worker"}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet"}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
LOCAL_URL = re.compile(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[\w/]*)")


# ------------------------------------------------------------------------------------------ helpers

def parse_cli(argv: list[str]):
    """The real argparse parser; a rejected command line fails the test with argparse's own message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"specrelay rejects {argv}: exit {exc.code}: {err.getvalue().strip()}")


def zmq_port(endpoint: str) -> int | None:
    if endpoint.startswith("tcp://"):
        return int(endpoint.rsplit(":", 1)[1])
    return None


def zmq_ports(args) -> set[int]:
    endpoints = [getattr(args, name, None) for name in ("frontend", "backend", "broker", "listen")]
    return {p for p in map(zmq_port, filter(None, endpoints)) if p is not None}


# ------------------------------------------------------------------------------------------ YAML

def yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def test_deploy_tree_exists():
    for name in UNITS:
        assert (SYSTEMD / name).is_file(), name
    for name in ("broker.yaml", "cloud-worker.yaml", "edge-worker.yaml", "kustomization.yaml"):
        assert (KUBE / name).is_file(), name
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
    argv = exec_start_argv(read_unit(SYSTEMD / name), instance)
    assert Path(argv[0]).is_absolute() and Path(argv[0]).name == "specrelay", argv[0]
    return parse_cli(argv[1:])


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
        assert args.health_port is not None and args.device == "cuda:0"
        assert unit_args(name, "3").device == "cuda:3"


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
    ports = {"broker": unit_args("specrelay-broker.service").health_port}
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
    for endpoint in filter(None, (getattr(args, a, None) for a in ("listen", "frontend", "backend", "broker"))):
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


# ------------------------------------------------------------------------------------------ Kubernetes

def kube_docs() -> list[dict]:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((KUBE / resource).read_text()) if d is not None]
    return docs


def containers() -> list[tuple[dict, dict]]:
    """(workload, container) for every container that runs `specrelay`."""
    found = []
    for doc in kube_docs():
        if doc["kind"] in WORKLOADS:
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if Path((c.get("command") or ["?"])[0]).name == "specrelay":
                    found.append((doc, c))
    return found


def container_args(c: dict):
    argv = [*c["command"][1:], *c.get("args", [])]
    assert all(isinstance(a, str) for a in argv), f"{c['name']}: quote every argument: {argv}"
    assert not any("$(" in a for a in argv), f"{c['name']}: $(VAR) expansion is not checked here"
    return parse_cli(argv)


def by_command() -> dict[str, tuple[dict, dict, object]]:
    out = {}
    for workload, c in containers():
        args = container_args(c)
        assert args.command not in out, f"two workloads run {args.command}"
        out[args.command] = (workload, c, args)
    return out


def probe_target(probe: dict, c: dict) -> tuple[int, str]:
    """(port, path) an HTTP probe hits; TCP and gRPC probes fail the test (never probe a ZeroMQ port)."""
    assert "tcpSocket" not in probe and "grpc" not in probe, f"{c['name']}: only HTTP health probes"
    if "httpGet" in probe:
        port = probe["httpGet"]["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in c.get("ports", []) if p.get("name") == port)
        return int(port), probe["httpGet"]["path"]
    command = " ".join(probe["exec"]["command"])
    urls = LOCAL_URL.findall(command)
    assert len(urls) == 1, f"{c['name']}: an exec probe must GET exactly one local URL: {command}"
    return int(urls[0][0]), urls[0][1]


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_every_container_command_parses_with_the_real_cli():
    commands = by_command()
    assert set(commands) == {"broker", "cloud-worker", "edge-worker"}


def test_probes_hit_the_health_port_never_zmq():
    for command, (workload, c, args) in by_command().items():
        probes = {kind: c[kind] for kind in PROBES if kind in c}
        if getattr(args, "health_port", None) is None:
            assert not probes, f"{command} has no --health-port, so nothing to probe: {sorted(probes)}"
            continue
        assert {"livenessProbe", "readinessProbe"} <= set(probes), f"{command}: liveness and readiness"
        for kind, probe in probes.items():
            port, path = probe_target(probe, c)
            assert port == args.health_port, f"{command} {kind} probes {port}, --health-port is {args.health_port}"
            assert port not in zmq_ports(args), f"{command} {kind} probes a ZeroMQ port"
            assert path in ("/healthz", "/readyz"), f"{command} {kind}: {path}"


def test_probe_paths():
    commands = by_command()
    _, cloud, _ = commands["cloud-worker"]
    assert probe_target(cloud["startupProbe"], cloud)[1] == "/healthz", "startup = model loaded"
    assert probe_target(cloud["livenessProbe"], cloud)[1] == "/healthz"
    assert probe_target(cloud["readinessProbe"], cloud)[1] == "/readyz"
    _, broker, _ = commands["broker"]
    # /readyz is 503 until a worker registers, and workers reach the broker through its Service
    assert probe_target(broker["readinessProbe"], broker)[1] == "/healthz"


def test_exec_probes_pass_on_200_and_fail_on_503():
    """Run the manifests' exec probe commands against the real health servers."""
    from prometheus_client import CollectorRegistry

    from specrelay.common import health

    probes = []
    for command, (_, c, _) in by_command().items():
        for kind in PROBES:
            if kind in c and "exec" in c[kind]:
                probes.append((command, kind, c[kind]["exec"]["command"]))
    assert probes

    async def run_probe(argv: list[str], port: int) -> int:
        argv = [re.sub(r"(http://(?:127\.0\.0\.1|localhost)):\d+", rf"\g<1>:{port}", a) for a in argv]
        if argv[0] in ("python3", "python"):
            argv[0] = sys.executable
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        return await asyncio.wait_for(proc.wait(), 30)

    async def main() -> None:
        stats = {"live_workers": 0, "sessions_open": 0}
        up = {"ok": True}
        broker = health.Endpoints(lambda: (True, stats), lambda: (stats["live_workers"] > 0, stats),
                                  CollectorRegistry())
        cloud = health.Endpoints(lambda: (up["ok"], {}), lambda: (up["ok"], {}), CollectorRegistry())
        servers = {"broker": await health.start_http("127.0.0.1", 0, broker),
                   "cloud-worker": await health.start_http("127.0.0.1", 0, cloud)}
        try:
            for command, kind, argv in probes:
                port = servers[command].sockets[0].getsockname()[1]
                stats["live_workers"], up["ok"] = 1, True
                assert await run_probe(argv, port) == 0, f"{command} {kind} fails against a healthy server"
                stats["live_workers"], up["ok"] = 0, False
                path = LOCAL_URL.search(" ".join(argv)).group(2)
                if command == "cloud-worker" or path == "/readyz":
                    assert await run_probe(argv, port) != 0, f"{command} {kind} passes on a 503"
        finally:
            for server in servers.values():
                server.close()
                await server.wait_closed()

    asyncio.run(main())


def services() -> list[dict]:
    return [d for d in kube_docs() if d["kind"] == "Service"]


def service_for(workload: dict) -> dict | None:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    matching = [s for s in services() if s["spec"]["selector"].items() <= labels.items()]
    assert len(matching) <= 1
    return matching[0] if matching else None


def container_port(c: dict, target) -> int:
    if isinstance(target, int):
        return target
    return next(p["containerPort"] for p in c.get("ports", []) if p.get("name") == target)


def test_services_reach_the_bound_zmq_ports():
    for command, (workload, c, args) in by_command().items():
        svc = service_for(workload)
        binds = {"broker": lambda: [args.frontend, args.backend], "edge-worker": lambda: [args.listen]}
        binds = binds[command]() if command in binds else []
        if command == "cloud-worker":
            assert svc is None, "cloud workers dial the broker; they need no Service"
            continue
        assert svc is not None, f"no Service selects {command}"
        targets = {container_port(c, p.get("targetPort", p["port"])) for p in svc["spec"]["ports"]}
        for endpoint in binds:
            host = urlsplit(endpoint).hostname
            assert endpoint.startswith("tcp://") and host in ("0.0.0.0", "*", None), \
                f"{command} binds {endpoint}: unreachable from other pods"
            assert zmq_port(endpoint) in targets, f"{command} binds {endpoint}; Service targets {targets}"
            assert zmq_port(endpoint) in {p["containerPort"] for p in c.get("ports", [])}
        assert getattr(args, "health_port", None) is None or args.health_port not in targets, \
            "the health server listens on 127.0.0.1: a Service port for it would reach nothing"


def test_broker_endpoints_point_at_the_broker_service():
    commands = by_command()
    broker_workload, broker_c, broker_args = commands["broker"]
    svc = service_for(broker_workload)
    name = svc["metadata"]["name"]
    for command, side in (("cloud-worker", broker_args.backend), ("edge-worker", broker_args.frontend)):
        _, _, args = commands[command]
        url = urlsplit(args.broker)
        assert url.scheme == "tcp" and url.hostname.split(".")[0] == name, f"{command} --broker {args.broker}"
        port = next(p for p in svc["spec"]["ports"] if p["port"] == url.port)
        assert container_port(broker_c, port.get("targetPort", port["port"])) == zmq_port(side), \
            f"{command} reaches the broker's port {port}, not {side}"


def test_model_paths_are_mounted():
    for command, (workload, c, args) in by_command().items():
        mounts = [Path(m["mountPath"]) for m in c.get("volumeMounts", [])]
        for attr in ("model", "draft_model", "target_tokenizer"):
            value = getattr(args, attr, None)
            if value and value.startswith("/"):
                assert any(Path(value).is_relative_to(m) for m in mounts), f"{command} --{attr} {value} unmounted"


def test_cloud_worker_drains_within_the_grace_period():
    from specrelay.cloud_worker.server import WorkerConfig

    workload, c, _ = by_command()["cloud-worker"]
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    sleep = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= sleep + WorkerConfig().drain_timeout_s + 5, "SIGKILL would cut the drain short"
    assert "startupProbe" in c
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model loading needs minutes"


def test_broker_is_a_single_replica():
    workload, _, _ = by_command()["broker"]
    assert workload["kind"] == "Deployment" and workload["spec"]["replicas"] == 1
    assert workload["spec"]["strategy"]["type"] == "Recreate", "a rolling update would run two brokers"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders():
    proc = subprocess.run(["kubectl", "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(proc.stdout) if d)
    assert kinds == sorted(d["kind"] for d in kube_docs())
