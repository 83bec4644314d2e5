#!/usr/bin/env bash
# What disaggregation costs the proxy at no load: the same completion, one at a time, to an
# aggregated model (two `kvmesh-engine-sim --no-delay` engines) and to a disaggregated one
# (`mode: enforce`, a `--role prefill` and a `--role decode` engine, no-delay: the KV pull
# takes no simulated time). The difference is the prefill leg's round trip, the decode
# engine's read of the held blocks, and the proxy's work on both legs. Writes the
# `disaggregation` section of docs/BENCHMARKS.md.
#
# Usage: benches/disaggregation.sh [options]
#   --duration S       measured seconds per lane (default 10)
#   --warmup S         unmeasured seconds before each lane (default 2)
#   --concurrency N    workers per lane (default 1: no load)
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

build_release kvmesh-engine-sim kvmesh-proxy
SIM=$BIN_DIR/kvmesh-engine-sim
PROXY=$BIN_DIR/kvmesh-proxy
BENCH=$BIN_DIR/kvmesh-grpc-bench
need_bins "$SIM" "$PROXY" "$BENCH"

begin_run pd

sims=()
start_sim() { # name role engines model
  local name=$1
  start_bg "PID_$name" "$WORK_DIR/$name.out" "$SIM" --no-delay --engines "$3" --port 0 \
    --block-size 16 --role "$2" --model "$4"
  local pid_var="PID_$name"
  wait_ready "$WORK_DIR/$name.out" "${!pid_var}"
  sims+=("${!pid_var}")
}
start_sim agg both 2 agg-model
start_sim prefill prefill 1 pd-model
start_sim decode decode 1 pd-model
backends() { # name role
  listening "$WORK_DIR/$1.out" 'engine-[0-9]+' | sed "s|^|      - url: http://|; s|\$|\n        role: $2|"
}
{
  printf 'listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n'
  printf 'grpc:\n  address: 127.0.0.1:0\nhealth_check:\n  enabled: false\nmodels:\n'
  printf '  - name: agg-model\n    policy: kv\n    kv:\n      block_size: 16\n    backends:\n'
  listening "$WORK_DIR/agg.out" 'engine-[0-9]+' | sed 's|^|      - url: http://|'
  printf '  - name: pd-model\n    policy: kv\n    kv:\n      block_size: 16\n'
  printf '    disaggregation:\n      mode: enforce\n    backends:\n'
  backends prefill prefill
  backends decode decode
} >"$WORK_DIR/proxy.yaml"
start_bg PROXY_PID "$WORK_DIR/proxy.out" env RUST_LOG=warn "$PROXY" --config "$WORK_DIR/proxy.yaml"
wait_ready "$WORK_DIR/proxy.out" "$PROXY_PID"
HTTP_ADDR=$(listening "$WORK_DIR/proxy.out" main)
GRPC_ADDR=$(listening "$WORK_DIR/proxy.out" grpc)

ROWS=$WORK_DIR/rows.md
for model in agg-model pd-model; do
  log "$model: $CONCURRENCY workers, ${DURATION}s"
  "$BENCH" --http "$HTTP_ADDR" --grpc "$GRPC_ADDR" --model "$model" --lanes http1-unary \
    --concurrency "$CONCURRENCY" --duration "$DURATION" --warmup "$WARMUP" --max-tokens 16 \
    --prompt-words 200 >"$WORK_DIR/$model.md" 2>"$WORK_DIR/$model.err"
  expect_alive "$model" "$PROXY_PID" "${sims[@]}"
  row=$(tail -n 1 "$WORK_DIR/$model.md")
  echo "${row/http\/1.1 unary/$model}" >>"$ROWS"
  log "$row"
done
p50() { awk -F'|' -v m="$1" '$2 ~ m { gsub(/ /, "", $5); print $5 }' "$ROWS"; }
ADDED=$(awk -v a="$(p50 agg-model)" -v d="$(p50 pd-model)" 'BEGIN { printf "%.2f", d - a }')

SECTION=$WORK_DIR/section.md
{
  echo "## Disaggregation at no load (\`benches/disaggregation.sh\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\`."
  echo
  echo "$LOAD_BEFORE"
  echo "- Load average after the run: \`$(cut -d' ' -f1-3 /proc/loadavg)\`"
  echo "- One \`kvmesh-proxy\` with two models: \`agg-model\` (two \`kvmesh-engine-sim --no-delay\` engines, each request served whole) and \`pd-model\` (\`disaggregation: {mode: enforce}\`, one \`--role prefill\` and one \`--role decode\` engine, no-delay: the KV pull takes no simulated time). Everything shares the machine."
  echo "- Load: completions, a 200-word text prompt, max_tokens 16, HTTP/1.1, closed loop, $CONCURRENCY worker(s), ${DURATION}s measured after ${WARMUP}s of warm-up."
  echo "- What disaggregation adds at p50: **$ADDED ms** (the prefill leg's round trip to the prefill engine, the decode engine's read of the held blocks from it, and the proxy's work on both legs)."
  echo
  echo "| model | requests/s | output tok/s | E2E p50 ms | E2E p99 ms | TTFT p50 ms | TTFT p99 ms | errors |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|"
  cat "$ROWS"
} >"$SECTION"

mkdir -p "$(dirname "$DOC")"
replace_section "$DOC" disaggregation "$SECTION"
log "wrote the disaggregation section of $DOC"
cat "$SECTION"
