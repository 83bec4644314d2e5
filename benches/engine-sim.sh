#!/usr/bin/env bash
# Engine-sim throughput benchmark: one engine in no-delay mode pinned to one core, the load
# generator pinned to the other; non-streaming and streaming, closed loop. Writes the
# `engine-sim` section of docs/BENCHMARKS.md. Target: >= 20,000 non-streaming req/s.
#
# Usage: benches/engine-sim.sh [options]
#   --duration D       measured time per run (default 10s)
#   --warmup D         unmeasured load before each run (default 2s)
#   --concurrency N    connections (default 32)
#   --max-tokens N     max_tokens of every request (default 16)
#   --no-build         use the binaries already in --bin-dir
#   --bin-dir DIR      where the binaries are (default target/release)
#   --doc FILE         document to update (default docs/BENCHMARKS.md)
#   --keep             keep the work directory (logs, JSON reports)
# Environment: SIM_CPU (default 0) and LOADGEN_CPU (default 1) choose the pinning.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DURATION=10s
WARMUP=2s
CONCURRENCY=32
MAX_TOKENS=16
PROMPT_WORDS=16
TARGET_RPS=20000
SIM_CPU=${SIM_CPU:-0}
LOADGEN_CPU=${LOADGEN_CPU:-1}
MODEL=sim-model

while (($#)); do
  case $1 in
    --duration) DURATION=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; shift 2 ;;
    *) common_option "$@"; shift "$TAKEN" ;;
  esac
done

need_tool jq jq
need_tool taskset util-linux

if ((BUILD)); then
  log "building release binaries (several minutes on 2 cores)"
  (cd "$BENCH_ROOT" && cargo build --release -p kvmesh-engine-sim -p kvmesh-bench)
fi
SIM=$BIN_DIR/kvmesh-engine-sim
BENCH=$BIN_DIR/kvmesh-bench
for bin in "$SIM" "$BENCH"; do [[ -x $bin ]] || die "missing $bin"; done

WORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvmesh-engine-sim.XXXXXX")
trap cleanup EXIT
trap 'exit 130' INT TERM
LOAD_BEFORE=$(machine_lines)
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')

start_bg SIM_PID "$WORK_DIR/sim.out" taskset -c "$SIM_CPU" "$SIM" --no-delay --engines 1 --port 0 --block-size 64
wait_ready "$WORK_DIR/sim.out" "$SIM_PID"
SIM_ADDR=$(listening "$WORK_DIR/sim.out" 'engine-[0-9]+' | head -n 1)
[[ -n $SIM_ADDR ]] || die "the sim announced no listener"
log "engine-sim at $SIM_ADDR (pid $SIM_PID)"

MODES=(non-stream stream)
for mode in "${MODES[@]}"; do
  flags=(--url "http://$SIM_ADDR" --endpoint chat --model "$MODEL" --prompt-tokens "$PROMPT_WORDS"
    --max-tokens "$MAX_TOKENS" --concurrency "$CONCURRENCY" --threads 1)
  [[ $mode == stream ]] && flags+=(--stream)
  log "$mode: $CONCURRENCY connections, $DURATION"
  taskset -c "$LOADGEN_CPU" "$BENCH" "${flags[@]}" --duration "$WARMUP" >/dev/null
  before=$(cpu_ticks "$SIM_PID")
  taskset -c "$LOADGEN_CPU" "$BENCH" "${flags[@]}" --duration "$DURATION" \
    --json "$WORK_DIR/$mode.json" >"$WORK_DIR/$mode.txt"
  expect_alive "$mode" "$SIM_PID"
  echo $(($(cpu_ticks "$SIM_PID") - before)) >"$WORK_DIR/$mode.ticks"
  rss_kb VmRSS "$SIM_PID" >"$WORK_DIR/$mode.rss"
  sed 's/^/    /' "$WORK_DIR/$mode.txt" >&2
done

SECTION=$WORK_DIR/section.md
{
  echo "## Engine-sim alone (\`benches/engine-sim.sh\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\`."
  echo
  echo "$LOAD_BEFORE"
  echo "- Load average after the run: \`$(cut -d' ' -f1-3 /proc/loadavg)\`"
  echo "- \`kvmesh-engine-sim --no-delay --engines 1 --port 0 --block-size 64\` pinned with \`taskset -c $SIM_CPU\`; \`kvmesh-bench\` (one runtime thread) pinned with \`taskset -c $LOADGEN_CPU\`."
  echo "- Load: chat completions, $PROMPT_WORDS-word prompt, max_tokens $MAX_TOKENS, closed loop, $CONCURRENCY HTTP/1.1 keep-alive connections, $DURATION measured after a $WARMUP warm-up run."
  echo "- Sim CPU per request: utime + stime from \`/proc/PID/stat\` over the measured run. Generator CPU near 100 % would mean the generator, not the sim, was the limit."
  echo
  echo "| mode | req/s | output tok/s | p50 ms | p99 ms | TTFT p50 ms | sim CPU µs/req | sim RSS MB | errors | generator CPU % |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for mode in "${MODES[@]}"; do
    f=$WORK_DIR/$mode.json
    printf '| %s | %.0f | %.0f | %s | %s | %s | %s | %s | %s | %.0f |\n' "$mode" \
      "$(json "$f" '.requests_per_s')" "$(json "$f" '.output_tokens_per_s')" \
      "$(json "$f" '.e2e_ms.p50')" "$(json "$f" '.e2e_ms.p99')" "$(json "$f" '.ttft_ms.p50')" \
      "$(us_per_request "$(cat "$WORK_DIR/$mode.ticks")" "$(json "$f" '.requests_ok')")" \
      "$(awk -v k="$(cat "$WORK_DIR/$mode.rss")" 'BEGIN { printf "%.1f", k / 1024 }')" \
      "$(json "$f" '.errors_total')" "$(json "$f" '.client_cpu_percent')"
  done
  echo
  rps=$(json "$WORK_DIR/non-stream.json" '.requests_per_s')
  verdict=$(awk -v r="$rps" -v t="$TARGET_RPS" 'BEGIN { print (r >= t ? "pass" : "FAIL") }')
  printf 'Target: ≥ %s non-streaming req/s on one core — measured %.0f: **%s**.\n' "$TARGET_RPS" "$rps" "$verdict"
} >"$SECTION"

mkdir -p "$(dirname "$DOC")"
replace_section "$DOC" engine-sim "$SECTION"
log "wrote the engine-sim section of $DOC"
cat "$SECTION"
