"""A short ``deepbatch bench serve`` run against the real CPU server: every request succeeds and
the server's counters agree with the load generator's totals."""

from __future__ import annotations

import argparse

import pytest

from apitest_server import MAIN_SERVER, MODEL, get_server
from deepbatch.bench import serve

SERVERS = {"main": MAIN_SERVER}


@pytest.fixture(scope="module")
def server():
    return get_server("main")


def test_bench_serve_against_the_server(server, capsys):
    before = server.metric("vllm:generation_tokens_total")
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--base-url", server.url, "--api-key", server.api_key, "--disable-tqdm",
                         "--num-prompts", "12", "--request-rate", "8", "--random-input-len", "32",
                         "--random-output-len", "6", "--vocab-size", "49152", "--goodput", "ttft:60000", "tpot:60000"])
    r = serve.run(args)
    assert r["completed"] == 12 and r["failed"] == 0 and r["model"] == MODEL
    assert r["total_output_tokens"] == 12 * 6
    assert server.metric("vllm:generation_tokens_total") - before == r["total_output_tokens"]
    assert r["request_goodput"] > 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Request goodput (req/s):" in out
