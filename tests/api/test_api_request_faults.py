"""A request's fault is that request's, against a real server process on the real engine: a
sampler fault injected into one request (in the engine core) and a detokenization fault into
another (in the API process, which makes the text) end each with a clean error while 31
concurrent streams finish in full; hundreds of aborted streams and rejected requests leave no request running and
every KV block free; a seed outside 64 bits is a 400 (it used to kill the engine) and distinct
64-bit seeds give distinct samples (they used to collide modulo 2**32 and across choices)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from apitest_hostile_bodies import COMPLETIONS, HostileRequest, build, encode, nested
from apitest_hostile_checks import fresh_completion_problem, live_server, parse_sse, stop_restarted, wait_idle
from apitest_server import API_KEY, MODEL, assert_error, httpx

# The sampler raises for the request whose id is this, and detokenization for the other; the
# server names a completion request ``cmpl-<X-Request-Id>``.
FAULT_ID = "fault-target"
DETOKENIZE_FAULT_ID = "detokenize-fault-target"
FAULT_SERVER = dict(
    args=["--num-gpu-blocks-override", "512"],
    env={"DEEPBATCH_FAULT_INJECT_SAMPLE_REQUEST": f"cmpl-{FAULT_ID}",
         "DEEPBATCH_FAULT_INJECT_DETOKENIZE_REQUEST": f"cmpl-{DETOKENIZE_FAULT_ID}",
         "DEEPBATCH_LOG_STATS_INTERVAL": "5"},
    api_key=API_KEY,
)
SERVERS = {"faults": FAULT_SERVER}
OTHERS = 31
OTHER_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def _stop_restarted():
    yield
    stop_restarted()


@pytest.fixture
def server():
    return live_server("faults", FAULT_SERVER)


class HealthWatch:
    """Polls /health until stopped; ``bad`` holds every answer that was not 200."""

    def __init__(self, client):
        self.bad: list = []
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._run(client))

    async def _run(self, client) -> None:
        while not self._stop.is_set():
            try:
                status = (await client.get("/health", timeout=5)).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            if status != 200:
                self.bad.append(status)
            await asyncio.sleep(0.2)

    async def stop(self) -> list:
        self._stop.set()
        await self._task
        return self.bad


async def _stream_events(client, body: dict, started: asyncio.Event | None = None, headers=None) -> tuple[int, list]:
    """Status and SSE payloads of one streamed completion; ``started`` is set at its first chunk."""
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        raw = b""
        async for chunk in resp.aiter_bytes():
            raw += chunk
            if started is not None and b"data: " in raw:
                started.set()
    if started is not None:
        started.set()
    if resp.status_code != 200:
        return resp.status_code, [raw.decode(errors="replace")]
    events, problem = parse_sse(raw)
    assert problem is None, problem
    return resp.status_code, events


def _other_body(i: int) -> dict:
    return {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": OTHER_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_injected_faults_end_only_their_requests(server, stream):
    fault_body = {"model": MODEL, "prompt": "This request fails", "max_tokens": OTHER_TOKENS, "ignore_eos": True,
                  "stream": stream}

    async def run():
        async with server.async_http(timeout=120) as client:
            health = HealthWatch(client)
            started = [asyncio.Event() for _ in range(OTHERS)]
            others = [asyncio.ensure_future(_stream_events(client, _other_body(i), started[i])) for i in range(OTHERS)]
            # The faulted request joins a batch that is already decoding the others, so the fault
            # is raised in a shared sampling pass, not in a batch of its own.
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)

            async def faulted(request_id: str):
                headers = {"X-Request-Id": request_id}
                if stream:
                    return await _stream_events(client, fault_body, headers=headers)
                resp = await client.post("/v1/completions", json=fault_body, headers=headers)
                return resp.status_code, resp

            faults = await asyncio.gather(faulted(FAULT_ID), faulted(DETOKENIZE_FAULT_ID))
            results = await asyncio.gather(*others)
            return faults, results, await health.stop()

    faults, results, bad_health = asyncio.run(run())

    for where, faulted in zip(("sampling", "detokenization"), faults):
        if stream:
            status, events = faulted
            assert status == 200, (where, status, events)
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            assert errors and events[-1] == "[DONE]" and events.index(errors[0]) == len(events) - 2, \
                f"the stream faulted in {where} does not end with an error event and [DONE]: {events}"
            assert errors[0]["error"]["code"] == "request_failed", (where, errors[0])
            assert where in errors[0]["error"]["message"], (where, errors[0])
            assert not any(c.get("finish_reason") == "length" for e in events if isinstance(e, dict)
                           for c in e.get("choices", [])), f"the {where} fault did not fire"
        else:
            # The server failed this request (the client's input was fine), so 500, with an error
            # body naming a request failure rather than a dead engine.
            _, resp = faulted
            assert_error(resp, 500, code="request_failed")
            assert where in resp.json()["error"]["message"], (where, resp.text)

    for i, (status, events) in enumerate(results):
        assert status == 200, (i, status, events)
        chunks = [e for e in events if isinstance(e, dict)]
        assert not any("error" in e for e in chunks), (i, chunks[-3:])
        reasons = [c["finish_reason"] for e in chunks for c in e["choices"] if c.get("finish_reason")]
        usage = [e["usage"] for e in chunks if e.get("usage")]
        assert reasons == ["length"] and usage and usage[-1]["completion_tokens"] == OTHER_TOKENS, \
            (i, reasons, usage)
    assert bad_health == [], f"/health answered {bad_health} during the run"
    assert fresh_completion_problem(server) is None, server.log_tail()
    assert wait_idle(server) is None


def test_request_id_header_names_the_request(server):
    with server.http() as http:
        plain = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                          headers={"X-Request-Id": "abc-123"})
        chat = http.post("/v1/chat/completions", headers={"X-Request-Id": "abc-124"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        streamed = http.post("/v1/completions", headers={"X-Request-Id": "abc-125"},
                             json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True})
    assert plain.status_code == 200 and plain.json()["id"] == "cmpl-abc-123", plain.text
    assert chat.status_code == 200 and chat.json()["id"] == "chatcmpl-abc-124", chat.text
    events, problem = parse_sse(streamed.content)
    assert problem is None and {e["id"] for e in events if isinstance(e, dict)} == {"cmpl-abc-125"}, events


ABORTED_STREAMS = 500
ABORT_BATCH = 50
REJECTED = 200


async def _abandon(client, i: int) -> bool:
    """Open a long stream, read its first chunk (some only the headers), hang up. True if it
    got as far as it was meant to."""
    body = {"model": MODEL, "prompt": f"Tale {i}", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return False
        if i % 10 == 0:
            return True  # hang up before any token
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                return True
    return False


def _rejected(i: int) -> HostileRequest:
    over_bounds = [
        {"prompt": [1] * 600}, {"prompt": [1] * 100, "max_tokens": 500}, {"n": 129}, {"logprobs": 21},
        {"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"min_tokens": 3, "max_tokens": 2},
        {"logit_bias": {"49152": 1}}, {"stop_token_ids": [10**9]}, {"prompt": "x " * 2000},
    ]
    if i % 4 == 3:
        body = encode({"prompt": nested(2000)} if i % 8 == 3 else [1, 2]).encode()
        return HostileRequest(COMPLETIONS, body, "bad body")
    fields = over_bounds[i % len(over_bounds)]
    base = build(COMPLETIONS, [], stream=bool(i % 2))
    body = {**json.loads(base.body), **fields}
    return HostileRequest(COMPLETIONS, json.dumps(body).encode(), f"over bounds {list(fields)}")


def test_aborted_streams_and_rejected_requests_leave_nothing_held(server):
    async def run():
        async with server.async_http(timeout=60) as client:
            health = HealthWatch(client)
            reached = 0
            for start in range(0, ABORTED_STREAMS, ABORT_BATCH):
                done = await asyncio.gather(*(_abandon(client, i) for i in range(start, start + ABORT_BATCH)))
                reached += sum(done)
            statuses = []
            for start in range(0, REJECTED, 50):
                batch = [_rejected(i) for i in range(start, start + 50)]
                replies = await asyncio.gather(*(client.post("/v1/completions", content=r.body,
                                                             headers={"Content-Type": "application/json"})
                                                 for r in batch))
                statuses += [(r.label, reply.status_code, reply.text[:200]) for r, reply in zip(batch, replies)]
            return reached, statuses, await health.stop()

    reached, statuses, bad_health = asyncio.run(run())
    assert reached == ABORTED_STREAMS, f"only {reached} of {ABORTED_STREAMS} streams started"
    not_rejected = [s for s in statuses if s[1] != 400 and s[1] != 413]
    assert len(statuses) == REJECTED and not not_rejected, not_rejected[:5]
    assert bad_health == [], f"/health answered {bad_health}"
    assert wait_idle(server, timeout=10) is None, wait_idle(server, timeout=0)
    assert fresh_completion_problem(server) is None, server.log_tail()


def test_seed_outside_64_bits_is_400_and_the_server_lives(server):
    with server.http() as http:
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                  "seed": 18446744073709551616})
        assert_error(resp, 400, "seed")
        # A dead engine keeps answering for a grace period before the process exits.
        time.sleep(2.5)
        assert http.get("/health").status_code == 200, server.log_tail()
    assert server.proc.poll() is None
    assert fresh_completion_problem(server) is None, server.log_tail()


SEEDED = [dict(seed=0), dict(seed=2**32), dict(seed=2**62), dict(seed=42, n=2), dict(seed=43)]


async def _samples(client) -> list[list[str]]:
    """The texts of each ``SEEDED`` request (16 tokens at temperature 1), sent together."""

    async def one(fields):
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0,
                "ignore_eos": True, **fields}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        assert [c["finish_reason"] for c in choices] == ["length"] * fields.get("n", 1), choices
        return [c["text"] for c in choices]

    return await asyncio.gather(*(one(f) for f in SEEDED))


def test_distinct_seeds_give_distinct_samples(server):
    async def run():
        async with server.async_http(timeout=120) as client:
            return await _samples(client), await _samples(client)

    first, again = asyncio.run(run())
    # Seeds are honoured at all: the same seeds give the same samples.
    assert first == again, (first, again)
    (s0,), (s32,), (s62,), pair, (s43,) = first
    assert len({s0, s32, s62}) == 3, f"seeds 0, 2**32 and 2**62 collide: {s0!r} {s32!r} {s62!r}"
    assert pair[0] != pair[1], pair
    assert pair[1] != s43, f"choice 1 of seed 42 is choice 0 of seed 43: {s43!r}"
