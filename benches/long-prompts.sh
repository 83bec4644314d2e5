#!/usr/bin/env bash
# Long prompts beside short ones: how much a burst of never-seen ~100k-token chat prompts in
# flight adds to a short request's latency through kvmesh-proxy (`policy: kv`, Qwen3
# tokenizer, so every prompt is parsed, rendered, tokenized and hashed).
#
# The proxy is pinned to SERVER_CPU; the engine-sims (--no-delay) and both load generators to
# LOADGEN_CPU, the long prompts on a model and sims of their own at nice 10. Each round runs
# the short probe alone (open loop), then again while another kvmesh-bench keeps
# --long-concurrency long prompts in flight (closed loop, 64 distinct prompts in turn, so the
# proxy's segment cache never holds the next one), then once more as the control: the same
# long prompts at the rate the proxy just carried, sent straight to the long sims. The control
# loads LOADGEN_CPU (the long client, the long sims, the loopback traffic) as the proxied run
# does and the proxy not at all, so beside − control is the part of the probe's rise that is
# the proxy's doing, and control − alone the part the shared load-generator core adds.
# Writes the `long-prompts` section of docs/BENCHMARKS.md.
#
# Usage: benches/long-prompts.sh [options]
#   --duration D          probe's measured time per run (default 20s)
#   --rate R              probe's arrival rate, requests/s (default 50)
#   --probe-words N       probe's prompt words (default 200: a body past the inline limit)
#   --long-words N        words of each long prompt (default 100000, ≈ 100k tokens)
#   --long-concurrency N  long prompts in flight (default 32)
#   --rounds N            rounds; cells are medians (default 3)
#   --baseline FILE       another kvmesh-proxy binary, run the same way in every round
#   --no-build, --bin-dir DIR, --doc FILE, --keep
# Environment: LOADGEN_CPU (default 0) and SERVER_CPU (default 1) choose the pinning.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DURATION=20s
RATE=50
PROBE_WORDS=200
LONG_WORDS=100000
LONG_CONCURRENCY=32
ROUNDS=3
BASELINE=
LOADGEN_CPU=${LOADGEN_CPU:-0}
SERVER_CPU=${SERVER_CPU:-1}
MODEL=sim-model
LONG_MODEL=long-model
TOKENIZER=$BENCH_ROOT/.cache/tokenizers/qwen3

while (($#)); do
  case $1 in
    --duration) DURATION=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --probe-words) PROBE_WORDS=$2; shift 2 ;;
    --long-words) LONG_WORDS=$2; shift 2 ;;
    --long-concurrency) LONG_CONCURRENCY=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --baseline) BASELINE=$(realpath "$2"); shift 2 ;;
    *) common_option "$@"; shift "$TAKEN" ;;
  esac
done
need_tool jq jq
need_tool taskset util-linux
"$BENCH_ROOT/scripts/fetch-tokenizer.sh" "$TOKENIZER" >&2
build_release kvmesh-proxy kvmesh-engine-sim kvmesh-bench
SIM=$BIN_DIR/kvmesh-engine-sim
PROXY=$BIN_DIR/kvmesh-proxy
BENCH=$BIN_DIR/kvmesh-bench
need_bins "$SIM" "$PROXY" "$BENCH"
[[ -z $BASELINE || -x $BASELINE ]] || die "--baseline $BASELINE is not an executable"
begin_run long-prompts
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

# Two models on separate sims: the probe's (one engine) and the long prompts' (four engines),
# so a probe never waits in an engine behind a long prompt. The long prompts' sims and load
# generator run at nice 10 beside the probe's on LOADGEN_CPU: what the probe's latency rises
# by is the proxy's doing.
start_bg SIM_PID "$WORK_DIR/sim.out" taskset -c "$LOADGEN_CPU" "$SIM" --engines 1 --port 0 \
  --block-size 64 --no-delay --model "$MODEL"
wait_ready "$WORK_DIR/sim.out" "$SIM_PID"
start_bg LONG_SIM_PID "$WORK_DIR/long-sim.out" nice -n 10 taskset -c "$LOADGEN_CPU" "$SIM" \
  --engines 4 --port 0 --block-size 64 --num-gpu-blocks 200000 --max-model-len 200000 \
  --no-delay --model "$LONG_MODEL"
