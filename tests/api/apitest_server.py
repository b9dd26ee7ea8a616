"""A real ``deepbatch serve`` process for the API tests, and a few helpers around it.

Loading the model takes tens of seconds on a small CPU, so tests/api/conftest.py starts every
process the selected tests need at once, in the background (they load in parallel), and each
test module waits only for its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

try:
    import httpx
except ImportError:  # some environments ship httpx only under its 2.x distribution name
    import httpx2 as httpx  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-deepbatch-test"
MODEL = "SmolLM2-135M-Instruct"
# Enough KV blocks for the tests (16 tokens each) without the CPU default's 2 GiB per process.
KV_BLOCKS = "1024"
# The main server: auth on, a small body limit (so 413 is cheap to provoke), quick stats lines.
MAIN_SERVER = dict(
    args=["--num-gpu-blocks-override", KV_BLOCKS],
    env={"DEEPBATCH_MAX_REQUEST_BODY_BYTES": "65536", "DEEPBATCH_LOG_STATS_INTERVAL": "1"},
    api_key=API_KEY,
)


# Process logs; kept when a test failed (see conftest.py), removed otherwise.
LOG_DIR = Path(tempfile.mkdtemp(prefix="deepbatch-api-tests-"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundProcess:
    """A process whose stderr goes to a log file and stdout to another (``output()``)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None):
        self.name = name
        self.log = open(LOG_DIR / f"{name}.log", "wb")
        self.out = open(LOG_DIR / f"{name}.out", "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.out, stderr=self.log,
                                     env={**os.environ, **(env or {})})

    def log_tail(self, chars: int = 6000) -> str:
        text = Path(self.log.name).read_text(errors="replace") + Path(self.out.name).read_text(errors="replace")
        return text[-chars:]

    def output(self, timeout: float = 600) -> str:
        """Its stdout, once it has exited 0."""
        self.proc.wait(timeout)
        assert self.proc.returncode == 0, f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
        return Path(self.out.name).read_text()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


class ServerProcess(BackgroundProcess):
    def __init__(self, name: str, args: list[str] = (), env: dict[str, str] | None = None, api_key: str | None = None):
        self.port = free_port()
        self.api_key = api_key
        cmd = [sys.executable, "-m", "deepbatch.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", "512", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        super().__init__(name, cmd, env)
        self._ready = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = 420.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while not self._ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self._ready = httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                pass
            if not self._ready:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server {self.name} not ready after {timeout} s:\n{self.log_tail()}")
                time.sleep(0.5)
        return self

    def http(self, **kwargs) -> httpx.Client:
        kwargs.setdefault("headers", self.headers)
        kwargs.setdefault("timeout", 60)
        return httpx.Client(base_url=self.url, **kwargs)

    def async_http(self, **kwargs) -> httpx.AsyncClient:
        kwargs.setdefault("headers", self.headers)
        kwargs.setdefault("timeout", 60)
        return httpx.AsyncClient(base_url=self.url, **kwargs)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=kwargs.pop("timeout", 120), **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=kwargs.pop("timeout", 120), **kwargs)

    def metrics(self) -> dict[str, float]:
        """``{'name{label="v",...}': value}``, labels sorted, from /metrics."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        return parse_metrics(text)

    def metric(self, name: str, **labels: str) -> float:
        labels.setdefault("model_name", MODEL)
        return self.metrics().get(metric_key(name, labels), 0.0)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)


def warm_default_model_cache() -> None:
    """Dequantize the embedded SmolLM2's GGUF weights into this run's cache directory (once), so
    every engine and server started afterwards reads them instead (a few seconds, not twenty)."""
    from deepbatch.models.gguf_loader import warm_weight_cache
    from deepbatch.models.loader import gguf_cache_dir, load_hf_config, resolve_model

    root = os.environ["DEEPBATCH_CACHE_DIR"]
    source = resolve_model(None)
    warm_weight_cache(source.path, load_hf_config(source, root), gguf_cache_dir(source, root))



# -- processes shared by the selected test modules (see conftest.py) -------------------------------

_servers: dict[str, ServerProcess] = {}
_background: dict[str, BackgroundProcess] = {}


def launch_for_modules(modules) -> None:
    """Start every process the modules declare (``SERVERS``, ``BACKGROUND``) that is not running
    yet, all at once, so their model loads overlap."""
    for mod in modules:
        for name, spec in getattr(mod, "SERVERS", {}).items():
            if name not in _servers:
                _servers[name] = ServerProcess(name, **spec)
        for name, cmd in getattr(mod, "BACKGROUND", {}).items():
            if name not in _background:
                _background[name] = BackgroundProcess(name, cmd)


def declared(modules) -> set[str]:
    """The names of the processes the modules declare."""
    return {name for mod in modules for name in (*getattr(mod, "SERVERS", {}), *getattr(mod, "BACKGROUND", {}))}


def stop_unneeded(keep: set[str]) -> None:
    """Stop every launched process whose name is not in ``keep``."""
    _stop([_servers.pop(n) for n in list(_servers) if n not in keep]
          + [_background.pop(n) for n in list(_background) if n not in keep])


def stop_all(keep_logs: bool) -> None:
    """Stop every launched process; the logs stay when ``keep_logs``, else they are removed."""
    stop_unneeded(set())
    if keep_logs:
        print(f"\nserver logs: {LOG_DIR}")
    else:
        shutil.rmtree(LOG_DIR, ignore_errors=True)


def _stop(procs: list[BackgroundProcess]) -> None:
    for proc in procs:  # all drain at once, then each is waited for
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGINT)
    for proc in procs:
        try:
            proc.proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.proc.kill()
            proc.proc.wait(10)
        proc.log.close()
        proc.out.close()


def get_server(name: str) -> ServerProcess:
    """The launched server ``name``, once it answers /health."""
    return _servers[name].wait_ready()


def get_background(name: str) -> BackgroundProcess:
    return _background[name]


_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_key(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or line.startswith("#"):
            continue
        out[metric_key(m.group(1), dict(_LABEL.findall(m.group(3) or "")))] = float(m.group(4))
    return out


def assert_error(resp, status: int, param: str | None = "any", code: str | None = None) -> dict:
    """The reply is ``status`` with an OpenAI error body; returns the error object."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and isinstance(err["code"], str)
    if param != "any":
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


class BackgroundStream:
    """One streaming completion read in the background; ``first`` is set at its first token."""

    def __init__(self, client, payload):
        self.first = asyncio.Event()
        self.status = None
        self.events: list = []
        self.task = asyncio.ensure_future(self._run(client, payload))

    async def _run(self, client, payload):
        async with client.stream("POST", "/v1/completions", json=payload) as resp:
            self.status = resp.status_code
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                self.events.append(data if data == "[DONE]" else json.loads(data))
                if data != "[DONE]" and self.events[-1].get("choices"):
                    self.first.set()

    def text_and_reason(self):
        chunks = [e for e in self.events if isinstance(e, dict) and e.get("choices")]
        return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


# -- the engine core process of a server ------------------------------------------------------------


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def engine_core_pid(server_pid: int) -> int:
    cores = [pid for pid in children(server_pid)
             if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"deepbatch::EngineCore")]
    assert len(cores) == 1, f"one process titled deepbatch::EngineCore under {server_pid}, found {cores}"
    return cores[0]


def wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still alive after {timeout} s"
        time.sleep(0.1)
