#!/usr/bin/env bash
# The demo in front of two real vLLM engines (scripts/vllm.sh: the CPU build, a tiny
# random-weight Qwen3), each with its kvmesh-agent, etcd and nats-server, and the proxy on
# 127.0.0.1:8080 (admin 127.0.0.1:9090) with etcd discovery, NATS KV events and policy: kv,
# until Ctrl-C. `scripts/demo.sh --vllm` runs it.
#
# Needs an x86-64 Linux machine; no GPU. Two engines take about 11 GB of memory; the first
# run downloads 3.2 GB and installs 6.4 GB under ~/.cache/kvmesh (docs/real-engines.md).
# ENGINE_URLS="http://gpu-1:8000 http://gpu-2:8000" points the same setup at running vLLM
# engines instead (their KV events on port 5557 of the same hosts) and starts none.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --system-only
cargo build --locked --release -p kvmesh-proxy -p kvmesh-agent
scripts/vllm.sh model >/dev/null

run="$(mktemp -d -t kvmesh-demo-vllm.XXXXXX)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "demo: logs were in $run"
}
trap cleanup EXIT INT TERM

start() { # name, command...: runs it in its own process group, logs to $run/name.log
  local name="$1"; shift
  setsid "$@" >"$run/$name.log" 2>&1 &
  pids+=($!)
}

wait_http() { # url, seconds
  local deadline=$((SECONDS + $2))
  until curl -sf -o /dev/null "$1"; do
    [ $SECONDS -lt $deadline ] || { echo "demo: $1 did not answer in $2 s; logs in $run" >&2; exit 1; }
    sleep 0.5
  done
}

start etcd etcd --name demo --data-dir "$run/etcd" --listen-client-urls http://127.0.0.1:22379 \
  --advertise-client-urls http://127.0.0.1:22379 --listen-peer-urls http://127.0.0.1:22380 \
  --initial-advertise-peer-urls http://127.0.0.1:22380 --initial-cluster demo=http://127.0.0.1:22380
start nats nats-server -a 127.0.0.1 -p 24222

engines=()
if [ -n "${ENGINE_URLS:-}" ]; then
  for url in $ENGINE_URLS; do
    host="${url#*://}"; host="${host%%:*}"
    engines+=("$url tcp://$host:5557 tcp://$host:5558")
  done
else
  for i in 1 2; do
    port=$((18000 + i)); events=$((15550 + 2 * i)); replay=$((events + 1))
    echo "demo: starting vLLM engine $i on 127.0.0.1:$port (about 30-60 s)"
    start "vllm-$i" scripts/vllm.sh serve --port "$port" --events-port "$events" --replay-port "$replay"
    engines+=("http://127.0.0.1:$port tcp://127.0.0.1:$events tcp://127.0.0.1:$replay")
  done
fi
wait_http http://127.0.0.1:22379/health 30
for engine in "${engines[@]}"; do
  read -r url _ _ <<<"$engine"
  wait_http "$url/health" 300
done

i=0
for engine in "${engines[@]}"; do
  read -r url events replay <<<"$engine"
  i=$((i + 1))
  start "agent-$i" target/release/kvmesh-agent --engine-url "$url" --model qwen3 \
    --kv-events-endpoint "$events" --kv-events-replay-endpoint "$replay" --kv-events-topic kv-events \
    --etcd http://127.0.0.1:22379 --nats nats://127.0.0.1:24222
done

cat >"$run/proxy.yaml" <<EOF
listeners:
  - name: main
    address: 127.0.0.1:8080
admin:
  address: 127.0.0.1:9090
models:
  - name: qwen3
    policy: kv
    tokenizer: $PWD/.cache/tokenizers/qwen3
    backends: []
discovery:
  kind: etcd
  endpoint: http://127.0.0.1:22379
events:
  kind: nats
  url: nats://127.0.0.1:24222
EOF
start proxy target/release/kvmesh-proxy --config "$run/proxy.yaml"
wait_http http://127.0.0.1:9090/health 30

cat <<'EOF'

kvmesh is up in front of real vLLM engines. Try:

  curl -si http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"qwen3","messages":[{"role":"user","content":"Hello!"}],"max_tokens":16}'

(the model has random weights: its text is gibberish; x-kvmesh-route says where the request
went and what the engine's KV events say it caches). Instances: curl -s 127.0.0.1:9090/health

Ctrl-C stops everything.
EOF
wait
