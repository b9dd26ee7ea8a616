#!/usr/bin/env bash
# One GPU session's checks and timings, each stage time-boxed so one slow stage cannot sink
# the rest. Results land in $OUT (or ./out): *.log per stage, *.json per benchmark.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
M=${MODELS:-benchmarks/models}
stage() { local name=$1 secs=$2; shift 2; echo "=== $name ($(date +%T))"; timeout "$secs" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n 12 "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
stage nano-x4 ${T_NANO:-170} python3 -m deepbatch.bench.throughput --workload nano-x4 --model-config "$M/qwen3-0.6b.json" \
  --random-weights --peers hf-static --peer-requests 128 --peer-batch-size 128 --output-json "$OUT/nano-x4.json"
stage parity ${T_PARITY:-110} python3 benchmarks/gpu_parity.py --model-config "$M/qwen3-0.6b.json" --output-json "$OUT/parity.json"
stage kernels ${T_KERNELS:-80} python3 -m pytest -q -m gpu tests/kernels
stage random-1k ${T_LLAMA:-150} python3 -m deepbatch.bench.throughput --workload random-1k --num-requests 256 \
  --model-config "$M/llama-3.1-8b.json" --random-weights --output-json "$OUT/random-1k.json"
