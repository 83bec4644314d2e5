#!/usr/bin/env bash
# Proxy-overhead benchmark, in one go: the same closed-loop load against
#   (1) an engine-sim directly, (2) nginx round robin over two sims, (3) kvmesh-proxy round robin,
#   (4) kvmesh-proxy `policy: kv` (Qwen3 tokenizer: render, tokenize, hash, score every request),
#   (5) sglang-router 0.3.2 round_robin, (6) sglang-router cache_aware, (7) vllm-router 0.1.17
#   round_robin, (8) vllm-router cache_aware, all over the same two sims; non-streaming and
# streaming; then 1,000 concurrent long streams through kvmesh-proxy to read its peak RSS.
# Writes the `overhead` section of docs/BENCHMARKS.md.
#
# Usage: benches/overhead.sh [options]
#   --duration D       measured time per run (default 10s)
#   --warmup D         unmeasured load before each run (default 2s)
#   --concurrency N    connections of the saturating runs (default 32)
#   --max-tokens N     max_tokens of every request (default 16)
#   --unloaded-duration D  measured time of the 1-connection runs (default 5s)
#   --rounds N         rounds over all setups, even ones in reverse order; cells are medians
#                      (default 4: each setup as often first as second in its pair)
#   --streams N        concurrent streams of the memory test (default 1000)
#   --stream-duration D  length of the memory test (default 20s)
#   --no-build         use the binaries already in --bin-dir
#   --bin-dir DIR      where the binaries are (default target/release)
#   --doc FILE         document to update (default docs/BENCHMARKS.md)
#   --setups LIST      comma-separated subset of direct,nginx,kvmesh,kvmesh-kv,sglang-rr,
#                      sglang-ca,vllm-rr,vllm-ca (default: all), and kvmesh-traced (not in
#                      the default: kvmesh's config with tracing on, every request recorded,
#                      exported to benches/otlp_sink.py; needs .venv from scripts/setup.sh)
#   --baseline FILE    another kvmesh-proxy binary (e.g. built from an earlier commit), run as
#                      setup kvmesh-baseline with kvmesh's config (and kvmesh-kv-baseline with
#                      kvmesh-kv's, when that runs), to measure a change before and after in
#                      the same run
#   --keep             keep the work directory (configs, logs, JSON reports)
# Environment: LOADGEN_CPU (default 0) and SERVER_CPU (default 1) choose the pinning.
# The peers are installed from PyPI into virtualenvs under .cache/bench/ (once); the Qwen3
# tokenizer for kvmesh-kv by scripts/fetch-tokenizer.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DURATION=10s
WARMUP=2s
CONCURRENCY=32
MAX_TOKENS=16
PROMPT_WORDS=16
LOW_LOAD_DURATION=5s
ROUNDS=4
STREAMS=1000
STREAM_TOKENS=100
STREAM_DURATION=20s
LOADGEN_CPU=${LOADGEN_CPU:-0}
SERVER_CPU=${SERVER_CPU:-1}
MODEL=sim-model
SETUPS_ARG=direct,nginx,kvmesh,kvmesh-kv,sglang-rr,sglang-ca,vllm-rr,vllm-ca
CACHE_DIR=$BENCH_ROOT/.cache/bench
TOKENIZER=$BENCH_ROOT/.cache/tokenizers/qwen3
SGLANG_VERSION=0.3.2
VLLM_ROUTER_VERSION=0.1.17
BASELINE=

while (($#)); do
  case $1 in
    --duration) DURATION=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; shift 2 ;;
    --unloaded-duration) LOW_LOAD_DURATION=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --stream-duration) STREAM_DURATION=$2; shift 2 ;;
    --streams) STREAMS=$2; shift 2 ;;
    --setups) SETUPS_ARG=$2; shift 2 ;;
    --baseline) BASELINE=$(realpath "$2"); shift 2 ;;
    *) common_option "$@"; shift "$TAKEN" ;;
  esac
done

if [[ -n $BASELINE ]]; then
  [[ -x $BASELINE ]] || die "--baseline $BASELINE is not an executable"
  # Right after kvmesh, so the two run back to back in every round.
  SETUPS_ARG=$(sed -E 's/(^|,)kvmesh(,|$)/\1kvmesh,kvmesh-baseline\2/' <<<"$SETUPS_ARG")
  [[ ,$SETUPS_ARG, == *,kvmesh-baseline,* ]] || SETUPS_ARG+=,kvmesh-baseline
  # KV mode too, when it runs: the baseline binary with kvmesh-kv's configuration.
  SETUPS_ARG=$(sed -E 's/(^|,)kvmesh-kv(,|$)/\1kvmesh-kv,kvmesh-kv-baseline\2/' <<<"$SETUPS_ARG")
