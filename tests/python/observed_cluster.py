"""A kvmesh cluster whose metrics cover every panel of deploy/grafana/kvmesh.json, and the
traffic that makes them: what the demo runs (simulated engines with the Qwen3 tokenizer and
KV events, a worker-agent beside each, the proxy routing with `policy: kv`), with etcd and
NATS as in a real cluster, plus what the demo lacks: a disaggregated model (a prefill engine
and a decode engine behind its agent as inbound sidecar), a TLS listener, and a model on two
engines that the traffic kills mid-stream (migrations).

Used by tests/python/test_dashboard.py and scripts/render-dashboard.py.
"""

import calendar
import json
import os
import socket
import ssl
import subprocess
import time
from pathlib import Path

import httpx

from kvmesh_processes import ROOT, Proc, free_port

TOKENIZER = ROOT / ".cache" / "tokenizers" / "qwen3"
CHAT = "chat-model"
PD = "pd-model"
FLAKY = "flaky-model"
NAMESPACE = "kvmesh"
SERVER_TIMEOUT_S = 30
# Days the TLS listener's certificate is valid (the dashboard shows the days left).
CERT_DAYS = 20
# Instance ids of the chat engines' agents (a forged batch numbers past one's, making a gap).
CHAT_IDS = ("c0ffee0000000001", "c0ffee0000000002")



def wait_until(what, check, timeout):
    """Polls `check` until it returns something true, up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)  # polling state that has no readiness signal, bounded by the deadline


class Server:
    """etcd or nats-server on a free loopback port, killed at the end."""

    def __init__(self, args, log, ready):
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_until(args[0], lambda: self.proc.poll() is None and ready(), SERVER_TIMEOUT_S)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"{args[0]} did not start: {Path(log).read_text(errors='replace')}") from None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def greets(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.settimeout(1)
            return s.recv(5).startswith(b"INFO ")
    except OSError:
        return False


def etcd_healthy(url):
    try:
        return httpx.get(f"{url}/health", timeout=1).json().get("health") == "true"
    except (httpx.HTTPError, ValueError):
        return False


def make_certificate(workdir):
    """A self-signed certificate for 127.0.0.1, valid CERT_DAYS days (openssl)."""
    cert, key = workdir / "listener.pem", workdir / "listener.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
         "-days", str(CERT_DAYS), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


def certificate_not_after(cert):
    """The certificate's notAfter in Unix seconds, as openssl reads it."""
    out = subprocess.run(["openssl", "x509", "-noout", "-enddate", "-in", str(cert)],
                         check=True, capture_output=True, text=True).stdout
    stamp = out.strip().split("=", 1)[1]
    return calendar.timegm(time.strptime(stamp, "%b %d %H:%M:%S %Y GMT"))


def engine_urls(proc):
    return [f"http://{a}" for n, a in sorted(proc.listeners.items()) if n.startswith("engine-")]


