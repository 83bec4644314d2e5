#!/usr/bin/env bash
# The endpoint picker's cost next to the HTTP proxy's routing decision: one kvmesh-proxy
# (`policy: kv`, the Qwen3 tokenizer) pinned to one core, serving both its OpenAI HTTP
# listener (in front of two `kvmesh-engine-sim --no-delay` engines) and its endpoint picker;
# the load generator and the engines on the other cores. Lanes: `epp` (full ext_proc exchanges
# as Envoy runs them: request headers and a completion's body, the pick, the response reported
# as served) and `http1-unary` (the same completion proxied to an engine). Writes the
# `epp` section of docs/BENCHMARKS.md.
#
# Usage: benches/epp.sh [options]
#   --duration S       measured seconds per lane (default 10)
#   --warmup S         unmeasured seconds of load before each lane (default 2)
#   --concurrency N    workers per lane (default 32)
#   --prompt-words N   words in the prompt (default 200)
#   --no-build         use the binaries already in --bin-dir
#   --bin-dir DIR      where the binaries are (default target/release)
#   --doc FILE         document to update (default docs/BENCHMARKS.md)
#   --keep             keep the work directory (logs)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DURATION=10
WARMUP=2
CONCURRENCY=32
PROMPT_WORDS=200
MODEL=sim-model
TOKENIZER=$BENCH_ROOT/.cache/tokenizers/qwen3

while (($#)); do
  case $1 in
    --duration) DURATION=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --prompt-words) PROMPT_WORDS=$2; shift 2 ;;
    *) common_option "$@"; shift "$TAKEN" ;;
  esac
done

need_tool taskset
[[ -f $TOKENIZER/tokenizer.json ]] || die "no tokenizer in $TOKENIZER: run scripts/fetch-tokenizer.sh"
CPUS=$(nproc)
((CPUS >= 2)) || die "needs 2 CPUs (the proxy gets one of its own)"
build_release kvmesh-engine-sim kvmesh-proxy
SIM=$BIN_DIR/kvmesh-engine-sim
PROXY=$BIN_DIR/kvmesh-proxy
BENCH=$BIN_DIR/kvmesh-grpc-bench
need_bins "$SIM" "$PROXY" "$BENCH"

begin_run epp
OTHERS=1-$((CPUS - 1))

start_bg SIM_PID "$WORK_DIR/sim.out" taskset -c "$OTHERS" "$SIM" --no-delay --engines 2 --port 0 --block-size 64 --model "$MODEL"
wait_ready "$WORK_DIR/sim.out" "$SIM_PID"
{
  printf 'listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n'
  printf 'grpc:\n  address: 127.0.0.1:0\nepp:\n  address: 127.0.0.1:0\n'
  printf 'models:\n  - name: %s\n    policy: kv\n    tokenizer: %s\n    kv:\n      block_size: 16\n    backends:\n' "$MODEL" "$TOKENIZER"
  listening "$WORK_DIR/sim.out" 'engine-[0-9]+' | sed 's|^|      - url: http://|'
} >"$WORK_DIR/proxy.yaml"
start_bg PROXY_PID "$WORK_DIR/proxy.out" env RUST_LOG=warn taskset -c 0 "$PROXY" --config "$WORK_DIR/proxy.yaml"
wait_ready "$WORK_DIR/proxy.out" "$PROXY_PID"
HTTP_ADDR=$(listening "$WORK_DIR/proxy.out" main)
GRPC_ADDR=$(listening "$WORK_DIR/proxy.out" grpc)
EPP_ADDR=$(listening "$WORK_DIR/proxy.out" epp)
ADMIN_ADDR=$(listening "$WORK_DIR/proxy.out" admin)
log "proxy on CPU 0: HTTP $HTTP_ADDR, endpoint picker $EPP_ADDR (pid $PROXY_PID)"

# `<sum> <count>` of a decision: the sum over the histogram series matching $1 (a regex on
# name{labels}), the count of the series matching $2 (one observation per request).
decisions() {
  curl -s "http://$ADMIN_ADDR/metrics" | awk -v sums="$1" -v counts="$2" '
    $1 ~ sums "_sum" { sum += $2 } $1 ~ counts { count += $2 }
    END { printf "%s %s\n", sum, count }'
}
# Mean µs per decision between two `decisions` snapshots.
mean_us() { awk -v a="$1" -v b="$2" 'BEGIN { split(a, x, " "); split(b, y, " "); n = y[2] - x[2]; if (n > 0) printf "%.1f", (y[1] - x[1]) / n * 1e6; else print "n/a" }'; }
# The HTTP proxy's decision: its routing stages (template, tokenize, hash, lookup, score) per
# request (counted by its hash stage, once per request); the picker's: from the body's end to
# its answer (the same stages, the queue, the fallbacks).
ROUTE=('kvmesh_route_decision_seconds' 'kvmesh_route_decision_seconds_count[{].*stage="hash"')
PICK=('kvmesh_epp_decision_seconds' 'kvmesh_epp_decision_seconds_count')

