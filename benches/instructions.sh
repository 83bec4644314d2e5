#!/usr/bin/env bash
# Proxy instructions per request, old binary against new: each kvmesh-proxy binary runs under
# valgrind's callgrind (which counts executed instructions, the same count for the same work
# whatever else the machine does) in front of no-delay engine-sims, and serves first N1, then,
# in a fresh process, N2 requests; (instructions(N2) − instructions(N1)) ÷ (N2 − N1) is its
# cost per request with start-up and shutdown cancelled out. Round robin and `policy: kv`,
# non-streaming and streaming. End-to-end req/s on a shared 2-core machine moves by ±10 % between
# identical runs (see the overhead analysis); this count resolves differences of a fraction of
# a per cent. Writes the `instructions` section of docs/BENCHMARKS.md.
#
# Usage: benches/instructions.sh --baseline FILE [options]
#   --baseline FILE   the kvmesh-proxy binary to compare with (e.g. built from an earlier commit)
#   --n1 N / --n2 N   request counts of the two runs (default 200 / 1200)
#   --no-build        use the binaries already in --bin-dir
#   --bin-dir DIR     where the binaries are (default target/release)
#   --doc FILE        document to update (default docs/BENCHMARKS.md)
#   --keep            keep the work directory
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
N1=200
N2=1200
TOKENIZER=$BENCH_ROOT/.cache/tokenizers/qwen3
MODEL=sim-model
BASELINE=
while (($#)); do
  case $1 in
    --baseline) BASELINE=$(realpath "$2"); shift 2 ;;
    --n1) N1=$2; shift 2 ;;
    --n2) N2=$2; shift 2 ;;
    *) common_option "$@"; shift "$TAKEN" ;;
  esac
done
[[ -x $BASELINE ]] || die "--baseline FILE (an executable kvmesh-proxy) is required"
((N2 > N1)) || die "--n2 must be larger than --n1"
need_tool valgrind valgrind
need_tool jq jq
"$BENCH_ROOT/scripts/fetch-tokenizer.sh" "$TOKENIZER" >&2
if ((BUILD)); then
  (cd "$BENCH_ROOT" && cargo build --release -p kvmesh-proxy -p kvmesh-engine-sim -p kvmesh-bench)
fi
SIM=$BIN_DIR/kvmesh-engine-sim
PROXY=$BIN_DIR/kvmesh-proxy
BENCH=$BIN_DIR/kvmesh-bench
for bin in "$SIM" "$PROXY" "$BENCH"; do [[ -x $bin ]] || die "missing $bin"; done

WORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvmesh-instructions.XXXXXX")
trap cleanup EXIT
trap 'exit 130' INT TERM
DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
start_bg SIM_PID "$WORK_DIR/sim.out" "$SIM" --no-delay --engines 2 --port 0 --block-size 64
wait_ready "$WORK_DIR/sim.out" "$SIM_PID"
mapfile -t SIM_ADDRS < <(listening "$WORK_DIR/sim.out" 'engine-[0-9]+')

write_config() { # FILE POLICY
  {
    printf 'listeners:\n  - name: main\n    address: 127.0.0.1:0\n'
    printf 'models:\n  - name: %s\n    policy: %s\n' "$MODEL" "$2"
    [[ $2 == kv ]] && printf '    tokenizer: %s\n' "$TOKENIZER"
    printf '    backends:\n'
    for addr in "${SIM_ADDRS[@]}"; do printf '      - url: http://%s\n' "$addr"; done
    printf 'health_check:\n  enabled: false\n'
  } >"$1"
}
write_config "$WORK_DIR/round_robin.yaml" round_robin
write_config "$WORK_DIR/kv.yaml" kv

# instructions BINARY POLICY MODE N: instructions the proxy executed serving N requests.
instructions() {
  local binary=$1 policy=$2 mode=$3 n=$4 label="$2-$3-$4-$5"
  local out=$WORK_DIR/$label.out stream=()
  [[ $mode == stream ]] && stream=(--stream)
  start_bg PID "$out" env RUST_LOG=warn valgrind --tool=callgrind \
    --callgrind-out-file="$WORK_DIR/$label.callgrind" "$binary" --config "$WORK_DIR/$policy.yaml"
  wait_ready "$out" "$PID" 300
  "$BENCH" --url "http://$(listening "$out" main)" --endpoint chat --model "$MODEL" --max-tokens 16 \
    --prompt-tokens 16 --concurrency 4 --requests "$n" "${stream[@]}" \
    --json "$WORK_DIR/$label.json" >/dev/null 2>&1
  [[ $(jq -r .errors_total "$WORK_DIR/$label.json") == 0 ]] || die "$label: errors"
  stop_pid "$PID"
  awk '/^(summary|totals):/ { print $2; exit }' "$WORK_DIR/$label.callgrind"
}

SECTION=$WORK_DIR/section.md
{
  echo "## Instructions per request (\`benches/instructions.sh\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\`."
  echo
  machine_lines
  echo "- Each proxy binary under \`valgrind --tool=callgrind\` (instructions executed, all threads) in front of one \`kvmesh-engine-sim --no-delay --engines 2\`, serving \`kvmesh-bench --concurrency 4 --prompt-tokens 16 --max-tokens 16\` chat completions; per request = (count for $N2 requests − count for $N1) ÷ $((N2 - N1)), each count from a fresh process."
  echo "- *new*: \`$PROXY\`; *baseline*: \`$BASELINE\`."
  echo
  echo "| policy | mode | new instructions/request | baseline instructions/request | new ÷ baseline |"
  echo "|---|---|---:|---:|---:|"
  for policy in round_robin kv; do
    for mode in non-stream stream; do
      declare -A per=()
      for which in new baseline; do
        binary=$PROXY
        [[ $which == baseline ]] && binary=$BASELINE
        log "$which $policy $mode"
        low=$(instructions "$binary" "$policy" "$mode" "$N1" "$which")
        high=$(instructions "$binary" "$policy" "$mode" "$N2" "$which")
        per[$which]=$(((high - low) / (N2 - N1)))
      done
      printf '| %s | %s | %d | %d | %.3f |\n' "$policy" "$mode" "${per[new]}" "${per[baseline]}" \
        "$(awk -v a="${per[new]}" -v b="${per[baseline]}" 'BEGIN { print a / b }')"
    done
  done
} >"$SECTION"
cat "$SECTION" >&2
replace_section "$DOC" instructions "$SECTION"
log "updated $DOC"
