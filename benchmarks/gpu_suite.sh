#!/usr/bin/env bash
# GPU checks and timings, each stage time-boxed so one slow stage cannot sink the rest.
# Results land in $OUT (or ./out): *.log per stage, *.json per benchmark.
#
#   benchmarks/gpu_suite.sh                 # the default stages
#   benchmarks/gpu_suite.sh parity nano-x4  # just these
#
# To compare with an earlier commit in the same call (the machine's speed drifts between calls),
# extract it beside this tree and name it in BASE_TREE: each stage then runs there first (results
# in $OUT/base), then here ($OUT/new), alternating, so both runs of a pair meet the same machine.
#   git archive C deepbatch benchmarks | tar -x -C .base
#   BASE_TREE=.base benchmarks/gpu_suite.sh nano-x4 random-1k mla-moe-plain
# (the base tree's own gpu_suite.sh runs its half, so a stage must exist in both).
#
# Stage time limits can be set through T_<STAGE> (upper case, dashes as underscores).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -n "${BASE_TREE:-}" ]; then
  OUT=$(cd "$OUT" && pwd); here=$(pwd); base=$(cd "$BASE_TREE" && pwd)
  [ $# -gt 0 ] || { echo "BASE_TREE: name the stages to compare"; exit 2; }
  for s in "$@"; do
    (cd "$base" && env -u BASE_TREE OUT="$OUT/base" PYTHONPATH= bash benchmarks/gpu_suite.sh "$s")
    (cd "$here" && env -u BASE_TREE OUT="$OUT/new" bash benchmarks/gpu_suite.sh "$s")
  done
  exit 0
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
M=${MODELS:-benchmarks/models}
# BENCH_ARGS: more flags for every throughput stage (e.g. --max-num-seqs 512).
TP="python3 -m deepbatch.bench.throughput --random-weights ${BENCH_ARGS:-}"
# pytest in one process: the project's addopts ask for pytest-xdist, which GPU hosts need not have.
PYTEST="python3 -m pytest -o addopts= -q"
# Memory under pressure: the KV pool capped at 4096 blocks (65,536 tokens), requests adding up to 2x.
KV2X="$TP --workload kv-2x --model-config $M/qwen3-0.6b.json --num-gpu-blocks-override ${KV_BLOCKS:-4096}"

# A copy of a config with edits (a Python statement on the dict `c`), for the format variants.
derive() {
  mkdir -p /tmp/derived
  python3 -c "import json,sys; c=json.load(open(sys.argv[1])); $2; json.dump(c, open(sys.argv[3], 'w'))" \
    "$M/$1.json" "$2" "/tmp/derived/$3.json"
  echo "/tmp/derived/$3.json"
}
FP8_BLOCK='c["quantization_config"]={"quant_method":"fp8","activation_scheme":"dynamic","fmt":"e4m3","weight_block_size":[128,128]}'
AWQ='c["quantization_config"]={"quant_method":"awq","bits":4,"group_size":128,"zero_point":True,"version":"gemm"}'

# Request counts for the long workloads when a run must fit a time box (default: the whole workload).
R1K_N=${R1K_REQUESTS:+--num-requests $R1K_REQUESTS}
SEED_N=${SEED_REQUESTS:+--num-requests $SEED_REQUESTS}

limit() { local v="T_$(echo "$1" | tr 'a-z-' 'A-Z_')"; echo "${!v:-$2}"; }
stage() {
  local name=$1 secs; secs=$(limit "$1" "$2"); shift 2
  echo "=== $name ($(date +%T), limit ${secs}s)"
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n 14 "$OUT/$name.log"
}

run_stage() {
  case $1 in
    parity) stage parity 150 python3 benchmarks/gpu_parity.py --model-config "$M/qwen3-0.6b.json" ${PARITY_RUNS:+--runs $PARITY_RUNS} \
      --output-json "$OUT/parity.json" ;;
    kernels) stage kernels 90 $PYTEST -m gpu tests/kernels ;;
    profile-nano) stage profile-nano 90 python3 benchmarks/gpu_profile.py --model-config "$M/qwen3-0.6b.json" \
      --workload nano --output-json "$OUT/profile-nano.json" ;;
    timeline-nano) stage timeline-nano 120 python3 benchmarks/gpu_profile.py --model-config "$M/qwen3-0.6b.json" \
      --workload nano --timeline --output-json "$OUT/timeline-nano.json" ;;
    profile-nano-x4) stage profile-nano-x4 120 python3 benchmarks/gpu_profile.py --model-config "$M/qwen3-0.6b.json" \
      --workload nano-x4 --warm-steps 900 --steps 40 --output-json "$OUT/profile-nano-x4.json" ;;
    timeline-nano-x4) stage timeline-nano-x4 120 python3 benchmarks/gpu_profile.py --model-config "$M/qwen3-0.6b.json" \
      --workload nano-x4 --timeline --output-json "$OUT/timeline-nano-x4.json" ;;
    nano-x4) stage nano-x4 120 $TP --workload nano-x4 --model-config "$M/qwen3-0.6b.json" --output-json "$OUT/nano-x4.json" ;;
    # Every request penalised: async scheduling must hold (the penalty state lives on the device).
    nano-x4-penalties) stage $1 120 $TP --workload nano-x4 --model-config "$M/qwen3-0.6b.json" \
      --sampling '{"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5}' \
      --output-json "$OUT/$1.json" ;;
    # What each sampling option costs beside temperature-only, one engine for every variant.
    sampling-variants) stage $1 ${T_SV:-420} python3 benchmarks/sampling_variants.py --model-config "$M/qwen3-0.6b.json" \
      --num-requests ${SV_REQUESTS:-1024} ${SV_VARIANTS:+--variants $SV_VARIANTS} --output-json "$OUT/$1.json" ;;
    # The same with a JSON schema on every request: SmolLM2's real tokenizer under a qwen3-0.6b-shaped
    # model of its vocabulary (benchmarks/smollm2_tokenizer.py writes it; carry it, and xgrammar's wheels
    # from benchmarks/gpu_wheels.sh).
    sampling-json) stage $1 ${T_SJ:-420} python3 benchmarks/sampling_variants.py --model-config "$M/qwen3-0.6b.json" \
      --vocab-size 49152 --tokenizer "${BENCH_TOKENIZER:-.bench-tokenizer}" --variants temperature,json \
      --num-requests ${SV_REQUESTS:-1024} --output-json "$OUT/$1.json" ;;
    # The variants under py-spy (pip install py-spy): where each one's host time goes, in collapsed
    # stacks (benchmarks/pyspy_summary.py reads them; the temperature-only runs are in them too).
    # By default everything at once and a JSON schema, so SmolLM2's tokenizer (as sampling-json).
    sampling-variants-pyspy) stage $1 ${T_SVP:-300} py-spy record --nonblocking --rate 250 --format raw -o "$OUT/$1.txt" \
      -- python3 benchmarks/sampling_variants.py --model-config "$M/qwen3-0.6b.json" \
      --vocab-size 49152 --tokenizer "${BENCH_TOKENIZER:-.bench-tokenizer}" \
      --num-requests ${SV_REQUESTS:-512} --variants ${SVP_VARIANTS:-all,json} --output-json "$OUT/$1.json" ;;
    sample-sweep) stage $1 150 python3 benchmarks/sample_sweep.py --output-json "$OUT/$1.json" ;;
    # Speculative decoding (prompt lookup, draft model): output with and without drafts, kernels and graphs.
    spec-decode-check) stage $1 240 python3 benchmarks/spec_decode_check.py --model-config "$M/qwen3-0.6b.json" \
      --output-json "$OUT/$1.json" ;;
    # DeepSeek-V3's MTP layer drafting (random weights), on V3 cut to its first MoE layer, bf16.
    spec-decode-mtp) stage $1 ${T_SDM:-300} python3 benchmarks/spec_decode_check.py --methods mtp --dtype bfloat16 \
      --gpu-memory-utilization 0.6 --num-prompts 16 --output-json "$OUT/$1.json" \
      --model-config "$(derive deepseek-v3 "c['num_hidden_layers']=4; c.pop('auto_map', None)" v3-cut4)" ;;
    # Speed-up against a set acceptance rate at batch 1/8/64/256, every draft and the cost model.
    spec-decode-curve) stage $1 ${T_SDC:-420} python3 benchmarks/spec_decode_curve.py --model-config "$M/qwen3-0.6b.json" ${SDC_ARGS:-} \
      --output-json "$OUT/$1.json" ;;
    # Where a verification step's time goes at batch 1 and 8: sync, k + 1 tokens, k + 1 sampled rows.
    spec-verify-cost) stage $1 ${T_SVC:-240} python3 benchmarks/spec_verify_cost.py --model-config "$M/qwen3-0.6b.json" \
      ${SVC_ARGS:-} --output-json "$OUT/$1.json" ;;
    kernels-sampling) stage $1 150 $PYTEST -m gpu tests/kernels/test_sample.py tests/kernels/test_sample_top_k_top_p.py tests/kernels/test_sample_rejection.py \
      tests/kernels/test_apply_penalties.py tests/kernels/test_logprobs_topk.py tests/sampling ;;
    nano-x4-fused-sampler) stage nano-x4-fused-sampler 120 $TP --workload nano-x4 --model-config "$M/qwen3-0.6b.json" \
      --fused-sampler --output-json "$OUT/nano-x4-fused-sampler.json" ;;
    attention-sweep) stage attention-sweep 120 python3 benchmarks/attention_sweep.py --output-json "$OUT/attention-sweep.json" ;;
    attention-sweep-ragged) stage attention-sweep-ragged 120 python3 benchmarks/attention_sweep.py --ragged \
      --output-json "$OUT/attention-sweep-ragged.json" ;;
    attention-sweep-gqa4) stage attention-sweep-gqa4 120 python3 benchmarks/attention_sweep.py --ragged \
      --num-heads 32 --num-kv-heads 8 --output-json "$OUT/attention-sweep-gqa4.json" ;;
    moe-sweep) stage moe-sweep 200 python3 benchmarks/moe_sweep.py --output-json "$OUT/moe-sweep.json" ;;
    mla-prefill-sweep) stage mla-prefill-sweep 150 python3 benchmarks/mla_prefill_sweep.py \
      --output-json "$OUT/mla-prefill-sweep.json" ;;
    mla-sweep) stage mla-sweep 150 python3 benchmarks/mla_sweep.py --output-json "$OUT/mla-sweep.json" ;;
    # 8-bit caches: which tiles reach the copy bandwidth over fp8 keys and latents.
    attention-sweep-fp8) stage $1 240 python3 benchmarks/attention_sweep.py --ragged --kv-cache-dtype fp8 \
      --tile-n 64,128,256 --warps 4,8 --stages 2,3,4,5 --output-json "$OUT/$1.json" ;;
    mla-sweep-fp8|mla-sweep-int8) stage $1 200 python3 benchmarks/mla_sweep.py --kv-cache-dtype ${1#mla-sweep-} \
      --output-json "$OUT/$1.json" ;;
    profile-mla-decode) stage profile-mla-decode 150 python3 benchmarks/gpu_profile.py \
      --model-config "$M/deepseek-v2-lite.json" --workload mla-moe --warm-steps 300 --steps 20 \
      --output-json "$OUT/profile-mla-decode.json" ;;
    profile-mla-prefill-absorbed) stage profile-mla-prefill-absorbed 150 python3 benchmarks/gpu_profile.py \
      --model-config "$M/deepseek-v2-lite.json" --workload mla-moe --warm-steps 0 --steps 6 --mla-prefill absorbed \
      --output-json "$OUT/profile-mla-prefill-absorbed.json" ;;
    timeline-mla) stage timeline-mla 180 python3 benchmarks/gpu_profile.py --model-config "$M/deepseek-v2-lite.json" \
      --workload mla-moe --timeline --output-json "$OUT/timeline-mla.json" ;;
    profile-mla-prefill) stage profile-mla-prefill 150 python3 benchmarks/gpu_profile.py \
      --model-config "$M/deepseek-v2-lite.json" --workload mla-moe --warm-steps 0 --steps 6 \
      --output-json "$OUT/profile-mla-prefill.json" ;;
    nano-x4-decode-graphs) stage nano-x4-decode-graphs 120 $TP --workload nano-x4 --model-config "$M/qwen3-0.6b.json" \
      --cuda-graph-mode decode --output-json "$OUT/nano-x4-decode-graphs.json" ;;
    parity-mla) stage parity-mla 150 python3 benchmarks/gpu_parity.py --model-config "$M/deepseek-v2-lite.json" \
      --dtype bfloat16 --runs triton-eager,triton-graphs-full --skip-logits --output-json "$OUT/parity-mla.json" ;;
    nano-x4-sync) stage nano-x4-sync 120 $TP --workload nano-x4 --model-config "$M/qwen3-0.6b.json" \
      --no-async-scheduling --output-json "$OUT/nano-x4-sync.json" ;;
    nano-x4-peer) stage nano-x4-peer 330 $TP --workload nano-x4 --model-config "$M/qwen3-0.6b.json" \
      --peers hf-static --peer-requests 64 --peer-batch-size 64 --output-json "$OUT/nano-x4-peer.json" ;;
    random-1k) stage random-1k 330 $TP --workload random-1k --model-config "$M/llama-3.1-8b.json" $R1K_N \
      --output-json "$OUT/random-1k.json" ;;
    seed-table) stage seed-table 240 $TP --workload seed-table --model-config "$M/deepseek-r1-distill-qwen-7b.json" $SEED_N \
      --output-json "$OUT/seed-table.json" ;;
    mla-moe) stage mla-moe 300 $TP --workload mla-moe --model-config "$M/deepseek-v2-lite.json" \
      --num-requests ${MLA_REQUESTS:-1000} --peers hf-static --peer-requests ${MLA_PEER:-16} --peer-batch-size ${MLA_PEER:-16} \
      --output-json "$OUT/mla-moe.json" ;;
    mla-moe-expanded|mla-moe-absorbed) stage $1 200 $TP --workload mla-moe --model-config "$M/deepseek-v2-lite.json" \
      --num-requests ${MLA_REQUESTS:-1000} --mla-prefill ${1#mla-moe-} --output-json "$OUT/$1.json" ;;
    mla-kernels) stage mla-kernels 120 $PYTEST -m gpu tests/kernels/test_mla_prefill.py \
      tests/kernels/test_mla_decode.py tests/kernels/test_mla_decode_swap_ab.py ;;
    kv-2x-recompute) stage kv-2x-recompute 90 $KV2X --output-json "$OUT/kv-2x-recompute.json" ;;
    kv-2x-swap) stage kv-2x-swap 90 $KV2X --swap-space ${KV_SWAP_GIB:-8} --preemption-mode swap --output-json "$OUT/kv-2x-swap.json" ;;
    kv-2x-predictive) stage kv-2x-predictive 90 $KV2X --admission predictive --output-json "$OUT/kv-2x-predictive.json" ;;
    kv-2x-auto) stage kv-2x-auto 90 $KV2X --swap-space ${KV_SWAP_GIB:-8} --output-json "$OUT/kv-2x-auto.json" ;;
    # Quantized KV cache and weights, each beside the plain run of the same workload.
    kernels-quant) stage kernels-quant 240 $PYTEST -m gpu tests/kernels/test_fp8_quant.py \
      tests/kernels/test_w8a8_fp8_gemm.py tests/kernels/test_fused_moe_fp8.py tests/kernels/test_w4a16_gemm.py \
      tests/kernels/test_mla_kv_quant.py tests/kernels/test_kv_cache_quant.py tests/kernels/test_paged_attention_window.py ;;
    quant-parity) stage quant-parity 200 python3 benchmarks/quant_parity.py --model-config "$M/qwen3-0.6b.json" \
      --output-json "$OUT/quant-parity.json" ;;
    nano-x4-kv-fp8|nano-x4-kv-int8) stage $1 120 $TP --workload nano-x4 --model-config "$M/qwen3-0.6b.json" \
      --kv-cache-dtype ${1#nano-x4-kv-} --output-json "$OUT/$1.json" ;;
    mla-moe-plain) stage $1 240 $TP --workload mla-moe --model-config "$M/deepseek-v2-lite.json" \
      --num-requests ${MLA_REQUESTS:-1000} --output-json "$OUT/$1.json" ;;
    mla-moe-kv-fp8|mla-moe-kv-int8) stage $1 240 $TP --workload mla-moe --model-config "$M/deepseek-v2-lite.json" \
      --num-requests ${MLA_REQUESTS:-1000} --kv-cache-dtype ${1#mla-moe-kv-} --output-json "$OUT/$1.json" ;;
    mla-moe-fp8) stage $1 240 $TP --workload mla-moe --model-config "$(derive deepseek-v2-lite "$FP8_BLOCK" v2-lite-fp8)" \
      --num-requests ${MLA_REQUESTS:-1000} --output-json "$OUT/$1.json" ;;
    random-1k-fp8) stage $1 330 $TP --workload random-1k --model-config "$M/llama-3.1-8b.json" $R1K_N --quantization fp8 \
      --output-json "$OUT/$1.json" ;;
    random-1k-fp8-kv-fp8) stage $1 330 $TP --workload random-1k --model-config "$M/llama-3.1-8b.json" $R1K_N --quantization fp8 \
      --kv-cache-dtype fp8 --output-json "$OUT/$1.json" ;;
    random-1k-kv-fp8) stage $1 330 $TP --workload random-1k --model-config "$M/llama-3.1-8b.json" $R1K_N \
      --kv-cache-dtype fp8 --output-json "$OUT/$1.json" ;;
    seed-table-awq) stage $1 240 $TP --workload seed-table --model-config "$(derive deepseek-r1-distill-qwen-7b "$AWQ" r1-7b-awq)" $SEED_N \
      --output-json "$OUT/$1.json" ;;
    # DeepSeek-V3's layer shapes in its own FP8 format, cut to the first MoE layers so it fits one GPU.
    v3-fp8) stage $1 300 $TP --workload mla-moe --num-requests ${V3_REQUESTS:-256} \
      --model-config "$(derive deepseek-v3 "c['num_hidden_layers']=${V3_LAYERS:-6}; c.pop('auto_map', None)" v3-cut)" \
      --output-json "$OUT/$1.json" ;;
    # Sliding windows: mistral-7b with its 4,096-token window against the same config without it.
    long-swa) stage $1 ${T_LONG:-500} $TP --workload long-swa --model-config "$M/mistral-7b.json" \
      --num-requests ${LONG_REQUESTS:-1000} --output-json "$OUT/$1.json" ;;
    long-swa-nowindow) stage $1 ${T_LONG:-500} $TP --workload long-swa --num-requests ${LONG_REQUESTS:-1000} \
      --model-config "$(derive mistral-7b "c['sliding_window']=None" mistral-7b-nowindow)" --output-json "$OUT/$1.json" ;;
    # The server against the offline engine on the same requests, in one run (issue: the server at
    # the engine's speed). Needs fastapi, uvicorn, pydantic, pyzmq, msgspec, httpx: carry the wheels
    # benchmarks/gpu_wheels.sh downloads (the lock's versions).
    serve-vs-offline) stage $1 ${T_SVO:-420} python3 -m deepbatch.bench.serve_offline "$M/qwen3-0.6b.json" --random-weights \
      --num-prompts ${SVO_PROMPTS:-1000} --random-input-len 1000 --random-output-len 250 --variants ${SVO_VARIANTS:-process,api2,offline-core} \
      --single-stream 20 --max-model-len 4096 --output-json "$OUT/$1.json" ;;
    serve-vs-offline-8b) stage $1 ${T_SVO8:-420} python3 -m deepbatch.bench.serve_offline "$M/llama-3.1-8b.json" --random-weights \
      --num-prompts ${SVO8_PROMPTS:-512} --random-input-len 1000 --random-output-len 250 --variants ${SVO8_VARIANTS:-process} \
      --max-model-len 4096 --output-json "$OUT/$1.json" ;;
    # The same 0.6b load as serve-vs-offline (engine core process only) under py-spy, every process
    # sampled (offline child, API process, engine core, clients): collapsed stacks in $OUT/$1.txt,
    # one root frame per process. Needs `pip install py-spy` (benchmarks/pyspy_summary.py reads it).
    serve-vs-offline-pyspy) stage $1 ${T_SVOP:-300} py-spy record --subprocesses --nonblocking --rate 250 \
      --format raw -o "$OUT/$1.txt" -- python3 -m deepbatch.bench.serve_offline "$M/qwen3-0.6b.json" --random-weights \
      --num-prompts ${SVO_PROMPTS:-1000} --random-input-len 1000 --random-output-len 250 --variants process \
      --max-model-len 4096 --output-json "$OUT/$1.json" ;;
    *) echo "unknown stage $1"; return 2 ;;
  esac
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
git rev-parse --short HEAD 2>/dev/null
if [ $# -eq 0 ]; then set -- parity kernels nano-x4 random-1k; fi
for s in "$@"; do run_stage "$s"; done