class ObservedCluster:
    """etcd, NATS, the engines, their agents and the proxy; `stop()` ends them all."""

    def __init__(self, workdir, speedup=20):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs, self.servers = [], []
        try:
            self._start(speedup)
        except BaseException:
            self.stop()
            raise

    def _start(self, speedup):
        w = self.workdir
        etcd_port, peer_port, nats_port = free_port(), free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        self.servers.append(Server(
            [os.environ.get("KVMESH_ETCD_BIN", "etcd"), "--name", "kvmesh-dash", "--data-dir", str(w / "etcd-data"),
             "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvmesh-dash={peer}", "--log-level", "warn"],
            w / "etcd.log", lambda: etcd_healthy(self.etcd_url)))
        self.nats_port = nats_port
        self.servers.append(Server(
            [os.environ.get("KVMESH_NATS_BIN", "nats-server"), "-a", "127.0.0.1", "-p", str(nats_port)],
            w / "nats.log", lambda: greets(nats_port)))
        self.nats_url = f"nats://127.0.0.1:{nats_port}"
        self.cert, key = make_certificate(w)

        def sim(model, count, *extra):
            return self._proc("kvmesh-engine-sim", [
                "--engines", str(count), "--port", "0", "--model", model, "--block-size", "16",
                "--tokenizer", str(TOKENIZER / "tokenizer.json"), "--enable-prompt-tokens-details",
                "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
                "--speedup-ratio", str(speedup), *extra])

        chat = sim(CHAT, 2)
        prefill = sim(PD, 1, "--role", "prefill")
        decode = sim(PD, 1, "--role", "decode")
        # Real time: a long stream lasts seconds, long enough to kill its engine under it.
        self.flaky = [self._proc("kvmesh-engine-sim", ["--engines", "1", "--port", "0", "--model", FLAKY])
                      for _ in range(2)]
        self.agents = {}
        for i, instance_id in enumerate(CHAT_IDS):
            self.agents[f"chat-{i}"] = self._agent(chat, i, CHAT, "--instance-id", instance_id)
        self.agents["prefill"] = self._agent(prefill, 0, PD, "--role", "prefill")
        self.agents["decode"] = self._agent(decode, 0, PD, "--role", "decode", "--inbound-listen", "127.0.0.1:0",
                                     "--pace-max-inflight-bytes", "4294967296")

        config = w / "proxy.yaml"
        flaky = "".join(f"      - url: {url}\n" for proc in self.flaky for url in engine_urls(proc))
        config.write_text(
            "listeners:\n  - name: main\n    address: 127.0.0.1:0\n"
            f"  - name: secure\n    address: 127.0.0.1:0\n    tls:\n      cert: {self.cert}\n      key: {key}\n"
            "admin:\n  address: 127.0.0.1:0\n"
            "health_check:\n  interval: 1s\n"
            "models:\n"
            f"  - name: {CHAT}\n    policy: kv\n    tokenizer: \"{TOKENIZER}\"\n    kv:\n      block_size: 16\n    backends: []\n"
            f"  - name: {PD}\n    policy: kv\n    tokenizer: \"{TOKENIZER}\"\n    kv:\n      block_size: 16\n"
            "    disaggregation:\n      mode: enforce\n    backends: []\n"
            f"  - name: {FLAKY}\n    policy: round_robin\n    backends:\n{flaky}"
            f"discovery:\n  kind: etcd\n  endpoint: {self.etcd_url}\n  initial_sync_timeout: 5s\n"
            f"events:\n  kind: nats\n  url: {self.nats_url}\n  resync_timeout: 1s\n"
        )
        self.proxy = self._proc("kvmesh-proxy", ["--config", str(config)])
        self.base = self.proxy.url("main")
        self.admin = self.proxy.url("admin")
        wait_until("the four agents' instances in the proxy, fed by KV events", self._settled, 30)

    def _proc(self, binary, args):
        proc = Proc(binary, args, self.workdir)
        self.procs.append(proc)
        return proc

    def _agent(self, engines, index, model, *extra):
        listeners = engines.listeners
        return self._proc("kvmesh-agent", [
            "--engine-url", f"http://{listeners[f'engine-{index}']}", "--model", model,
            "--kv-events-endpoint", f"tcp://{listeners[f'kv-events-{index}']}",
            "--kv-events-replay-endpoint", f"tcp://{listeners[f'kv-replay-{index}']}",
            "--etcd", self.etcd_url, "--nats", self.nats_url, "--listen", "127.0.0.1:0",
            "--drain", "0s", "--load-interval", "250ms", "--health-interval", "1s", *extra])

    def _settled(self):
        health = httpx.get(self.admin + "/health", timeout=5).json()
        text = json.dumps(health)
        sources = self.proxy_metrics()
        fed = all(f'kvmesh_kv_index_source{{mode="events",model="{m}"}} 1' in sources for m in (CHAT, PD))
        return text.count('"healthy": true') + text.count('"healthy":true') >= 6 and fed

    def proxy_metrics(self):
        return httpx.get(self.admin + "/metrics", timeout=10).text

    def agent_metrics(self):
        """Each agent's /metrics text, by name."""
        return {name: httpx.get(f"{agent.url('agent')}/metrics", timeout=10).text for name, agent in self.agents.items()}

    def stop(self):
        for proc in reversed(self.procs):
            proc.stop()
        for server in reversed(self.servers):
            server.stop()
        self.procs, self.servers = [], []


