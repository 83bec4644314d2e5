#!/usr/bin/env bash
# Disaggregation under load, and what the worker-agent's KV-transfer pacer does to it: the
# conversation trace through kvmesh-proxy in front of the same number of simulated engines
# (kvmesh-engine-sim with the timing model and the link model), fresh for every lane:
#   agg          every engine `--role both`, the model aggregated
#   pd-unpaced   half the engines `--role prefill`, half `--role decode`, `mode: enforce`;
#                the decode engines' agents forward decode legs as they come
#                (`--pace-max-inflight-bytes 0`)
#   pd-paced     the same, the decode engines' agents pacing decode legs (their defaults:
#                4 GiB in flight (--pace-max-inflight-bytes), held until the first token or bytes / rate, smallest
#                first, 250 ms age bound; rate = the link's)
# Every engine has its kvmesh-agent in front as its inbound sidecar (etcd discovery, NATS
# events), so every lane crosses the same hops. The PD lanes run once per interference model
# of the engines (`--kv-transfer-interference-scaling`): `any` (a transfer slows the decode
# iterations by the factor however many run) and `per-transfer` (by the factor per transfer
# in flight). Writes the `pacing` section of docs/BENCHMARKS.md.
#
# Usage: benches/pacing.sh [options]
#   --trace FILE          Mooncake JSONL trace (default: the committed 200-request slice,
#                         benches/data/conversation_trace_head200.jsonl)
#   --slice-requests N    replay the first N requests of the trace (default 2000)
#   --arrival-speedup A   replay the trace A times faster than recorded, in engine time (default 4)
#   --speedup S           engine-sim --speedup-ratio (default 4); latencies in the doc are
#                         wall time × S
#   --engines N           simulated engines, even (default 8: 4 prefill + 4 decode)
#   --link-gbps G         each engine's inbound KV link, GB/s of engine time (default 50,
#                         a 400 Gb/s NIC); the sims get G × S of wall time, the pacer the same
#   --interference F      --kv-transfer-interference of the engines (default 0.3)
#   --scalings LIST       interference models, comma-separated (default any,per-transfer)
#   --pace-max-inflight-bytes B  the paced agents' budget of bytes in flight (default 4 GiB)
#   --pace-hold-factor F  the paced agents' --pace-hold-factor (default: theirs)
#   --lanes LIST          subset of agg,pd-unpaced,pd-paced (default all)
#   --no-build            use the binaries already in --bin-dir
#   --bin-dir DIR         where the binaries are (default target/release)
#   --doc FILE            document to update (default docs/BENCHMARKS.md)
#   --keep                keep the work directory (configs, logs, JSON reports)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TRACE=$BENCH_ROOT/benches/data/conversation_trace_head200.jsonl
SLICE_REQUESTS=2000
ARRIVAL_SPEEDUP=4
SPEEDUP=4
ENGINES=8
LINK_GBPS=50
INTERFERENCE=0.3
SCALINGS=any,per-transfer
PACE_INFLIGHT=$((4 << 30))
PACE_HOLD=
LANES=agg,pd-unpaced,pd-paced
MODEL=sim-model

while (($#)); do
  case $1 in
    --trace) TRACE=$(realpath "$2"); shift 2 ;;
    --slice-requests) SLICE_REQUESTS=$2; shift 2 ;;
    --arrival-speedup) ARRIVAL_SPEEDUP=$2; shift 2 ;;
    --speedup) SPEEDUP=$2; shift 2 ;;
    --engines) ENGINES=$2; shift 2 ;;
    --link-gbps) LINK_GBPS=$2; shift 2 ;;
    --interference) INTERFERENCE=$2; shift 2 ;;
    --scalings) SCALINGS=$2; shift 2 ;;
    --pace-max-inflight-bytes) PACE_INFLIGHT=$2; shift 2 ;;
    --pace-hold-factor) PACE_HOLD=$2; shift 2 ;;
    --lanes) LANES=$2; shift 2 ;;
    *) common_option "$@"; shift "$TAKEN" ;;
  esac
done
((ENGINES >= 2 && ENGINES % 2 == 0)) || die "--engines must be even and at least 2"
[[ -f $TRACE ]] || die "no trace at $TRACE"

