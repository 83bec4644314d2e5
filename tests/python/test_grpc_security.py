"""mTLS and API keys on the KServe v2 gRPC listener, through the real `tritonclient[grpc]`.

The proxy's data listener terminates TLS with `client_ca` and `require_client_cert: true`;
its gRPC listener serves the same certificate and client-certificate settings
(docs/grpc.md). API keys: `full` may use every model, `narrow` only `other-model`. The test
PKI comes from `kvmesh-test-certs` (ca.pem, server.pem/key, client.pem/key, other-ca.pem).
Engines: one fast `kvmesh-engine-sim` per model.
"""

import hashlib
import queue
import subprocess

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import BIN_DIR, MODEL, Proc, proxy_config

OTHER = "other-model"
FULL_KEY = "kvmesh-grpc-full-0f3c9a"
NARROW_KEY = "kvmesh-grpc-narrow-7d41e2"
TIMEOUT_S = 30


def digest(key):
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def secured(workdir):
    certs = workdir / "grpc-security-certs"
    subprocess.run([str(BIN_DIR / "kvmesh-test-certs"), str(certs)], check=True, capture_output=True)
    sim = Proc("kvmesh-engine-sim", ["--engines", "1", "--port", "0", "--model", MODEL, "--no-delay"], workdir)
    other = Proc("kvmesh-engine-sim", ["--engines", "1", "--port", "0", "--model", OTHER, "--no-delay"], workdir)
    tls = (
        "    tls:\n"
        f"      cert: {certs / 'server.pem'}\n      key: {certs / 'server.key'}\n"
        f"      client_ca: {certs / 'ca.pem'}\n      require_client_cert: true\n"
        "admin:"
    )
    extra = (
        f"  - name: {OTHER}\n    backends:\n"
        + "".join(f"      - url: http://{addr}\n" for addr in other.listeners.values())
        + "grpc:\n  address: 127.0.0.1:0\n"
        + "auth:\n  keys:\n"
        + f"    - name: full\n      sha256: {digest(FULL_KEY)}\n"
        + f"    - name: narrow\n      sha256: {digest(NARROW_KEY)}\n      models: [{OTHER}]\n"
    )
    config = workdir / "grpc-security.yaml"
    config.write_text(proxy_config([f"http://{a}" for a in sim.listeners.values()], extra).replace("admin:", tls, 1))
    proxy = Proc("kvmesh-proxy", ["--config", str(config)], workdir)
    yield {"proxy": proxy, "certs": certs}
    proxy.stop()
    sim.stop()
    other.stop()


def connect(secured, identity=True, ca="ca.pem"):
    """A tritonclient over TLS trusting `ca`, with the test client certificate if `identity`."""
    certs = secured["certs"]
    client_files = {"private_key": str(certs / "client.key"), "certificate_chain": str(certs / "client.pem")}
    return grpcclient.InferenceServerClient(
        secured["proxy"].listeners["grpc"], ssl=True, root_certificates=str(certs / ca),
        # A connection of its own: gRPC shares one between equal channels by default.
        channel_args=[("grpc.use_local_subchannel_pool", 1)],
        **(client_files if identity else {}),
    )


def bearer(key):
    return {"authorization": f"Bearer {key}"}


def text_inputs(prompt, streaming=None):
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs = [text]
    if streaming is not None:
        flag = grpcclient.InferInput("streaming", [1], "BOOL")
        flag.set_data_from_numpy(np.array([streaming], dtype=bool))
        inputs.append(flag)
    return inputs


def infer(client, model, headers):
    return client.infer(model, text_inputs("secured hello"), parameters={"max_tokens": 3}, headers=headers,
                        client_timeout=TIMEOUT_S)


def completion_tokens(result):
    return result.get_response().parameters["completion_tokens"].int64_param


def metrics(secured):
    return httpx.get(secured["proxy"].url("admin") + "/metrics", timeout=10).text


def metric(secured, series):
    """The value of the exact series `series` (0 when absent)."""
    for line in metrics(secured).splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    return 0.0


def failure(call):
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status().replace("StatusCode.", ""), err.value.message()


def rejections(secured, reason):
    return metric(secured, f'kvmesh_auth_rejections_total{{reason="{reason}"}}')


def grpc_requests(secured, model, status):
    return metric(
        secured, f'kvmesh_requests_total{{model="{model}",protocol="grpc",route="model_infer",status="{status}"}}'
    )