fi
IFS=, read -ra SETUPS <<<"$SETUPS_ARG"
has_setup() { [[ ",$SETUPS_ARG," == *",$1,"* ]]; }
need_tool jq jq
need_tool taskset util-linux
need_tool nginx nginx
need_tool curl curl
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
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
{ has_setup sglang-rr || has_setup sglang-ca; } && SGLANG_VENV=$(venv sglang "sglang-router==$SGLANG_VERSION")
{ has_setup vllm-rr || has_setup vllm-ca; } && VLLM_VENV=$(venv vllm-router "vllm-router==$VLLM_ROUTER_VERSION")
if has_setup kvmesh-kv; then "$BENCH_ROOT/scripts/fetch-tokenizer.sh" "$TOKENIZER" >&2; fi
SINK_PYTHON=$BENCH_ROOT/.venv/bin/python
if has_setup kvmesh-traced; then
  "$SINK_PYTHON" -c 'import grpc, opentelemetry.proto' 2>/dev/null ||
    die "kvmesh-traced needs grpcio and opentelemetry-proto in .venv: run scripts/setup.sh"
fi

if ((BUILD)); then
  log "building release binaries (several minutes on 2 cores)"
  (cd "$BENCH_ROOT" && cargo build --release -p kvmesh-proxy -p kvmesh-engine-sim -p kvmesh-bench)
fi
SIM=$BIN_DIR/kvmesh-engine-sim
PROXY=$BIN_DIR/kvmesh-proxy
BENCH=$BIN_DIR/kvmesh-bench
for bin in "$SIM" "$PROXY" "$BENCH"; do [[ -x $bin ]] || die "missing $bin"; done

WORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvmesh-overhead.XXXXXX")
chmod 755 "$WORK_DIR"
trap cleanup EXIT
trap 'exit 130' INT TERM
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
LOAD_BEFORE=$(machine_lines)
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')

