"""The layering of docs/architecture.md, written as import-linter contracts in pyproject.toml: they
hold on the package as it is, and an import that runs upward (or across independent siblings, or
from a kernel or a shared type into the engine's settings) breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = shutil.which("lint-imports")


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with this repository's contracts over the ``deepbatch`` in ``package_parent``."""
    assert LINT, "import-linter is a test dependency: pip install -e '.[test]'"
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([LINT, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_every_contract():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "2 kept, 0 broken" in r.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("kernels/common.py", "import deepbatch.engine.llm_engine", "Layers import downward"),
    ("core/request.py", "from deepbatch.scheduler import scheduler", "Layers import downward"),
    ("scheduler/policy.py", "import deepbatch.runner.model_runner", "Layers import downward"),  # independent siblings
    ("layers/linear.py", "from deepbatch.core import forward_batch\nimport deepbatch.models.llama", "Layers import downward"),
    ("kernels/common.py", "from deepbatch import envs", "Kernels are leaves"),
], ids=["kernel-to-engine", "core-to-scheduler", "scheduler-to-runner", "layer-to-model", "kernel-to-envs"])
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, line, contract):
    shutil.copytree(ROOT / "deepbatch", tmp_path / "deepbatch", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "deepbatch" / module, "a") as f:
        f.write(f"\n{line}\n")
    r = lint(tmp_path)
    assert r.returncode != 0, r.stdout[-3000:]
    broken = [ln for ln in r.stdout.splitlines() if ln.endswith("BROKEN")]
    assert any(ln.startswith(contract) for ln in broken), r.stdout[-3000:]
