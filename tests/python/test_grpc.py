"""The KServe v2 gRPC frontend through kvmesh-proxy, driven by the real `tritonclient[grpc]`.

Engines: two fast simulated engines for `sim-model` (alias `sim`), one real-time engine for
`slow-model` (cancellation and deadlines), three fast engines behind `policy: kv` for
`kv-model`, a refused port for `dead-model` and an engine-sim answering 500 (`--fail-status`)
for `broken-model`.
"""

import concurrent.futures
import queue
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import ALIAS, MODEL, Proc, proxy_config

SLOW = "slow-model"
KV = "kv-model"
DEAD = "dead-model"
BROKEN = "broken-model"
MAX_MESSAGE_BYTES = 65536
RELEASE_TIMEOUT_S = 10


def backends(proc):
    return [f"http://{addr}" for name, addr in sorted(proc.listeners.items()) if name.startswith("engine-")]


def model_yaml(name, urls, policy="round_robin", extra=""):
    lines = [f"  - name: {name}", f"    policy: {policy}"] + ([extra] if extra else []) + ["    backends:"]
    return "\n".join(lines + [f"      - url: {url}" for url in urls]) + "\n"


@pytest.fixture(scope="module")
def cluster(workdir):
    fast = Proc("kvmesh-engine-sim", ["--engines", "2", "--port", "0", "--model", MODEL, "--no-delay"], workdir)
    slow = Proc("kvmesh-engine-sim", ["--engines", "1", "--port", "0", "--model", SLOW], workdir)
    kv = Proc("kvmesh-engine-sim", ["--engines", "3", "--port", "0", "--model", KV, "--no-delay"], workdir)
    failing = Proc("kvmesh-engine-sim", ["--engines", "1", "--port", "0", "--model", BROKEN, "--no-delay",
                                         "--fail-status", "500"], workdir)
    extra = (
        model_yaml(SLOW, backends(slow))
        + model_yaml(KV, backends(kv), "kv", "    kv:\n      block_size: 64")
        + model_yaml(DEAD, ["http://127.0.0.1:1"])
        + model_yaml(BROKEN, backends(failing))
        + f"limits:\n  retries: 0\ngrpc:\n  address: 127.0.0.1:0\n  max_message_bytes: {MAX_MESSAGE_BYTES}\n"
    )
    cfg = workdir / "grpc-proxy.yaml"
    cfg.write_text(proxy_config(backends(fast), extra))
    proxy = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    yield {"proxy": proxy, "fast": fast, "slow": slow, "kv": kv}
    proxy.stop()
    for proc in (fast, slow, kv, failing):
        proc.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with grpcclient.InferenceServerClient(url=cluster["proxy"].listeners["grpc"]) as c:
        yield c


def text_inputs(prompt, streaming=None):
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs = [text]
    if streaming is not None:
        flag = grpcclient.InferInput("streaming", [1], "BOOL")
        flag.set_data_from_numpy(np.array([streaming], dtype=bool))
        inputs.append(flag)
    return inputs


def ids_inputs(ids):
    tensor = grpcclient.InferInput("input_ids", [1, len(ids)], "INT64")
    tensor.set_data_from_numpy(np.array([ids], dtype=np.int64))
    return [tensor]


def text_of(result, name="text_output"):
    return result.as_numpy(name)[0].decode()


def param(result, name):
    parameter = result.get_response().parameters.get(name)
    return None if parameter is None else getattr(parameter, parameter.WhichOneof("parameter_choice"))


def engine_metric(proc, name):
    values = []
    for url in backends(proc):
        text = httpx.get(f"{url}/metrics").text
        values.append(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(name) and line[len(name)] in "{ "
            )
        )
    return values


def wait_until(condition, what):
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def status_of(error):
    return error.status().replace("StatusCode.", "")


