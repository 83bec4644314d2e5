"""Fixtures for the end-to-end suite: real kvmesh binaries on loopback.

Every server binary prints `LISTENING <name> <addr>` per listener and then
`READY` on stdout once it accepts connections; the fixtures wait for that line
instead of sleeping.
"""

import tempfile
from pathlib import Path

import pytest

from kvmesh_processes import BIN_DIR, ROOT, Proc  # noqa: F401 (the tests import them from here)

MODEL = "sim-model"
ALIAS = "sim"


def proxy_config(backends, extra=""):
    """A proxy config with one model over `backends` (engine base URLs)."""
    lines = [
        "listeners:",
        "  - name: main",
        "    address: 127.0.0.1:0",
        "admin:",
        "  address: 127.0.0.1:0",
        "models:",
        f"  - name: {MODEL}",
        f"    aliases: [{ALIAS}]",
        "    policy: round_robin",
        "    backends:",
    ]
    lines += [f"      - url: {url}" for url in backends]
    return "\n".join(lines) + "\n" + extra


@pytest.fixture(scope="session")
def workdir():
    with tempfile.TemporaryDirectory(prefix="kvmesh-py-e2e-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def engines(workdir):
    proc = Proc(
        "kvmesh-engine-sim",
        ["--engines", "2", "--port", "0", "--model", MODEL, "--no-delay"],
        workdir,
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def proxy(engines, workdir):
    backends = [f"http://{addr}" for name, addr in sorted(engines.listeners.items())]
    cfg = workdir / "proxy.yaml"
    cfg.write_text(proxy_config(backends, "limits:\n  max_body_bytes: 65536\n"))
    proc = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def base_url(proxy):
    return proxy.url("main") + "/v1"