ROWS=$WORK_DIR/rows.md
for lane in epp http1-unary; do
  log "$lane: $CONCURRENCY workers, ${DURATION}s"
  routed_before=$(decisions "${ROUTE[@]}")
  picked_before=$(decisions "${PICK[@]}")
  before=$(cpu_ticks "$PROXY_PID")
  taskset -c "$OTHERS" "$BENCH" --http "$HTTP_ADDR" --grpc "$GRPC_ADDR" --epp "$EPP_ADDR" \
    --model "$MODEL" --lanes "$lane" --concurrency "$CONCURRENCY" --duration "$DURATION" \
    --warmup "$WARMUP" --max-tokens 1 --prompt-words "$PROMPT_WORDS" \
    >"$WORK_DIR/$lane.md" 2>"$WORK_DIR/$lane.err"
  ticks=$(($(cpu_ticks "$PROXY_PID") - before))
  expect_alive "$lane" "$PROXY_PID" "$SIM_PID"
  routing=$(mean_us "$routed_before" "$(decisions "${ROUTE[@]}")")
  answer=$(mean_us "$picked_before" "$(decisions "${PICK[@]}")")
  row=$(tail -n 1 "$WORK_DIR/$lane.md")
  rps=$(awk -F'|' '{ gsub(/ /, "", $3); print $3 }' <<<"$row")
  requests=$(awk -v r="$rps" -v d="$DURATION" -v w="$WARMUP" 'BEGIN { printf "%.0f", r * (d + w) }')
  echo "$row $routing | $answer | $(us_per_request "$ticks" "$requests") |" >>"$ROWS"
  log "$row routing ${routing}µs, pick answer ${answer}µs"
done

SECTION=$WORK_DIR/section.md
{
  echo "## Endpoint picker (\`benches/epp.sh\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\`."
  echo
  echo "$LOAD_BEFORE"
  echo "- Load average after the run: \`$(cut -d' ' -f1-3 /proc/loadavg)\`"
  echo "- One \`kvmesh-proxy\` pinned to CPU 0 (\`policy: kv\`, Qwen3 tokenizer, block size 16), its HTTP listener in front of two \`kvmesh-engine-sim --no-delay\` engines; engines and \`kvmesh-grpc-bench\` on CPUs $OTHERS."
  echo "- Load: completions, a ${PROMPT_WORDS}-word text prompt (the same for every request, so routing cost, not cache reuse, is what differs), max_tokens 1, closed loop, $CONCURRENCY workers, ${DURATION}s measured after ${WARMUP}s of warm-up."
  echo "- \`epp\`: one ext_proc stream per request over one HTTP/2 connection, as Envoy runs it in full duplex mode: request headers and body, the pick's two answers, response headers with the pick reported as served, the response body; \"TTFT\" is the pick's latency (the body sent → the headers answer), E2E the whole exchange. Nothing is forwarded."
  echo "- \`http/1.1 unary\`: the same completion proxied to an engine (a keep-alive connection per worker): routing plus forwarding."
  echo "- From the proxy's own metrics, means per request: routing µs = the \`kvmesh_route_decision_seconds\` stages (template, tokenize, hash, lookup, score; the picker's two fallback peeks add score passes), the same work on both paths; pick answer µs = \`kvmesh_epp_decision_seconds\`, from the body's end to the answer, which adds the wait for the one saturated core. Proxy CPU µs/req: its utime + stime over warm-up and measured run over the requests of both."
  echo
  echo "| lane | requests/s | output tok/s | E2E p50 ms | E2E p99 ms | TTFT (pick) p50 ms | TTFT (pick) p99 ms | errors | routing µs | pick answer µs | proxy CPU µs/req |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  cat "$ROWS"
} >"$SECTION"

mkdir -p "$(dirname "$DOC")"
replace_section "$DOC" epp "$SECTION"
log "wrote the epp section of $DOC"
cat "$SECTION"