def test_live_ready_metadata_and_config(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(MODEL)
    assert client.is_model_ready(ALIAS)
    assert not client.is_model_ready("no-such-model")
    assert not client.is_model_ready(MODEL, model_version="2")

    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "kvmesh"
    assert "model_configuration" in server["extensions"]

    metadata = client.get_model_metadata(ALIAS, as_json=True)
    assert metadata["name"] == MODEL, "an alias describes its model"
    assert metadata["versions"] == ["1"]
    inputs = {t["name"]: (t["datatype"], t["shape"]) for t in metadata["inputs"]}
    assert inputs["text_input"] == ("BYTES", ["1"])
    assert inputs["input_ids"] == ("INT64", ["-1"])
    assert inputs["streaming"] == ("BOOL", ["1"])
    assert [t["name"] for t in metadata["outputs"]] == ["text_output", "finish_reason"]

    config = client.get_model_config(MODEL, as_json=True)["config"]
    assert config["name"] == MODEL
    assert config["model_transaction_policy"]["decoupled"] is True
    assert {i["name"]: i["data_type"] for i in config["input"]}["text_input"] == "TYPE_STRING"
    assert "max_tokens" in config["parameters"]["request_parameters"]["string_value"]


def test_infer_with_text(client):
    result = client.infer(MODEL, text_inputs("Say hello to the mesh."), request_id="t-1", parameters={"max_tokens": 7})
    response = result.get_response()
    assert response.id == "t-1"
    assert response.model_name == MODEL
    assert text_of(result)
    assert text_of(result, "finish_reason") == "length"
    assert param(result, "completion_tokens") == 7
    assert param(result, "prompt_tokens") > 0
    assert param(result, "triton_final_response") is True
    again = client.infer(ALIAS, text_inputs("Say hello to the mesh."), parameters={"max_tokens": 7, "temperature": 0.5})
    assert text_of(again) == text_of(result), "the same prompt gives the same answer through an alias"


def test_infer_with_token_ids_and_requested_outputs(client):
    ids = list(range(100, 164))
    outputs = [grpcclient.InferRequestedOutput("text_output")]
    result = client.infer(MODEL, ids_inputs(ids), outputs=outputs, parameters={"max_tokens": 4})
    assert param(result, "prompt_tokens") == len(ids)
    assert param(result, "completion_tokens") == 4
    assert text_of(result)
    assert result.as_numpy("finish_reason") is None, "only the requested output"


def test_a_stream_carries_several_requests(client):
    prompts = {"a": "First prompt", "b": "Second prompt", "c": "Third prompt"}
    expected = {
        rid: text_of(client.infer(MODEL, text_inputs(p), parameters={"max_tokens": 6})) for rid, p in prompts.items()
    }
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for rid, prompt in prompts.items():
            client.async_stream_infer(MODEL, text_inputs(prompt, True), request_id=rid, parameters={"max_tokens": 6})
        client.async_stream_infer(MODEL, text_inputs("Folded"), request_id="folded", parameters={"max_tokens": 3})
        client.async_stream_infer("no-such-model", text_inputs("x", True), request_id="lost")
        client.async_stream_infer(MODEL, text_inputs("x", True), request_id="bad", parameters={"max_tokens": "many"})
        texts, chunks, finals, errors = {}, {}, {}, []
        while len(finals) < 4 or len(errors) < 2:
            result, error = results.get(timeout=30)
            if error is not None:
                errors.append(str(error))
                continue
            rid = result.get_response().id
            assert rid not in finals, "nothing after a request's last response"
            texts[rid] = texts.get(rid, "") + text_of(result)
            chunks[rid] = chunks.get(rid, 0) + 1
            if param(result, "triton_final_response"):
                finals[rid] = result
    finally:
        client.stop_stream()
    for rid in prompts:
        assert texts[rid] == expected[rid], f"the deltas of {rid} add up to its answer"
        assert chunks[rid] >= 6
        assert text_of(finals[rid], "finish_reason") == "length"
        assert param(finals[rid], "completion_tokens") == 6
    assert chunks["folded"] == 1
    assert sorted(e.split(":")[0] for e in errors) == ['request "bad"', 'request "lost"']
    assert any("NOT_FOUND" in e for e in errors) and any("INVALID_ARGUMENT" in e for e in errors), errors


@pytest.mark.parametrize(
    "call, status, words",
    [
        (lambda c: c.infer("no-such-model", text_inputs("x")), "NOT_FOUND", ["no-such-model", MODEL]),
        (lambda c: c.infer(MODEL, text_inputs("x"), model_version="3"), "NOT_FOUND", ["version"]),
        (lambda c: c.infer(MODEL, ids_inputs([-5])), "INVALID_ARGUMENT", ["input_ids", "-5"]),
        (lambda c: c.infer(MODEL, text_inputs("x"), parameters={"beam_width": 2}), "INVALID_ARGUMENT", ["beam_width"]),
        (lambda c: c.infer(MODEL, text_inputs("x", True)), "INVALID_ARGUMENT", ["ModelStreamInfer"]),
        (lambda c: c.infer(MODEL, []), "INVALID_ARGUMENT", ["text_input"]),
        (lambda c: c.infer(DEAD, text_inputs("x")), "UNAVAILABLE", []),
        (lambda c: c.infer(BROKEN, text_inputs("x")), "INTERNAL", ["500", "simulated failure"]),
        (lambda c: c.get_inference_statistics(MODEL), "UNIMPLEMENTED", ["ModelStatistics"]),
        (lambda c: c.infer(MODEL, text_inputs("x" * (MAX_MESSAGE_BYTES + 10))), "OUT_OF_RANGE", []),
    ],
    ids=["unknown-model", "unknown-version", "bad-tensor", "bad-parameter", "stream-on-unary", "no-prompt",
         "no-instance", "engine-failure", "unimplemented", "too-large"],
)
def test_error_codes(client, call, status, words):
    with pytest.raises(InferenceServerException) as err:
        call(client)
    assert status_of(err.value) == status, str(err.value)
    for word in words:
        assert word in err.value.message(), err.value.message()


def proxy_counter(cluster, line_prefix):
    """The value of the proxy's metric line that starts with `line_prefix` (0 when absent)."""
    text = httpx.get(cluster["proxy"].url("admin") + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_prefix))


