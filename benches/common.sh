# Helpers shared by the benchmark scripts (sourced, not run).
#
# Process handling, readiness (the `LISTENING <name> <addr>` / `READY` stdout lines every kvmesh
# server prints), CPU and memory readings from /proc, and the replacement of one marked section
# of docs/BENCHMARKS.md.

# shellcheck disable=SC2034 # used by the scripts that source this file
BENCH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Defaults of the options every script takes (common_option), and the command as run, for
# the documents (sourced before the script parses its arguments, so "$@" is still whole).
BUILD=1
BIN_DIR=$BENCH_ROOT/target/release
DOC=$BENCH_ROOT/docs/BENCHMARKS.md
COMMAND="benches/$(basename "$0")${*:+ $*}"
CLK_TCK=$(getconf CLK_TCK)
STARTED_PIDS=()

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Stops every process this script started (by PID, newest first), then removes the work dir
# (kept when the script fails, for its logs).
cleanup() {
  local status=$? i
  for ((i = ${#STARTED_PIDS[@]} - 1; i >= 0; i--)); do
    kill "${STARTED_PIDS[i]}" 2>/dev/null || true
  done
  for ((i = ${#STARTED_PIDS[@]} - 1; i >= 0; i--)); do
    wait "${STARTED_PIDS[i]}" 2>/dev/null || true
  done
  STARTED_PIDS=()
  if [[ -n ${WORK_DIR:-} && -d $WORK_DIR ]]; then
    if [[ -z ${KEEP_WORK_DIR:-} && $status -eq 0 ]]; then
      rm -rf "$WORK_DIR"
    else
      log "work directory kept: $WORK_DIR"
    fi
  fi
}

# build_release PACKAGE...: unless BUILD is 0, builds the release binaries of PACKAGE... and
# the load generator kvmesh-grpc-bench.
build_release() {
  ((${BUILD:-1})) || return 0
  local packages=() package
  for package in "$@"; do packages+=(-p "$package"); done
  log "building release binaries (several minutes on 2 cores)"
  (cd "$BENCH_ROOT" && cargo build --release "${packages[@]}" --bins &&
    cargo build --release -p kvmesh-bench --bin kvmesh-grpc-bench)
}

# need_bins BIN...: dies unless every BIN is an executable file.
need_bins() {
  local bin
  for bin in "$@"; do [[ -x $bin ]] || die "missing $bin"; done
}

# begin_run NAME: a fresh work directory WORK_DIR (removed at exit unless the run failed or
# --keep), the cleanup traps, and LOAD_BEFORE and DATE for the section's header.
begin_run() {
  WORK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvmesh-$1.XXXXXX")
  trap cleanup EXIT
  trap 'exit 130' INT TERM
  LOAD_BEFORE=$(machine_lines)
  DATE=$(date -u '+%Y-%m-%d %H:%M UTC')
}

# common_option ARG...: the options every benchmark takes, for the option loop's last case:
# --no-build, --bin-dir DIR, --doc FILE, --keep (read by cleanup) and --help (the script's
# header); sets TAKEN to how many words it used. Anything else is an error.
common_option() {
  case $1 in
    --no-build) BUILD=0; TAKEN=1 ;;
    --bin-dir) BIN_DIR=$(cd "$2" && pwd); TAKEN=2 ;;
    --doc) DOC=$2; TAKEN=2 ;;
    --keep) KEEP_WORK_DIR=1; TAKEN=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
}

# expect_alive LABEL PID...: fails (showing the dead process's stderr) unless every PID runs.
expect_alive() {
  local label=$1 pid
  shift
  for pid in "$@"; do
    kill -0 "$pid" 2>/dev/null && continue
    log "process $pid exited during $label; results would be meaningless"
    grep -l "" "$WORK_DIR"/*.err 2>/dev/null | while read -r f; do log "--- $f"; tail -n 20 "$f" >&2; done
    return 1
  done
}

# stop_pid PID: stops one process this script started and forgets it.
stop_pid() {
  local pid=$1 kept=() p
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  for p in "${STARTED_PIDS[@]}"; do [[ $p == "$pid" ]] || kept+=("$p"); done
  STARTED_PIDS=("${kept[@]}")
}

# need_tool CMD PACKAGE: installs PACKAGE with apt-get when CMD is missing.
need_tool() {
  command -v "$1" >/dev/null 2>&1 && return 0
  log "$1 not found: installing Debian package $2"
  local sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  "${sudo[@]}" apt-get install -y --no-install-recommends "$2" >&2 ||
    { "${sudo[@]}" apt-get update >&2 && "${sudo[@]}" apt-get install -y --no-install-recommends "$2" >&2; } ||
    die "cannot install $2"
  command -v "$1" >/dev/null 2>&1 || [[ -x /usr/sbin/$1 ]] || die "$1 still missing after installing $2"
}

# start_bg VAR LOG CMD...: starts CMD in the background, stdout to LOG, stderr to LOG.err;
# stores its PID in VAR. CMD may start with `taskset -c N` (taskset execs, so the PID is CMD's).
start_bg() {
  local var=$1 out=$2
  shift 2
  "$@" >"$out" 2>"$out.err" &
  local pid=$!
  STARTED_PIDS+=("$pid")
  printf -v "$var" '%s' "$pid"
}

# wait_http URL [SECONDS]: waits until GET URL answers 2xx.
wait_http() {
  local url=$1 deadline=$((SECONDS + ${2:-60}))
  until curl -sf -o /dev/null "$url"; do
    ((SECONDS < deadline)) || { log "$url did not answer within ${2:-60}s"; return 1; }
    sleep 0.1
  done
}

# proxy_config_head: the start of a kvmesh-proxy config for a benchmark: one listener and the
# admin listener on loopback port 0, then `models:` (the caller writes the models next).
proxy_config_head() {
  printf '%s\n' "listeners:" "  - name: main" "    address: 127.0.0.1:0" "admin:" \
    "  address: 127.0.0.1:0" "models:"
}

# start_etcd_nats DIR: starts etcd and nats-server on free loopback ports (data and logs in DIR)
# and waits until both answer; sets ETCD_PID, NATS_PID, ETCD_URL and NATS_URL.
start_etcd_nats() {
  local dir=$1 etcd_port peer_port nats_port deadline=$((SECONDS + 30))
  etcd_port=$(free_port)
  peer_port=$(free_port)
  nats_port=$(free_port)
  start_bg ETCD_PID "$dir/etcd.out" etcd --name bench --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "bench=http://127.0.0.1:$peer_port"
  start_bg NATS_PID "$dir/nats.out" nats-server -a 127.0.0.1 -p "$nats_port"
  ETCD_URL=http://127.0.0.1:$etcd_port
  NATS_URL=nats://127.0.0.1:$nats_port
  wait_http "$ETCD_URL/health" 30
  until (exec 3<>"/dev/tcp/127.0.0.1/$nats_port") 2>/dev/null; do
    ((SECONDS < deadline)) || { log "nats-server did not listen on $nats_port within 30s"; return 1; }
    sleep 0.05
  done
}

# wait_ready LOG PID [SECONDS]: waits for the READY line a server prints once it listens.
wait_ready() {
  local out=$1 pid=$2 deadline=$((SECONDS + ${3:-60}))
  until grep -qx 'READY' "$out" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      log "process $pid exited before READY; its output:"
      cat "$out" "$out.err" >&2 || true
      return 1
    fi
    if ((SECONDS >= deadline)); then
      log "no READY from $pid within ${3:-60}s"
      return 1
    fi
    sleep 0.05
  done
}

# listening LOG [NAME]: the addresses of the LISTENING lines (whose listener name matches the
# regular expression NAME in full), one a line.
listening() {
  awk -v n="^(${2:-.*})\$" '$1 == "LISTENING" && $2 ~ n { print $3 }' "$1"
}

# free_port: a TCP port on 127.0.0.1 nothing listens on (for servers that cannot bind port 0).
free_port() {
  local port
  for ((port = 18080 + RANDOM % 2000; port < 65000; port += 7)); do
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return 0
    fi
  done
  return 1
}

# children PID: the PIDs whose parent is PID.
children() {
  local parent=$1 stat line fields pid
  for stat in /proc/[0-9]*/stat; do
    read -r line <"$stat" 2>/dev/null || continue
    read -ra fields <<<"${line##*) }"
    if [[ ${fields[1]} == "$parent" ]]; then
      pid=${stat#/proc/}
      echo "${pid%/stat}"
    fi
  done
}

# cpu_ticks PID...: user + system CPU time of the processes (all their threads), in clock ticks.
cpu_ticks() {
  local pid line fields total=0
  for pid in "$@"; do
    read -r line <"/proc/$pid/stat" || continue
    # Fields after "(comm) ": state ppid ... utime (14th of the line) and stime (15th).
    read -ra fields <<<"${line##*) }"
    total=$((total + fields[11] + fields[12]))
  done
  echo "$total"
}

# rss_kb FIELD PID...: the sum of a /proc/PID/status memory field (VmRSS, VmHWM) in kB.
rss_kb() {
  local field=$1 pid total=0 value
  shift
  for pid in "$@"; do
    value=$(awk -v f="$field:" '$1 == f { print $2 }' "/proc/$pid/status" 2>/dev/null)
    total=$((total + ${value:-0}))
  done
  echo "$total"
}

# us_per_request TICKS REQUESTS: CPU microseconds per request.
us_per_request() {
  awk -v t="$1" -v n="$2" -v hz="$CLK_TCK" 'BEGIN { if (n > 0) printf "%.1f\n", t * 1e6 / hz / n; else print "n/a" }'
}

# machine_lines: markdown bullet lines describing this machine and its load.
machine_lines() {
  local cpu
  cpu=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
  echo "- Machine: \`nproc\` = $(nproc), CPU \`${cpu:-unknown}\`, kernel \`$(uname -r)\`, $(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo) RAM"
  echo "- Load average before the run: \`$(cut -d' ' -f1-3 /proc/loadavg)\` (the 2 cores may be shared with other work)"
}

# replace_section DOC NAME CONTENT_FILE: replaces the text between `<!-- BEGIN NAME -->` and
# `<!-- END NAME -->` in DOC with the file's content (appends the section if it is missing).
replace_section() {
  local doc=$1 name=$2 content=$3
  local begin="<!-- BEGIN $name -->" end="<!-- END $name -->"
  [[ -f $doc ]] || printf '# Benchmarks\n' >"$doc"
  if grep -qxF "$begin" "$doc" && grep -qxF "$end" "$doc"; then
    awk -v b="$begin" -v e="$end" -v f="$content" '
      $0 == b { print; while ((getline l < f) > 0) print l; skip = 1; next }
      $0 == e { skip = 0 }
      !skip { print }' "$doc" >"$doc.tmp"
  else
    { cat "$doc"; printf '\n%s\n' "$begin"; cat "$content"; printf '%s\n' "$end"; } >"$doc.tmp"
  fi
  mv "$doc.tmp" "$doc"
}

# median [DECIMALS]: the median of the numbers on stdin, one a line, with DECIMALS (default 3)
# decimals ("n/a" when there are none).
median() {
  sort -g | awk -v fmt="%.${1:-3}f\n" '{ v[NR] = $1 }
    END {
      if (NR == 0) { print "n/a"; exit }
      m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
      printf fmt, m
    }'
}

# span: "min–max" of the numbers on stdin, rounded to integers.
span() { sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { if (NR) printf "%.0f–%.0f", lo, hi; else print "n/a" }'; }

# json FILE FILTER: one value from a kvmesh-bench JSON report (jq filter; null becomes n/a).
json() { jq -r "($2) // \"n/a\" | if type == \"number\" then (. * 1000 | round / 1000) else . end" "$1"; }
