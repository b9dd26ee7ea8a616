#!/usr/bin/env bash
# Refreshes requirements/ci.lock, the versions scripts/install.sh installs the test environment
# at. Run it on purpose (a new dependency, an upgrade), then run the tests and commit the lock:
#
#   scripts/lock.sh            # keep every pin that still fits; add what is new
#   scripts/lock.sh --upgrade  # move every pin to the newest release that fits
#
# torch is left out: install.sh pins the CPU build itself and leaves a CUDA build alone.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
"$py" -m pip install -q "pip-tools>=7.4"
"$py" -m piptools compile --quiet --extra test --strip-extras --no-emit-index-url --no-emit-find-links \
  --unsafe-package torch --output-file requirements/ci.lock "$@" pyproject.toml