# ---- backends -------------------------------------------------------------------------------
start_sims() { # VAR_PID OUT ARGS...: two engines in one process, pinned to the server core.
  local var=$1 out=$2
  shift 2
  start_bg "$var" "$out" taskset -c "$SERVER_CPU" "$SIM" --engines 2 --port 0 --block-size 64 "$@"
  wait_ready "$out" "${!var}"
}
start_sims SIM_PID "$WORK_DIR/sim.out" --no-delay
mapfile -t SIM_ADDRS < <(listening "$WORK_DIR/sim.out" 'engine-[0-9]+')
((${#SIM_ADDRS[@]} >= 2)) || die "expected two engine listeners, got: ${SIM_ADDRS[*]}"
log "engine-sims at ${SIM_ADDRS[0]} ${SIM_ADDRS[1]} (pid $SIM_PID)"

# ---- nginx ----------------------------------------------------------------------------------
NGINX_PORT=$(free_port)
mkdir -p "$WORK_DIR/nginx/logs"
cat >"$WORK_DIR/nginx/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK_DIR/nginx/nginx.pid;
error_log $WORK_DIR/nginx/logs/error.log warn;
events { worker_connections 8192; }
http {
    access_log off;
    client_body_temp_path $WORK_DIR/nginx/client_body;
    proxy_temp_path $WORK_DIR/nginx/proxy;
    fastcgi_temp_path $WORK_DIR/nginx/fastcgi;
    uwsgi_temp_path $WORK_DIR/nginx/uwsgi;
    scgi_temp_path $WORK_DIR/nginx/scgi;
    keepalive_requests 1000000;
    upstream sims {
        server ${SIM_ADDRS[0]};
        server ${SIM_ADDRS[1]};
        keepalive 64;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:$NGINX_PORT;
        location / {
            proxy_pass http://sims;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
EOF
NGINX_PID=
start_bg NGINX_PID "$WORK_DIR/nginx.out" taskset -c "$SERVER_CPU" "$NGINX" -c "$WORK_DIR/nginx/nginx.conf" -p "$WORK_DIR/nginx"
deadline=$((SECONDS + 30))
until (exec 3<>"/dev/tcp/127.0.0.1/$NGINX_PORT") 2>/dev/null; do
  kill -0 "$NGINX_PID" 2>/dev/null || { cat "$WORK_DIR/nginx.out.err" >&2; die "nginx exited"; }
  ((SECONDS < deadline)) || die "nginx did not listen on $NGINX_PORT"
  sleep 0.05
done
# The master listens before it forks its worker: wait for the worker too.
until [[ -n $(children "$NGINX_PID") ]]; do
  ((SECONDS < deadline)) || die "nginx started no worker"
  sleep 0.05
done
mapfile -t NGINX_PIDS < <(echo "$NGINX_PID"; children "$NGINX_PID")
NGINX_VERSION=$("$NGINX" -v 2>&1 | sed 's/^nginx version: //')
log "$NGINX_VERSION at 127.0.0.1:$NGINX_PORT (pids ${NGINX_PIDS[*]})"

# ---- kvmesh-proxy ---------------------------------------------------------------------------
write_proxy_config() { # FILE POLICY SIM_ADDR...
  local file=$1 policy=$2 addr
  shift 2
  {
    proxy_config_head
    echo "  - name: $MODEL"
    echo "    policy: $policy"
    if [[ $policy == kv ]]; then echo "    tokenizer: $TOKENIZER"; fi
    echo "    backends:"
    for addr in "$@"; do echo "      - url: http://$addr"; done
    echo "upstream:"
    echo "  pool_size: 64"
    echo "health_check:"
    echo "  enabled: false"
  } >"$file"
}
start_proxy() { # VAR_PID OUT CONFIG [BINARY]
  local var=$1 out=$2 config=$3 binary=${4:-$PROXY}
  "$binary" --check-config "$config" >/dev/null || die "$binary rejects $config"
  start_bg "$var" "$out" env RUST_LOG=warn taskset -c "$SERVER_CPU" "$binary" --config "$config"
  wait_ready "$out" "${!var}"
}
write_proxy_config "$WORK_DIR/kvmesh.yaml" round_robin "${SIM_ADDRS[@]}"
start_proxy PROXY_PID "$WORK_DIR/proxy.out" "$WORK_DIR/kvmesh.yaml"
PROXY_ADDR=$(listening "$WORK_DIR/proxy.out" main)
log "kvmesh-proxy at $PROXY_ADDR (pid $PROXY_PID)"
BASELINE_ADDR=
if [[ -n $BASELINE ]]; then
  start_proxy BASELINE_PID "$WORK_DIR/proxy-baseline.out" "$WORK_DIR/kvmesh.yaml" "$BASELINE"
  BASELINE_ADDR=$(listening "$WORK_DIR/proxy-baseline.out" main)
  log "kvmesh-proxy baseline $BASELINE at $BASELINE_ADDR (pid $BASELINE_PID)"
fi
TRACED_ADDR=
if has_setup kvmesh-traced; then
  # The receiver shares the load generator's core: the server core stays sims + proxy.
  start_bg SINK_PID "$WORK_DIR/otlp.out" taskset -c "$LOADGEN_CPU" "$SINK_PYTHON" \
    "$BENCH_ROOT/benches/otlp_sink.py" "$WORK_DIR/otlp.spans"
  wait_ready "$WORK_DIR/otlp.out" "$SINK_PID"
  cp "$WORK_DIR/kvmesh.yaml" "$WORK_DIR/kvmesh-traced.yaml"
  printf 'telemetry:\n  otlp_endpoint: http://%s\n  sampling_ratio: 1.0\n' \
    "$(listening "$WORK_DIR/otlp.out" otlp)" >>"$WORK_DIR/kvmesh-traced.yaml"
  start_proxy TRACED_PID "$WORK_DIR/proxy-traced.out" "$WORK_DIR/kvmesh-traced.yaml"
  TRACED_ADDR=$(listening "$WORK_DIR/proxy-traced.out" main)
  log "kvmesh-proxy (tracing on) at $TRACED_ADDR (pid $TRACED_PID)"
fi
KV_PROXY_ADDR=
if has_setup kvmesh-kv; then
  write_proxy_config "$WORK_DIR/kvmesh-kv.yaml" kv "${SIM_ADDRS[@]}"
  start_proxy KV_PROXY_PID "$WORK_DIR/proxy-kv.out" "$WORK_DIR/kvmesh-kv.yaml"
  KV_PROXY_ADDR=$(listening "$WORK_DIR/proxy-kv.out" main)
  log "kvmesh-proxy (policy kv) at $KV_PROXY_ADDR (pid $KV_PROXY_PID)"
fi
KV_BASELINE_ADDR=
if has_setup kvmesh-kv-baseline; then
  start_proxy KV_BASELINE_PID "$WORK_DIR/proxy-kv-baseline.out" "$WORK_DIR/kvmesh-kv.yaml" "$BASELINE"
  KV_BASELINE_ADDR=$(listening "$WORK_DIR/proxy-kv-baseline.out" main)
  log "kvmesh-proxy baseline (policy kv) at $KV_BASELINE_ADDR (pid $KV_BASELINE_PID)"
fi

# ---- sglang-router and vllm-router ----------------------------------------------------------
# start_peer VAR_PID VAR_URL LOG CMD...: a peer router pinned like the others; waits until it
# routes a request (they check their workers before serving).
start_peer() {
  local var=$1 url_var=$2 out=$3 port=$4
  shift 4
  start_bg "$var" "$out" taskset -c "$SERVER_CPU" "$@"
  printf -v "$url_var" 'http://127.0.0.1:%s' "$port"
  local deadline=$((SECONDS + 120))
  until curl -sf -o /dev/null -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1}" \
    "${!url_var}/v1/chat/completions"; do
    kill -0 "${!var}" 2>/dev/null || { cat "$out.err" >&2; die "$* exited"; }
    ((SECONDS < deadline)) || die "$* never answered"
    sleep 0.2
  done
}
declare -A PEER_PID PEER_URL
NEW_PEER_PID=
NEW_PEER_URL=
for setup in sglang-rr sglang-ca vllm-rr vllm-ca; do
  has_setup "$setup" || continue
  case $setup in sglang-*) kind=sglang ;; *) kind=vllm ;; esac
  [[ $setup == *-rr ]] && policy=round_robin || policy=cache_aware
  port=$(free_port)
  prom=$(free_port)
  if [[ $kind == sglang ]]; then
    start_peer NEW_PEER_PID NEW_PEER_URL "$WORK_DIR/$setup.out" "$port" "$SGLANG_VENV/bin/python" -m sglang_router.launch_router \
      --host 127.0.0.1 --port "$port" --worker-urls "${SIM_ADDRS[@]/#/http://}" --policy "$policy" \
      --prometheus-host 127.0.0.1 --prometheus-port "$prom" --log-level warn
  else
    start_peer NEW_PEER_PID NEW_PEER_URL "$WORK_DIR/$setup.out" "$port" "$VLLM_VENV/bin/vllm-router" \
      --host 127.0.0.1 --port "$port" --worker-urls "${SIM_ADDRS[@]/#/http://}" --policy "$policy" \
      --prometheus-host 127.0.0.1 --prometheus-port "$prom" --log-level warning
  fi
  PEER_PID[$setup]=$NEW_PEER_PID
  PEER_URL[$setup]=$NEW_PEER_URL
  log "$setup at $NEW_PEER_URL (pid $NEW_PEER_PID)"
done

# ---- measurements ---------------------------------------------------------------------------
# run_load LABEL URL MODE CONCURRENCY DURATION PROXY_PIDS...: a warm-up run, then a measured run
# (round $ROUND of LABEL) with CPU readings of the proxy processes and of the sims around it.
run_load() {
  local label=$1 url=$2 mode=$3 conc=$4 duration=$5
  shift 5
  local out=$WORK_DIR/$label.r$ROUND
  local flags=(--url "$url" --endpoint chat --model "$MODEL" --prompt-tokens "$PROMPT_WORDS"
    --max-tokens "$MAX_TOKENS" --concurrency "$conc" --threads 1)
  [[ $mode == stream ]] && flags+=(--stream)
  log "round $ROUND/$ROUNDS $label: $conc connections, $duration"
  taskset -c "$LOADGEN_CPU" "$BENCH" "${flags[@]}" --duration "$WARMUP" >/dev/null
  local proxy_before sim_before ok
  proxy_before=$(cpu_ticks "$@")
  sim_before=$(cpu_ticks "$SIM_PID")
  taskset -c "$LOADGEN_CPU" "$BENCH" "${flags[@]}" --duration "$duration" --json "$out.json" >"$out.txt"
  expect_alive "$label" "$SIM_PID" "$@"
  ok=$(jq '.requests_ok' "$out.json")
  us_per_request $(($(cpu_ticks "$@") - proxy_before)) "$ok" >"$out.proxy_us"
  us_per_request $(($(cpu_ticks "$SIM_PID") - sim_before)) "$ok" >"$out.sim_us"
  if (($#)); then rss_kb VmRSS "$@" >"$out.rss"; else echo 0 >"$out.rss"; fi
  sed 's/^/    /' "$out.txt" >&2
}

declare -A URL=([direct]="http://${SIM_ADDRS[0]}" [nginx]="http://127.0.0.1:$NGINX_PORT" [kvmesh]="http://$PROXY_ADDR" [kvmesh-baseline]="http://$BASELINE_ADDR" [kvmesh-traced]="http://$TRACED_ADDR" [kvmesh-kv]="http://$KV_PROXY_ADDR" [kvmesh-kv-baseline]="http://$KV_BASELINE_ADDR")
for setup in "${!PEER_URL[@]}"; do URL[$setup]=${PEER_URL[$setup]}; done
MODES=(non-stream stream)
# Rounds interleave the setups, so background load on the shared machine hits them alike;
# even rounds run them in reverse order, because a setup run second in a pair measured 6-12 %
# cheaper than the same binary run first (docs/BENCHMARKS.md, 2026-11-27 22:44 and 22:53).
for ((ROUND = 1; ROUND <= ROUNDS; ROUND++)); do
  ORDER=("${SETUPS[@]}")
  if ((ROUND % 2 == 0)); then
    ORDER=()
    for ((i = ${#SETUPS[@]} - 1; i >= 0; i--)); do ORDER+=("${SETUPS[i]}"); done
  fi
  for setup in "${ORDER[@]}"; do
    case $setup in
      direct) pids=() ;;
      nginx) pids=("${NGINX_PIDS[@]}") ;;
      kvmesh) pids=("$PROXY_PID") ;;
      kvmesh-baseline) pids=("$BASELINE_PID") ;;
      kvmesh-traced) pids=("$TRACED_PID") ;;
      kvmesh-kv) pids=("$KV_PROXY_PID") ;;
      kvmesh-kv-baseline) pids=("$KV_BASELINE_PID") ;;
      *) pids=("${PEER_PID[$setup]}") ;;
    esac
    for mode in "${MODES[@]}"; do
      run_load "$setup-$mode-sat" "${URL[$setup]}" "$mode" "$CONCURRENCY" "$DURATION" "${pids[@]}"
      run_load "$setup-$mode-one" "${URL[$setup]}" "$mode" 1 "$LOW_LOAD_DURATION" "${pids[@]}"
    done
  done
