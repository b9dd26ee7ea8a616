"""A local Ray instance with Serve on a loopback port, applications deployed on it, and the
calls the tests make to them (the official openai client, the ingress's JSON routes, the
replicas' stats, the metrics)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

RAY_MISSING = "ray[serve] is not installed (pip install 'deepbatch[ray]'); the Ray Serve tests need it"
MODEL = "SmolLM2-135M-Instruct"
# Small engines: a short context, a few seats, a small KV pool (16-token blocks).
ENGINE = {"max_model_len": 512, "max_num_seqs": 4, "num_gpu_blocks_override": 256}
# Replicas start in parallel on a small, shared machine; loading one can take a minute there.
DEPLOY_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ray() -> str:
    """Ray with Serve's proxy on a free loopback port; returns the proxy's URL."""
    import ray
    from ray import serve

    # Logical CPUs for the replicas' reservations (one each); the machine may have fewer cores.
    ray.init(num_cpus=8, include_dashboard=False, logging_level="warning", _node_ip_address="127.0.0.1")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(interval)


class ServeApp:
    def __init__(self, name: str, proxy_url: str):
        self.name = name
        self.url = f"{proxy_url}/{name}"
        self.http = httpx.Client(base_url=self.url, timeout=120)

    @classmethod
    def deploy(cls, name: str, args: dict, proxy_url: str) -> ServeApp:
        from ray import serve

        from deepbatch.serve_ray.app import build_app

        serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
        app = cls(name, proxy_url)
        wait_for(lambda: serve.status().applications[name].status == "RUNNING", DEPLOY_TIMEOUT_S,
                 f"application {name} running")
        return app

    def delete(self) -> None:
        from ray import serve

        self.http.close()
        serve.delete(self.name)

    def openai(self) -> openai.OpenAI:
        # No client-side retries: what the server does is what the test sees.
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=180)

    def get(self, path: str):
        r = self.http.get(path)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict | None = None) -> httpx.Response:
        return self.http.post(path, json=body)

    def rollout(self) -> dict:
        return self.get("/v1/rollout")

    def start_rollout(self, spec: dict) -> dict:
        r = self.post("/v1/rollout", spec)
        assert r.status_code == 200, r.text
        return r.json()

    def replicas(self) -> dict[str, list[dict]]:
        return self.get("/v1/replicas")

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Samples by (name, sorted label pairs)."""
        r = self.http.get("/metrics")
        r.raise_for_status()
        out = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def broadcast(self, deployment: str, method: str, *args) -> list:
        from ray import serve

        handle = serve.get_deployment_handle(deployment, app_name=self.name)
        return handle.broadcast(method, *args).results(timeout_s=60)


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def users_on(arm: str, percent: float, count: int, prefix: str = "user") -> list[str]:
    """Tenants that a rollout at ``percent`` puts on ``arm``, by the definition of the split:
    the canary takes the hash buckets below percent/100 of the range."""
    from deepbatch.serve_ray.rollout import BUCKETS, tenant_bucket

    out, i = [], 0
    while len(out) < count:
        name = f"{prefix}-{i}"
        if (tenant_bucket(name) < percent * BUCKETS / 100) == (arm == "canary"):
            out.append(name)
        i += 1
    return out
