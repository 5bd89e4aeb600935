"""deploy/kubernetes (kustomize base + cpu/gpu overlays) and deploy/docker, checked against the real CLI and code.

Every container's command line is parsed by the real CLI together with its `env` (every flag reads SPECRELAY_*);
every rendered object of both overlays passes the Kubernetes schema (kubernetes-validate, strict); every probe is
an httpGet on the container's resolved --health-port with --health-host 0.0.0.0, never a ZeroMQ port; annotations,
Services, --broker endpoints, volumes and grace periods agree with each other and with the code's timeouts; the
brokers are a StatefulSet of replicas behind a headless Service, each named in every worker's and edge's --broker;
the Dockerfile passes hadolint and its slim broker image's packages run the broker without torch.
"""

from __future__ import annotations

import asyncio
import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from deploy_common import BASE, DOCKERFILE, OVERLAYS, PROBES, WORKLOADS, parse_cli, zmq_port, zmq_ports

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (it normally comes in with transformers)")


# ------------------------------------------------------------------------------------------ Kubernetes

def base_docs() -> list[dict]:
    """The base's resources as written (no kustomize needed)."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / resource).read_text()) if d is not None]
    return docs


def kustomize(path: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (kustomize renders the overlays)")
    proc = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@functools.lru_cache(maxsize=None)
def rendered() -> dict[str, list[dict]]:
    """What each overlay deploys (the base's files when kubectl is missing, for the checks that need no kustomize)."""
    if shutil.which("kubectl") is None:
        return {"base": base_docs()}
    return {name: kustomize(path) for name, path in OVERLAYS.items()}


def env_of(c: dict) -> dict[str, str]:
    env = {}
    for item in c.get("env", []):
        assert "value" in item or "valueFrom" in item, item
        if "value" in item:
            env[item["name"]] = item["value"]
    return env


def containers(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, container) for every container that runs `specrelay`."""
    found = []
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if Path((c.get("command") or ["?"])[0]).name == "specrelay":
                    found.append((doc, c))
    return found


def container_args(c: dict):
    argv = [*c["command"][1:], *c.get("args", [])]
    assert all(isinstance(a, str) for a in argv), f"{c['name']}: quote every argument: {argv}"
    assert not any("$(" in a for a in argv), f"{c['name']}: $(VAR) expansion is not checked here"
    return parse_cli(argv, env_of(c))


def by_command(docs: list[dict]) -> dict[str, tuple[dict, dict, object]]:
    out = {}
    for workload, c in containers(docs):
        args = container_args(c)
        assert args.command not in out, f"two workloads run {args.command}"
        out[args.command] = (workload, c, args)
    return out


def every_overlay():
    return pytest.mark.parametrize("overlay", sorted(rendered()) if shutil.which("kubectl") is None
                                   else sorted(OVERLAYS))


def named_port(c: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c.get("ports", []) if p.get("name") == port)


def test_base_lists_every_manifest():
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    present = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == present


@every_overlay()
def test_every_rendered_object_passes_the_kubernetes_schema(overlay):
    validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    docs = rendered()[overlay]
    shared = {"Job", "PersistentVolumeClaim"} if overlay == "shared-models" else set()
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap",
                                        "PodDisruptionBudget"} | shared
    for doc in docs:
        validate.validate(doc, validate.latest_version(), strict=True)  # raises ValidationError


@every_overlay()
def test_every_container_command_parses_with_the_real_cli(overlay):
    commands = by_command(rendered()[overlay])
    assert set(commands) == {"broker", "cloud-worker", "edge-worker"}


@every_overlay()
def test_probes_are_http_gets_on_the_health_port(overlay):
    for command, (workload, c, args) in by_command(rendered()[overlay]).items():
        assert args.health_port is not None and args.health_host == "0.0.0.0", f"{command}: probes reach the pod IP"
        probes = {kind: c[kind] for kind in PROBES if kind in c}
        assert {"livenessProbe", "readinessProbe"} <= set(probes), f"{command}: liveness and readiness"
        for kind, probe in probes.items():
            assert set(probe) & {"httpGet", "exec", "tcpSocket", "grpc"} == {"httpGet"}, f"{command} {kind}"
            port = named_port(c, probe["httpGet"]["port"])
            assert port == args.health_port, f"{command} {kind} probes {port}, --health-port is {args.health_port}"
            assert port not in zmq_ports(args), f"{command} {kind} probes a ZeroMQ port"
            assert probe["httpGet"]["path"] in ("/healthz", "/readyz"), f"{command} {kind}"


@every_overlay()
def test_metrics_are_exposed_for_scraping(overlay):
    for command, (workload, c, args) in by_command(rendered()[overlay]).items():
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", command
        assert int(annotations["prometheus.io/port"]) == args.health_port and annotations["prometheus.io/path"] == "/metrics"
        assert args.health_port in {p["containerPort"] for p in c["ports"]}, f"{command}: declare the health port"


def test_probe_paths():
    commands = by_command(base_docs())
    _, cloud, _ = commands["cloud-worker"]
    assert cloud["startupProbe"]["httpGet"]["path"] == "/healthz", "startup = model loaded"
    assert cloud["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert cloud["readinessProbe"]["httpGet"]["path"] == "/readyz"
    _, broker, _ = commands["broker"]
    # /readyz is 503 until a worker registers, and workers reach the broker through its Service
    assert broker["readinessProbe"]["httpGet"]["path"] == "/healthz"


def test_health_endpoints_answer_the_probe_paths():
    """The paths the probes GET exist on the real health server: 200 when healthy, 503 when not."""
    import urllib.error
    import urllib.request

    from prometheus_client import CollectorRegistry

    from specrelay.common import health

    async def main() -> None:
        state = {"ok": True}
        endpoints = health.Endpoints(lambda: (state["ok"], {}), lambda: (state["ok"], {}), CollectorRegistry())
        server = await health.start_http("0.0.0.0", 0, endpoints)
        port = server.sockets[0].getsockname()[1]

        def get(path: str) -> int:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status
            except urllib.error.HTTPError as exc:
                return exc.code
        try:
            for path in ("/healthz", "/readyz", "/metrics"):
                assert await asyncio.to_thread(get, path) == 200
            state["ok"] = False
            assert await asyncio.to_thread(get, "/healthz") == 503
            assert await asyncio.to_thread(get, "/readyz") == 503
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def services(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "Service"]


def service_for(workload: dict, docs: list[dict]) -> dict | None:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    matching = [s for s in services(docs) if s["spec"]["selector"].items() <= labels.items()]
    assert len(matching) <= 1
    return matching[0] if matching else None


@every_overlay()
def test_services_reach_the_bound_ports(overlay):
    docs = rendered()[overlay]
    for command, (workload, c, args) in by_command(docs).items():
        svc = service_for(workload, docs)
        if command == "cloud-worker":
            assert svc is None, "cloud workers dial the broker; they need no Service"
            continue
        assert svc is not None, f"no Service selects {command}"
        targets = {named_port(c, p.get("targetPort", p["port"])) for p in svc["spec"]["ports"]}
        binds = [args.frontend, args.backend] if command == "broker" else [args.listen]
        for endpoint in binds:
            host = urlsplit(endpoint).hostname
            assert endpoint.startswith("tcp://") and host in ("0.0.0.0", "*", None), \
                f"{command} binds {endpoint}: unreachable from other pods"
            assert zmq_port(endpoint) in targets, f"{command} binds {endpoint}; Service targets {targets}"
        if command == "edge-worker":
            assert args.http is not None and args.http[0] == "0.0.0.0" and args.http[1] in targets, "HTTP API"


@every_overlay()
def test_broker_endpoints_name_every_replica_of_the_broker_statefulset(overlay):
    """Workers and edges address the brokers one by one: their --broker lists are exactly the StatefulSet's
    replicas, in ordinal order, by their stable names under the headless Service, on the right port."""
    docs = rendered()[overlay]
    commands = by_command(docs)
    broker_workload, broker_c, broker_args = commands["broker"]
    svc = service_for(broker_workload, docs)
    assert svc["spec"]["clusterIP"] == "None" and broker_workload["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"].get("publishNotReadyAddresses") is True, "a worker that starts first must find each broker"
    replicas = broker_workload["spec"]["replicas"]
    names = [f"{broker_workload['metadata']['name']}-{i}.{svc['metadata']['name']}" for i in range(replicas)]
    for command, side in (("cloud-worker", broker_args.backend), ("edge-worker", broker_args.frontend)):
        _, _, args = commands[command]
        urls = [urlsplit(endpoint) for endpoint in args.broker]
        assert [url.hostname for url in urls] == names, f"{command} --broker {args.broker}: one per replica"
        for url in urls:
            port = next(p for p in svc["spec"]["ports"] if p["port"] == url.port)
            assert url.scheme == "tcp" and named_port(broker_c, port.get("targetPort", port["port"])) == \
                zmq_port(side), f"{command} reaches the broker's port {port}, not {side}"


# what each worker needs under /models, in fetch-models.sh's parts (the edge: the draft, and the target's config
# and tokenizer for its context)
PARTS = {"cloud-worker": {"target"}, "edge-worker": {"draft", "target-tok"}}


@every_overlay()
def test_workers_start_only_once_their_models_are_there(overlay):
    """Every model path a worker reads is mounted read-only from a volume that, before the worker starts, its own
    init container fills (the default: a copy per pod, no ReadWriteMany needed) or waits for the markers of the
    Job that fills the shared volume (components/shared-models)."""
    docs = rendered()[overlay]
    jobs = [d for d in docs if d["kind"] == "Job"]
    for command, (workload, c, args) in by_command(docs).items():
        pod = workload["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        paths = [getattr(args, a, None) for a in ("model", "draft_model", "target_tokenizer")]
        paths = [p for p in paths if p and p.startswith("/")]
        if not paths:
            continue
        mount = next((m for m in mounts.values() if all(Path(p).is_relative_to(m["mountPath"]) for p in paths)), None)
        assert mount is not None and mount.get("readOnly"), f"{command}: {paths} not mounted read-only"
        (init,) = [i for i in pod.get("initContainers", []) if mount["name"] in
                   {m["name"] for m in i.get("volumeMounts", [])}]
        script = " ".join(init.get("command", []) + init.get("args", []))
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:  # its own copy: the init container fetches exactly this worker's parts
            assert init["command"] == ["sh", "/scripts/fetch-models.sh"] and set(init["args"]) == PARTS[command]
            assert not init_mount(init, mount["name"]).get("readOnly")
        else:  # the shared volume: the Job writes it, the init container waits for its markers
            claim = volume["persistentVolumeClaim"]["claimName"]
            (job,) = jobs
            spec = job["spec"]["template"]["spec"]
            fetched = {part for j in spec["containers"] if "fetch-models.sh" in " ".join(j["command"])
                       for part in j["args"]}
            written = {v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
            assert claim in written
            needs = {"target" if p == "target-tok" else p for p in PARTS[command]}  # the whole target covers it
            assert needs <= fetched and all(f"/models/.ready-{p}" in script for p in needs), script
    assert BASE.joinpath("fetch-models.sh").read_text().count('touch ".ready-$part"') == 1  # in /models


def init_mount(container: dict, volume: str) -> dict:
    return next(m for m in container["volumeMounts"] if m["name"] == volume)


def test_editing_models_env_renames_nothing(tmp_path):
    """A Job's pod template is immutable: were the generated ConfigMap named by its content's hash, editing
    models.env would change the Job's template and `kubectl apply` would fail until the Job is deleted."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(BASE.parent, copy)
    (copy / "base" / "models.env").write_text("TARGET_MODEL=Qwen/Qwen2.5-7B-Instruct\nDRAFT_MODEL=Qwen/Qwen2.5-0.5B\n")
    for overlay in OVERLAYS:
        before, after = (kustomize(root / "overlays" / overlay) for root in (BASE.parent, copy))
        templates = lambda docs: {(d["kind"], d["metadata"]["name"]): d["spec"].get("template")  # noqa: E731
                                  for d in docs if d["kind"] != "ConfigMap"}
        assert templates(before) == templates(after), overlay
        (models,) = [d for d in after if d["kind"] == "ConfigMap" and d["data"].get("TARGET_MODEL")]
        assert models["metadata"]["name"] == "specrelay-models" and "Qwen" in models["data"]["TARGET_MODEL"]


def test_gpu_overlay_runs_cuda_bfloat16_on_one_gpu_per_pod():
    docs = kustomize(OVERLAYS["gpu"])
    workload, c, args = by_command(docs)["cloud-worker"]
    assert args.device == "cuda" and args.dtype == "bfloat16"
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert any(t["key"] == "nvidia.com/gpu" for t in workload["spec"]["template"]["spec"]["tolerations"])
    _, _, cpu_args = by_command(kustomize(OVERLAYS["cpu"]))["cloud-worker"]
    assert cpu_args.device == "cpu" and cpu_args.dtype == "float32"
    for other in ("broker", "edge-worker"):  # only the cloud workers need GPUs
        assert "nvidia.com/gpu" not in str(by_command(docs)[other][1].get("resources"))


def test_cloud_worker_drains_within_the_grace_period():
    from specrelay.cloud_worker.server import WorkerConfig

    workload, c, _ = by_command(base_docs())["cloud-worker"]
    pre_stop = c["lifecycle"]["preStop"]
    sleep = float(pre_stop["sleep"]["seconds"]) if "sleep" in pre_stop else 0.0
    grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= sleep + WorkerConfig().drain_timeout_s + 5, "SIGKILL would cut the drain short"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model loading needs minutes"


def test_brokers_are_replicas_that_fail_over_one_at_a_time_on_the_slim_image():
    docs = base_docs()
    workload, c, _ = by_command(docs)["broker"]
    assert workload["kind"] == "StatefulSet" and workload["spec"]["replicas"] >= 2, "several brokers, failover"
    assert workload["spec"]["podManagementPolicy"] == "Parallel"
    assert workload["spec"]["updateStrategy"]["type"] == "RollingUpdate", "one broker restarts at a time"
    (budget,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["maxUnavailable"] == 1
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert c["image"].split(":")[0].endswith("-broker"), "the broker runs the image without torch"
    for command in ("cloud-worker", "edge-worker"):
        assert not by_command(docs)[command][1]["image"].split(":")[0].endswith("-broker")


def test_one_broker_key_serves_every_replica():
    """The replicas share one template, so one key pair (one Secret): workers and edges give one --broker-key for
    all brokers, which the CLI pairs with every --broker."""
    from specrelay.common.brokers import per_broker

    for command in ("cloud-worker", "edge-worker"):
        _, _, args = by_command(base_docs())[command]
        assert len(args.broker_key) == 1 and len(per_broker(args.broker_key, len(args.broker))) == len(args.broker)


# ------------------------------------------------------------------------------------------ Dockerfile

def dockerfile_stages() -> dict[str, str]:
    stages, name = {}, None
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            name = m.group(1)
            stages[name] = ""
        elif name:
            stages[name] += line + "\n"
    return stages


def broker_deps() -> list[str]:
    m = re.search(r'ARG BROKER_DEPS="([^"]+)"', DOCKERFILE.read_text())
    return [re.split(r"[<>=!]", spec)[0] for spec in m.group(1).split()]


def test_dockerfile_has_a_slim_broker_and_non_root_role_images():
    stages = dockerfile_stages()
    assert {"wheel", "broker", "worker"} <= set(stages)
    assert "--no-deps" in stages["broker"] and "torch" not in stages["broker"], "the broker image has no torch"
    for role in ("broker", "worker"):
        user = re.findall(r"^USER\s+(\S+)", stages[role], re.M)
        assert user and user[-1].split(":")[0] not in ("root", "0"), f"{role} runs as non-root"
        assert 'ENTRYPOINT ["specrelay"]' in stages[role]
    images = {c["image"].split(":")[0] for _, c in containers(base_docs())}
    comments = DOCKERFILE.read_text()
    assert all(f"-t {image}:" in comments for image in images), "every image the manifests run is built here"


@pytest.mark.skipif(shutil.which("hadolint") is None and not (Path(sys.executable).parent / "hadolint").exists(),
                    reason="hadolint is not installed")
def test_hadolint():
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    proc = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(180)
def test_broker_runs_with_only_the_slim_images_packages(built_wheel, tmp_path):
    """The broker image installs specrelay --no-deps plus BROKER_DEPS: the same here, and `specrelay broker`
    serves /healthz while torch cannot even be imported."""
    import importlib.util
    import time
    import urllib.request
    import venv

    from specrelay.cluster import free_port

    deps = tmp_path / "deps"
    deps.mkdir()
    for dist in broker_deps():
        module = {"pyzmq": "zmq"}.get(dist, dist)
        spec = importlib.util.find_spec(module)
        if spec is None:
            continue  # an optional speed-up (uvloop) that this venv lacks
        origin = Path(spec.submodule_search_locations[0]) if spec.submodule_search_locations else Path(spec.origin)
        (deps / origin.name).symlink_to(origin)
        for libs in origin.parent.glob(f"{dist}.libs"):  # manylinux wheels' vendored shared libraries
            (deps / libs.name).symlink_to(libs)
    home = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / "bin" / "python"
    site = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    (Path(site) / "deps.pth").write_text(f"{deps}\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           str(built_wheel)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0
    port = free_port()
    broker = subprocess.Popen([home / "bin" / "specrelay", "broker", "--frontend", f"tcp://127.0.0.1:{free_port()}",
                               "--backend", f"tcp://127.0.0.1:{free_port()}", "--health-port", str(port)],
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert broker.poll() is None, broker.stderr.read()[-2000:]
            try:
                assert urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).status == 200
                break
            except OSError:
                assert time.monotonic() < deadline, "the slim broker never answered /healthz"
                time.sleep(0.2)
    finally:
        broker.terminate()
        broker.wait(timeout=20)


@every_overlay()
def test_every_process_runs_with_curve_keys_from_its_own_secret(overlay):
    """CURVE everywhere: each key file the CLI is pointed at lies in a read-only volume of the pod, the secret key
    in a Secret that only its role mounts, the allowlists in ConfigMaps; nobody passes --insecure."""
    secrets_by_role = {}
    for command, (workload, c, args) in by_command(rendered()[overlay]).items():
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}

        def source(path: str) -> dict:
            owner = max((m for m in mounts if path.startswith(m.rstrip("/") + "/") or path == m), key=len)
            return mounts[owner]

        assert args.curve_secret, f"{command} runs without --curve-secret"
        secret = source(args.curve_secret)
        assert "secret" in secret and oct(secret["secret"]["defaultMode"]) == "0o440", secret
        secrets_by_role[command] = secret["secret"]["secretName"]
        if command == "broker":
            assert not args.insecure
            assert "configMap" in source(args.edge_keys + "/x") and "configMap" in source(args.worker_keys + "/x")
        else:
            for key in args.broker_key:
                assert source(key)["secret"]["secretName"] == secrets_by_role[command]
    assert len(set(secrets_by_role.values())) == 3  # no role can read another role's secret key


# ------------------------------------------------------------------------------------------ NetworkPolicy

def _policies(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "NetworkPolicy"]


def _admits(policy: dict, labels: dict, port_name: str) -> list[dict]:
    """The `from` peers of `policy`'s rules that open `port_name` on a pod with `labels`."""
    selector = policy["spec"]["podSelector"].get("matchLabels", {})
    if not selector.items() <= labels.items():
        return []
    return [peer for rule in policy["spec"].get("ingress", []) if any(p["port"] == port_name for p in rule["ports"])
            for peer in rule["from"]]


@every_overlay()
def test_network_policies_open_each_port_only_to_its_peers(overlay):
    """Default deny; the broker's frontend only from edges, its backend only from cloud workers; the edge's
    client ports only from labelled clients; every health port only from Prometheus; every named port exists."""
    docs = rendered()[overlay]
    policies = _policies(docs)
    deny = [p for p in policies if not p["spec"].get("ingress")]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"]
    pods = {command: (w["spec"]["template"]["metadata"]["labels"], c)
            for command, (w, c, _) in by_command(docs).items()}
    role = lambda peer: peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")  # noqa: E731
    expected = {("broker", "frontend"): {"edge-worker"}, ("broker", "backend"): {"cloud-worker"}}
    for command, (labels, container) in pods.items():
        for port in (p["name"] for p in container["ports"]):
            peers = [peer for policy in policies for peer in _admits(policy, labels, port)]
            assert peers, f"{command}: port {port} is open to nobody"
            if (command, port) in expected:
                assert {role(peer) for peer in peers} == expected[(command, port)], (command, port, peers)
                assert all("namespaceSelector" not in peer for peer in peers)
            elif port == "health":
                assert all(peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
                           for peer in peers)
            else:
                assert command == "edge-worker" and port in ("http", "clients"), (command, port)
                assert all(peer["podSelector"]["matchLabels"] == {"specrelay.io/client": "true"} for peer in peers)


@every_overlay()
def test_an_edge_on_a_pod_address_requires_api_keys(overlay):
    _, container, args = by_command(rendered()[overlay])["edge-worker"]
    if args.http and args.http[0] not in ("127.0.0.1", "::1"):
        assert args.api_key or args.api_key_file, "the edge's HTTP API listens on the pod IP without API keys"


@every_overlay()
def test_the_edge_knows_the_targets_context(overlay):
    """The edge reads the target's config (its context) from the directory the Job fills: a request past the
    context is refused before any work."""
    _, _, args = by_command(rendered()[overlay])["edge-worker"]
    assert args.max_model_len or args.target_tokenizer == "/models/target"


# ------------------------------------------------------------------------------------------ image hygiene

def test_dockerignore_keeps_the_venv_out_and_every_copied_path_in():
    """The build context is the repository root, where a 1.7 GB .venv sits: .dockerignore leaves it (and .git)
    out, and nothing the Dockerfile COPYs from the context."""
    import fnmatch

    root = DOCKERFILE.parents[2]
    patterns = [line.strip() for line in (root / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    ignored = lambda path: any(fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)  # noqa: E731
    assert ignored(".venv") and ignored(".git")
    copied = [src for line in DOCKERFILE.read_text().splitlines() if line.startswith("COPY ") and "--from=" not in line
              for src in line.split()[1:-1]]
    assert copied and not [src for src in copied if ignored(src.rstrip("/"))], copied


def test_broker_image_installs_its_packages_with_the_constraints_file():
    root = DOCKERFILE.parents[2]
    pins = {re.split(r"==", line)[0].strip().lower().replace("_", "-")
            for line in (root / "constraints.txt").read_text().splitlines() if "==" in line}
    install = next(line for line in dockerfile_stages()["broker"].splitlines() if "${BROKER_DEPS}" in line)
    assert "-c /tmp/constraints.txt ${BROKER_DEPS}" in install, install
    assert all(dep.lower().replace("_", "-") in pins for dep in broker_deps()), (broker_deps(), pins)


def test_the_images_workdir_belongs_to_the_user_it_runs_as():
    for role, stage in dockerfile_stages().items():
        workdirs = re.findall(r"^WORKDIR\s+(\S+)", stage, re.M)
        user = (re.findall(r"^USER\s+(\d+)", stage, re.M) or [None])[-1]
        if role == "wheel" or not workdirs or user is None:
            continue
        for path in workdirs:
            assert re.search(rf"install -d -o {user} -g {user} {re.escape(path)}\b", stage), \
                f"{role}: WORKDIR {path} is root's unless created for uid {user}"


def test_fetch_models_gives_each_worker_what_it_reads(tmp_path):
    """base/fetch-models.sh with the demo pair, as the edge's init container runs it: the draft in draft/, the
    target's config and tokenizer (no weights) in target/, which the edge's own loaders accept."""
    import os

    from specrelay.common.modelsource import check_model
    from specrelay.edge_worker.loading import target_context

    env = dict(os.environ, MODELS_DIR=str(tmp_path), TARGET_MODEL="demo", DRAFT_MODEL="demo",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["sh", str(BASE / "fetch-models.sh"), "draft", "target-tok"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / ".ready-draft").exists() and (tmp_path / ".ready-target-tok").exists()
    check_model(str(tmp_path / "draft"), "--draft-model")
    check_model(str(tmp_path / "target"), "--target-tokenizer", weights=False)
    assert not list((tmp_path / "target").glob("*.safetensors"))  # the edge needs no target weights
    assert target_context(str(tmp_path / "target")) == 1024
