"""Loading, rendering and validating deploy/kubernetes, and reading the server's side of each
number (its CLI parser, README command, shutdown bounds) for tests/deploy.

Overlays are rendered by the kustomize binary, or by ``kubectl kustomize`` (the same kustomize
built into kubectl) when only kubectl is installed; with neither, rendering skips the test.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# Not a manifest: Helm values for prometheus-adapter, which the HPA component relies on.
ADAPTER_VALUES = KUBE / "components" / "hpa" / "prometheus-adapter-values.yaml"
# The oldest Kubernetes these manifests are meant for, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30", "1.37")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1.json",
}


def load_yaml(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomizations() -> list[Path]:
    return sorted(KUBE.rglob("kustomization.yaml"))


def listed_files() -> tuple[set[Path], set[Path]]:
    """(resources, patches): the files the kustomizations name (directories are other
    kustomizations, found by themselves)."""
    resources, patches = set(), set()
    for k in kustomizations():
        spec = load_yaml(k)[0]
        for entry in spec.get("resources", []):
            if (k.parent / entry).is_file():
                resources.add((k.parent / entry).resolve())
        for patch in spec.get("patches", []):
            if "path" in patch:
                patches.add((k.parent / patch["path"]).resolve())
    return resources, patches


@functools.cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    uri = f"urn:deepbatch-test:{CRD_SCHEMAS[(api_version, kind)]}"
    contents = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    registry = Registry().with_resource(uri, Resource.from_contents(contents))
    return jsonschema.Draft202012Validator({"$ref": f"{uri}#/$defs/{kind}"}, registry=registry)


def validate(doc: dict) -> None:
    """Raise unless ``doc`` is valid: built-in kinds for every version in K8S_VERSIONS with
    unknown fields rejected, CRDs against tests/deploy/schemas."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        crd_validator(*key).validate(doc)
        if doc["kind"] == "ScaledObject":  # the CRD's CEL rule, which a JSON schema cannot say
            spec = doc["spec"]
            assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100), doc
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@functools.cache
def render(directory: str) -> tuple[dict, ...]:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed: the overlays cannot be rendered")
    out = subprocess.run([*command, directory], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d is not None)


def overlay(name: str) -> tuple[dict, ...]:
    return render(str(KUBE / "overlays" / name))


def one(docs, kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def server_container(docs) -> dict:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


@functools.cache
def serve_flags(argv: tuple[str, ...]):
    """The container's command line as `deepbatch serve` parses it, defaults filled in."""
    from deepbatch.cli import build_parser

    assert argv[0] == "deepbatch", argv
    try:
        return build_parser().parse_args(list(argv[1:]))
    except SystemExit:  # argparse has printed why
        raise AssertionError(f"`deepbatch` rejects the container's command line {list(argv)}") from None


def container_flags(container: dict):
    return serve_flags(tuple(container["command"] + container.get("args", [])))


def readme_serve_command() -> list[str]:
    for block in re.findall(r"```[^\n]*\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        for line in block.splitlines():
            if line.startswith("deepbatch serve [MODEL]"):
                return shlex.split(line.split("#")[0])
    raise AssertionError("README.md shows no `deepbatch serve [MODEL] ...` command")


def uvicorn_graceful_shutdown_s() -> float:
    """The ``timeout_graceful_shutdown`` run_server gives uvicorn (read from the source: it only
    exists inside run_server)."""
    tree = ast.parse((ROOT / "deepbatch" / "api" / "server.py").read_text())
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "timeout_graceful_shutdown":
            if isinstance(node.value, ast.Constant):
                return float(node.value.value)
            if isinstance(node.value, ast.Name) and node.value.id in constants:
                return float(constants[node.value.id])
    raise AssertionError("deepbatch/api/server.py no longer passes timeout_graceful_shutdown to uvicorn")


def parse_keda_query(scaled: dict) -> tuple[str, dict[str, str]]:
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus"
    m = re.fullmatch(r"sum\(([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}\)", trigger["metadata"]["query"])
    assert m, trigger["metadata"]["query"]
    return m[1], dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', m[2]))


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (KUBE / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]
