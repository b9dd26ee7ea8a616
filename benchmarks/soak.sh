#!/usr/bin/env bash
# A soak of `deepbatch serve` on one GPU: qwen3-0.6b with random weights, its saturation rate
# measured first, then SOAK_S seconds (default 1200) of Poisson load at RATE_MULT (1.5) x that rate
# with 10% of clients disconnecting mid-stream and 2% sending hostile bodies (deepbatch.bench.soak).
# At the end the server gets SIGTERM and must drain and exit 0.
#
# The run outlasts one 10-minute command, so it runs detached, in its own session, under $DIR
# (/tmp/soak), from a copy of the code taken at start:
#   benchmarks/soak.sh start         # installs the carried wheels (.whl/*.whl), launches `run`, returns
#   benchmarks/soak.sh wait SECONDS  # up to SECONDS, printing progress; returns early once it has ended
#   benchmarks/soak.sh collect       # $DIR -> $OUT: soak.tar.gz (all of it), result.json, the log tails
#   benchmarks/soak.sh run           # the whole run in the foreground
# e.g. `benchmarks/soak.sh start && benchmarks/soak.sh wait 560; benchmarks/soak.sh collect`, then
# `benchmarks/soak.sh wait 570; benchmarks/soak.sh collect` until status.txt says done.
set -u
DIR=${SOAK_DIR:-/tmp/soak}
SITE=${SOAK_SITE:-/tmp/site}
SOAK_S=${SOAK_S:-1200}            # seconds of soak load
SAT_S=${SAT_S:-60}                # seconds of the saturation measurement
SAT_CONC=${SAT_CONC:-384}         # requests in flight while measuring it: 256 running + a waiting queue
RATE_MULT=${RATE_MULT:-1.5}
CLIENTS=${CLIENTS:-4}             # load generator processes
MAX_QUEUED=${MAX_QUEUED:-256}     # the server's waiting queue bound: past it, arrivals get 429
MODEL=${MODEL:-benchmarks/models/qwen3-0.6b.json}  # random weights, token-id prompts
PORT=${PORT:-8200}
SERVE_ARGS=${SERVE_ARGS:-}        # more `deepbatch serve` flags (later flags win)
SOAK_ARGS=${SOAK_ARGS:-}          # more deepbatch.bench.soak flags (later flags win)
KEY=soak-key