# ---- traffic -----------------------------------------------------------------------------

SYSTEM = "You are kvmesh's test assistant. " + " ".join(f"Rule {i}: answer briefly and exactly." for i in range(40))


def chat_body(model, user, stream=False, max_tokens=12):
    body = {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def drive(cluster, round_no=0):
    """One round of ordinary traffic: chat (shared system prompt: prefix reuse), streams, text
    completions, the disaggregated model, the flaky model (5xx once `break_streams` killed its
    engines), client errors (unknown model, invalid JSON) and a request over TLS. Returns the
    statuses seen, for the caller to check."""
    statuses = []
    with httpx.Client(base_url=cluster.base, timeout=60) as client:
        for i in range(6):
            r = client.post("/v1/chat/completions", json=chat_body(CHAT, f"round {round_no} question {i}"))
            statuses.append(r.status_code)
        for i in range(4):
            with client.stream("POST", "/v1/chat/completions",
                               json=chat_body(CHAT, f"round {round_no} stream {i}", stream=True, max_tokens=24)) as r:
                r.read()
                statuses.append(r.status_code)
        r = client.post("/v1/completions", json={"model": CHAT, "prompt": SYSTEM + f" round {round_no}", "max_tokens": 8})
        statuses.append(r.status_code)
        for i in range(3):
            r = client.post("/v1/chat/completions", json=chat_body(PD, f"round {round_no} disaggregated {i}", stream=i == 0))
            statuses.append(r.status_code)
        flaky = client.post("/v1/chat/completions", json=chat_body(FLAKY, f"round {round_no}", max_tokens=2))
        statuses.append(flaky.status_code)
        statuses.append(client.post("/v1/chat/completions", json=chat_body("no-such-model", "hello")).status_code)
        statuses.append(client.post("/v1/chat/completions", content=b"{not json",
                                    headers={"content-type": "application/json"}).status_code)
    secure = cluster.proxy.listeners["secure"]
    trust = ssl.create_default_context(cafile=str(cluster.cert))
    with httpx.Client(base_url=f"https://{secure}", verify=trust, timeout=60) as tls:
        statuses.append(tls.post("/v1/chat/completions", json=chat_body(CHAT, f"round {round_no} over TLS")).status_code)
    return statuses


def break_streams(cluster):
    """Streams of the flaky model whose engine is killed under them: the first migrates to the
    other engine, the second (on the last engine) has nowhere to go (a migration failure);
    a request after that is answered 503. Returns (first stream's text, second stream's
    last event, the 503's status)."""
    outcomes = []
    urls = {url: proc for proc in cluster.flaky for url in engine_urls(proc)}
    for _ in range(2):
        with httpx.stream("POST", cluster.base + "/v1/chat/completions",
                          json={"model": FLAKY, "messages": [{"role": "user", "content": "a long story"}],
                                "max_tokens": 400, "stream": True}, timeout=120) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            urls.pop(r.headers["x-kvmesh-instance"].rstrip("/")).stop()
            outcomes.append([line[6:] for line in lines if line.startswith("data: ")])
    failed = httpx.post(cluster.base + "/v1/chat/completions",
                        json={"model": FLAKY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                        timeout=60).status_code
    return outcomes[0], outcomes[1], failed


def forge_gap(cluster, instance_id=CHAT_IDS[0]):
    """Publishes, over NATS's text protocol, an empty batch numbered far past what the chat
    agent `instance_id` published: the proxy sees a gap in its numbers and resyncs it."""
    payload = json.dumps({"instance_id": instance_id, "seq": 1_000_000, "events": []}).encode()
    with socket.create_connection(("127.0.0.1", cluster.nats_port), timeout=5) as s:
        s.recv(4096)  # the server's INFO
        s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\n')
        s.sendall(f"PUB {NAMESPACE}.kv.{CHAT} {len(payload)}\r\n".encode() + payload + b"\r\nPING\r\n")
        reply = b""
        while b"PONG" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                raise ConnectionError(f"NATS closed the connection: {reply!r}")
            reply += chunk