need_tool jq
need_tool etcd
need_tool nats-server
build_release kvmesh-engine-sim kvmesh-proxy kvmesh-agent kvmesh-bench
SIM=$BIN_DIR/kvmesh-engine-sim
PROXY=$BIN_DIR/kvmesh-proxy
AGENT=$BIN_DIR/kvmesh-agent
BENCH=$BIN_DIR/kvmesh-bench
need_bins "$SIM" "$PROXY" "$AGENT" "$BENCH"

TIME_SCALE=$(awk -v a="$ARRIVAL_SPEEDUP" -v s="$SPEEDUP" 'BEGIN { print a * s }')
WALL_GBPS=$(awk -v g="$LINK_GBPS" -v s="$SPEEDUP" 'BEGIN { print g * s }')
begin_run pacing

# start_sims ROLE COUNT SCALING: COUNT engines of ROLE in one process; appends to SIM_ADDRS,
# EVENT_ADDRS, SIM_ROLES.
start_sims() {
  local role=$1 count=$2 scaling=$3 out=$RUN_DIR/sim-$1.out
  start_bg SIM_PID "$out" "$SIM" --engines "$count" --port 0 --block-size 64 --model "$MODEL" \
    --speedup-ratio "$SPEEDUP" --role "$role" --kv-link-gbps "$WALL_GBPS" \
    --kv-transfer-interference "$INTERFERENCE" --kv-transfer-interference-scaling "$scaling" \
    --kv-events-endpoint tcp://127.0.0.1:0
  wait_ready "$out" "$SIM_PID"
  LANE_PIDS+=("$SIM_PID")
  local addrs events
  mapfile -t addrs < <(listening "$out" 'engine-[0-9]+')
  mapfile -t events < <(listening "$out" 'kv-events-[0-9]+')
  ((${#addrs[@]} == count)) || die "expected $count $role engines, got ${addrs[*]}"
  SIM_ADDRS+=("${addrs[@]}")
  EVENT_ADDRS+=("${events[@]}")
  for _ in "${addrs[@]}"; do SIM_ROLES+=("$role"); done
}

# start_agents PACE: one inbound-sidecar agent per engine; PACE=0 leaves decode legs unpaced.
start_agents() {
  local i pace=(--pace-rate-gbps "$WALL_GBPS")
  pace+=(--pace-max-inflight-bytes "$PACE_INFLIGHT")
  [[ -n $PACE_HOLD ]] && pace+=(--pace-hold-factor "$PACE_HOLD")
  [[ $1 == 0 ]] && pace=(--pace-max-inflight-bytes 0)
  AGENT_PIDS=()
  for i in "${!SIM_ADDRS[@]}"; do
    start_bg AGENT_PID "$RUN_DIR/agent-$i.out" env RUST_LOG=warn "$AGENT" \
      --engine-url "http://${SIM_ADDRS[i]}" --model "$MODEL" --role "${SIM_ROLES[i]}" \
      --kv-events-endpoint "tcp://${EVENT_ADDRS[i]}" --block-size 64 --total-blocks 16384 \
      --nats "$NATS_URL" --etcd "$ETCD_URL" --inbound-listen 127.0.0.1:0 --drain 0s "${pace[@]}"
    wait_ready "$RUN_DIR/agent-$i.out" "$AGENT_PID"
    LANE_PIDS+=("$AGENT_PID")
    AGENT_PIDS+=("$AGENT_PID")
  done
}

# start_proxy DISAGGREGATED: kvmesh-proxy over what etcd lists, waiting until it routes.
start_proxy() {
  local config=$RUN_DIR/kvmesh.yaml
  {
    proxy_config_head
    echo "  - name: $MODEL"
    echo "    policy: kv"
    if [[ $1 == 1 ]]; then
      echo "    disaggregation:"
      echo "      mode: enforce"
      echo "      link_gbps: $LINK_GBPS"
    fi
    echo "    backends: []"
    echo "limits:"
    echo "  first_byte_timeout: 600s"
    echo "  idle_timeout: 600s"
    echo "health_check:"
    echo "  enabled: false"
    echo "discovery:"
    echo "  kind: etcd"
    echo "  endpoint: $ETCD_URL"
    echo "events:"
    echo "  kind: nats"
    echo "  url: $NATS_URL"
  } >"$config"
  "$PROXY" --check-config "$config" >/dev/null || die "kvmesh-proxy rejects $config"
  start_bg PROXY_PID "$RUN_DIR/proxy.out" env RUST_LOG=warn "$PROXY" --config "$config"
  wait_ready "$RUN_DIR/proxy.out" "$PROXY_PID"
  LANE_PIDS+=("$PROXY_PID")
  PROXY_URL=http://$(listening "$RUN_DIR/proxy.out" main)
  ADMIN_URL=http://$(listening "$RUN_DIR/proxy.out" admin)
  local deadline=$((SECONDS + 60))
  until [[ $(scrape "$ADMIN_URL" kvmesh_discovery_instances) == "$ENGINES" ]]; do
    ((SECONDS < deadline)) || die "the proxy never listed $ENGINES instances"
    sleep 0.2
  done
}

# scrape URL NAME: the sum of NAME over its label sets at URL/metrics.
scrape() {
  curl -sf "$1/metrics" | awk -v n="$2" '$1 == n || index($1, n "{") == 1 { s += $NF } END { printf "%.6g", s }'
}

agent_sum() { # NAME: summed over the decode engines' agents
  local i total=0 v
  for i in "${!SIM_ADDRS[@]}"; do
    [[ ${SIM_ROLES[i]} == decode ]] || continue
    v=$(scrape "http://$(listening "$RUN_DIR/agent-$i.out" agent)" "$1")
    total=$(awk -v a="$total" -v b="${v:-0}" 'BEGIN { print a + b }')
  done
  echo "$total"
}

# engine_itl Q: the engines' own inter-token latency quantile Q in ms of wall time
# (`kvmesh_sim_inter_token_latency_seconds`, 1 ms buckets, summed over the engines, interpolated):
# the decode iterations' time, without the proxy's or the load generator's scheduling delays.
engine_itl() {
  local addr
  for addr in "${SIM_ADDRS[@]}"; do curl -sf "http://$addr/metrics"; done |
    awk 'index($1, "kvmesh_sim_inter_token_latency_seconds_bucket{") == 1 {
        match($1, /le="[^"]*"/); le = substr($1, RSTART + 4, RLENGTH - 5)
        count[le == "+Inf" ? "inf" : le + 0] += $NF
      }
      END { for (le in count) print le, count[le] }' |
    sort -g | awk -v q="$1" '
      { bound[NR] = $1; cum[NR] = $2 }
      END {
        total = cum[NR]
        if (NR == 0 || total == 0) { print "n/a"; exit }
        want = q * total; lower = 0; below = 0
        for (i = 1; i <= NR; i++) {
          if (cum[i] >= want) {
            if (bound[i] == "inf") { printf ">%.0f", lower * 1000; exit }
            printf "%.2f", (lower + (bound[i] - lower) * (want - below) / (cum[i] - below)) * 1000
            exit
          }
          lower = bound[i]; below = cum[i]
        }
      }'
}

sim_sum() { # NAME: summed over every engine
  local addr total=0 v
  for addr in "${SIM_ADDRS[@]}"; do
    v=$(scrape "http://$addr" "$1")
    total=$(awk -v a="$total" -v b="${v:-0}" 'BEGIN { print a + b }')
  done
  echo "$total"
}

# run_lane LANE SCALING: fresh etcd, NATS, engines, agents and proxy; the trace through them.
run_lane() {
  local lane=$1 scaling=$2 started=$SECONDS half=$((ENGINES / 2))
  RUN_DIR=$WORK_DIR/$lane-$scaling
  mkdir -p "$RUN_DIR"
  log "== $lane ($scaling)"
  LANE_PIDS=() SIM_ADDRS=() EVENT_ADDRS=() SIM_ROLES=()
  start_etcd_nats "$RUN_DIR"
  LANE_PIDS+=("$ETCD_PID" "$NATS_PID")
  if [[ $lane == agg ]]; then
    start_sims both "$ENGINES" "$scaling"
    start_agents 0
    start_proxy 0
  else
    start_sims prefill "$half" "$scaling"
    start_sims decode "$half" "$scaling"
    start_agents "$([[ $lane == pd-paced ]] && echo 1 || echo 0)"
    start_proxy 1
  fi
  local engine_urls
  engine_urls=$(printf 'http://%s,' "${SIM_ADDRS[@]}")
  "$BENCH" --url "$PROXY_URL" --model "$MODEL" --stream --timeout 600s --max-outstanding 4096 \
    --workload trace --trace "$TRACE" --slice-requests "$SLICE_REQUESTS" --time-scale "$TIME_SCALE" \
    --engine-metrics "${engine_urls%,}" --json "$RUN_DIR/report.json" >"$RUN_DIR/report.txt"
  expect_alive "$lane ($scaling)" "${LANE_PIDS[@]}"
  {
    echo "legs_remote=$(scrape "$ADMIN_URL" 'kvmesh_prefill_legs_total{model="'"$MODEL"'",outcome="remote"}')"
    echo "transfers=$(sim_sum kvmesh_sim_kv_transfers_total)"
    echo "transfer_gb=$(awk -v b="$(sim_sum kvmesh_sim_kv_transfer_bytes_total)" 'BEGIN { printf "%.1f", b / 1e9 }')"
    echo "transfer_s=$(sim_sum kvmesh_sim_kv_transfer_seconds_total)"
    echo "waited=$(agent_sum kvmesh_agent_kv_transfer_wait_seconds_count)"
    echo "wait_s=$(agent_sum kvmesh_agent_kv_transfer_wait_seconds_sum)"
    echo "admitted=$(agent_sum kvmesh_agent_kv_transfers_admitted_total)"
    echo "engine_itl_p90=$(engine_itl 0.9)"
    echo "engine_itl_p99=$(engine_itl 0.99)"
  } >"$RUN_DIR/counters"
  sed 's/^/    /' "$RUN_DIR/report.txt" "$RUN_DIR/counters" >&2
  local pid
  for pid in "${LANE_PIDS[@]}"; do stop_pid "$pid"; done
  echo $((SECONDS - started)) >"$RUN_DIR/seconds"
}

has_lane() { [[ ",$LANES," == *",$1,"* ]]; }
IFS=, read -r -a SCALING_LIST <<<"$SCALINGS"
RAN=()
if has_lane agg; then run_lane agg any; RAN+=(agg-any); fi
for scaling in "${SCALING_LIST[@]}"; do
  for lane in pd-unpaced pd-paced; do
    if has_lane "$lane"; then run_lane "$lane" "$scaling"; RAN+=("$lane-$scaling"); fi
  done
done

ms() { jq -r --argjson s "$SPEEDUP" "($2) as \$v | if \$v == null then \"n/a\" else (\$v * \$s | round) end" "$1"; }
counter() { awk -F= -v k="$2" '$1 == k { print $2 }' "$1"; }
engine_ms() { awk -v v="$(counter "$1/counters" "$2")" -v k="$SPEEDUP" 'BEGIN { if (v ~ /^[0-9.]+$/) printf "%.0f", v * k; else print v }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f×", a / b; else print "n/a" }'; }

SECTION=$WORK_DIR/section.md
{
  echo "## KV-transfer pacing under load (\`benches/pacing.sh\`)"
  echo
  echo "Last run: $DATE, command \`$COMMAND\`."
  echo
  echo "$LOAD_BEFORE"
  echo "- Load average after the run: \`$(cut -d' ' -f1-3 /proc/loadavg)\`"
  requests=$(jq -r '.requests_ok + .errors_total' "$WORK_DIR/${RAN[0]}/report.json")
  echo "- Workload: the first $requests requests of \`$(basename "$TRACE")\` (token-id prompts, streamed), $ARRIVAL_SPEEDUP× faster than recorded; $ENGINES \`kvmesh-engine-sim\` engines at \`--speedup-ratio $SPEEDUP\` (times below are engine time: wall × $SPEEDUP), each with a ${LINK_GBPS} GB/s inbound KV link (engine time), Qwen3-8B's KV shape (147 kB per token), \`--kv-transfer-interference $INTERFERENCE\`. Every engine has its \`kvmesh-agent\` in front as its inbound sidecar; kvmesh-proxy routes with \`policy: kv\` (etcd discovery, NATS events), disaggregated lanes with \`mode: enforce\` over $((ENGINES / 2)) prefill and $((ENGINES / 2)) decode engines."
  echo "- *Paced*: the decode engines' agents admit decode legs into $(awk -v b="$PACE_INFLIGHT" 'BEGIN { printf "%g GiB", b / 2^30 }') in flight and a ${LINK_GBPS} GB/s token bucket, each transfer held until its first token or until its bytes at that rate have passed (hold factor ${PACE_HOLD:-1}), smallest first, 250 ms age bound; *unpaced*: \`--pace-max-inflight-bytes 0\`. Interference \`any\`: iterations $INTERFERENCE slower while any transfer runs; \`per-transfer\`: $INTERFERENCE slower per transfer in flight."
  echo
  echo "| lane | interference | ok | errors | output tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | engine ITL p90 / p99 ms | transfers (GB, link s) | paced waits (mean ms) | seconds |"
  echo "|---|---|---:|---:|---:|---|---|---|---|---|---:|"
  for run in "${RAN[@]}"; do
    dir=$WORK_DIR/$run
    report=$dir/report.json
    lane=${run%-*}
    scaling=${run##*-}
    [[ $run == *per-transfer ]] && { lane=${run%-per-transfer}; scaling=per-transfer; }
    [[ $lane == agg ]] && scaling="—"
    waited=$(counter "$dir/counters" waited)
    mean_wait=$(awk -v n="$waited" -v s="$(counter "$dir/counters" wait_s)" -v k="$SPEEDUP" 'BEGIN { if (n > 0) printf "%.1f", s / n * 1000 * k; else print "—" }')
    echo "| $lane | $scaling | $(jq -r .requests_ok "$report") | $(jq -r .errors_total "$report") | $(jq -r --argjson s "$SPEEDUP" '.output_tokens_per_s / $s | round' "$report") | $(ms "$report" .ttft_ms.p50) / $(ms "$report" .ttft_ms.p90) / $(ms "$report" .ttft_ms.p99) | $(ms "$report" .itl_ms.p50) / $(ms "$report" .itl_ms.p90) / $(ms "$report" .itl_ms.p99) | $(engine_ms "$dir" engine_itl_p90) / $(engine_ms "$dir" engine_itl_p99) | $(counter "$dir/counters" transfers) ($(counter "$dir/counters" transfer_gb), $(awk -v s="$(counter "$dir/counters" transfer_s)" -v k="$SPEEDUP" 'BEGIN { printf "%.1f", s * k }')) | $waited ($mean_wait) | $(cat "$dir/seconds") |"
  done
  echo
  echo "Targets (issue 14), paced against unpaced with the same interference model:"
  echo
  for scaling in "${SCALING_LIST[@]}"; do
    off=$WORK_DIR/pd-unpaced-$scaling/report.json
    on=$WORK_DIR/pd-paced-$scaling/report.json
    [[ -f $off && -f $on ]] || continue
    echo "- \`$scaling\`: ITL p99 $(ratio "$(jq .itl_ms.p99 "$on")" "$(jq .itl_ms.p99 "$off")") (target ≤ 0.7×; the engines' own: $(ratio "$(counter "$WORK_DIR/pd-paced-$scaling/counters" engine_itl_p99)" "$(counter "$WORK_DIR/pd-unpaced-$scaling/counters" engine_itl_p99)")), TTFT p90 $(ratio "$(jq .ttft_ms.p90 "$on")" "$(jq .ttft_ms.p90 "$off")") (target ≤ 1.1×), output tokens/s $(ratio "$(jq .output_tokens_per_s "$on")" "$(jq .output_tokens_per_s "$off")")."
  done
} >"$SECTION"

mkdir -p "$(dirname "$DOC")"
replace_section "$DOC" pacing "$SECTION"
log "wrote the pacing section of $DOC"
cat "$SECTION"
