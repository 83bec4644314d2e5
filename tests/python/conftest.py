"""Fixtures for the end-to-end suite: real kvmesh binaries on loopback.

Every server binary prints `LISTENING <name> <addr>` per listener and then
`READY` on stdout once it accepts connections; the fixtures wait for that line
instead of sleeping.
"""

import os
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("KVMESH_BIN_DIR", ROOT / "target" / "debug"))
READY_TIMEOUT_S = 60
MODEL = "sim-model"
ALIAS = "sim"


class Proc:
    """A running project binary with its announced listeners."""

    def __init__(self, binary, args, log_dir):
        path = BIN_DIR / binary
        if not path.exists():
            raise RuntimeError(f"{path} missing: run `cargo build --workspace --bins` first")
        self.log_path = Path(log_dir) / f"{binary}-{os.getpid()}-{id(self)}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(path), *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")},
        )
        self.listeners = {}
        ready = threading.Event()

        def read():
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line == "READY":
                    ready.set()
                elif line.startswith("LISTENING "):
                    _, name, addr = line.split()[:3]
                    self.listeners[name] = addr
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(READY_TIMEOUT_S) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"{binary} failed to start: {self.log_path.read_text(errors='replace')}")

    def url(self, name):
        return f"http://{self.listeners[name]}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


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