wait_ready "$WORK_DIR/long-sim.out" "$LONG_SIM_PID"

# model NAME LOG: one `policy: kv` model over the engines a sim's LOG lists.
model() {
  echo "  - name: $1"
  echo "    policy: kv"
  echo "    tokenizer: $TOKENIZER"
  echo "    kv:"
  echo "      block_size: 64"
  echo "    backends:"
  listening "$2" 'engine-[0-9]+' | sed 's|^|      - url: http://|'
}
{
  proxy_config_head
  model "$MODEL" "$WORK_DIR/sim.out"
  model "$LONG_MODEL" "$WORK_DIR/long-sim.out"
  echo "health_check:"
  echo "  enabled: false"
} >"$WORK_DIR/kvmesh.yaml"

declare -A PROXIES=([kvmesh]=$PROXY)
[[ -n $BASELINE ]] && PROXIES[kvmesh-baseline]=$BASELINE
declare -A ADDR PID
for setup in "${!PROXIES[@]}"; do
  "${PROXIES[$setup]}" --check-config "$WORK_DIR/kvmesh.yaml" >/dev/null
  start_bg NEW_PID "$WORK_DIR/$setup.out" env RUST_LOG=warn taskset -c "$SERVER_CPU" \
    "${PROXIES[$setup]}" --config "$WORK_DIR/kvmesh.yaml"
  wait_ready "$WORK_DIR/$setup.out" "$NEW_PID"
  PID[$setup]=$NEW_PID
  ADDR[$setup]=$(listening "$WORK_DIR/$setup.out" main)
  log "$setup at ${ADDR[$setup]} (pid $NEW_PID)"
done

# probe SETUP LABEL: the short requests, open loop, recorded as LABEL of this round.
probe() {
  taskset -c "$LOADGEN_CPU" "$BENCH" --url "http://${ADDR[$1]}" --endpoint chat --model "$MODEL" \
    --prompt-tokens "$PROBE_WORDS" --max-tokens 1 --rate "$RATE" --duration "$DURATION" \
    --warmup 2s --threads 1 --seed 7 --json "$WORK_DIR/$1.$2.r$ROUND.json" >/dev/null
}

SETUPS=(kvmesh)
[[ -n $BASELINE ]] && SETUPS+=(kvmesh-baseline)
LONG_SECONDS=$((${DURATION%s} + 10))
# The control's long prompts go straight to the long sims' engines, spread over them.
LONG_URLS=()
for engine in $(listening "$WORK_DIR/long-sim.out" 'engine-[0-9]+'); do
  LONG_URLS+=(--also-url "http://$engine")
done
LONG_URLS[0]=--url
for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
  for setup in "${SETUPS[@]}"; do
    log "round $ROUND/$ROUNDS $setup: probe alone"
    probe "$setup" alone
    log "round $ROUND/$ROUNDS $setup: probe beside $LONG_CONCURRENCY long prompts"
    start_bg LONG_PID "$WORK_DIR/long.out" nice -n 10 taskset -c "$LOADGEN_CPU" "$BENCH" \
      --url "http://${ADDR[$setup]}" --endpoint chat --model "$LONG_MODEL" \
      --prompt-tokens "$LONG_WORDS" --distinct-prompts 64 --max-tokens 1 \
      --concurrency "$LONG_CONCURRENCY" --duration "${LONG_SECONDS}s" --warmup 5s --threads 1 \
      --timeout 120s --json "$WORK_DIR/$setup.long.r$ROUND.json"
    sleep 5 # the long load's own warm-up: the probe starts once it is in full flow
    probe "$setup" loaded
    wait "$LONG_PID" || die "the long load failed: $(cat "$WORK_DIR/long.out.err")"
    stop_pid "$LONG_PID"
    expect_alive "$setup" "${PID[$setup]}" "$SIM_PID" "$LONG_SIM_PID"
    carried=$(json "$WORK_DIR/$setup.long.r$ROUND.json" '.requests_per_s')
    log "round $ROUND/$ROUNDS $setup: probe beside $carried long prompts/s sent straight to the sims (control)"
    start_bg LONG_PID "$WORK_DIR/long.out" nice -n 10 taskset -c "$LOADGEN_CPU" "$BENCH" \
      "${LONG_URLS[@]}" --endpoint chat --model "$LONG_MODEL" \
      --prompt-tokens "$LONG_WORDS" --distinct-prompts 64 --max-tokens 1 \
      --rate "$carried" --duration "${LONG_SECONDS}s" --warmup 5s --threads 1 \
      --timeout 120s --json "$WORK_DIR/$setup.control-long.r$ROUND.json"
    sleep 5
    probe "$setup" control
    wait "$LONG_PID" || die "the control's long load failed: $(cat "$WORK_DIR/long.out.err")"
    stop_pid "$LONG_PID"
    expect_alive "$setup" "${PID[$setup]}" "$SIM_PID" "$LONG_SIM_PID"
  done
