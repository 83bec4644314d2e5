"""`GET /openapi.json` against real responses, so the document cannot drift.

Every request below goes through a real kvmesh-proxy to real kvmesh-engine-sim
engines (or to a closed port, for 502/503). Each response is checked against
the document the proxy serves: its status must be documented for that path and
method, the headers the document marks as always present must be there, and the
body must validate (JSON Schema 2020-12) against the documented schema — for
SSE streams, every event's JSON against `x-kvmesh-event-schema`. A last test
checks that every documented operation answered 200 and every documented
status was seen.
"""

import hashlib
import json
import socket
import time

import httpx
import jsonschema
import pytest

from conftest import ALIAS, MODEL, ROOT, Proc, proxy_config

SPEC_FILE = ROOT / "proxy" / "src" / "openai" / "openapi" / "openapi.json"
CLIENT_HEADER_TIMEOUT_S = 2
FIRST_BYTE_TIMEOUT_S = 1
DEAD_MODEL = "dead-model"
OTHER_MODEL = "other-model"
LIMITED_KEY = "sk-kvmesh-limited"
RESTRICTED_KEY = "sk-kvmesh-restricted"

# (path, method, status) seen with a validated response.
SEEN = set()


class Spec:
    """The served OpenAPI document, with lookups and JSON Schema validation."""

    def __init__(self, doc):
        self.doc = doc
        self.components = doc["components"]

    def resolve(self, node):
        while isinstance(node, dict) and "$ref" in node and len(node) == 1:
            node = self.pointer(node["$ref"])
        return node

    def pointer(self, ref):
        assert ref.startswith("#/"), ref
        node = self.doc
        for key in ref[2:].split("/"):
            node = node[key.replace("~1", "/").replace("~0", "~")]
        return node

    def operation(self, path, method):
        assert path in self.doc["paths"], f"{path} is not documented"
        op = self.doc["paths"][path].get(method.lower())
        assert op is not None, f"{method} {path} is not documented"
        return op

    def response(self, path, method, status, allow_default=False):
        responses = self.operation(path, method)["responses"]
        key = str(status)
        if key not in responses:
            assert allow_default and "default" in responses, f"{method} {path}: status {status} is not documented"
            key = "default"
        return key, self.resolve(responses[key])

    def validate(self, schema, instance):
        wrapper = dict(schema)
        wrapper["components"] = self.components
        jsonschema.Draft202012Validator(wrapper).validate(instance)


def parse_sse(text):
    """[(event name or None, data)] of a `text/event-stream` body."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:") :].lstrip())
        assert data, f"SSE event without data: {block!r}"
        events.append((name, "\n".join(data)))
    return events


def check(spec, path, method, status, headers, body, allow_default=False):
    """Validates one response against the document; returns the parsed body."""
    key, response = spec.response(path, method, status, allow_default)
    lower = {k.lower(): v for k, v in headers.items()}
    for name, header in response.get("headers", {}).items():
        header = spec.resolve(header)
        if header.get("required"):
            assert name.lower() in lower, f"{method} {path} {status}: header {name} missing"
            spec.validate(header["schema"], int(lower[name.lower()]) if header["schema"].get("type") == "integer" else lower[name.lower()])
    content_type = lower.get("content-type", "").split(";")[0].strip()
    media = response["content"].get(content_type)
    assert media is not None, f"{method} {path} {status}: content type {content_type!r} is not documented"
    if content_type == "application/json":
        parsed = json.loads(body)
        spec.validate(media["schema"], parsed)
    elif content_type == "text/event-stream":
        parsed = parse_sse(body.decode())
        event_schema = media["x-kvmesh-event-schema"]
        for name, data in parsed:
            if data == "[DONE]":
                continue
            event = json.loads(data)
            spec.validate(event_schema, event)
            if name is not None:
                assert event.get("type") == name, f"event {name} carries type {event.get('type')}"
    else:
        parsed = body.decode()
        spec.validate(media["schema"], parsed)
    SEEN.add((path, method.lower(), key))
    return parsed


def raw_exchange(address, request, timeout_s):
    """Writes `request` on a new connection and reads until the server closes it: (status, headers, body)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(request)
        raw = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    return int(lines[0].split()[1]), dict(line.split(": ", 1) for line in lines[1:]), body


def closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def api(engines, workdir):
    """A proxy with short timeouts and no ejection, in front of the engines."""
    backends = [f"http://{addr}" for name, addr in sorted(engines.listeners.items()) if name.startswith("engine-")]
    extra = (
        "limits:\n"
        "  max_body_bytes: 65536\n"
        f"  first_byte_timeout: {FIRST_BYTE_TIMEOUT_S}s\n"
        f"  client_header_timeout: {CLIENT_HEADER_TIMEOUT_S}s\n"
        "outlier_detection:\n"
        "  consecutive_failures: 0\n"
    )
    cfg = workdir / "openapi-proxy.yaml"
    cfg.write_text(proxy_config(backends, extra))
    proc = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def dead(workdir):
    """A proxy whose only model's engine is a closed port: 502, then 503 once ejected."""
    cfg = workdir / "openapi-dead.yaml"
    cfg.write_text(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\n"
        "admin:\n  address: 127.0.0.1:0\n"
        f"models:\n  - name: {DEAD_MODEL}\n    backends:\n      - url: http://127.0.0.1:{closed_port()}\n"
        "limits:\n  retries: 0\n"
        "health_check:\n  enabled: false\n"
        "outlier_detection:\n  consecutive_failures: 1\n  base_ejection_time: 60s\n  max_ejection_time: 120s\n"
    )
    proc = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def authed(engines, workdir):
    """A proxy with API keys: one for sim-model at most one request per 100 s, one for another model only."""
    backends = [f"http://{addr}" for name, addr in sorted(engines.listeners.items()) if name.startswith("engine-")]
    digest = lambda key: hashlib.sha256(key.encode()).hexdigest()
    extra = (
        f"  - name: {OTHER_MODEL}\n    backends:\n      - url: http://127.0.0.1:{closed_port()}\n"
        "auth:\n  keys:\n"
        f"    - name: limited\n      sha256: {digest(LIMITED_KEY)}\n      models: [{MODEL}]\n      requests_per_second: 0.01\n"
        f"    - name: restricted\n      sha256: {digest(RESTRICTED_KEY)}\n      models: [{OTHER_MODEL}]\n"
    )
    cfg = workdir / "openapi-authed.yaml"
    cfg.write_text(proxy_config(backends, extra))
    proc = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def spec(api):
    resp = httpx.get(api.url("main") + "/openapi.json")
    assert resp.status_code == 200
    doc = resp.json()
    s = Spec(doc)
    check(s, "/openapi.json", "GET", 200, resp.headers, resp.content)
    return s


def send(spec, base, path, method="POST", body=None, headers=None, allow_default=False, stream=False):
    """Sends one request, checks the response against the document, returns (response, parsed body)."""
    if body is not None and isinstance(body, dict) and method == "POST" and path in spec.doc["paths"]:
        request_schema = spec.operation(path, method)["requestBody"]["content"]["application/json"]["schema"]
        spec.validate(request_schema, body)
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"content-type": "application/json", **(headers or {})}
    with httpx.Client(timeout=30) as client:
        resp = client.request(method, base + path, content=content, headers=hdrs)
    parsed = check(spec, path, method, resp.status_code, resp.headers, resp.content, allow_default)
    if stream:
        assert resp.headers["content-type"].startswith("text/event-stream")
    return resp, parsed