done

# ---- 1,000 concurrent long streams through kvmesh -------------------------------------------
# A fresh proxy (so VmHWM is this test's peak) over sims with the timing model slowed down, so
# every stream stays open for seconds.
stop_pid "$PROXY_PID"
[[ -n $BASELINE_ADDR ]] && stop_pid "$BASELINE_PID"
[[ -n $KV_PROXY_ADDR ]] && stop_pid "$KV_PROXY_PID"
[[ -n $KV_BASELINE_ADDR ]] && stop_pid "$KV_BASELINE_PID"
for setup in "${!PEER_PID[@]}"; do stop_pid "${PEER_PID[$setup]}"; done
stop_pid "$NGINX_PID"
stop_pid "$SIM_PID"
start_sims SLOW_SIM_PID "$WORK_DIR/slow-sim.out" --speedup-ratio 0.1 --max-num-seqs "$STREAMS"
mapfile -t SLOW_ADDRS < <(listening "$WORK_DIR/slow-sim.out" 'engine-[0-9]+')
write_proxy_config "$WORK_DIR/kvmesh-streams.yaml" round_robin "${SLOW_ADDRS[@]}"
start_proxy STREAM_PROXY_PID "$WORK_DIR/stream-proxy.out" "$WORK_DIR/kvmesh-streams.yaml"
STREAM_PROXY_ADDR=$(listening "$WORK_DIR/stream-proxy.out" main)
STREAM_PORT=${STREAM_PROXY_ADDR##*:}
log "memory test: $STREAMS streams of $STREAM_TOKENS tokens through $STREAM_PROXY_ADDR for $STREAM_DURATION"
(
  peak=0
  while kill -0 "$STREAM_PROXY_PID" 2>/dev/null; do
    n=$(ss -Htn state established "( sport = :$STREAM_PORT )" 2>/dev/null | wc -l)
    ((n > peak)) && peak=$n && echo "$peak" >"$WORK_DIR/streams.peak_conns"
    sleep 0.5
  done
) &
SAMPLER_PID=$!
STARTED_PIDS+=("$SAMPLER_PID")
STREAM_RSS_IDLE=$(rss_kb VmRSS "$STREAM_PROXY_PID")
taskset -c "$LOADGEN_CPU" "$BENCH" --url "http://$STREAM_PROXY_ADDR" --endpoint chat --model "$MODEL" \
  --prompt-tokens "$PROMPT_WORDS" --max-tokens "$STREAM_TOKENS" --stream --concurrency "$STREAMS" \
  --threads 1 --duration "$STREAM_DURATION" --timeout 120s \
  --json "$WORK_DIR/streams.json" >"$WORK_DIR/streams.txt"
sed 's/^/    /' "$WORK_DIR/streams.txt" >&2
expect_alive "the memory test" "$SLOW_SIM_PID" "$STREAM_PROXY_PID"
STREAM_HWM=$(rss_kb VmHWM "$STREAM_PROXY_PID")
stop_pid "$SAMPLER_PID"
PEAK_CONNS=$(cat "$WORK_DIR/streams.peak_conns" 2>/dev/null || echo 0)

# ---- report ---------------------------------------------------------------------------------
mb() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1024 }'; }
# of LABEL FILTER: the JSON value of every round of LABEL, one a line.
of() { local f; for f in "$WORK_DIR/$1".r*.json; do jq -r "($2) // empty" "$f"; done; }
# saved LABEL EXT: the value of every round's LABEL.rN.EXT file, one a line.
saved() { cat "$WORK_DIR/$1".r*."$2"; }
# added SETUP MODE-LOAD: median p50 of SETUP-MODE-LOAD minus median p50 of the direct run in the
# same mode and load.
added() {
  local direct=direct-$2
  set -- "$1-$2"
  awk -v a="$(of "$1" '.e2e_ms.p50' | median)" -v d="$(of "$direct" '.e2e_ms.p50' | median)" \
    'BEGIN { printf "%.3f", a - d }'
}
sum() { awk '{ s += $1 } END { print s + 0 }'; }
SECTION=$WORK_DIR/section.md
{
  echo "## Proxy overhead (\`benches/overhead.sh\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\`."
  echo
  echo "$LOAD_BEFORE"
  echo "- Load average after the run: \`$(cut -d' ' -f1-3 /proc/loadavg)\`"
  echo "- Backends: one \`kvmesh-engine-sim --no-delay --engines 2 --port 0 --block-size 64\` process (two engines); *direct* loads engine 0 only."
  echo "- Load: \`kvmesh-bench\`, chat completions, $PROMPT_WORDS-word prompt, max_tokens $MAX_TOKENS, closed loop, HTTP/1.1 keep-alive; every measured run follows a $WARMUP warm-up run."
  echo "- $ROUNDS rounds, each running every setup and mode in turn (even rounds in reverse order); each cell is the median over the rounds (req/s also shows the range), errors are summed."
  echo "- Pinning: load generator \`taskset -c $LOADGEN_CPU\` with one runtime thread; sims and the proxy under test \`taskset -c $SERVER_CPU\`. Sim and proxy share one core, so saturated req/s measures sim + proxy CPU per request; the generator's CPU use is in its reports."
  echo "- nginx: $NGINX_VERSION, \`worker_processes 1\`, upstream with both sims, \`keepalive 64\`, \`proxy_http_version 1.1\`, \`proxy_set_header Connection \"\"\`, \`proxy_buffering off\`, \`keepalive_requests 1000000\` (client and upstream side, so neither closes connections mid-run), access log off."
  echo "- kvmesh-proxy: \`policy: round_robin\` (*kvmesh*) and \`policy: kv\` with the Qwen3 tokenizer directory (*kvmesh-kv*: every request is rendered with the chat template, tokenized, hashed into 64-token blocks, scored against the KV index and booked), \`upstream.pool_size: 64\`, health checks off (nginx has none either), \`RUST_LOG=warn\` (no per-request log line, like nginx's access log off); pinned to one CPU, the proxy runs a single-threaded tokio runtime (it chooses one whenever it may use one CPU), as nginx runs \`worker_processes 1\`."
  if [[ -n $BASELINE ]]; then
    echo "- *kvmesh-baseline* (and *kvmesh-kv-baseline*): the binary \`$BASELINE\` with *kvmesh*'s (*kvmesh-kv*'s) configuration, run right after *kvmesh* (*kvmesh-kv*) in odd rounds and right before it in even rounds, to compare a change with what it changes."
  fi
  if has_setup kvmesh-traced; then
    echo "- *kvmesh-traced*: *kvmesh*'s configuration plus \`telemetry\` with \`sampling_ratio: 1.0\` (every request recorded: 6 spans each), exported over OTLP/gRPC to \`benches/otlp_sink.py\` (grpcio, pinned to the load generator's core); the receiver counted $(cat "$WORK_DIR/otlp.spans" 2>/dev/null || echo 0) spans."
  fi
  echo "- Peers, from PyPI into \`.cache/bench/venv-*\`, started as in reference/peers.md §7 and pinned like the proxy: sglang-router $SGLANG_VERSION (\`python -m sglang_router.launch_router --policy round_robin|cache_aware\`, *sglang-rr* / *sglang-ca*) and vllm-router $VLLM_ROUTER_VERSION (\`vllm-router --policy round_robin|cache_aware\`, *vllm-rr* / *vllm-ca*), each with its own Prometheus port and its default health checks; all peers run during the whole benchmark. Their process is the Python launcher that hosts the Rust router, so CPU and RSS include the interpreter."
  echo "- CPU per request: utime + stime from \`/proc/PID/stat\` (all threads; nginx master + worker) over the measured run, divided by its successful requests. RSS: \`VmRSS\` after the run."
  echo
  echo "### Saturated: $CONCURRENCY connections, $DURATION per run"
  echo
  echo "| setup | mode | req/s | req/s range | p50 ms | p99 ms | added p50 ms | proxy CPU µs/req | sim CPU µs/req | proxy RSS MB | errors | generator CPU % |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for mode in "${MODES[@]}"; do
    for setup in "${SETUPS[@]}"; do
      l=$setup-$mode-sat
      if [[ $setup == direct ]]; then proxy_cpu="—"; rss="—"; delta="—"; else
        proxy_cpu=$(saved "$l" proxy_us | median 1)
        rss=$(mb "$(saved "$l" rss | median 0)")
        delta=$(added "$setup" "${l#"$setup"-}")
      fi
      printf '| %s | %s | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %.0f |\n' "$setup" "$mode" \
        "$(of "$l" '.requests_per_s' | median)" "$(of "$l" '.requests_per_s' | span)" \
        "$(of "$l" '.e2e_ms.p50' | median)" "$(of "$l" '.e2e_ms.p99' | median)" "$delta" \
        "$proxy_cpu" "$(saved "$l" sim_us | median 1)" "$rss" "$(of "$l" '.errors_total' | sum)" \
        "$(of "$l" '.client_cpu_percent' | median 0)"
    done
  done
  echo
  echo "### Unloaded: 1 connection, $LOW_LOAD_DURATION per run"
  echo
  echo "| setup | mode | req/s | p50 ms | p99 ms | added p50 ms | proxy CPU µs/req | errors |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|"
  for mode in "${MODES[@]}"; do
    for setup in "${SETUPS[@]}"; do
      l=$setup-$mode-one
      if [[ $setup == direct ]]; then proxy_cpu="—"; delta="—"; else
        proxy_cpu=$(saved "$l" proxy_us | median 1)
        delta=$(added "$setup" "${l#"$setup"-}")
      fi
      printf '| %s | %s | %.0f | %s | %s | %s | %s | %s |\n' "$setup" "$mode" \
        "$(of "$l" '.requests_per_s' | median)" "$(of "$l" '.e2e_ms.p50' | median)" \
        "$(of "$l" '.e2e_ms.p99' | median)" "$delta" "$proxy_cpu" "$(of "$l" '.errors_total' | sum)"
    done
  done
  echo
  echo "### $STREAMS concurrent streams through kvmesh-proxy"
  echo
  echo "A fresh kvmesh-proxy over a second sim process (\`--engines 2 --speedup-ratio 0.1 --max-num-seqs $STREAMS\`, so streams last seconds); \`kvmesh-bench --stream --concurrency $STREAMS --max-tokens $STREAM_TOKENS --duration $STREAM_DURATION\`."
  echo
  echo "| client connections (peak seen by \`ss\`) | streams completed | errors | TTFT p50 ms | E2E p50 ms | proxy RSS idle MB | proxy peak RSS (VmHWM) MB |"
  echo "|---:|---:|---:|---:|---:|---:|---:|"
  f=$WORK_DIR/streams.json
  echo "| $PEAK_CONNS | $(json "$f" '.requests_ok') | $(json "$f" '.errors_total') | $(json "$f" '.ttft_ms.p50') | $(json "$f" '.e2e_ms.p50') | $(mb "$STREAM_RSS_IDLE") | $(mb "$STREAM_HWM") |"
  echo
  echo "### Targets"
  echo
  echo "| target | measured | result |"
  echo "|---|---|---|"
  for mode in "${MODES[@]}"; do
    has_setup nginx || break
    k=$(of "kvmesh-$mode-sat" '.requests_per_s' | median)
    n=$(of "nginx-$mode-sat" '.requests_per_s' | median)
    verdict=$(awk -v k="$k" -v n="$n" 'BEGIN { print (k >= n ? "pass" : "FAIL") }')
    printf '| kvmesh req/s ≥ nginx req/s, %s | %.0f vs %.0f | %s |\n' "$mode" "$k" "$n" "$verdict"
  done
  for mode in "${MODES[@]}"; do
    for load in one sat; do
      delta=$(added kvmesh "$mode-$load")
      verdict=$(awk -v a="$delta" 'BEGIN {
        print (a < -0.05 ? "inconclusive: negative, the direct runs were disturbed" : a <= 0.2 ? "pass" : "FAIL") }')
      [[ $load == one ]] && what="1 connection" || what="$CONCURRENCY connections (saturated)"
      measured="$delta ms"
      has_setup nginx && measured+=" (nginx: $(added nginx "$mode-$load") ms)"
      echo "| kvmesh p50 added latency over direct ≤ 0.2 ms, $mode, $what | $measured | $verdict |"
    done
  done
  for mode in "${MODES[@]}"; do
    if ! has_setup kvmesh-kv || ! has_setup sglang-ca; then break; fi
    k=$(of "kvmesh-kv-$mode-sat" '.requests_per_s' | median)
    g=$(of "sglang-ca-$mode-sat" '.requests_per_s' | median)
    verdict=$(awk -v k="$k" -v g="$g" 'BEGIN { print (k >= 3 * g ? "pass" : "FAIL") }')
    printf '| kvmesh KV mode req/s ≥ 3 × sglang-router cache_aware, %s | %.0f vs %.0f (%.1f×) | %s |\n' "$mode" "$k" "$g" "$(awk -v k="$k" -v g="$g" 'BEGIN { print (g > 0 ? k / g : 0) }')" "$verdict"
  done
  for pair in kvmesh:kvmesh-baseline kvmesh-kv:kvmesh-kv-baseline; do
    new=${pair%%:*} old=${pair#*:}
    has_setup "$old" || continue
    for mode in "${MODES[@]}"; do
      kn=$(of "$new-$mode-sat" '.requests_per_s' | median)
      ko=$(of "$old-$mode-sat" '.requests_per_s' | median)
      cn=$(saved "$new-$mode-sat" proxy_us | median 1)
      co=$(saved "$old-$mode-sat" proxy_us | median 1)
      verdict=$(awk -v kn="$kn" -v ko="$ko" -v cn="$cn" -v co="$co" 'BEGIN {
        print (kn >= 0.98 * ko && cn <= 1.02 * co ? "pass" : "FAIL") }')
      printf '| %s within 2 %% of %s (req/s, proxy CPU µs/req), %s | %.0f vs %.0f req/s, %s vs %s µs | %s |\n' \
        "$new" "$old" "$mode" "$kn" "$ko" "$cn" "$co" "$verdict"
    done
  done
  verdict=$(awk -v h="$STREAM_HWM" 'BEGIN { print (h < 50 * 1024 ? "pass" : "FAIL") }')
  echo "| kvmesh peak RSS < 50 MB with $STREAMS concurrent streams | $(mb "$STREAM_HWM") MB at $PEAK_CONNS connections | $verdict |"
  echo
  echo "Saturated added latency is mostly queueing: sim and proxy share one core, so a proxy that costs CPU lowers throughput and every one of the $CONCURRENCY connections waits longer (p50 ≈ connections ÷ req/s). The 1-connection rows show the latency a request gains by going through the proxy when nothing queues; at a few tens of µs they are within the noise of a shared machine."
} >"$SECTION"

mkdir -p "$(dirname "$DOC")"
replace_section "$DOC" overhead "$SECTION"
log "wrote the overhead section of $DOC"
cat "$SECTION"