case ${1:-} in
start)
  if kill -0 "$(cat "$DIR/run.pid" 2>/dev/null)" 2>/dev/null && [ ! -f "$DIR/done" ]; then
    echo "a run is already going under $DIR"; exit 1
  fi
  mkdir -p "$DIR" && rm -rf "${DIR:?}"/*
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl ||
      { echo "wheel install failed"; exit 1; }
  fi
  # The run reads its code from a copy: later calls re-sync the working tree under it.
  mkdir -p "$DIR/src" && cp -r deepbatch benchmarks "$DIR/src/"
  (cd "$DIR/src" && PYTHONPATH="$SITE:$DIR/src" python3 -c "import deepbatch.api.server, deepbatch.bench.soak") ||
    { echo "the server or the load tool cannot be imported"; exit 1; }
  setsid nohup bash "$DIR/src/benchmarks/soak.sh" run </dev/null >"$DIR/run.log" 2>&1 &
  echo $! >"$DIR/run.pid"
  echo "started (pid $(cat "$DIR/run.pid")); output under $DIR"
  ;;
wait)
  limit=${2:-560} began=$SECONDS last=-60
  while [ ! -f "$DIR/done" ] && [ $((SECONDS - began)) -lt "$limit" ]; do
    if ! kill -0 "$(cat "$DIR/run.pid" 2>/dev/null)" 2>/dev/null; then
      echo "the run is gone without finishing"; break
    fi
    if [ $((SECONDS - last)) -ge 60 ]; then
      last=$SECONDS
      progress=$(grep -E '^\[|^saturation' "$DIR/soak.log" 2>/dev/null | tail -n 1)
      echo "$(date +%T) $(cat "$DIR/status.txt" 2>/dev/null) | $progress"
    fi
    sleep 5
  done
  if [ -f "$DIR/done" ]; then cat "$DIR/done"; else echo "still running: $(cat "$DIR/status.txt" 2>/dev/null)"; fi
  ;;
collect)
  OUT=${OUT:-out}; mkdir -p "$OUT"
  # At most 8 files of 16 MiB come back: the per-request records travel apart, when small enough.
  tar czf "$OUT/soak.tar.gz" --exclude=src --exclude=requests.jsonl.gz -C "$(dirname "$DIR")" "$(basename "$DIR")"
  for f in result.json status.txt done; do [ -f "$DIR/$f" ] && cp "$DIR/$f" "$OUT/"; done
  if [ -f "$DIR/requests.jsonl.gz" ] && [ "$(stat -c %s "$DIR/requests.jsonl.gz")" -lt 15000000 ]; then
    cp "$DIR/requests.jsonl.gz" "$OUT/"
  fi
  tail -n 60 "$DIR/soak.log" >"$OUT/soak-tail.log" 2>/dev/null
  grep -v '"POST /v1/' "$DIR/server.log" 2>/dev/null | tail -n 200 >"$OUT/server-tail.log"
  ls -la "$OUT"; cat "$OUT/soak-tail.log" 2>/dev/null | tail -n 25
  ;;
run)
  cd "$(dirname "$0")/.." || exit 1
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0 PYTHONPATH="$SITE:$PWD"
  ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
  status() { echo "$(date +%T) $*" >"$DIR/status.txt"; echo "=== $(date +%T) $*"; }
  nvidia-smi >"$DIR/nvidia-smi-start.txt" 2>&1
  status "starting the server"
  python3 -m deepbatch.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" --max-model-len 4096 \
    --max-queued-requests "$MAX_QUEUED" --api-key "$KEY" $SERVE_ARGS >"$DIR/server.log" 2>&1 &
  SPID=$!
  up=0
  for _ in $(seq 600); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null &&
      { up=1; break; }
    kill -0 "$SPID" 2>/dev/null || break
    sleep 1
  done
  if [ "$up" != 1 ]; then
    status "the server did not start"; tail -n 30 "$DIR/server.log"; kill -9 "$SPID" 2>/dev/null
    echo "server did not start" >"$DIR/done"; exit 1
  fi
  status "server up (pid $SPID); saturation ${SAT_S}s, then soak ${SOAK_S}s"
  python3 -m deepbatch.bench.soak --url "http://127.0.0.1:$PORT" --api-key "$KEY" --server-pid "$SPID" \
    --find-saturation --saturation-s "$SAT_S" --saturation-concurrency "$SAT_CONC" --rate-multiplier "$RATE_MULT" \
    --duration-s "$SOAK_S" --num-clients "$CLIENTS" --workload random-short --vocab-size 32000 \
    --disconnect-fraction 0.1 --hostile-fraction 0.02 --out "$DIR/result.json" \
    --requests-out "$DIR/requests.jsonl.gz" $SOAK_ARGS >"$DIR/soak.log" 2>&1
  soak_rc=$?
  status "soak ended (rc $soak_rc); stopping the server with SIGTERM"
  kill -TERM "$SPID" 2>/dev/null
  for _ in $(seq 90); do kill -0 "$SPID" 2>/dev/null || break; sleep 1; done
  if kill -0 "$SPID" 2>/dev/null; then kill -9 "$SPID"; fi
  wait "$SPID"; server_rc=$?
  nvidia-smi >"$DIR/nvidia-smi-end.txt" 2>&1
  status "done: soak rc $soak_rc (0: every verdict passed), server exit code $server_rc after SIGTERM"
  echo "soak_rc=$soak_rc server_exit_code=$server_rc" >"$DIR/done"
  ;;
*)
  sed -n '2,15p' "$0"; exit 2 ;;
esac
