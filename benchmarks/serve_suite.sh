#!/usr/bin/env bash
# Online serving on one GPU, about 6 minutes: the SLO controller against fixed settings (goodput
# over a rate sweep), head-of-line blocking, two tenants, static vs continuous batching. Servers
# run one at a time on $PORT; each is started, benchmarked and stopped (SIGINT drains it).
# Results land in $OUT: bench JSONs, server logs, slo.json + slo.png (serve_compare).
#
#   OUT=out bash benchmarks/serve_suite.sh
#   MODEL=benchmarks/models/llama-3.1-8b.json RATES=2,4,6 SLO_TPOT=60 bash benchmarks/serve_suite.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MODEL=${MODEL:-benchmarks/models/qwen3-0.6b.json}  # random weights, token-id prompts
PORT=${PORT:-8100}
RATES=${RATES:-10,20,40}                 # requests/s of the SLO sweep
N=${N:-120}                              # requests per rate
SLO_TTFT=${SLO_TTFT:-500} SLO_TPOT=${SLO_TPOT:-25}  # p99 targets, ms (controller and goodput)
FIXED=${FIXED:-"256:8192 64:2048"}       # fixed settings (max_num_seqs:max_num_batched_tokens)
SWEEP_ONLY=${SWEEP_ONLY:-0}              # 1: only the controller-vs-fixed sweep (no hol, tenants, static)
SERVE=(python3 -m deepbatch.cli serve "$MODEL" --port "$PORT" --max-model-len 8192 --max-queued-requests 0)
BENCH=(python3 -m deepbatch.bench.serve --base-url "http://127.0.0.1:$PORT" --disable-tqdm --seed 0 --vocab-size "${VOCAB:-32000}")
PID=
python3 -c "import importlib.util as u, sys, fastapi, uvicorn, prometheus_client
sys.exit(0 if u.find_spec('httpx') or u.find_spec('httpx2') else 1)" ||
  { echo "the server and the load generator need: pip install -e '.[serve,bench]'"; exit 1; }

get() {  # get PATH: the body of a GET on the server (no curl needed)
  python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$PORT$1', timeout=5).read().decode())"
}

start() {  # start NAME FLAGS...: a server, ready when /health answers (at most 150 s)
  local name=$1; shift
  echo "=== server $name ($(date +%T)): $*"
  "${SERVE[@]}" "$@" >"$OUT/server-$name.log" 2>&1 &
  PID=$!
  for _ in $(seq 150); do
    get /health >/dev/null 2>&1 && return 0
    kill -0 "$PID" 2>/dev/null || break
    sleep 1
  done
  echo "server $name did not start"; tail -n 20 "$OUT/server-$name.log"; stop; return 1
}

stop() {
  [ -n "$PID" ] || return 0
  kill -INT "$PID" 2>/dev/null; timeout 40 tail --pid="$PID" -f /dev/null; kill -9 "$PID" 2>/dev/null
  PID=
}
trap stop EXIT

bench() {  # bench NAME SECONDS ARGS...: one bench serve run, time-boxed, its report's tail shown
  local name=$1 secs=$2; shift 2
  timeout "$secs" "${BENCH[@]}" "$@" --output-json "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  echo "rc=$? $name"; grep -E "goodput|P99 (TTFT|TPOT)|Short P99|token share" "$OUT/$name.log" | head -n 12
}

SWEEP=(--workload random-short --sweep-rates "$RATES" --num-prompts "$N" --goodput "ttft:$SLO_TTFT" "tpot:$SLO_TPOT")
HOL=(--workload hol --request-rate 8 --num-prompts 160 --hol-long-len 6000 --hol-long-every 4)

# 1. The SLO controller: sweep, then head-of-line blocking with it on.
if start controller --slo-ttft-ms "$SLO_TTFT" --slo-tpot-ms "$SLO_TPOT"; then
  bench slo-controller 150 "${SWEEP[@]}" --label controller
  get /v1/controller >"$OUT/controller-report.json"
  get /metrics | grep '^deepbatch:controller' >"$OUT/controller-gauges.txt"
  [ "$SWEEP_ONLY" = 1 ] || bench hol-controller 50 "${HOL[@]}" --label controller
  stop
fi

# 2. Fixed settings: the same sweep; the first one (the defaults) also runs hol, the FCFS side of
#    tenants, and the continuous side of static vs continuous.
first=1
for f in $FIXED; do
  seqs=${f%:*} tokens=${f#*:}
  start "fixed-$seqs-$tokens" --max-num-seqs "$seqs" --max-num-batched-tokens "$tokens" || continue
  bench "slo-fixed-$seqs-$tokens" 150 "${SWEEP[@]}" --label "fixed-$seqs-$tokens"
  if [ "$first" = 1 ] && [ "$SWEEP_ONLY" != 1 ]; then
    bench hol-fcfs 50 "${HOL[@]}" --label "fixed-$seqs-$tokens"
    bench tenants-fcfs 40 --workload tenants --request-rate 12 --num-prompts 220 --random-input-len 512 --random-output-len 64
    bench continuous 40 --workload random-short --request-rate 8 --num-prompts 120
    first=0
  fi
  stop
done

# 3. Fair share between two tenants at a 10:1 load.
if [ "$SWEEP_ONLY" != 1 ] && start fair --scheduling-policy fair; then
  bench tenants-fair 40 --workload tenants --request-rate 12 --num-prompts 220 --random-input-len 512 --random-output-len 64
  stop
fi

# 4. Static batching at the continuous run's load.
if [ "$SWEEP_ONLY" != 1 ] && start static --scheduling static --static-batch-size 32; then
  bench static 60 --workload random-short --request-rate 8 --num-prompts 120
  stop
fi

python3 -m deepbatch.bench.serve_compare "$OUT"/slo-*.json --plot "$OUT/slo.png" --output-json "$OUT/slo.json" \
  --title "SLO controller vs fixed settings: p99 TTFT $SLO_TTFT ms, TPOT $SLO_TPOT ms"
