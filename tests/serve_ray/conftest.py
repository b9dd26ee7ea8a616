"""One local Ray instance (and Serve proxy) for every Ray Serve test of the run, started by the
first test that needs it. Modules that need Ray skip themselves where it is not installed."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def serve_proxy_url():
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed")
    import ray
    from ray import serve

    from serve_ray_harness import start_ray

    url = start_ray()
    yield url
    serve.shutdown()
    ray.shutdown()
