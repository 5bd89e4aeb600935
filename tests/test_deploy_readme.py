"""deploy/README.md's Kubernetes steps, read as a platform engineer would follow them: the Secrets and ConfigMaps
they create are every one the rendered pods mount or read (with the keys the containers' paths name), every file
they load is made by an earlier step, the key commands run through the real CLI, and the first request carries
the API key the Kubernetes edge requires."""

from __future__ import annotations

import re
import shlex
from pathlib import Path, PurePosixPath

import pytest

from deploy_common import BASE, DEPLOY
from test_deploy_kubernetes import rendered

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (it normally comes in with transformers)")


def steps() -> list[list[str]]:
    """The Kubernetes section's shell block, one argv per command (comments and `&` dropped)."""
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("## Kubernetes:"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in block.splitlines() if shlex.split(line, comments=True)]


def created() -> dict[tuple[str, str], set[str]]:
    """(kind, name) -> the keys each `kubectl create secret generic|configmap` gives it."""
    made = {}
    for argv in steps():
        if argv[:1] != ["kubectl"] or "create" not in argv:
            continue
        rest = argv[argv.index("create") + 1:]
        if rest[0] not in ("secret", "configmap"):
            continue
        kind, name, options = ("Secret", rest[2], rest[3:]) if rest[0] == "secret" else ("ConfigMap", rest[1], rest[2:])
        keys = set()
        for option in options:
            flag, _, value = option.partition("=")
            if flag == "--from-file":
                keys.add(value.split("=", 1)[0] if "=" in value else PurePosixPath(value).name)
            elif flag == "--from-literal":
                keys.add(value.split("=", 1)[0])
        made[(kind, name)] = keys
    return made


def generated_config_maps() -> set[str]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return {g["name"] for g in kustomization.get("configMapGenerator", [])}


def referenced(docs: list[dict]) -> dict[tuple[str, str], set[str]]:
    """(kind, name) -> the keys the pods need of every Secret / ConfigMap they mount or read."""
    need: dict[tuple[str, str], set[str]] = {}
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if not pod:
            continue
        volumes = {}
        for v in pod.get("volumes", []):
            if "secret" in v:
                volumes[v["name"]] = ("Secret", v["secret"]["secretName"])
            elif "configMap" in v:
                volumes[v["name"]] = ("ConfigMap", v["configMap"]["name"])
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            values = [e.get("value", "") for e in c.get("env", [])] + c.get("args", [])
            for m in c.get("volumeMounts", []):
                if m["name"] in volumes:
                    keys = need.setdefault(volumes[m["name"]], set())
                    keys |= {PurePosixPath(v).relative_to(m["mountPath"]).parts[0] for v in values
                             if v.startswith(m["mountPath"] + "/")}
            for e in c.get("env", []):
                for ref, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                    if ref in e.get("valueFrom", {}):
                        need.setdefault((kind, e["valueFrom"][ref]["name"]), set()).add(e["valueFrom"][ref]["key"])
            for e in c.get("envFrom", []):
                for ref, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
                    if ref in e:
                        need.setdefault((kind, e[ref]["name"]), set())
    return {k: v for k, v in need.items() if not (k[0] == "ConfigMap" and k[1] in generated_config_maps())}


@pytest.mark.parametrize("overlay", sorted(rendered()))
def test_the_steps_create_everything_the_pods_mount(overlay):
    need, made = referenced(rendered()[overlay]), created()
    missing = sorted(set(need) - set(made))
    assert not missing, f"the pods mount {missing}, which the steps never create"
    for what, keys in need.items():
        assert keys <= made[what], f"{what} needs keys {keys - made[what]}"
    kinds = [kind for kind, _ in made]
    assert kinds.count("Secret") == 5 and kinds.count("ConfigMap") == 2  # what the section's first lines promise


def test_every_file_the_steps_load_is_made_by_an_earlier_step():
    made_files: set[str] = set()
    for argv in steps():
        if argv[:3] == ["specrelay", "keys", "generate"]:
            directory, name = argv[3], argv[argv.index("--name") + 1]
            made_files |= {f"{directory}/{name}.key", f"{directory}/{name}.key_secret"}
        made_files |= {argv[i + 1] for i, word in enumerate(argv[:-1]) if word == ">"}
        for option in argv:
            if option.startswith("--from-file="):
                path = option.removeprefix("--from-file=").split("=")[-1]
                assert path in made_files, f"{path} is loaded before any step makes it"


def test_the_key_steps_run_with_the_real_cli(tmp_path, monkeypatch):
    from specrelay.cli import main

    monkeypatch.chdir(tmp_path)
    for argv in steps():
        if argv[:3] == ["specrelay", "keys", "generate"]:
            assert main(argv[1:]) == 0
    assert {p.name for p in (tmp_path / "keys").iterdir()} >= {"broker.key_secret", "worker.key", "edge.key_secret"}


def test_the_first_request_sends_the_api_key():
    (curl,) = [argv for argv in steps() if argv[:1] == ["curl"]]
    assert any(word.startswith("Authorization: Bearer ") for word in curl), curl