def chat(stream=False, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Describe the mesh."}], "max_tokens": 5, "stream": stream, **extra}


def test_served_document_is_the_committed_one(api, spec):
    assert spec.doc == json.loads(SPEC_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema({"components": spec.components})
    for name, schema in spec.components["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_request_examples_match_their_schemas(spec):
    for path, item in spec.doc["paths"].items():
        for method, op in item.items():
            body = op.get("requestBody")
            if body:
                media = body["content"]["application/json"]
                spec.validate(media["schema"], media["example"])


def test_docs_page(api, spec):
    resp = httpx.get(api.url("main") + "/docs")
    assert resp.status_code == 200
    page = check(spec, "/docs", "GET", 200, resp.headers, resp.content)
    assert "openapi.json" in page and "<script>" in page


def test_models(api, spec):
    resp = httpx.get(api.url("main") + "/v1/models")
    models = check(spec, "/v1/models", "GET", 200, resp.headers, resp.content)
    assert {MODEL, ALIAS} <= {m["id"] for m in models["data"]}


def test_chat(api, spec):
    resp, body = send(spec, api.url("main"), "/v1/chat/completions", body=chat())
    assert resp.status_code == 200 and body["choices"][0]["message"]["content"]
    resp, events = send(spec, api.url("main"), "/v1/chat/completions", body=chat(True, stream_options={"include_usage": True}), stream=True)
    assert events[-1][1] == "[DONE]"
    assert json.loads(events[-2][1])["usage"]["completion_tokens"] == 5


def test_chat_by_alias(api, spec):
    resp, body = send(spec, api.url("main"), "/v1/chat/completions", body={**chat(), "model": ALIAS})
    assert body["model"] == MODEL


def test_completions(api, spec):
    body = {"model": MODEL, "prompt": list(range(100, 140)), "max_tokens": 4}
    resp, parsed = send(spec, api.url("main"), "/v1/completions", body=body)
    assert parsed["usage"]["prompt_tokens"] == 40
    resp, events = send(spec, api.url("main"), "/v1/completions", body={**body, "prompt": "Once upon", "stream": True}, stream=True)
    assert events[-1][1] == "[DONE]" and len(events) > 2


def test_embeddings(api, spec):
    resp, parsed = send(spec, api.url("main"), "/v1/embeddings", body={"model": MODEL, "input": ["kv", "mesh"]})
    assert len(parsed["data"]) == 2
    resp, parsed = send(spec, api.url("main"), "/v1/embeddings", body={"model": MODEL, "input": "kv", "encoding_format": "base64"})
    assert isinstance(parsed["data"][0]["embedding"], str)


def test_responses(api, spec):
    body = {"model": MODEL, "input": "Hello mesh", "instructions": "Be brief.", "max_output_tokens": 6}
    resp, parsed = send(spec, api.url("main"), "/v1/responses", body=body)
    assert parsed["status"] == "completed" and parsed["usage"]["output_tokens"] == 6
    resp, events = send(spec, api.url("main"), "/v1/responses", body={**body, "stream": True}, stream=True)
    names = [name for name, _ in events]
    assert names[0] == "response.created" and names[-1] == "response.completed"


@pytest.mark.parametrize(
    "body, code",
    [
        (b"{not json", "invalid_json"),
        ({"model": 5, "messages": []}, "invalid_body"),
        ({"messages": [{"role": "user", "content": "x"}]}, "missing_model"),
    ],
)
def test_proxy_400s(api, spec, body, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp, parsed = send(spec, api.url("main"), "/v1/chat/completions", body=content)
    assert resp.status_code == 400 and parsed["error"]["code"] == code
    assert "x-kvmesh-instance" not in resp.headers


def test_engine_400_is_relayed(api, spec):
    resp, parsed = send(spec, api.url("main"), "/v1/completions", body=b'{"model":"sim-model","max_tokens":2}')
    assert resp.status_code == 400 and "x-kvmesh-instance" in resp.headers


def test_engine_error_status_is_relayed(api, spec):
    resp, parsed = send(spec, api.url("main"), "/v1/embeddings", body={"model": MODEL, "input": "x"}, headers={"x-sim-status": "500"}, allow_default=True)
    assert resp.status_code == 500 and resp.headers["x-kvmesh-instance"]


def test_unknown_model_is_404(api, spec):
    resp, parsed = send(spec, api.url("main"), "/v1/responses", body={"model": "nope", "input": "x"})
    assert resp.status_code == 404 and parsed["error"]["code"] == "model_not_found"


def test_unknown_path_is_404_in_the_documented_shape(api, spec):
    assert "/v1/nope" not in spec.doc["paths"]
    resp = httpx.post(api.url("main") + "/v1/nope", json={"model": MODEL})
    assert resp.status_code == 404
    unknown = spec.resolve(spec.components["responses"]["UnknownPath"])
    spec.validate(unknown["content"]["application/json"]["schema"], resp.json())
    assert resp.json()["error"]["code"] == "unknown_url" and resp.headers["x-request-id"]


def test_every_documented_path_rejects_other_methods(api, spec):
    for path, item in spec.doc["paths"].items():
        documented = {m.upper() for m in item}
        wrong = "GET" if "GET" not in documented else "DELETE"
        with httpx.Client() as client:
            resp = client.request(wrong, api.url("main") + path)
        check(spec, path, sorted(documented)[0], resp.status_code, resp.headers, resp.content)
        assert resp.status_code == 405, path
        assert set(resp.headers["allow"].split(", ")) == documented


def test_body_too_large_is_413(api, spec):
    big = {"model": MODEL, "prompt": "x" * 70_000}
    resp, parsed = send(spec, api.url("main"), "/v1/completions", body=big)
    assert resp.status_code == 413 and parsed["error"]["code"] == "request_too_large"


def test_slow_body_is_408(api, spec):
    status, headers, body = raw_exchange(
        api.listeners["main"],
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: kvmesh\r\ncontent-type: application/json\r\n"
        b'content-length: 100\r\n\r\n{"model":',
        CLIENT_HEADER_TIMEOUT_S + 10,
    )
    assert status == 408
    parsed = check(spec, "/v1/chat/completions", "POST", status, headers, body)
    assert parsed["error"]["code"] == "request_timeout"


def test_slow_engine_is_504(api, spec):
    delay_ms = (FIRST_BYTE_TIMEOUT_S + 2) * 1000
    started = time.monotonic()
    resp, parsed = send(spec, api.url("main"), "/v1/chat/completions", body=chat(), headers={"x-sim-delay-ms": str(delay_ms)})
    assert resp.status_code == 504 and parsed["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - started < delay_ms / 1000


def test_unreachable_engine_is_502_then_503(dead, spec):
    body = {"model": DEAD_MODEL, "messages": [{"role": "user", "content": "x"}]}
    resp, parsed = send(spec, dead.url("main"), "/v1/chat/completions", body=body)
    assert resp.status_code == 502 and parsed["error"]["code"] == "upstream_unavailable"
    resp, parsed = send(spec, dead.url("main"), "/v1/chat/completions", body=body)
    assert resp.status_code == 503 and parsed["error"]["code"] == "no_healthy_instance"
    assert int(resp.headers["retry-after"]) > 0


def test_api_keys_401_403_429(authed, spec):
    base = authed.url("main")
    resp, parsed = send(spec, base, "/v1/chat/completions", body=chat())
    assert resp.status_code == 401 and parsed["error"]["code"] == "missing_api_key"
    resp, parsed = send(spec, base, "/v1/embeddings", body={"model": MODEL, "input": "x"}, headers={"authorization": "Bearer sk-wrong"})
    assert resp.status_code == 401 and parsed["error"]["code"] == "invalid_api_key"
    resp = httpx.get(base + "/v1/models")
    assert check(spec, "/v1/models", "GET", resp.status_code, resp.headers, resp.content)["error"]["code"] == "missing_api_key"
    for path in ("/openapi.json", "/docs"):
        resp = httpx.get(base + path)
        check(spec, path, "GET", resp.status_code, resp.headers, resp.content)
        assert resp.status_code == 200, f"{path} needs no key"
    resp, parsed = send(spec, base, "/v1/responses", body={"model": MODEL, "input": "x"}, headers={"authorization": f"Bearer {RESTRICTED_KEY}"})
    assert resp.status_code == 403 and parsed["error"]["code"] == "model_not_allowed"
    limited = {"authorization": f"Bearer {LIMITED_KEY}"}
    resp, parsed = send(spec, base, "/v1/completions", body={"model": MODEL, "prompt": "a", "max_tokens": 1}, headers=limited)
    assert resp.status_code == 200
    resp, parsed = send(spec, base, "/v1/completions", body={"model": MODEL, "prompt": "a", "max_tokens": 1}, headers=limited)
    assert resp.status_code == 429 and parsed["error"]["code"] == "rate_limit_exceeded"
    assert int(resp.headers["retry-after"]) >= 1


def test_too_many_headers_is_431(api, spec):
    many = {f"x-filler-{i}": "x" for i in range(120)}
    resp = httpx.get(api.url("main") + "/v1/models", headers=many)
    parsed = check(spec, "/v1/models", "GET", resp.status_code, resp.headers, resp.content)
    assert resp.status_code == 431 and parsed["error"]["code"] == "request_header_fields_too_large"
    resp, parsed = send(spec, api.url("main"), "/v1/chat/completions", body=chat(), headers=many)
    assert resp.status_code == 431


def test_malformed_head_is_400_in_the_documented_shape(api, spec):
    status, headers, body = raw_exchange(api.listeners["main"], b"NOT HTTP AT ALL\r\n\r\n", 10)
    assert status == 400
    bad_request = spec.resolve(spec.components["responses"]["BadRequest"])
    spec.validate(bad_request["content"]["application/json"]["schema"], json.loads(body))
    assert json.loads(body)["error"]["code"] == "malformed_request"


def test_every_documented_operation_and_status_was_checked(spec):
    """Runs last: the requests above covered the whole document."""
    documented = set()
    for path, item in spec.doc["paths"].items():
        for method, op in item.items():
            assert (path, method, "200") in SEEN, f"{method.upper()} {path} never answered 200"
            documented |= set(op["responses"])
    seen_statuses = {status for _, _, status in SEEN}
    assert documented <= seen_statuses, f"never seen: {sorted(documented - seen_statuses)}"
