"""deploy/kubernetes, offline: every manifest and every overlay's rendering validates against the
Kubernetes API schemas (kubernetes-validate, strict) or, for the CRDs, against
tests/deploy/schemas; and the numbers in them are the server's own: the probe path and port, the
grace period against --shutdown-timeout, the README's command, the metric the autoscalers read.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploytest_kube import (
    ADAPTER_VALUES, CRD_SCHEMAS, KUBE, ROOT, container_flags, dockerfile_instructions, kustomizations, listed_files,
    load_yaml, one, overlay, parse_keda_query, readme_serve_command, render, server_container,
    uvicorn_graceful_shutdown_s, validate,
)

OVERLAYS = ("cpu", "gpu")
# In this order: api-key patches the monitors, so it comes after them.
COMPONENTS = ("servicemonitor", "podmonitor", "keda", "hpa", "api-key")
# A checkout of a catalog of the CRDs' published JSON schemas ({group}/{kind}_{version}.json).
PUBLISHED_SCHEMAS = os.environ.get("DEEPBATCH_CRD_SCHEMA_DIR")
# The kubelet's SIGKILL must not come before the server's own exit: beyond the preStop sleep,
# --shutdown-timeout and uvicorn's bound on writing the last replies, the grace period leaves
# time for the step in progress, the engine's stop and the interpreter's exit; more than this
# much slack only delays the replacement of a wedged pod.
MAX_GRACE_SLACK_S = 10


@pytest.fixture(scope="module")
def with_all_components(tmp_path_factory) -> tuple[dict, ...]:
    """The base with every component applied (the overlays leave some out)."""
    where = tmp_path_factory.mktemp("all-components")

    def rel(path: Path) -> str:  # kustomize takes references relative to the kustomization
        return os.path.relpath(path, where)

    (where / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "deepbatch",
        "resources": [rel(KUBE / "base")], "components": [rel(KUBE / "components" / c) for c in COMPONENTS]}))
    return render(str(where))


# --- every manifest validates -------------------------------------------------------------------

def test_every_yaml_file_is_a_kustomization_or_listed_in_one():
    resources, patches = listed_files()
    known = {k.resolve() for k in kustomizations()} | resources | patches | {ADAPTER_VALUES.resolve()}
    stray = [p for p in KUBE.rglob("*.y*ml") if p.resolve() not in known]
    assert not stray, f"not referenced by any kustomization.yaml, so never validated or applied: {stray}"


@pytest.mark.parametrize("path", sorted(listed_files()[0]), ids=lambda p: str(p.relative_to(KUBE)))
def test_every_manifest_validates(path):
    for doc in load_yaml(path):
        validate(doc)


@pytest.mark.parametrize("name", OVERLAYS)
def test_each_overlay_renders_to_valid_objects(name):
    docs = overlay(name)
    for doc in docs:
        validate(doc)
    namespace = one(docs, "Namespace")["metadata"]["name"]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {namespace}


def test_every_component_applies_to_the_base(with_all_components):
    for doc in with_all_components:
        validate(doc)
    assert {d["kind"] for d in with_all_components} >= {
        "Deployment", "Service", "ServiceMonitor", "PodMonitor", "ScaledObject", "HorizontalPodAutoscaler"}


def test_the_validators_reject_broken_manifests():
    """The checks above can fail: a misspelt field or a wrongly typed value is an error."""
    deployment = load_yaml(KUBE / "base" / "deployment.yaml")[0]
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 50
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    scaled = load_yaml(KUBE / "components" / "keda" / "scaledobject.yaml")[0]
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 5  # KEDA takes strings only
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)
    monitor = load_yaml(KUBE / "components" / "servicemonitor" / "servicemonitor.yaml")[0]
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


@pytest.mark.skipif(not PUBLISHED_SCHEMAS, reason=(
    "the CRDs' published JSON schemas (KEDA, prometheus-operator) ship in no PyPI, npm or Debian package "
    "(npm's @kubernetes-models/* hold compiled validators, not schemas); tests/deploy/schemas holds the "
    "fields these manifests use, written from the CRD references. Set DEEPBATCH_CRD_SCHEMA_DIR to a CRD "
    "schema catalog ({group}/{kind}_{version}.json) to validate against the published ones too"))
def test_crds_validate_against_their_published_schemas():
    resources, _ = listed_files()
    crds = [d for p in sorted(resources) for d in load_yaml(p) if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS]
    assert crds
    for doc in crds:
        group, version = doc["apiVersion"].split("/")
        schema = json.loads((Path(PUBLISHED_SCHEMAS) / group / f"{doc['kind'].lower()}_{version}.json").read_text())
        jsonschema.Draft202012Validator(schema).validate(doc)


# --- the numbers are the server's -------------------------------------------------------------

@pytest.mark.parametrize("name", OVERLAYS)
def test_container_command_is_the_readmes(name):
    readme = readme_serve_command()
    assert readme[:3] == ["deepbatch", "serve", "[MODEL]"], readme
    container = server_container(overlay(name))
    assert container["command"] == readme[:2]
    args = container["args"]
    flags = readme[3:]  # the README's flags, in its order, after the optional MODEL
    assert any(args[i:i + len(flags)] == flags for i in range(len(args))), (args, flags)
    assert container_flags(container).model_tag in (None, args[0])  # MODEL, if any, comes first


@pytest.mark.parametrize("name", OVERLAYS)
def test_probes_ports_and_grace_period_match_the_servers_flags(name):
    from deepbatch.distributed.parallel_state import STARTUP_TIMEOUT_S

    docs = overlay(name)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    flags = container_flags(container)
    assert flags.host in ("0.0.0.0", "::"), "the kubelet and the Service reach the pod's IP, not loopback"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [flags.port]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        assert ports.get(get["port"], get["port"]) == flags.port, kind
        assert get.get("scheme", "HTTP") == "HTTP", kind
    assert len({container[k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}) == 1
    service = one(docs, "Service")
    assert [ports.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]] == [flags.port]

    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep", sleep
    drain = float(sleep[1]) + flags.shutdown_timeout + uvicorn_graceful_shutdown_s()
    grace = pod["terminationGracePeriodSeconds"]
    assert drain < grace <= drain + MAX_GRACE_SLACK_S, (grace, drain)

    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > STARTUP_TIMEOUT_S
    # The server reads DEEPBATCH_* variables; Service links would add DEEPBATCH_SERVICE_HOST & co.
    assert pod["enableServiceLinks"] is False


def test_probe_and_scrape_paths_are_the_servers_routes(with_all_components):
    """The probes' path answers without an API key, 200 while serving and 503 while draining
    (so readiness fails); the monitors' path serves the metrics and, with a key, needs it."""
    from fastapi.testclient import TestClient

    from deepbatch.api.server import ServerConfig, build_app
    from deepbatch.engine.async_engine import AsyncEngine

    sys.path.insert(0, str(ROOT / "tests" / "api"))  # the API tests' fake engine
    from apitest_fakes import FakeEngine

    probes = {server_container(overlay(n))[k]["httpGet"]["path"] for n in OVERLAYS
              for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    scrapes = {e["path"] for d in with_all_components
               for e in d["spec"].get("endpoints", []) + d["spec"].get("podMetricsEndpoints", [])}
    assert len(probes) == 1 and len(scrapes) == 1, (probes, scrapes)
    health, metrics = probes.pop(), scrapes.pop()
    app = build_app(AsyncEngine(FakeEngine()), ServerConfig(api_key="sk-test", log_stats_interval=0))
    with TestClient(app) as client:
        assert client.get(health).status_code == 200
        assert client.get(metrics).status_code == 401
        scraped = client.get(metrics, headers={"Authorization": "Bearer sk-test"})
        assert scraped.status_code == 200 and "vllm:num_requests_waiting" in scraped.text
        app.state.server_state.draining = True
        reply = client.get(health)
        assert reply.status_code == 503 and reply.json() == {"status": "draining"}


def test_monitors_and_autoscalers_point_at_the_server(with_all_components):
    docs = with_all_components
    deployment, service = one(docs, "Deployment"), one(docs, "Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = server_container(docs)
    port_names = {p["name"] for p in container["ports"]}
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names

    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    pod_monitor = one(docs, "PodMonitor")
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= port_names
    for kind in ("ScaledObject", "HorizontalPodAutoscaler"):
        target = one(docs, kind)["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"]), kind


def test_the_api_key_reaches_the_server_and_every_scrape(with_all_components):
    from deepbatch import envs

    docs = with_all_components
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in server_container(docs)["env"] if "valueFrom" in e}
    assert list(secrets) == ["DEEPBATCH_API_KEY"] and "DEEPBATCH_API_KEY" in dir(envs)
    ref = secrets["DEEPBATCH_API_KEY"]
    endpoints = (one(docs, "ServiceMonitor")["spec"]["endpoints"]
                 + one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"])
    for endpoint in endpoints:  # the server takes the key as a bearer token
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": ref["name"], "key": ref["key"]}}


def test_keda_sums_the_servers_waiting_requests_over_this_deployments_pods():
    from prometheus_client.parser import text_string_to_metric_families

    from deepbatch.api.metrics import ServerMetrics
    from deepbatch.engine.snapshot import EngineSnapshot

    docs = overlay("gpu")
    metric, matchers = parse_keda_query(one(docs, "ScaledObject"))
    deployment = one(docs, "Deployment")
    assert matchers == {"namespace": deployment["metadata"]["namespace"], "container": server_container(docs)["name"]}
    engine = SimpleNamespace(snapshot=lambda: EngineSnapshot(num_waiting=7), add_observer=lambda observer: None)
    text = ServerMetrics(engine, "m").render().decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[metric] == 7


def test_the_hpa_scales_like_the_scaled_object():
    scaled = load_yaml(KUBE / "components" / "keda" / "scaledobject.yaml")[0]
    hpa = load_yaml(KUBE / "components" / "hpa" / "hpa.yaml")[0]
    adapter = load_yaml(ADAPTER_VALUES)[0]
    metric, _ = parse_keda_query(scaled)
    (rule,) = adapter["rules"]["custom"]
    assert re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"])[0] == metric
    assert {k: v["resource"] for k, v in rule["resources"]["overrides"].items()} == {"namespace": "namespace",
                                                                                     "pod": "pod"}
    as_python = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])  # Go's ${1} is Python's \g<1>
    (source,) = hpa["spec"]["metrics"]
    assert source["type"] == "Pods"
    assert source["pods"]["metric"]["name"] == re.sub(rule["name"]["matches"], as_python, metric)
    assert source["pods"]["target"] == {"type": "AverageValue",
                                        "averageValue": scaled["spec"]["triggers"][0]["metadata"]["threshold"]}
    assert scaled["spec"]["triggers"][0]["metricType"] == "AverageValue"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"])
    assert hpa["spec"]["behavior"] == scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    prometheus = f"{adapter['prometheus']['url']}:{adapter['prometheus']['port']}"
    assert prometheus == scaled["spec"]["triggers"][0]["metadata"]["serverAddress"]


