#!/usr/bin/env bash
# Runs every check and test of kvmesh on a fresh machine: installs what is
# missing (scripts/setup.sh), then formatting, clippy, the Rust unit and
# end-to-end tests, the Python end-to-end tests with the real `openai` client, and the
# agent's `cuda` feature.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy"
cargo clippy --locked --workspace --all-targets -- -D warnings

echo "== cargo build (binaries the end-to-end tests start)"
cargo build --locked --workspace --bins

echo "== cargo test"
cargo test --locked --workspace

echo "== pytest (openai client against real processes)"
KVMESH_BIN_DIR="$PWD/target/debug" .venv/bin/python -m pytest -q tests/python

# Last: its test builds target/debug/kvmesh-agent with the feature, which the Python tests
# above start without it. Without a GPU or driver these assert the clean fallback; with
# KVMESH_EXPECT_GPU=1 on a GPU machine, the measurements (docs/agent.md).
echo "== the agent's cuda feature (cudarc loads the driver at run time: no GPU needed here)"
cargo clippy --locked -p kvmesh-agent --features cuda --all-targets -- -D warnings
cargo test --locked -p kvmesh-agent --features cuda --lib gpu --test gpu
