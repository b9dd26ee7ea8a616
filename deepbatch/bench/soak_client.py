"""The soak's load client: the jobs it sends (workload requests, each drawn into a kind, and the
hostile bodies), and ``send``, which takes one request to its end and classifies that end as
exactly one of OUTCOMES (what each means: ``deepbatch.bench.soak``). A stream's events are
matched as bytes against the server's wire format, not parsed: one process reads every chunk of
its share of the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import time
from dataclasses import dataclass

import numpy as np

try:
    import httpx
except ImportError:  # some environments ship httpx only under its 2.x distribution name
    import httpx2 as httpx  # type: ignore[no-redef]

from deepbatch.bench.serve_workloads import build_requests

OUTCOMES = ("completed", "disconnected", "rejected_429", "rejected_400", "rejected_4xx", "error_event",
            "error_event_5xx", "http_5xx", "connect_error", "lost")
KINDS = ("stream", "disconnect", "non_stream", "hostile")
_SERVER_ERROR_TYPES = {"internal_server_error", "service_unavailable_error"}
# The server writes chunks with pydantic's compact JSON and leaves out null fields: a finish_reason
# key is present only on a choice's last chunk. Matching bytes spares a JSON parse per token.
_FINISHED = re.compile(rb'"finish_reason":\s*"')
_HAS_CHOICE = re.compile(rb'"choices":\s*\[\s*\{')
_CHUNK = 256  # workload requests drawn at a time, so a long run never holds all its prompts


@dataclass
class Job:
    kind: str
    path: str
    body: bytes
    at: float  # scheduled send offset, seconds from the phase start
    disconnect_after: int | None = None  # content chunks read before the client closes the stream
    hostile: str = ""
    must_reject: bool = False


def hostile_bodies(model: str, max_model_len: int | None) -> list[tuple[str, str, bytes, bool]]:
    """(name, path, raw body, must the server reject it). A body that need not be rejected must
    still end cleanly: a completion or a 4xx, never a 5xx or a broken server."""
    m = json.dumps(model)
    base = {"model": model, "max_tokens": 4, "stream": True}

    def j(**kw) -> bytes:
        return json.dumps({**base, **kw}).encode()

    c, chat = "/v1/completions", "/v1/chat/completions"
    too_long = (max_model_len or 1 << 18) + 8
    return [
        ("lone_surrogate_prompt", c, b'{"model": %s, "prompt": "ab\\ud800cd", "max_tokens": 4}' % m.encode(), True),
        ("lone_surrogate_user", c, b'{"model": %s, "prompt": [1, 2, 3], "max_tokens": 4, "stream": true, '
                                   b'"user": "t\\udc00"}' % m.encode(), False),
        ("lone_surrogate_stop", c, b'{"model": %s, "prompt": [1, 2, 3], "max_tokens": 4, "stream": true, '
                                   b'"stop": ["\\ud83d"]}' % m.encode(), False),
        ("invalid_utf8", c, b'{"prompt": "\xed\xa0\x80\xff", "max_tokens": 4}', True),
        ("huge_seed", c, j(prompt=[1, 2, 3], seed=2 ** 200, temperature=1.0), True),
        ("negative_seed", c, j(prompt=[1, 2, 3], seed=-(2 ** 70), temperature=1.0), True),
        ("negative_max_tokens", c, j(prompt=[1, 2, 3], max_tokens=-5), True),
        ("string_max_tokens", c, j(prompt=[1, 2, 3], max_tokens="16"), True),
        ("object_prompt", c, j(prompt={"a": 1}), True),
        ("string_stream", c, j(prompt=[1, 2, True], stream="yes"), True),
        ("invalid_json", c, b'{"prompt": [1, 2, 3], "max_tokens": ', True),
        ("nested_junk", c, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", True),
        ("nested_logit_bias", c, j(prompt=[1], logit_bias={"1": {"a": [1, {"b": None}]}}), True),
        ("null_content", chat, j(messages=[{"role": "user", "content": None}]), True),
        ("oversize_n", c, j(prompt=[1, 2, 3], n=10 ** 6), True),
        ("token_id_out_of_range", c, j(prompt=[2 ** 62]), True),
        ("stop_token_id_out_of_range", c, j(prompt=[1, 2, 3], stop_token_ids=[2 ** 70]), True),
        ("nan_temperature", c, b'{"prompt": [1], "max_tokens": 4, "temperature": NaN}', True),
        ("not_an_object", c, b"[1, 2, 3]", True),
        ("context_too_long", c, j(prompt=[5] * too_long), True),
        ("oversize_body", c, b'{"prompt": "' + b"a" * ((4 << 20) + 1024) + b'"}', True),
    ]


class Jobs:
    """The workload's requests (serve_workloads, drawn a chunk at a time with its own seed), each
    made into a job of one kind by a seeded draw; arrivals continue across chunks."""

    def __init__(self, args, model: str, max_model_len: int | None, rate: float, seed: int, mixed: bool,
                 share: tuple[int, int] = (0, 1)):
        self.args, self.model, self.max_model_len, self.rate, self.seed = args, model, max_model_len, rate, seed
        self.rng = np.random.default_rng(seed)
        self.hostile = hostile_bodies(model, max_model_len)
        # Client i of n starts the rotation i/n of the way in, so a short run still sends every body.
        self.next_hostile = share[0] * len(self.hostile) // share[1]
        self.mixed = mixed  # closed-loop saturation requests are all plain streams

    def __iter__(self):
        base, chunk = 0.0, 0
        while True:
            ns = argparse.Namespace(**{**vars(self.args), "seed": self.seed * 100_003 + chunk,
                                       "num_prompts": _CHUNK})
            specs = build_requests(ns, self.rate, self.max_model_len)
            for spec in specs:
                yield self._job(spec, base + spec.arrival_s)
            chunk += 1
            if math.isfinite(self.rate):  # one more gap joins the chunks into one arrival process
                shape = self.args.burstiness
                base += specs[-1].arrival_s + self.rng.gamma(shape, 1.0 / (self.rate * shape))

    def _job(self, spec, at: float) -> Job:
        a, kind = self.args, "stream"
        if self.mixed:
            u = self.rng.random()
            if u < a.hostile_fraction:
                name, path, body, must = self.hostile[self.next_hostile % len(self.hostile)]
                self.next_hostile += 1
                return Job("hostile", path, body, at, hostile=name, must_reject=must)
            u -= a.hostile_fraction
            if u < a.disconnect_fraction:
                kind = "disconnect"
            elif u < a.disconnect_fraction + a.non_stream_fraction:
                kind = "non_stream"
        payload = {"model": self.model, "prompt": spec.prompt, "max_tokens": spec.output_len, "ignore_eos": True,
                   "stream": kind != "non_stream", "temperature": 0.0}
        if kind != "non_stream":
            payload["stream_options"] = {"include_usage": True}
        if spec.user is not None:
            payload["user"] = spec.user
        mode = int(self.rng.integers(3)) if a.sampling == "mixed" else 0
        if mode == 1:  # seeded sampling
            payload.update(temperature=0.8, seed=int(self.rng.integers(0, 2 ** 63)))
        elif mode == 2:
            payload.update(temperature=1.0, top_p=0.9, top_k=50)
        after = int(self.rng.integers(0, max(spec.output_len, 1))) if kind == "disconnect" else None
        return Job(kind, "/v1/completions", json.dumps(payload).encode(), at, disconnect_after=after)


def _status_outcome(status: int) -> str:
    if status == 429:
        return "rejected_429"
    if status == 400:
        return "rejected_400"
    if 400 <= status < 500:
        return "rejected_4xx"
    return "http_5xx" if status >= 500 else "lost"  # a 1xx/3xx final answer ends nothing


def _error_outcome(error) -> str:
    kind = error.get("type") if isinstance(error, dict) else None
    return "error_event_5xx" if kind in _SERVER_ERROR_TYPES or kind is None else "error_event"


async def _read_stream(resp, job: Job, rec: dict, start: float) -> None:
    buf, finished, error, done = b"", False, None, False
    if job.disconnect_after == 0:
        rec["outcome"] = "disconnected"
        return
    async for piece in resp.aiter_raw():
        buf += piece
        while (i := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:i], buf[i + 2:]
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # SSE comments and keep-alives
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                elif b'"error"' in data and isinstance(obj := json.loads(data), dict) and "error" in obj:
                    error = obj["error"]
                elif _HAS_CHOICE.search(data):
                    if rec["ttft"] is None:
                        rec["ttft"] = time.monotonic() - start
                    rec["chunks"] += 1
                    finished = finished or _FINISHED.search(data) is not None
            if job.disconnect_after is not None and rec["chunks"] >= job.disconnect_after and not finished:
                rec["outcome"] = "disconnected"  # leaving the context closes the connection
                return
    if error is not None:
        rec["outcome"], rec["error"] = _error_outcome(error), json.dumps(error)[:300]
    elif finished:
        rec["outcome"] = "completed"
    else:
        rec["error"] = ("stream ended without a finish_reason or an error event "
                        f"([DONE] {'seen' if done else 'missing'})")


async def send(client, job: Job, t0: float, timeout: float) -> dict:
    """One request, to its end. Server and network faults become the record's outcome."""
    rec = {"kind": job.kind, "hostile": job.hostile, "must_reject": job.must_reject, "outcome": "lost",
           "status": None, "at": job.at, "send": 0.0, "end": 0.0, "ttft": None, "chunks": 0, "error": ""}
    start = time.monotonic()
    rec["send"] = start - t0
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", job.path, content=job.body,
                                     headers={"Content-Type": "application/json"}) as resp:
                rec["status"] = resp.status_code
                if resp.status_code != 200:
                    rec["outcome"] = _status_outcome(resp.status_code)
                    rec["error"] = (await resp.aread())[:300].decode(errors="replace")
                elif resp.headers.get("content-type", "").startswith("text/event-stream"):
                    await _read_stream(resp, job, rec, start)
                else:
                    body = json.loads(await resp.aread())
                    choices = body.get("choices") if isinstance(body, dict) else None
                    if choices and all(c.get("finish_reason") for c in choices):
                        rec["outcome"] = "completed"
                    elif isinstance(body, dict) and "error" in body:
                        rec["outcome"], rec["error"] = _error_outcome(body["error"]), json.dumps(body["error"])[:300]
                    else:
                        rec["error"] = "a 200 answer without a finished choice"
    except TimeoutError:
        rec["outcome"], rec["error"] = "lost", f"no end after {timeout:g} s"
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        rec["outcome"], rec["error"] = "connect_error", f"{type(e).__name__}: {e}"[:300]
    except httpx.HTTPError as e:  # reset or cut mid-answer
        rec["outcome"], rec["error"] = "lost", f"{type(e).__name__}: {e}"[:300]
    except ValueError as e:  # an event or a body that is not JSON
        rec["outcome"], rec["error"] = "lost", f"bad JSON from the server: {e}"[:300]
    rec["end"] = time.monotonic() - t0
    return rec


def make_client(args, limit: int | None = None) -> httpx.AsyncClient:
    # No pool limit: a pool queue would hold arrivals back and turn the open loop into a closed one.
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.AsyncClient(base_url=args.url, headers=headers, trust_env=False,
                             timeout=httpx.Timeout(args.timeout, connect=30.0),
                             limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit))


def discover_model(args) -> tuple[str, int | None]:
    """The model to send (``--model``, else the first that /v1/models lists) and its
    ``max_model_len`` as the server reports it (None if it does not)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        resp = httpx.get(f"{args.url}/v1/models", headers=headers, timeout=30, trust_env=False)
        resp.raise_for_status()
        cards = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(f"cannot list models at {args.url}/v1/models ({e})") from None
    card = next((c for c in cards if c.get("id") == args.model), None) if args.model else (cards[0] if cards else None)
    if card is None and not args.model:
        raise ValueError(f"{args.url}/v1/models lists no model; pass --model")
    return args.model or card["id"], (card or {}).get("max_model_len")
