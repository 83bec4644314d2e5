#!/usr/bin/env bash
# Proxy CPU per request over TLS (HTTP/1.1, keep-alive): the same chat completions, streamed
# and not, through a kvmesh-proxy TLS listener in front of one `kvmesh-engine-sim --no-delay`,
# for this build and (with --baseline) another binary, in alternating rounds of the same run.
# The client is benches/tls_load.py (Python's `ssl`, closed loop); the figure that matters is
# the proxy's own utime + stime per request, which the client's speed does not change. Writes
# the `tls` section of docs/BENCHMARKS.md.
#
# Usage: benches/tls.sh [options]
#   --baseline FILE    another kvmesh-proxy binary to measure beside this one
#   --requests N       requests per lane and round (default 3000; streamed: half)
#   --concurrency N    connections (default 4)
#   --rounds N         rounds (default 2)
#   --no-build         use the binaries already in --bin-dir
#   --bin-dir DIR      where the binaries are (default target/release)
#   --doc FILE         document to update (default docs/BENCHMARKS.md)
#   --keep             keep the work directory (configs, logs)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

BASELINE=
REQUESTS=3000
CONCURRENCY=4
ROUNDS=2
while (($#)); do
  case $1 in
    --baseline) BASELINE=$(realpath "$2"); shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) common_option "$@"; shift "$TAKEN" ;;
  esac
done

need_tool openssl openssl
need_tool python3 python3
build_release kvmesh-proxy kvmesh-engine-sim
SIM=$BIN_DIR/kvmesh-engine-sim
need_bins "$SIM" "$BIN_DIR/kvmesh-proxy" ${BASELINE:+"$BASELINE"}
begin_run tls

openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost \
  -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" \
  -keyout "$WORK_DIR/key.pem" -out "$WORK_DIR/cert.pem" 2>/dev/null
start_bg SIM_PID "$WORK_DIR/sim.out" "$SIM" --no-delay --engines 1 --port 0 --block-size 64
wait_ready "$WORK_DIR/sim.out" "$SIM_PID"
ENGINE=$(listening "$WORK_DIR/sim.out" engine-0)
cat >"$WORK_DIR/proxy.yaml" <<YAML
listeners:
  - name: main
    address: 127.0.0.1:0
    tls:
      cert: $WORK_DIR/cert.pem
      key: $WORK_DIR/key.pem
admin:
  address: 127.0.0.1:0
health_check:
  enabled: false
models:
  - name: sim-model
    backends:
      - url: http://$ENGINE
YAML

declare -A BINARIES=([kvmesh]=$BIN_DIR/kvmesh-proxy)
[[ -n $BASELINE ]] && BINARIES[kvmesh-baseline]=$BASELINE
ROWS=$WORK_DIR/rows.txt
for round in $(seq "$ROUNDS"); do
  for name in "${!BINARIES[@]}"; do
    start_bg PROXY_PID "$WORK_DIR/$name.out" env RUST_LOG=warn "${BINARIES[$name]}" --config "$WORK_DIR/proxy.yaml"
    wait_ready "$WORK_DIR/$name.out" "$PROXY_PID"
    MAIN=$(listening "$WORK_DIR/$name.out" main)
    python3 "$BENCH_ROOT/benches/tls_load.py" "$MAIN" "$WORK_DIR/cert.pem" 40 1 non-stream >/dev/null
    for mode in non-stream stream; do
      requests=$REQUESTS
      [[ $mode == stream ]] && requests=$((REQUESTS / 2))
      before=$(cpu_ticks "$PROXY_PID")
      rps=$(python3 "$BENCH_ROOT/benches/tls_load.py" "$MAIN" "$WORK_DIR/cert.pem" "$requests" "$CONCURRENCY" "$mode")
      cpu=$(us_per_request $(($(cpu_ticks "$PROXY_PID") - before)) "$requests")
      log "round $round, $name, $mode: $rps req/s, $cpu µs proxy CPU per request"
      echo "$name $mode $rps $cpu" >>"$ROWS"
    done
    stop_pid "$PROXY_PID"
  done
done

SECTION=$WORK_DIR/section.md
{
  echo "## HTTP/1.1 over TLS (\`benches/tls.sh\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\`."
  echo
  echo "$LOAD_BEFORE"
  echo "- One \`kvmesh-engine-sim --no-delay\` engine behind a kvmesh-proxy TLS listener (RSA 2048, TLS 1.3, ALPN \`http/1.1\`); the client is \`benches/tls_load.py\` (Python \`ssl\`, $CONCURRENCY keep-alive connections, closed loop, chat completions of 16 tokens: $REQUESTS per lane and round, $((REQUESTS / 2)) streamed); $ROUNDS rounds, the binaries alternating."
  echo "- *proxy CPU µs/req*: the proxy's utime + stime over the lane ÷ its requests (the figure to compare); requests/s is the Python client's pace on the shared 2 cores. Each cell lists the rounds."
  echo
  echo "| binary | mode | requests/s | proxy CPU µs/req |"
  echo "|---|---|---:|---:|"
  for name in $(printf '%s\n' "${!BINARIES[@]}" | sort); do
    for mode in non-stream stream; do
      rps=$(awk -v n="$name" -v m="$mode" '$1 == n && $2 == m { printf "%s%s", s, $3; s = ", " }' "$ROWS")
      cpu=$(awk -v n="$name" -v m="$mode" '$1 == n && $2 == m { printf "%s%s", s, $4; s = ", " }' "$ROWS")
      echo "| $name | $mode | $rps | $cpu |"
    done
  done
} >"$SECTION"
replace_section "$DOC" tls "$SECTION"
log "wrote the tls section of $DOC"
cat "$SECTION"
