#!/usr/bin/env bash
# Runs the kvmesh demo: 4 simulated engines in-process behind the proxy on
# 127.0.0.1:8080 (admin on 127.0.0.1:9090). Installs what a fresh machine lacks.
# Extra arguments go to kvmesh-demo (see `kvmesh-demo --help`).
# `--vllm` runs it in front of two real vLLM engines instead (scripts/demo-vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--vllm" ] && exec scripts/demo-vllm.sh
scripts/setup.sh --system-only
exec cargo run --locked --release -p kvmesh-demo -- "$@"
