"""What every reply of a real server must look like, whatever was sent, and the state the server
must be left in: no 5xx, an OpenAI error body on every 4xx, well-formed 200s (JSON or SSE), the
process alive and serving after every batch, and no request running nor KV block held at the end.

The checks are written from the OpenAI wire format, not from the server's own response models,
so a response model that drifts from the format fails here.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from apitest_hostile_bodies import CHAT, HostileRequest
from apitest_server import API_KEY, MODEL, ServerProcess, get_server, httpx, parse_metrics

# Enough KV blocks for 32 concurrent small requests several times over, and well under the
# default CPU pool, so several test servers fit beside each other.
HOSTILE_SERVER = dict(
    args=["--num-gpu-blocks-override", "512"],
    env={"DEEPBATCH_MAX_REQUEST_BODY_BYTES": "262144", "DEEPBATCH_LOG_STATS_INTERVAL": "5"},
    api_key=API_KEY,
)
FRESH = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
FINISH_REASONS = {"stop", "length"}


# -- one reply ------------------------------------------------------------------------------------


def error_body_problem(content: bytes) -> str | None:
    """None if ``content`` is exactly ``{"error": {message, type, param, code}}``."""
    try:
        body = json.loads(content)
    except ValueError:
        return f"not JSON: {content[:200]!r}"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"not an OpenAI error body: {content[:300]!r}"
    err = body["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)}: {content[:300]!r}"
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
            and isinstance(err["code"], str) and (err["param"] is None or isinstance(err["param"], str))):
        return f"error field types: {content[:300]!r}"
    return None


def _usage_problem(usage) -> str | None:
    if not isinstance(usage, dict):
        return f"usage {usage!r}"
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    if not all(isinstance(usage.get(k), int) and usage[k] >= 0 for k in keys):
        return f"usage {usage!r}"
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        return f"usage does not add up: {usage!r}"
    return None


def _expected_choices(req: HostileRequest) -> int | None:
    """n times the number of prompts, read from what was sent; None where it cannot be known."""
    try:
        body = json.loads(req.body)
    except ValueError:
        return None
    n = body.get("n", 1)
    if req.route == CHAT:
        return n
    prompt = body.get("prompt")
    single = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int))
    return n * (1 if single else len(prompt))


def _choice_problem(c, chat: bool, streamed: bool) -> str | None:
    if not isinstance(c, dict) or not isinstance(c.get("index"), int):
        return f"choice {str(c)[:200]}"
    if chat:
        part = c.get("delta" if streamed else "message")
        if not isinstance(part, dict) or not isinstance(part.get("content", ""), (str, type(None))):
            return f"chat choice {str(c)[:200]}"
    elif not isinstance(c.get("text"), str):
        return f"completion choice text {str(c)[:200]}"
    reason = c.get("finish_reason")
    if reason is not None and reason not in FINISH_REASONS:
        return f"finish_reason {reason!r}"
    return None


def json_reply_problem(req: HostileRequest, content: bytes) -> str | None:
    try:
        body = json.loads(content)
    except ValueError:
        return f"200 but not JSON: {content[:200]!r}"
    chat = req.route == CHAT
    want_object = "chat.completion" if chat else "text_completion"
    if not isinstance(body, dict) or body.get("object") != want_object or not isinstance(body.get("id"), str):
        return f"200 body {content[:300]!r}"
    if not isinstance(body.get("created"), int) or body.get("model") != MODEL:
        return f"200 created/model {content[:300]!r}"
    choices = body.get("choices")
    if not isinstance(choices, list):
        return f"200 choices {content[:300]!r}"
    want = _expected_choices(req)
    if want is not None and len(choices) != want:
        return f"{len(choices)} choices, expected {want}"
    for c in choices:
        problem = _choice_problem(c, chat, streamed=False)
        if problem is None and c.get("finish_reason") is None:
            problem = "a finished choice without finish_reason"
        if problem:
            return problem
    if sorted(c["index"] for c in choices) != list(range(len(choices))):
        return f"choice indices {[c['index'] for c in choices]}"
    return _usage_problem(body.get("usage"))


def parse_sse(content: bytes) -> tuple[list, str | None]:
    """The ``data:`` payloads (JSON, or the string "[DONE]"), or a problem with the framing."""
    events = []
    for line in content.decode("utf-8", errors="replace").split("\n"):
        if not line:
            continue
        if not line.startswith("data: "):
            return events, f"SSE line {line[:120]!r}"
        data = line[len("data: "):]
        if data == "[DONE]":
            events.append(data)
            continue
        try:
            events.append(json.loads(data))
        except ValueError:
            return events, f"SSE data not JSON: {data[:120]!r}"
    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        return events, f"stream does not end with one [DONE]: {content[-200:]!r}"
    return events, None


def sse_reply_problem(req: HostileRequest, content: bytes) -> str | None:
    events, problem = parse_sse(content)
    if problem:
        return problem
    chat = req.route == CHAT
    want_object = "chat.completion.chunk" if chat else "text_completion"
    finished: dict[int, str] = {}
    for i, ev in enumerate(events[:-1]):
        if not isinstance(ev, dict):
            return f"SSE event {ev!r}"
        if "error" in ev:
            problem = error_body_problem(json.dumps(ev).encode())
            if problem:
                return f"SSE error event: {problem}"
            if i != len(events) - 2:
                return "SSE error event not followed by [DONE]"
            return None
        if (ev.get("object") != want_object or not isinstance(ev.get("id"), str)
                or not isinstance(ev.get("choices"), list)):
            return f"SSE chunk {str(ev)[:300]}"
        if ev.get("usage") is not None and (problem := _usage_problem(ev["usage"])):
            return problem
        for c in ev["choices"]:
            if problem := _choice_problem(c, chat, streamed=True):
                return problem
            if c["index"] in finished:
                return f"choice {c['index']} continued after finish_reason {finished[c['index']]!r}"
            if c.get("finish_reason") is not None:
                finished[c["index"]] = c["finish_reason"]
    want = _expected_choices(req)
    if want is not None and sorted(finished) != list(range(want)):
        return f"stream finished choices {sorted(finished)}, expected {want}"
    return None


def reply_problem(req: HostileRequest, status: int, content_type: str, content: bytes) -> str | None:
    """None if the reply is acceptable for any input: < 500, error body on 4xx, well-formed 200."""
    if status >= 500 or status == 422:
        return f"{status} {content[:300]!r}"
    if 400 <= status < 500:
        return error_body_problem(content)
    if status != 200:
        return f"status {status}"
    if content_type.startswith("text/event-stream"):
        return sse_reply_problem(req, content)
    return json_reply_problem(req, content)


# -- batches --------------------------------------------------------------------------------------


@dataclass
class HostileRun:
    """Sends requests in concurrent batches and records every problem: bad replies, /health
    not 200 during a batch, a fresh completion not served within 5 s after one."""

    server: ServerProcess
    batch_size: int = 32
    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    dead: bool = False

    def run(self, requests) -> HostileRun:
        requests = list(requests)
        for start in range(0, len(requests), self.batch_size):
            if self.dead:
                break
            asyncio.run(self._batch(requests[start:start + self.batch_size]))
            self._after_batch(start // self.batch_size)
        return self

    async def _batch(self, batch: list[HostileRequest]) -> None:
        done = asyncio.Event()
        async with self.server.async_http(timeout=60) as client:
            watcher = asyncio.ensure_future(self._watch_health(client, done))
            await asyncio.gather(*(self._send(client, r) for r in batch))
            done.set()
            await watcher

    async def _send(self, client, req: HostileRequest) -> None:
        headers = list(req.headers)
        if req.content_type is not None:
            headers.append(("Content-Type", req.content_type))
        self.sent += 1
        try:
            resp = await client.post(f"/v1/{req.route}", content=req.body, headers=headers)
        except httpx.TimeoutException:
            self.problems.append(f"{req!r}: no reply within 60 s")
            return
        except httpx.TransportError as e:
            self.problems.append(f"{req!r}: {type(e).__name__} {e}")
            return
        self.statuses[resp.status_code] = self.statuses.get(resp.status_code, 0) + 1
        problem = reply_problem(req, resp.status_code, resp.headers.get("content-type", ""), resp.content)
        if problem:
            self.problems.append(f"{req!r} body={req.body[:160]!r}: {problem}")

    async def _watch_health(self, client, done: asyncio.Event) -> None:
        while not done.is_set():
            try:
                status = (await client.get("/health", timeout=5)).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            if status != 200:
                self.problems.append(f"/health answered {status} during a batch")
                return
            await asyncio.sleep(0.25)

    def _after_batch(self, index: int) -> None:
        problem = fresh_completion_problem(self.server)
        if problem:
            self.problems.append(f"after batch {index}: {problem}")
            self.dead = True

    def report(self, limit: int = 12) -> str:
        distinct = list(dict.fromkeys(self.problems))
        lines = [f"{len(self.problems)} problem(s) over {self.sent} requests (statuses {self.statuses}):"]
        lines += distinct[:limit]
        if len(distinct) > limit:
            lines.append(f"... and {len(distinct) - limit} more")
        if distinct:
            lines.append("server log tail:\n" + self.server.log_tail(3000))
        return "\n".join(lines)


def fresh_completion_problem(server: ServerProcess, timeout: float = 5.0) -> str | None:
    """None if the server serves a normal two-token completion within ``timeout``."""
    t0 = time.monotonic()
    try:
        with server.http(timeout=timeout) as http:
            resp = http.post("/v1/completions", json=FRESH)
    except httpx.HTTPError as e:
        return f"a fresh completion failed: {type(e).__name__} {e} (process exit code {server.proc.poll()})"
    took = time.monotonic() - t0
    if resp.status_code != 200:
        return f"a fresh completion got {resp.status_code} {resp.text[:300]}"
    if resp.json()["usage"]["completion_tokens"] < 1 or took > timeout:
        return f"a fresh completion took {took:.1f} s: {resp.text[:200]}"
    return None


IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> str | None:
    """None once no request runs or waits and every KV block is free; else what /metrics shows
    after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10)
        except httpx.HTTPError as e:
            return f"/metrics failed: {type(e).__name__} {e}"
        if resp.status_code != 200:
            return f"/metrics answered {resp.status_code}: {resp.text[:300]}"
        metrics = parse_metrics(resp.text)
        values = {name: metrics.get(f'{name}{{model_name="{MODEL}"}}') for name in
                  IDLE_GAUGES + ("deepbatch:kv_cache_free_blocks", "deepbatch:kv_cache_blocks_total")}
        free, total = values["deepbatch:kv_cache_free_blocks"], values["deepbatch:kv_cache_blocks_total"]
        if all(values[g] == 0 for g in IDLE_GAUGES) and total and free == total:
            return None
        if time.monotonic() > deadline:
            return f"not idle {timeout:.0f} s after the last reply: {values}"
        time.sleep(0.25)


# -- a server that a test may have killed ----------------------------------------------------------

_current: dict[str, ServerProcess] = {}
_started: list[ServerProcess] = []  # by live_server; conftest stops the ones it started


def live_server(name: str, spec: dict) -> ServerProcess:
    """The shared server ``name``, or a fresh one in its place if an earlier test killed it, so
    one fatal input fails one test instead of every later one."""
    server = _current.get(name) or get_server(name)
    try:
        healthy = httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        healthy = False
    if healthy:
        return server
    server.stop(timeout=10)
    restarted = ServerProcess(f"{name}-restart{len(_started) + 1}", **spec)
    _started.append(restarted)
    _current[name] = restarted
    return restarted.wait_ready()


def stop_restarted() -> None:
    for proc in _started:
        proc.stop()
        proc.log.close()
        proc.out.close()
    _started.clear()
    _current.clear()