def test_deadline_exceeded_drops_the_engine_request(client, cluster):
    """The deadline travels as `grpc-timeout` metadata alone, so the client sets no timer of its
    own: the proxy ends the call (its message, its 504), after the engine was seen busy with it."""
    timed_out = 'kvmesh_requests_total{model="slow-model",protocol="grpc",route="model_infer",status="504"}'
    before = proxy_counter(cluster, timed_out)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.infer, SLOW, text_inputs("take your time"), parameters={"max_tokens": 2000},
                             headers={"grpc-timeout": "1500m"})
        wait_until(lambda: sum(engine_metric(cluster["slow"], "vllm:num_requests_running")) > 0, "never reached the engine")
        with pytest.raises(InferenceServerException) as err:
            answer.result(timeout=30)
    elapsed = time.monotonic() - started
    assert status_of(err.value) == "DEADLINE_EXCEEDED", str(err.value)
    assert "the deadline passed" in err.value.message(), err.value.message()
    assert 1.4 <= elapsed < 4, elapsed  # not before the deadline (the proxy's timer may round it)
    wait_until(lambda: sum(engine_metric(cluster["slow"], "vllm:num_requests_running")) == 0, "engine still busy")
    assert proxy_counter(cluster, timed_out) == before + 1


def test_cancel_mid_stream_releases_the_engine_request(client, cluster):
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(SLOW, text_inputs("A very long story.", True), request_id="long", parameters={"max_tokens": 2000})
    for _ in range(3):
        result, error = results.get(timeout=30)
        assert error is None, error
    wait_until(lambda: sum(engine_metric(cluster["slow"], "vllm:num_requests_running")) > 0, "never reached the engine")
    client.stop_stream(cancel_requests=True)
    wait_until(lambda: sum(engine_metric(cluster["slow"], "vllm:num_requests_running")) == 0, "engine still busy")


def test_kv_aware_routing_on_the_grpc_path(client, cluster):
    prefix = list(range(1000, 1512))
    for turn in range(6):
        ids = prefix + [5000 + 100 * turn + i for i in range(64)]
        client.infer(KV, ids_inputs(ids), parameters={"max_tokens": 2})
    hits = engine_metric(cluster["kv"], "vllm:prefix_cache_hits_total")
    assert sorted(hits)[:-1] == [0, 0], f"one engine took the shared prefix: {hits}"
    assert max(hits) >= 5 * 512, hits


def test_metrics_carry_the_protocol(cluster, client):
    client.infer(MODEL, text_inputs("count me"), parameters={"max_tokens": 1})
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(MODEL, text_inputs("count me too"), parameters={"max_tokens": 1})
    assert results.get(timeout=30)[1] is None
    client.stop_stream()
    metrics = httpx.get(cluster["proxy"].url("admin") + "/metrics").text
    assert f'kvmesh_requests_total{{model="{MODEL}",protocol="grpc",route="model_infer",status="200"}}' in metrics
    assert f'kvmesh_requests_total{{model="{MODEL}",protocol="grpc",route="model_stream_infer",status="200"}}' in metrics
