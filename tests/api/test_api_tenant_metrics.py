"""Per-tenant metrics (tenant = the OpenAI ``user`` field) and the KV accounting gauges."""

from __future__ import annotations

import time

import pytest

from apitest_server import MAIN_SERVER, MODEL, get_server

SERVERS = {"main": MAIN_SERVER}


@pytest.fixture(scope="module")
def server():
    return get_server("main")


def test_tenant_counters_follow_the_user_field(server):
    tenants = {"alice-t": 2, "bob-t": 1}
    before = {t: server.metric("deepbatch:tenant_requests_total", tenant=t) for t in tenants}
    tokens_before = {t: server.metric("deepbatch:tenant_generation_tokens_total", tenant=t) for t in tenants}
    client = server.client()
    generated = {t: 0 for t in tenants}
    for tenant, n in tenants.items():
        for i in range(n):
            out = client.completions.create(model=MODEL, prompt=f"Hello {i}", max_tokens=3, user=tenant,
                                            extra_body={"ignore_eos": True})
            generated[tenant] += out.usage.completion_tokens
    for tenant, n in tenants.items():
        assert server.metric("deepbatch:tenant_requests_total", tenant=tenant) - before[tenant] == n
        assert server.metric("deepbatch:tenant_generation_tokens_total", tenant=tenant) - tokens_before[tenant] == \
            generated[tenant]
        assert server.metric("deepbatch:tenant_time_to_first_token_seconds_count", tenant=tenant) >= n


def test_kv_accounting_gauges(server):
    # A prompt of several full blocks: they stay behind in the prefix cache once it finishes.
    server.client().completions.create(model=MODEL, prompt="The quick brown fox jumps over the lazy dog. " * 12,
                                       max_tokens=2)
    time.sleep(0.2)  # the engine publishes its idle snapshot after the reply is sent
    total = server.metric("deepbatch:kv_cache_blocks_total")
    free = server.metric("deepbatch:kv_cache_free_blocks")
    assert total > 0 and 0 <= free <= total
    for name in ("deepbatch:kv_cache_token_usage_perc", "deepbatch:kv_cache_internal_fragmentation_perc"):
        assert 0.0 <= server.metric(name) <= 1.0
    assert server.metric("deepbatch:kv_cache_prefix_only_blocks") > 0