def test_gpu_overlay_requests_a_gpu_and_serves_the_model_volume():
    docs = overlay("gpu")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "1"
    model = container_flags(container).model_tag
    mount = next(m for m in container["volumeMounts"] if model.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    claim = one(docs, "PersistentVolumeClaim")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert container["image"].endswith(":cuda")


def test_cpu_overlay_serves_the_embedded_model_without_a_gpu_or_crds():
    docs = overlay("cpu")
    container = server_container(docs)
    flags = container_flags(container)
    assert flags.model_tag is None and flags.model is None and flags.device == "cpu"
    assert "nvidia.com/gpu" not in json.dumps(docs)
    assert not any((d["apiVersion"], d["kind"]) in CRD_SCHEMAS for d in docs)  # applies to any cluster
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["OMP_NUM_THREADS"] == container["resources"]["requests"]["cpu"]
    assert container["image"].endswith(":cpu")


# --- the image --------------------------------------------------------------------------------

def test_the_image_installs_like_the_readme_and_runs_its_command():
    steps = dockerfile_instructions()
    readme = (ROOT / "README.md").read_text()
    install = re.search(r"^(\./scripts/install\.sh) && deepbatch ", readme, re.M)[1]
    assert any(kind == "RUN" and install in shlex.split(arg) for kind, arg in steps), install
    pin = re.search(r"torch==([\w.]+)", (ROOT / "scripts" / "install.sh").read_text())[1]
    assert ("ARG", f"TORCH_VERSION={pin}") in steps
    command = readme_serve_command()
    assert json.loads(dict(steps)["ENTRYPOINT"]) == command[:2]
    assert json.loads(dict(steps)["CMD"]) == command[3:]  # no MODEL: the embedded one
    user = dict(steps)["USER"]
    deployment = load_yaml(KUBE / "base" / "deployment.yaml")[0]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user)
