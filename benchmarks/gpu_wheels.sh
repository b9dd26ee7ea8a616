#!/usr/bin/env bash
# Wheels for a GPU host that has torch, triton and transformers but not the server's own
# dependencies: the versions of requirements/ci.lock (what the tests run against), for CPython
# 3.12 on x86-64 Linux, into .wheels/ (git ignores it). On the GPU host:
#   python3 -m pip install --no-index --no-deps .wheels/*.whl
# Unpinned wheels there run a server the tests never saw (a newer pydantic, say).
#   benchmarks/gpu_wheels.sh            # the server, structured outputs, metrics
#   benchmarks/gpu_wheels.sh py-spy     # and more packages by name, at their newest
set -euo pipefail
cd "$(dirname "$0")/.."
# opentelemetry-api: fastapi imports it (its telemetry module) even where tracing is off.
names="annotated-doc annotated-types anyio apache-tvm-ffi certifi click fastapi h11 httpcore httpx idna msgspec
  opentelemetry-api prometheus-client pydantic pydantic-core pyzmq setproctitle starlette typing-extensions
  typing-inspection uvicorn uvloop xgrammar xxhash"
reqs=$(mktemp)
for n in $names; do
  grep -iE "^${n}==" requirements/ci.lock | sed 's/ ;.*//' >> "$reqs"
done
for extra in "$@"; do echo "$extra" >> "$reqs"; done
mkdir -p .wheels
python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .wheels -r "$reqs"
rm -f "$reqs"
ls .wheels
