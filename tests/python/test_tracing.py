"""OpenTelemetry tracing end to end: kvmesh-proxy and kvmesh-agent export spans over OTLP/gRPC to
a real receiver built on the official `opentelemetry-proto` package (grpcio), and the engines
(kvmesh-engine-sim, which echoes the `traceparent` it received as `x-sim-traceparent` and keeps
the last ones at `GET /sim/traceparents`) see the same trace.

Every wait has a deadline: spans are awaited on a condition the receiver signals, processes by
their READY line, servers by polling with a deadline.
"""

import json
import os
import socket
import subprocess
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from conftest import MODEL, Proc, proxy_config
from kvmesh_processes import free_port

SPAN_TIMEOUT_S = 20
SERVER_TIMEOUT_S = 30
FLAKY = "flaky-model"
MIGRATING = "migrating-model"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"

SERVER = trace_pb2.Span.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT
INTERNAL = trace_pb2.Span.SPAN_KIND_INTERNAL
PRODUCER = trace_pb2.Span.SPAN_KIND_PRODUCER
ERROR = trace_pb2.Status.STATUS_CODE_ERROR


def value_of(any_value):
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


class Span:
    """One received span, with its resource's service name."""

    def __init__(self, service, span):
        self.service = service
        self.raw = span
        self.name = span.name
        self.kind = span.kind
        self.trace_id = span.trace_id.hex()
        self.span_id = span.span_id.hex()
        self.parent_id = span.parent_span_id.hex()
        self.start = span.start_time_unix_nano
        self.end = span.end_time_unix_nano
        self.attributes = {kv.key: value_of(kv.value) for kv in span.attributes}
        self.error = span.status.code == ERROR

    def __repr__(self):
        return f"<{self.service} {self.name} {self.span_id} parent={self.parent_id} {self.attributes}>"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver keeping every span it is sent."""

    def __init__(self):
        self.spans = []
        self.exports = 0
        self.changed = threading.Condition()

    def Export(self, request, context):
        with self.changed:
            for resource_spans in request.resource_spans:
                resource = {kv.key: value_of(kv.value) for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [Span(resource.get("service.name"), s) for s in scope_spans.spans]
            self.exports += 1
            self.changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, found, what, timeout=SPAN_TIMEOUT_S):
        """Waits until `found(spans)` is truthy; returns it."""
        with self.changed:
            result = self.changed.wait_for(lambda: found(list(self.spans)), timeout)
            spans = list(self.spans)
        assert result, f"no {what} within {timeout}s; received: {spans}"
        return result

    def trace(self, trace_id, count, timeout=SPAN_TIMEOUT_S):
        """The spans of `trace_id`, once at least `count` have arrived."""

        def of_trace(spans):
            mine = [s for s in spans if s.trace_id == trace_id]
            return mine if len(mine) >= count else None

        return self.wait_for(of_trace, f"{count} spans of trace {trace_id}", timeout)


@pytest.fixture(scope="module")
def receiver():
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.endpoint = f"http://127.0.0.1:{port}"
    yield servicer
    server.stop(grace=None)


def engine_urls(proc):
    return [f"http://{addr}" for name, addr in sorted(proc.listeners.items()) if name.startswith("engine-")]


def model_yaml(name, urls):
    return f"  - name: {name}\n    policy: round_robin\n    backends:\n" + "".join(
        f"      - url: {url}\n" for url in urls
    )


def telemetry_yaml(endpoint, ratio=1.0):
    return (
        "telemetry:\n"
        f"  otlp_endpoint: {endpoint}\n"
        f"  sampling_ratio: {ratio}\n"
        "  export_interval: 50ms\n"
        "  export_timeout: 2s\n"
    )


@pytest.fixture(scope="module")
def traced(receiver, workdir):
    """Two fast engines for sim-model; a failing and a fast engine for flaky-model; a real-time
    (slow) engine and a fast one for migrating-model; the proxy tracing everything."""
    fast = Proc("kvmesh-engine-sim", ["--engines", "2", "--port", "0", "--model", MODEL, "--no-delay"], workdir)
    flaky = Proc("kvmesh-engine-sim", ["--engines", "1", "--port", "0", "--model", FLAKY, "--no-delay"], workdir)
    slow = Proc("kvmesh-engine-sim", ["--engines", "1", "--port", "0", "--model", MIGRATING], workdir)
    steady = Proc("kvmesh-engine-sim", ["--engines", "1", "--port", "0", "--model", MIGRATING, "--no-delay"], workdir)
    failing = Proc("kvmesh-engine-sim", ["--engines", "1", "--port", "0", "--model", FLAKY, "--no-delay",
                                         "--fail-status", "503"], workdir)
    extra = (
        model_yaml(FLAKY, engine_urls(failing) + engine_urls(flaky))
        + model_yaml(MIGRATING, engine_urls(slow) + engine_urls(steady))
        + "health_check:\n  enabled: false\n"
        + "grpc:\n  address: 127.0.0.1:0\n"
        + telemetry_yaml(receiver.endpoint)
    )
    cfg = workdir / "traced-proxy.yaml"
    cfg.write_text(proxy_config(engine_urls(fast), extra))
    proxy = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    yield {"proxy": proxy, "fast": fast, "slow": slow}
    proxy.stop()
    for proc in (fast, flaky, slow, steady, failing):
        proc.stop()


def chat(base, model=MODEL, headers=None, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers or {}, timeout=30)


def traceparent(trace_id=CLIENT_TRACE, span_id=CLIENT_SPAN, flags="01"):
    return f"00-{trace_id}-{span_id}-{flags}"


def parse_traceparent(value):
    version, trace_id, span_id, flags = value.split("-")
    assert version == "00" and len(trace_id) == 32 and len(span_id) == 16, value
    return trace_id, span_id, flags


def by_name(spans, name):
    return [s for s in spans if s.name == name]


def one(spans, name):
    found = by_name(spans, name)
    assert len(found) == 1, f"{len(found)} {name} spans in {spans}"
    return found[0]


def fresh_trace_id():
    return os.urandom(16).hex()


def test_a_chat_request_is_one_span_tree_continuing_the_clients_trace(traced, receiver):
    trace_id = fresh_trace_id()
    response = chat(
        traced["proxy"].url("main"),
        headers={"traceparent": traceparent(trace_id), "tracestate": "vendor=abc"},
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    spans = receiver.trace(trace_id, 6)
    root = one(spans, f"chat {MODEL}")
    assert root.kind == SERVER and root.service == "kvmesh-proxy"
    assert root.parent_id == CLIENT_SPAN, "the request's span is a child of the client's"
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.request.model"] == MODEL
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["kvmesh.request_id"] == response.headers["x-request-id"]
    assert root.attributes["kvmesh.instance"] == response.headers["x-kvmesh-instance"]
    assert root.attributes["kvmesh.migrations"] == 0
    assert not root.error
    phases = [one(spans, name) for name in ("admit", "prepare", "queue")]
    attempt = one(spans, "attempt")
    for child in phases + [attempt]:
        assert child.parent_id == root.span_id, child
        assert root.start <= child.start <= child.end <= root.end, child
    starts = [span.start for span in phases + [attempt]]
    assert starts == sorted(starts), "admit, prepare, queue, then the attempt"
    assert attempt.kind == CLIENT
    engine = response.headers["x-kvmesh-instance"].removeprefix("http://")
    host, port = engine.rsplit(":", 1)
    assert attempt.attributes["server.address"] == host
    assert attempt.attributes["server.port"] == int(port)
    assert attempt.attributes["http.response.status_code"] == 200
    relay = one(spans, "relay")
    assert relay.parent_id == attempt.span_id
    assert attempt.start <= relay.start <= relay.end <= attempt.end
    # The engine saw the same trace, its parent being the attempt, the client's state kept.
    seen_trace, seen_parent, seen_flags = parse_traceparent(response.headers["x-sim-traceparent"])
    assert (seen_trace, seen_parent, seen_flags) == (trace_id, attempt.span_id, "01")
    assert response.headers["x-sim-tracestate"] == "vendor=abc"


def test_a_stream_reports_its_tokens(traced, receiver):
    trace_id = fresh_trace_id()
    with httpx.stream(
        "POST",
        traced["proxy"].url("main") + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={"traceparent": traceparent(trace_id)},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    root = one(receiver.trace(trace_id, 6), f"chat {MODEL}")
    assert root.attributes["kvmesh.stream"] is True
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 12
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]


def test_a_new_trace_starts_when_the_client_sends_none(traced, receiver):
    response = chat(traced["proxy"].url("main"))
    assert response.status_code == 200
    trace_id, parent, flags = parse_traceparent(response.headers["x-sim-traceparent"])
    assert flags == "01"
    spans = receiver.trace(trace_id, 6)
    root = one(spans, f"chat {MODEL}")
    assert root.parent_id == "", "a root span"
    assert one(spans, "attempt").span_id == parent


def test_an_invalid_traceparent_starts_a_new_trace(traced, receiver):
    invalid = traceparent(trace_id="0" * 32)
    response = chat(traced["proxy"].url("main"), headers={"traceparent": invalid})
    assert response.status_code == 200
    trace_id, _, _ = parse_traceparent(response.headers["x-sim-traceparent"])
    assert trace_id != "0" * 32
    assert one(receiver.trace(trace_id, 6), f"chat {MODEL}").parent_id == ""


def test_an_unsampled_client_trace_is_propagated_but_not_recorded(traced, receiver):
    unsampled = fresh_trace_id()
    response = chat(traced["proxy"].url("main"), headers={"traceparent": traceparent(unsampled, flags="00")})
    assert response.status_code == 200
    seen_trace, _, seen_flags = parse_traceparent(response.headers["x-sim-traceparent"])
    assert (seen_trace, seen_flags) == (unsampled, "00")
    # Spans leave in the order they end: once a later sampled request's spans are here, the
    # unsampled one's would be too.
    later = fresh_trace_id()
    assert chat(traced["proxy"].url("main"), headers={"traceparent": traceparent(later)}).status_code == 200
    receiver.trace(later, 6)
    with receiver.changed:
        assert not [s for s in receiver.spans if s.trace_id == unsampled]


def test_each_attempt_is_a_span_with_its_engine_and_status(traced, receiver):
    # Round robin over [503 engine, good engine]: of two requests, at least one tries the
    # failing one first and is retried on the other.
    trace_ids = [fresh_trace_id() for _ in range(2)]
    for trace_id in trace_ids:
        response = chat(traced["proxy"].url("main"), model=FLAKY, headers={"traceparent": traceparent(trace_id)})
        assert response.status_code == 200, response.text
    traces = [receiver.trace(t, 6) for t in trace_ids]
    retried = [spans for spans in traces if len(by_name(spans, "attempt")) == 2]
    assert retried, f"neither request was retried: {traces}"
    spans = receiver.trace(retried[0][0].trace_id, 7)
    first, second = sorted(by_name(spans, "attempt"), key=lambda s: s.start)
    root = one(spans, f"chat {FLAKY}")
    assert first.parent_id == second.parent_id == root.span_id
    assert first.attributes["http.response.status_code"] == 503 and first.error
    assert first.attributes["kvmesh.attempt"] == 1 and second.attributes["kvmesh.attempt"] == 2
    assert first.attributes["server.port"] != second.attributes["server.port"]
    assert second.attributes["http.response.status_code"] == 200 and not second.error
    assert one(spans, "relay").parent_id == second.span_id
    assert root.attributes["http.response.status_code"] == 200 and not root.error


def test_a_migrated_stream_shows_its_migration(traced, receiver):
    """The stream starts on the real-time engine, which is killed mid-stream: the stream
    continues on the other engine, and the trace shows both attempts and the migration."""
    base = traced["proxy"].url("main")
    for _ in range(2):  # round robin: one of two streams starts on the slow engine
        trace_id = fresh_trace_id()
        with httpx.stream(
            "POST",
            base + "/v1/chat/completions",
            json={
                "model": MIGRATING,
                "messages": [{"role": "user", "content": "tell a long story"}],
                "max_tokens": 200,
                "stream": True,
            },
            headers={"traceparent": traceparent(trace_id)},
            timeout=60,
        ) as response:
            assert response.status_code == 200
            slow = [f"http://{a}" for a in traced["slow"].listeners.values()]
            if response.headers["x-kvmesh-instance"] not in slow:
                continue
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert first != "data: [DONE]"
            traced["slow"].stop()
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        break
    else:
        pytest.fail("no stream started on the slow engine")
    spans = receiver.trace(trace_id, 9)
    root = one(spans, f"chat {MIGRATING}")
    assert root.attributes["kvmesh.migrations"] == 1
    first, second = sorted(by_name(spans, "attempt"), key=lambda s: s.start)
    assert first.error and not second.error
    migration = one(spans, "migration")
    assert migration.parent_id == root.span_id
    assert migration.attributes["kvmesh.migration.reason"] in ("reset", "timeout")
    first_relay, second_relay = sorted(by_name(spans, "relay"), key=lambda s: s.start)
    assert (first_relay.parent_id, second_relay.parent_id) == (first.span_id, second.span_id)
    assert first_relay.error
    assert first_relay.end <= migration.start <= second.start <= migration.end <= second_relay.start + 1


def test_the_kserve_grpc_path_continues_the_metadata_trace(traced, receiver):
    trace_id = fresh_trace_id()
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello over grpc"], dtype=np.object_))
    with grpcclient.InferenceServerClient(url=traced["proxy"].listeners["grpc"]) as client:
        result = client.infer(MODEL, [text], headers={"traceparent": traceparent(trace_id)})
    assert result.as_numpy("text_output")[0]
    spans = receiver.trace(trace_id, 6)
    root = one(spans, f"text_completion {MODEL}")
    assert root.parent_id == CLIENT_SPAN
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    attempt = one(spans, "attempt")
    seen = []
    for url in engine_urls(traced["fast"]):
        seen += httpx.get(f"{url}/sim/traceparents", timeout=10).json()["traceparents"]
    assert traceparent(trace_id, attempt.span_id) in seen, "the engine saw the attempt as parent"


def test_an_unreachable_receiver_fails_no_request(workdir, engines):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    cfg = workdir / "unreachable-otlp.yaml"
    cfg.write_text(proxy_config(engine_urls(engines), telemetry_yaml(f"http://127.0.0.1:{closed}")))
    proxy = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    try:
        for _ in range(5):
            response = chat(proxy.url("main"))
            assert response.status_code == 200, response.text
            assert "x-sim-traceparent" in response.headers
        deadline = time.monotonic() + SPAN_TIMEOUT_S
        dropped = 0.0
        while dropped < 5 * 6 and time.monotonic() < deadline:
            metrics = httpx.get(proxy.url("admin") + "/metrics", timeout=10).text
            dropped = sum(
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith('kvmesh_trace_spans_dropped_total{reason="export_failed"}')
            )
            if dropped < 5 * 6:
                time.sleep(0.1)  # polling a counter, bounded by the deadline
        assert dropped >= 5 * 6, f"dropped spans counted: {dropped}"
    finally:
        proxy.stop()


def test_tracing_off_adds_no_trace_context_and_passes_the_clients_through(base_url):
    base = base_url.removesuffix("/v1")
    response = chat(base)
    assert response.status_code == 200
    assert "x-sim-traceparent" not in response.headers, "no traceparent added while tracing is off"
    theirs = traceparent(fresh_trace_id())
    response = chat(base, headers={"traceparent": theirs, "tracestate": "k=v"})
    assert response.headers["x-sim-traceparent"] == theirs, "passed through unchanged"
    assert response.headers["x-sim-tracestate"] == "k=v"


# ---- the agent -------------------------------------------------------------------------------



class Server:
    """etcd or nats-server on a free loopback port, killed at the end."""

    def __init__(self, args, log, ready):
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + SERVER_TIMEOUT_S
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{args[0]} did not start: {Path(log).read_text(errors='replace')}")
            time.sleep(0.05)  # polling a starting server, bounded by the deadline

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def greets(port, prefix):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.settimeout(1)
            return s.recv(5).startswith(prefix)
    except OSError:
        return False


def etcd_healthy(url):
    try:
        return httpx.get(f"{url}/health", timeout=1).json().get("health") == "true"
    except (httpx.HTTPError, ValueError):
        return False


@pytest.fixture(scope="module")
def control_plane(workdir):
    client, peer, nats = free_port(), free_port(), free_port()
    etcd_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    etcd = Server(
        [
            os.environ.get("KVMESH_ETCD_BIN", "etcd"),
            "--name", "kvmesh-py", "--data-dir", str(workdir / "etcd-data"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"kvmesh-py={peer_url}", "--log-level", "warn",
        ],
        workdir / "etcd.log",
        lambda: etcd_healthy(etcd_url),
    )
    nats_server = Server(
        [os.environ.get("KVMESH_NATS_BIN", "nats-server"), "-a", "127.0.0.1", "-p", str(nats)],
        workdir / "nats.log",
        lambda: greets(nats, b"INFO "),
    )
    yield {"etcd": etcd_url, "nats": f"nats://127.0.0.1:{nats}"}
    nats_server.stop()
    etcd.stop()


def test_the_agent_exports_registration_and_event_batch_spans(receiver, control_plane, workdir):
    sim = Proc(
        "kvmesh-engine-sim",
        ["--engines", "1", "--port", "0", "--model", MODEL, "--no-delay", "--block-size", "16",
         "--kv-events-endpoint", "tcp://127.0.0.1:0"],
        workdir,
    )
    agent = None
    try:
        agent = Proc(
            "kvmesh-agent",
            ["--engine-url", f"http://{sim.listeners['engine-0']}", "--model", MODEL,
             "--kv-events-endpoint", f"tcp://{sim.listeners['kv-events-0']}",
             "--etcd", control_plane["etcd"], "--nats", control_plane["nats"],
             "--drain", "0s", "--otlp-endpoint", receiver.endpoint],
            workdir,
        )
        register = receiver.wait_for(
            lambda spans: [s for s in spans if s.service == "kvmesh-agent" and s.name == "register"],
            "agent register span",
        )[0]
        assert register.kind == CLIENT and not register.error
        assert register.attributes["kvmesh.instance_state"] in ("ready", "not_ready")
        # A prompt of several blocks: the engine stores them and publishes KV events.
        prompt = " ".join(f"word{i}" for i in range(200))
        response = httpx.post(
            f"http://{sim.listeners['engine-0']}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
            timeout=30,
        )
        assert response.status_code == 200

        def published(spans):
            agent_spans = [s for s in spans if s.service == "kvmesh-agent"]
            translations = {s.span_id: s for s in agent_spans if s.name == "translate kv events"}
            return [
                (translations[s.parent_id], s)
                for s in agent_spans
                if s.name == "publish kv events" and s.parent_id in translations
            ]

        translate, publish = receiver.wait_for(published, "a translated and published batch")[0]
        assert translate.trace_id == publish.trace_id
        assert translate.attributes["kvmesh.kv_events"] > 0
        assert publish.kind == PRODUCER and not publish.error
        assert publish.attributes["messaging.system"] == "nats"
        assert publish.attributes["messaging.destination.name"].endswith(f".kv.{MODEL}")
    finally:
        if agent is not None:
            agent.stop()
        sim.stop()