done

# cell SETUP LABEL FILTER: the median over rounds of one number from the JSON reports.
cell() {
  local r
  for ((r = 1; r <= ROUNDS; r++)); do json "$WORK_DIR/$1.$2.r$r.json" "$3"; done | median 2
}
# rise SETUP LABEL: the median over rounds of the loaded probe's p99 less LABEL's.
rise() {
  local r
  for ((r = 1; r <= ROUNDS; r++)); do
    awk -v a="$(json "$WORK_DIR/$1.$2.r$r.json" '.e2e_ms.p99')" \
      -v b="$(json "$WORK_DIR/$1.loaded.r$r.json" '.e2e_ms.p99')" 'BEGIN { print b - a }'
  done | median 2
}
SECTION=$WORK_DIR/section.md
{
  echo "### Long prompts beside short ones (\`benches/long-prompts.sh\`)"
  echo
  echo "Command: \`$COMMAND\`, $DATE."
  echo
  machine_lines
  echo "- Proxy (\`policy: kv\`, Qwen3 tokenizer, block 64) pinned to CPU $SERVER_CPU. On CPU $LOADGEN_CPU: the probe's model on its own engine-sim (\`--no-delay\`) and its load generator; the long prompts' model on 4 other engine-sims and its load generator, both at nice 10, which does not keep them from delaying the probe's client and sim: the control measures how much."
  echo "- Probe: $PROBE_WORDS-word chat prompts, \`max_tokens\` 1, open loop at $RATE req/s for $DURATION. Long load: $LONG_CONCURRENCY connections back to back, each a $LONG_WORDS-word chat prompt (one of 64 in turn: never in the segment cache), \`max_tokens\` 1."
  echo "- Medians of $ROUNDS rounds; each round runs the probe alone, then beside the long load through the proxy, then beside the control: the same long prompts at the rate the proxy carried, sent straight to the long sims (CPU $LOADGEN_CPU as loaded, the proxy not)."
  echo "- *Rise* is the median of each round's difference of p99s: *beside − alone* (what the issue's target measures), and *beside − control*, the part that is the proxy's doing."
  echo
  echo "| proxy | probe alone p50 / p99 ms | beside the long prompts p50 / p99 ms | beside the control p50 / p99 ms | p99 rise over alone ms | p99 rise over the control ms | long prompts/s |"
  echo "|---|---|---|---|---|---|---|"
  for setup in "${SETUPS[@]}"; do
    echo "| $setup | $(cell "$setup" alone '.e2e_ms.p50') / $(cell "$setup" alone '.e2e_ms.p99') |" \
      "$(cell "$setup" loaded '.e2e_ms.p50') / $(cell "$setup" loaded '.e2e_ms.p99') |" \
      "$(cell "$setup" control '.e2e_ms.p50') / $(cell "$setup" control '.e2e_ms.p99') |" \
      "$(rise "$setup" alone) | $(rise "$setup" control) | $(cell "$setup" long '.requests_per_s') |"
  done
} >"$SECTION"
cat "$SECTION" >&2
replace_section "$DOC" long-prompts "$SECTION"
log "updated $DOC"
