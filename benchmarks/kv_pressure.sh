#!/usr/bin/env bash
# Memory under pressure on one GPU: qwen3-0.6b (random weights) with the KV pool capped at
# $BLOCKS blocks of 16 tokens (default 4096: 65,536 tokens) and the kv-2x workload (requests of
# 256 + 256 tokens whose contexts add up to twice that). Recompute-only vs swap vs predictive
# admission, each time-boxed; kv-2x-<mode>.json and .log land in $OUT. AUTO=1 adds a run where
# the cost model picks swap or recompute per victim.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
M=${MODELS:-benchmarks/models}
COMMON=(--workload kv-2x --model-config "$M/qwen3-0.6b.json" --random-weights --num-gpu-blocks-override "${BLOCKS:-4096}")
run() {
  local name=$1; shift
  echo "=== $name ($(date +%T))"
  timeout "${T_RUN:-120}" python3 -m deepbatch.bench.throughput "${COMMON[@]}" "$@" \
    --output-json "$OUT/kv-2x-$name.json" >"$OUT/kv-2x-$name.log" 2>&1
  echo "rc=$?"; grep -v Generating "$OUT/kv-2x-$name.log" | tail -n 9
}
run recompute
run swap --swap-space "${SWAP_GIB:-8}" --preemption-mode swap
run predictive --admission predictive
if [ "${AUTO:-0}" = 1 ]; then run auto --swap-space "${SWAP_GIB:-8}"; fi
