"""Launching the project's binaries for the end-to-end suites (tests/python and
tests/real_engines): every server binary prints `LISTENING <name> <addr>` per listener and
then `READY` on stdout once it accepts connections; the launcher waits for that line
instead of sleeping."""

import os
import random
import socket
import subprocess
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("KVMESH_BIN_DIR", ROOT / "target" / "debug"))
READY_TIMEOUT_S = 60
# engine-sim's block size follows GPU vLLM (16); these suites were written against its old
# default, 64, and pin it wherever a test does not name one.
SIM_BLOCK_SIZE = "64"

# Ports handed out so far by `free_port` (none twice in one process).
_PORTS_GIVEN = set()


def free_port():
    """A loopback port free now, below the kernel's ephemeral range, for a server this
    process starts (etcd, nats-server, an engine, a receiver). A port the kernel hands to
    `bind(("127.0.0.1", 0))` lies in that range, where any outgoing connection draws its
    local port: between the draw and the server's bind, one can take it (an engine's
    worker once took another engine's side-channel port that way, and an etcd member
    found its port in use)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first_ephemeral = int(f.read().split()[0])
    draw = random.SystemRandom()
    while True:
        if first_ephemeral <= 10_000:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        else:
            port = draw.randrange(10_000, first_ephemeral)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port


class Proc:
    """A project binary that prints `LISTENING <name> <addr>` lines and `READY`."""

    def __init__(self, binary, args, log_dir, env=None):
        path = BIN_DIR / binary
        if binary == "kvmesh-engine-sim" and "--block-size" not in args:
            args = ["--block-size", SIM_BLOCK_SIZE, *args]
        if not path.exists():
            raise RuntimeError(f"{path} missing: run `cargo build --workspace --bins` first")
        self.name = binary
        self.log_path = Path(log_dir) / f"{binary}-{id(self)}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(path), *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info"), **(env or {})},
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
            raise RuntimeError(f"{binary} failed to start: {self.log_path.read_text(errors='replace')[-4000:]}")

    def url(self, name):
        return f"http://{self.listeners[name]}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()
