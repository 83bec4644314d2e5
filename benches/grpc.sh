#!/usr/bin/env bash
# gRPC vs HTTP through one kvmesh-proxy: the same completions to the same engine-sims (no-delay
# mode, so the proxy's own cost dominates) over the OpenAI HTTP listener (HTTP/1.1 and h2c) and
# over the KServe v2 gRPC listener, unary and streaming, closed loop. Writes the `grpc` section
# of docs/BENCHMARKS.md.
#
# Usage: benches/grpc.sh [options]
#   --duration S       measured seconds per lane (default 10)
#   --warmup S         unmeasured seconds of load before each lane (default 2)
#   --concurrency N    workers per lane (default 32)
#   --max-tokens N     max_tokens of every request (default 16)
#   --no-build         use the binaries already in --bin-dir
#   --bin-dir DIR      where the binaries are (default target/release)
#   --doc FILE         document to update (default docs/BENCHMARKS.md)
#   --keep             keep the work directory (logs)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DURATION=10
WARMUP=2
CONCURRENCY=32
MAX_TOKENS=16
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

build_release kvmesh-engine-sim kvmesh-proxy
SIM=$BIN_DIR/kvmesh-engine-sim
PROXY=$BIN_DIR/kvmesh-proxy
BENCH=$BIN_DIR/kvmesh-grpc-bench
need_bins "$SIM" "$PROXY" "$BENCH"

begin_run grpc

start_bg SIM_PID "$WORK_DIR/sim.out" "$SIM" --no-delay --engines 2 --port 0 --block-size 64 --model "$MODEL"
wait_ready "$WORK_DIR/sim.out" "$SIM_PID"
{
  printf 'listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n'
  printf 'grpc:\n  address: 127.0.0.1:0\nmodels:\n  - name: %s\n    policy: round_robin\n    backends:\n' "$MODEL"
  listening "$WORK_DIR/sim.out" 'engine-[0-9]+' | sed 's|^|      - url: http://|'
} >"$WORK_DIR/proxy.yaml"
start_bg PROXY_PID "$WORK_DIR/proxy.out" env RUST_LOG=warn "$PROXY" --config "$WORK_DIR/proxy.yaml"
wait_ready "$WORK_DIR/proxy.out" "$PROXY_PID"
HTTP_ADDR=$(listening "$WORK_DIR/proxy.out" main)
GRPC_ADDR=$(listening "$WORK_DIR/proxy.out" grpc)
log "proxy: HTTP $HTTP_ADDR, gRPC $GRPC_ADDR (pid $PROXY_PID)"

LANES=(http1-unary h2c-unary grpc-unary http1-stream h2c-stream grpc-stream)
ROWS=$WORK_DIR/rows.md
for lane in "${LANES[@]}"; do
  log "$lane: $CONCURRENCY workers, ${DURATION}s"
  before=$(cpu_ticks "$PROXY_PID")
  "$BENCH" --http "$HTTP_ADDR" --grpc "$GRPC_ADDR" --model "$MODEL" --lanes "$lane" \
    --concurrency "$CONCURRENCY" --duration "$DURATION" --warmup "$WARMUP" \
    --max-tokens "$MAX_TOKENS" >"$WORK_DIR/$lane.md" 2>"$WORK_DIR/$lane.err"
  ticks=$(($(cpu_ticks "$PROXY_PID") - before))
  expect_alive "$lane" "$PROXY_PID" "$SIM_PID"
  row=$(tail -n 1 "$WORK_DIR/$lane.md")
  # Requests counted over the measured window; the proxy's CPU covers warm-up too.
  rps=$(awk -F'|' '{ gsub(/ /, "", $3); print $3 }' <<<"$row")
  requests=$(awk -v r="$rps" -v d="$DURATION" -v w="$WARMUP" 'BEGIN { printf "%.0f", r * (d + w) }')
  echo "$row $(us_per_request "$ticks" "$requests") |" >>"$ROWS"
  log "$row"
done

SECTION=$WORK_DIR/section.md
{
  echo "## gRPC vs HTTP (\`benches/grpc.sh\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\`."
  echo
  echo "$LOAD_BEFORE"
  echo "- Load average after the run: \`$(cut -d' ' -f1-3 /proc/loadavg)\`"
  echo "- One \`kvmesh-proxy\` (round robin) in front of two \`kvmesh-engine-sim --no-delay\` engines; proxy, engines and \`kvmesh-grpc-bench\` share the machine (no pinning)."
  echo "- Load: completions, a 16-word text prompt, max_tokens $MAX_TOKENS, closed loop, $CONCURRENCY workers per lane, ${DURATION}s measured after ${WARMUP}s of warm-up. HTTP/1.1: a keep-alive connection per worker; h2c and gRPC: one HTTP/2 connection. gRPC unary is \`ModelInfer\`; gRPC streaming keeps one \`ModelStreamInfer\` call open per worker. TTFT: the first streamed chunk (HTTP) or response (gRPC)."
  echo "- Proxy CPU µs/req: the proxy's utime + stime over warm-up and measured run, divided by the requests of both (estimated from the measured rate)."
  echo
  echo "| lane | requests/s | output tok/s | E2E p50 ms | E2E p99 ms | TTFT p50 ms | TTFT p99 ms | errors | proxy CPU µs/req |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  cat "$ROWS"
} >"$SECTION"

mkdir -p "$(dirname "$DOC")"
replace_section "$DOC" grpc "$SECTION"
log "wrote the grpc section of $DOC"
cat "$SECTION"
