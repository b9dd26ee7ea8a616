"""Building a kernel as an H200 would, on the CPU: the interpreter runs kernels as Python, so a
construct the compiler rejects (a loop-carried value that changes type, a scan it cannot lower)
would pass there and fail on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def build_for_sm90(script: str) -> str:
    """Runs ``script`` (which compiles kernels for sm_90 and prints what it found; exit 3: no
    NVIDIA backend) outside the interpreter; returns its stdout, or skips without the backend."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True)
    if proc.returncode == 3:
        pytest.skip("Triton has no NVIDIA backend")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
