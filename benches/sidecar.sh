#!/usr/bin/env bash
# What the worker-agent's inbound sidecar adds to a request: the same completions to one
# `kvmesh-engine-sim --no-delay` engine directly and through `kvmesh-agent --inbound-listen`
# in front of it (registered in etcd, publishing on NATS, as in a pod), one lane after the
# other, closed loop. Writes the `sidecar` section of docs/BENCHMARKS.md.
#
# Usage: benches/sidecar.sh [options]
#   --duration S       measured seconds per lane (default 10)
#   --warmup S         unmeasured seconds before each lane (default 2)
#   --concurrency N    workers per lane (default 1)
#   --no-build         use the binaries already in --bin-dir
#   --bin-dir DIR      where the binaries are (default target/release)
#   --doc FILE         document to update (default docs/BENCHMARKS.md)
#   --keep             keep the work directory (logs)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DURATION=10
WARMUP=2
CONCURRENCY=1

while (($#)); do
  case $1 in
    --duration) DURATION=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    *) common_option "$@"; shift "$TAKEN" ;;
  esac
done

need_tool etcd
need_tool nats-server
build_release kvmesh-engine-sim kvmesh-agent
SIM=$BIN_DIR/kvmesh-engine-sim
AGENT=$BIN_DIR/kvmesh-agent
BENCH=$BIN_DIR/kvmesh-grpc-bench
need_bins "$SIM" "$AGENT" "$BENCH"

begin_run sidecar

start_etcd_nats "$WORK_DIR"
start_bg SIM_PID "$WORK_DIR/sim.out" "$SIM" --no-delay --engines 1 --port 0 --block-size 16 \
  --kv-events-endpoint tcp://127.0.0.1:0
wait_ready "$WORK_DIR/sim.out" "$SIM_PID"
ENGINE=$(listening "$WORK_DIR/sim.out" engine-0)
EVENTS=$(listening "$WORK_DIR/sim.out" kv-events-0)
start_bg AGENT_PID "$WORK_DIR/agent.out" env RUST_LOG=warn "$AGENT" --engine-url "http://$ENGINE" \
  --model sim-model --kv-events-endpoint "tcp://$EVENTS" --block-size 16 \
  --etcd "$ETCD_URL" --nats "$NATS_URL" \
  --inbound-listen 127.0.0.1:0
wait_ready "$WORK_DIR/agent.out" "$AGENT_PID"
SIDECAR=$(listening "$WORK_DIR/agent.out" inbound)
log "engine $ENGINE, sidecar $SIDECAR"

ROWS=$WORK_DIR/rows.md
for lane in direct sidecar; do
  target=$ENGINE
  [[ $lane == sidecar ]] && target=$SIDECAR
  log "$lane: $CONCURRENCY workers, ${DURATION}s"
  before=$(cpu_ticks "$AGENT_PID")
  # The gRPC address is required by the tool and unused by the HTTP lane.
  "$BENCH" --http "$target" --grpc 127.0.0.1:9 --model sim-model --lanes http1-unary \
    --concurrency "$CONCURRENCY" --duration "$DURATION" --warmup "$WARMUP" --max-tokens 16 \
    >"$WORK_DIR/$lane.md" 2>"$WORK_DIR/$lane.err"
  ticks=$(($(cpu_ticks "$AGENT_PID") - before))
  expect_alive "$lane" "$SIM_PID" "$AGENT_PID"
  row=$(tail -n 1 "$WORK_DIR/$lane.md")
  rps=$(awk -F'|' '{ gsub(/ /, "", $3); print $3 }' <<<"$row")
  requests=$(awk -v r="$rps" -v d="$DURATION" -v w="$WARMUP" 'BEGIN { printf "%.0f", r * (d + w) }')
  cpu="-"
  [[ $lane == sidecar ]] && cpu=$(us_per_request "$ticks" "$requests")
  echo "${row/http\/1.1 unary/$lane} $cpu |" >>"$ROWS"
  log "$row"
done
p50() { awk -F'|' -v m="$1" '$2 ~ m { gsub(/ /, "", $5); print $5 }' "$ROWS"; }
ADDED=$(awk -v a="$(p50 direct)" -v s="$(p50 sidecar)" 'BEGIN { printf "%.3f", s - a }')

SECTION=$WORK_DIR/section.md
{
  echo "## The agent's inbound sidecar (\`benches/sidecar.sh\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\`."
  echo
  echo "$LOAD_BEFORE"
  echo "- Load average after the run: \`$(cut -d' ' -f1-3 /proc/loadavg)\`"
  echo "- One \`kvmesh-engine-sim --no-delay\` engine; \`kvmesh-agent --inbound-listen\` in front of it (registered in etcd, events on NATS); everything shares the machine."
  echo "- Load: completions, a 16-word text prompt, max_tokens 16, HTTP/1.1 keep-alive, closed loop, $CONCURRENCY worker(s), ${DURATION}s measured after ${WARMUP}s of warm-up; \`direct\` to the engine, \`sidecar\` through the agent."
  echo "- The sidecar adds **$ADDED ms** at p50. Agent CPU µs/req: the agent's utime + stime over the sidecar lane (warm-up included) over its requests (it also publishes KV events and scrapes the engine meanwhile)."
  echo
  echo "| lane | requests/s | output tok/s | E2E p50 ms | E2E p99 ms | TTFT p50 ms | TTFT p99 ms | errors | agent CPU µs/req |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  cat "$ROWS"
} >"$SECTION"

mkdir -p "$(dirname "$DOC")"
replace_section "$DOC" sidecar "$SECTION"
log "wrote the sidecar section of $DOC"
cat "$SECTION"
