"""Two stable replicas and a canary behind the Ray Serve ingress, driven by the official openai
client: answers equal to the engine's own, a canary promoted through every step, a broken canary
rolled back with no client-visible error, and a replica killed mid-run.

One application for the module; each test starts its own rollout through ``POST /v1/rollout``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve_ray_harness import ENGINE, MODEL, RAY_MISSING, ServeApp, metric, users_on, wait_for

ray = pytest.importorskip("ray", reason=RAY_MISSING)

APP = {
    "engine_args": ENGINE, "num_replicas": 2, "num_cpus": 1, "routing_stats_period_s": 1,
    "canary": {"engine_args": {"max_num_seqs": 3}, "num_replicas": 1, "num_cpus": 1},
    "rollout": {"steps": [50, 100], "hold_s": 3600},
}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def app(serve_proxy_url):
    app = ServeApp.deploy("gray", APP, serve_proxy_url)
    yield app
    app.delete()


def canary_requests(app: ServeApp) -> int:
    return sum(r["num_requests"] for r in app.replicas()["canary"])


def stable_requests(app: ServeApp) -> int:
    return sum(r["num_requests"] for r in app.replicas()["stable"])


def ask(client, user: str, stream: bool, chat: bool, max_tokens: int = 12, **extra) -> str:
    kwargs = dict(model=MODEL, max_tokens=max_tokens, temperature=0.0, user=user, stream=stream, **extra)
    if chat:
        reply = client.chat.completions.create(messages=CHAT, **kwargs)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        return reply.choices[0].message.content
    reply = client.completions.create(prompt=PROMPT, **kwargs)
    if stream:
        return "".join(c.choices[0].text for c in reply if c.choices)
    return reply.choices[0].text


def test_both_arms_answer_the_openai_client_as_the_engine_does(app, smollm_llm):
    from deepbatch import SamplingParams

    app.start_rollout({"steps": [50, 100], "hold_s": 3600})
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    expected = {False: smollm_llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text,
                True: smollm_llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0].text}
    client = app.openai()
    for arm in ("canary", "stable"):
        user = users_on(arm, 50, 1)[0]
        before = {"canary": canary_requests(app), "stable": stable_requests(app)}
        for chat in (False, True):
            for stream in (False, True):
                assert ask(client, user, stream, chat) == expected[chat], (arm, chat, stream)
        after = {"canary": canary_requests(app), "stable": stable_requests(app)}
        other = "stable" if arm == "canary" else "canary"
        assert after[arm] - before[arm] == 4 and after[other] == before[other], (arm, before, after)
    # The replica's own checks reach the client as the single-process server's 400.
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000, user=users_on("canary", 50, 1)[0])
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    samples = app.metrics()
    for arm in ("stable", "canary"):
        assert metric(samples, "deepbatch:arm_requests_total", arm=arm) >= 4
        assert metric(samples, "deepbatch:arm_time_to_first_token_seconds_count", arm=arm) >= 4
    assert metric(samples, "deepbatch:rollout_canary_percent") == 50


def traffic(app: ServeApp, users: list[str], stop: threading.Event, workers: int = 3, max_tokens: int = 6,
            stream_every: int = 2):
    """Send requests until ``stop``, round-robin over ``users``; returns (sent log, errors) where
    the log holds (user, start wall time) per request."""
    client = app.openai()
    log, errors = [], []
    lock = threading.Lock()
    counter = iter(range(10**9))

    def worker():
        while not stop.is_set():
            i = next(counter)
            user = users[i % len(users)]
            with lock:
                log.append((user, time.time()))
            try:
                text = ask(client, user, stream=i % stream_every == 0, chat=False, max_tokens=max_tokens)
                assert text
            except Exception as e:  # noqa: BLE001 - collected: the test asserts there are none
                with lock:
                    errors.append(f"{user}: {type(e).__name__}: {e}")

    pool = ThreadPoolExecutor(workers)
    futures = [pool.submit(worker) for _ in range(workers)]
    return log, errors, lambda: ([f.result() for f in futures], pool.shutdown())


def test_healthy_canary_is_promoted_through_every_step(app):
    steps = [1, 5, 25, 50, 100]
    bad = app.post("/v1/rollout", {"steps": [5, 1, 100]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_rollout_spec"
    assert "rollout.steps: must be strictly increasing" in bad.json()["error"]["message"]
    before = app.metrics()
    start = app.start_rollout({"steps": steps, "hold_s": 1.5, "evaluation_interval_s": 0.25, "min_samples": 1,
                               "min_requests_per_step": 1,
                               "slo": [{"metric": "error_rate", "max": 0.5, "for_s": 1}]})
    assert start["state"] == "progressing" and start["canary_percent"] == 1
    # Tenants on the canary from the first step on (so every step sees canary requests), and others.
    users = users_on("canary", 1, 2) + users_on("stable", 1, 2)
    stop = threading.Event()
    _, errors, join = traffic(app, users, stop)
    try:
        report = wait_for(lambda: (r := app.rollout())["state"] != "progressing" and r, 180, "rollout finished")
    finally:
        stop.set()
        join()
    assert report["state"] == "promoted", report["history"][-3:]
    assert not errors, errors[:5]
    ours = report["history"][-len(steps) - 1:]
    assert [(h["action"], h["canary_percent"]) for h in ours] == (
        [("start", 1)] + [("promote", p) for p in steps[1:]] + [("promoted", 100)])
    assert all(b["time"] - a["time"] >= 1.5 for a, b in zip(ours, ours[1:]))
    after = app.metrics()
    assert metric(after, "deepbatch:rollout_canary_percent") == 100
    assert (metric(after, "deepbatch:rollout_promotions_total") -
            metric(before, "deepbatch:rollout_promotions_total")) == len(steps) - 1
    assert metric(after, "deepbatch:rollout_state", state="promoted") == 1


def test_broken_canary_is_rolled_back_and_clients_see_no_error(app):
    for_s, interval = 2.0, 0.5
    app.start_rollout({"steps": [50, 100], "hold_s": 3600, "window_s": 60, "evaluation_interval_s": interval,
                       "min_samples": 2, "min_requests_per_step": 0,
                       "slo": [{"metric": "error_rate", "max": 0.2, "for_s": for_s},
                               {"metric": "ttft_p95_ms", "max": 10_000, "for_s": for_s}]})
    before, accepted_before = app.metrics(), canary_requests(app)
    app.broadcast("canary", "set_faults", 0.0, 1)  # every request the canary takes fails before it is queued
    try:
        canary_users, stable_users = users_on("canary", 50, 4), users_on("stable", 50, 4)
        stop = threading.Event()
        log, errors, join = traffic(app, [u for pair in zip(canary_users, stable_users) for u in pair], stop,
                                    workers=4)
        try:
            report = wait_for(lambda: (r := app.rollout())["state"] == "rolled_back" and r, 120, "rollback")
            served_by_canary = canary_requests(app)
            time.sleep(2.0)  # traffic goes on after the decision
        finally:
            stop.set()
            join()
        decision = report["history"][-1]
        assert decision["action"] == "rollback" and decision["reason"].startswith("error_rate = 1 "), decision
        # The first two canary requests go out together and fail at once: the breach is visible
        # from then on, so the decision waits for_s and comes within one evaluation after it.
        first_canary = min(t for user, t in log if user in canary_users)
        assert for_s <= decision["time"] - first_canary <= for_s + interval + 0.5, decision
        assert not errors, errors[:5]  # every failed canary attempt was retried on stable
        assert canary_requests(app) == served_by_canary == accepted_before  # the broken canary accepted nothing
        after = app.metrics()

        def delta(name, **labels):
            return metric(after, name, **labels) - metric(before, name, **labels)

        assert delta("deepbatch:rollout_rollbacks_total") == 1
        assert delta("deepbatch:arm_request_errors_total", arm="canary") >= 2
        assert delta("deepbatch:arm_retries_total", arm="canary") >= 2
        assert delta("deepbatch:arm_request_errors_total", arm="stable") == 0
        assert metric(after, "deepbatch:rollout_canary_percent") == 0
        assert metric(after, "deepbatch:rollout_state", state="rolled_back") == 1
        assert app.rollout()["state"] == "rolled_back"
    finally:
        app.broadcast("canary", "set_faults", 0.0, 0)


def test_killed_replica_fails_only_its_started_streams_and_comes_back(app):
    from ray import serve

    if app.rollout()["state"] in ("progressing", "promoted"):
        assert app.post("/v1/rollout/rollback").status_code == 200  # stable only from here
    client = app.openai()
    started = threading.Barrier(5)

    def long_stream(i: int):
        stream = client.completions.create(model=MODEL, prompt=f"{i}: {PROMPT}", max_tokens=64, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        tokens, first = 0, True
        try:
            for chunk in stream:
                if first:
                    first = False
                    started.wait(120)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return ("done", tokens)
        except Exception as e:  # noqa: BLE001 - the test sorts out which failures are allowed
            return ("error", str(e))

    before = {r["replica"]: r for r in app.replicas()["stable"]}
    assert len(before) == 2
    pool = ThreadPoolExecutor(8)
    streams = [pool.submit(long_stream, i) for i in range(4)]
    started.wait(300)  # every stream has its first token: all four are in flight
    in_flight = {r["replica"]: r for r in app.replicas()["stable"]}
    victim = max(in_flight.values(), key=lambda r: r["num_in_flight"])
    assert victim["num_in_flight"] >= 1
    ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
    # Requests sent right after the kill: any that reach the dead replica are retried.
    later = [pool.submit(ask, client, f"after-{i}", False, False, 4) for i in range(4)]
    results = [f.result(timeout=600) for f in streams]
    assert all(f.result(timeout=600) for f in later)
    failed = [r for r in results if r[0] == "error"]
    assert 1 <= len(failed) <= victim["num_in_flight"], results
    assert all("replica" in message and "failed mid-stream" in message for _, message in failed), failed
    assert all(tokens == 64 for kind, tokens in results if kind == "done"), results
    pool.shutdown()
    # Serve replaces the replica; the new one serves.
    wait_for(lambda: len({r["replica"] for r in app.replicas()["stable"]} - set(before)) == 1
             and serve.status().applications[app.name].deployments["stable"].status == "HEALTHY",
             600, "a new stable replica", interval=2)
    assert all(ask(client, f"again-{i}", False, False, 4) for i in range(4))