def test_client_certificate_and_key_are_served(secured):
    with connect(secured) as client:
        result = infer(client, MODEL, bearer(FULL_KEY))
        assert completion_tokens(result) == 3
        assert result.as_numpy("text_output")[0]
        assert completion_tokens(infer(client, OTHER, bearer(FULL_KEY))) == 3
        assert completion_tokens(infer(client, OTHER, bearer(NARROW_KEY))) == 3


def test_without_a_client_certificate_the_handshake_is_refused(secured):
    handshake_errors = 'kvmesh_tls_handshake_errors_total{listener="main",reason="error"}'
    before = metric(secured, handshake_errors), grpc_requests(secured, MODEL, 200)
    with connect(secured, identity=False) as client:
        status, message = failure(lambda: infer(client, MODEL, bearer(FULL_KEY)))
    assert status == "UNAVAILABLE", message
    assert (metric(secured, handshake_errors), grpc_requests(secured, MODEL, 200)) == (before[0] + 1, before[1])


def test_a_client_trusting_another_ca_refuses_the_proxy(secured):
    with connect(secured, ca="other-ca.pem") as client:
        status, message = failure(lambda: infer(client, MODEL, bearer(FULL_KEY)))
    assert status == "UNAVAILABLE", message


@pytest.mark.parametrize(
    "headers, code, reason, counted, words",
    [
        ({}, "UNAUTHENTICATED", "missing_key", ("", 401), ["didn't provide an API key"]),
        (bearer("not-a-key"), "UNAUTHENTICATED", "invalid_key", ("", 401), ["incorrect API key"]),
        ({"authorization": FULL_KEY}, "UNAUTHENTICATED", "missing_key", ("", 401), ["didn't provide"]),
        (bearer(NARROW_KEY), "PERMISSION_DENIED", "model_not_allowed", (MODEL, 403), [MODEL]),
    ],
    ids=["no-key", "unknown-key", "not-bearer", "model-not-allowed"],
)
def test_api_key_refusals(secured, headers, code, reason, counted, words):
    """Refused with the documented code, counted once by reason and in the request metrics
    (a key is checked before the model is read: 401s count under `model=""`)."""
    before = rejections(secured, reason), grpc_requests(secured, *counted)
    with connect(secured) as client:
        got, message = failure(lambda: infer(client, MODEL, headers))
    assert got == code, message
    for word in words:
        assert word in message, message
    assert (rejections(secured, reason), grpc_requests(secured, *counted)) == (before[0] + 1, before[1] + 1)


def stream_outcomes(secured, headers, requests):
    """Sends `requests` ((id, model), ...) on one ModelStreamInfer call with `headers`; returns
    the ids that finished and the error messages, once each request had its answer."""
    results = queue.Queue()
    errors, finished = [], []
    with connect(secured) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=TIMEOUT_S,
                            headers=headers)
        try:
            for request_id, model in requests:
                client.async_stream_infer(model, text_inputs("x", True), request_id=request_id,
                                          parameters={"max_tokens": 2})
            while len(errors) + len(finished) < len(requests):
                result, error = results.get(timeout=TIMEOUT_S)
                if error is not None:
                    errors.append(str(error))
                elif result.get_response().parameters["triton_final_response"].bool_param:
                    finished.append(result.get_response().id)
        finally:
            client.stop_stream()
    return sorted(finished), sorted(errors)


def test_a_stream_refuses_a_model_the_key_may_not_use_and_goes_on(secured):
    finished, errors = stream_outcomes(secured, bearer(NARROW_KEY), [("denied", MODEL), ("allowed", OTHER)])
    assert finished == ["allowed"]
    assert len(errors) == 1 and errors[0].startswith('request "denied": PERMISSION_DENIED'), errors


def test_a_stream_without_a_key_has_each_request_refused(secured):
    finished, errors = stream_outcomes(secured, None, [("a", MODEL), ("b", OTHER)])
    assert finished == []
    assert [e.split(": ")[:2] for e in errors] == [[f'request "{r}"', "UNAUTHENTICATED"] for r in "ab"], errors


def test_metadata_rpcs_need_no_key(secured):
    with connect(secured) as client:
        assert client.is_server_live()
        assert client.is_model_ready(MODEL)
        assert client.get_model_metadata(MODEL, as_json=True)["name"] == MODEL
        assert client.get_model_config(MODEL, as_json=True)["config"]["name"] == MODEL


def test_keys_are_not_logged(secured):
    log = secured["proxy"].log_path.read_text(errors="replace")
    for key in (FULL_KEY, NARROW_KEY, "not-a-key"):
        assert key not in log
        assert digest(key) not in log
