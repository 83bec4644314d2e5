#!/usr/bin/env bash
# Runs the kvmesh demo: 4 simulated engines in-process behind the proxy on
# 127.0.0.1:8080 (admin on 127.0.0.1:9090). Installs what a fresh machine lacks.
# Extra arguments go to kvmesh-demo (see `kvmesh-demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --system-only
exec cargo run --locked --release -p kvmesh-demo -- "$@"
