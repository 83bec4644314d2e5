"""kvmesh as the endpoint picker (EPP) of a Gateway API Inference Extension pool.

No Envoy binary can run here, so the tests drive `kvmesh-proxy`'s `epp` listener the way
Envoy does, with the ext_proc client generated from Envoy's own protos (PyPI `xds-protos`):
request headers (with the body modes and the subset hint), body chunks, then, after calling
the engine the picker named (a real `kvmesh-engine-sim`), the response headers (with the
served endpoint in the metadata) and body chunks. Engines: three for `kv-model`
(`policy: kv`, the Qwen3 tokenizer), one for `limited-model` (one request at a time, no
queue).
"""

import asyncio
import json
import random
import subprocess
import sys

import grpc
import httpx
import pytest

from conftest import BIN_DIR, ROOT, Proc

# xds-protos lives apart (scripts/setup.sh says why); appended, so the venv's own packages
# (opentelemetry-proto among them) keep precedence.
sys.path.append(str(ROOT / ".venv" / "xds-protos"))

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2  # noqa: E402

KV = "kv-model"
PD = "pd-model"
POOLED = "pooled-model"
LIMITED = "limited-model"
MAX_BODY = 65536
DEST = "x-gateway-destination-endpoint"
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
MODE = processing_mode_pb2.ProcessingMode
FULL = (MODE.FULL_DUPLEX_STREAMED, MODE.FULL_DUPLEX_STREAMED)
TIMEOUT_S = 30


def backends(proc):
    return [addr for name, addr in sorted(proc.listeners.items()) if name.startswith("engine-")]


@pytest.fixture(scope="module")
def cluster(workdir):
    kv = Proc("kvmesh-engine-sim", ["--engines", "3", "--port", "0", "--model", KV, "--no-delay"], workdir)
    limited = Proc("kvmesh-engine-sim", ["--engines", "1", "--port", "0", "--model", LIMITED, "--no-delay"], workdir)
    pd = Proc("kvmesh-engine-sim", ["--engines", "2", "--port", "0", "--model", PD, "--no-delay"], workdir)
    pooled = Proc("kvmesh-engine-sim", ["--engines", "2", "--port", "0", "--model", POOLED, "--no-delay"], workdir)
    urls = lambda proc: "".join(f"      - url: http://{addr}\n" for addr in backends(proc))  # noqa: E731
    config = (
        "listeners: []\nadmin:\n  address: 127.0.0.1:0\n"
        "epp:\n  address: 127.0.0.1:0\n  fallbacks: 2\n"
        f"limits:\n  max_body_bytes: {MAX_BODY}\n"
        f"models:\n  - name: {KV}\n    policy: kv\n    tokenizer: {ROOT / '.cache/tokenizers/qwen3'}\n"
        f"    kv:\n      block_size: 16\n    backends:\n{urls(kv)}"
        f"  - name: {LIMITED}\n    concurrency:\n      max_in_flight: 1\n      queue_size: 0\n"
        f"    backends:\n{urls(limited)}"
        f"  - name: {PD}\n    policy: kv\n    kv:\n      block_size: 16\n"
        f"    disaggregation:\n      mode: enforce\n    backends:\n"
        f"      - url: http://{backends(pd)[0]}\n        role: prefill\n"
        f"      - url: http://{backends(pd)[1]}\n        role: decode\n"
        f"  - name: {POOLED}\n    policy: kv\n    kv:\n      block_size: 16\n"
        f"    pools:\n      - name: short\n        max_input_tokens: 100\n      - name: long\n"
        f"    backends:\n"
        f"      - url: http://{backends(pooled)[0]}\n        pool: short\n"
        f"      - url: http://{backends(pooled)[1]}\n        pool: long\n"
    )
    cfg = workdir / "epp.yaml"
    cfg.write_text(config)
    proxy = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    yield {
        "proxy": proxy,
        "kv": backends(kv),
        "limited": backends(limited),
        "pd": backends(pd),
        "pooled": backends(pooled),
    }
    proxy.stop()
    kv.stop()
    limited.stop()
    pd.stop()
    pooled.stop()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))


def channel(cluster):
    return grpc.aio.insecure_channel(cluster["proxy"].listeners["epp"])


def header_map(pairs):
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def request_headers(path, extra=(), end_of_stream=False, modes=FULL, subset=None):
    pairs = [(":method", "POST"), (":path", path), ("content-type", "application/json"), *extra]
    message = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=header_map(pairs), end_of_stream=end_of_stream),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=modes[0], response_body_mode=modes[1]),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({SUBSET_KEY: subset})
        message.metadata_context.filter_metadata[SUBSET_NS].CopyFrom(hint)
    return message


def set_headers(common):
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


class Exchange:
    """One ext_proc stream, written and read in Envoy's order."""

    def __init__(self, chan):
        self.call = ep_grpc.ExternalProcessorStub(chan).Process()

    async def send(self, message):
        await self.call.write(message)

    async def recv(self):
        return await asyncio.wait_for(self.call.read(), TIMEOUT_S)

    async def request(self, path, body, chunks=2, **headers):
        """Sends the request (full duplex unless `modes` says otherwise); returns the first answer."""
        modes = headers.get("modes", FULL)
        await self.send(request_headers(path, **headers))
        if modes[0] == MODE.BUFFERED:
            answer = await self.recv()
            assert answer.WhichOneof("response") == "request_headers", answer
            assert not answer.request_headers.response.HasField("header_mutation")
            await self.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
            return await self.recv()
        # Exactly `chunks` pieces (rounding the size down left a third, tiny one for odd
        # lengths: written after a refusal that came with the second, it raced the stream's end).
        step = max(1, -(-len(body) // chunks))
        pieces = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            await self.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=piece, end_of_stream=last)))
        return await self.recv()

    async def pick(self, path, body, **headers):
        """Sends the request; returns the endpoints picked (pick first) after checking the
        header, the metadata and the body carried back."""
        first = await self.request(path, body, **headers)
        assert first.WhichOneof("response") == "request_headers", first
        endpoints = set_headers(first.request_headers.response)[DEST]
        assert first.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value == endpoints
        echoed = await self.recv()
        assert echoed.WhichOneof("response") == "request_body", echoed
        streamed = echoed.request_body.response.body_mutation.streamed_response
        assert (streamed.body, streamed.end_of_stream) == (body, True)
        return endpoints.split(",")

    async def respond(self, served, status=200, content_type="application/json", chunks=(b"{}",)):
        """Sends the engine's response as Envoy would (served endpoint in the metadata);
        returns the headers the picker adds to the client's response."""
        message = ep.ProcessingRequest(
            response_headers=ep.HttpHeaders(headers=header_map([(":status", str(status)), ("content-type", content_type)]))
        )
        if served is not None:
            message.metadata_context.filter_metadata["envoy.lb"].update({SERVED_KEY: served})
        await self.send(message)
        answer = await self.recv()
        assert answer.WhichOneof("response") == "response_headers", answer
        added = set_headers(answer.response_headers.response)
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            await self.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk, end_of_stream=last)))
            echo = (await self.recv()).response_body.response.body_mutation.streamed_response
            assert (echo.body, echo.end_of_stream) == (chunk, last)
        return added

    async def close(self):
        await self.call.done_writing()
        assert await self.recv() == grpc.aio.EOF


def completion(tokens, model=KV, **extra):
    return json.dumps({"model": model, "prompt": tokens, "max_tokens": 4, **extra}).encode()


def explain(cluster, body):
    url = cluster["proxy"].url("admin") + "/debug/route?route=completions"
    response = httpx.post(url, content=body, timeout=10)
    assert response.status_code == 200, response.text
    return {i["instance"].removeprefix("http://"): i for i in response.json()["instances"]}


def metric(cluster, line_start):
    text = httpx.get(cluster["proxy"].url("admin") + "/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start + " ")]
    return values[0] if values else 0.0


def health_stub(chan):
    """`grpc.health.v1.Health` from message classes built at run time (no health package
    matches the protobuf the other clients need)."""
    proto = descriptor_pb2.FileDescriptorProto(name="health_check_test.proto", package="grpc.health.v1", syntax="proto3")
    for name, field, kind in [("HealthCheckRequest", "service", 9), ("HealthCheckResponse", "status", 5)]:
        proto.message_type.add(name=name).field.add(name=field, number=1, type=kind, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    request, response = (
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.health.v1.{n}"))
        for n in ("HealthCheckRequest", "HealthCheckResponse")
    )
    check = chan.unary_unary(
        "/grpc.health.v1.Health/Check", request.SerializeToString, response.FromString
    )
    watch = chan.unary_stream(
        "/grpc.health.v1.Health/Watch", request.SerializeToString, response.FromString
    )
    return request, check, watch


SERVING = 1


def test_health_services_report_liveness_readiness_and_the_processor(cluster):
    async def go():
        async with channel(cluster) as chan:
            request, check, watch = health_stub(chan)
            async for status in watch(request(service="readiness"), timeout=TIMEOUT_S):
                if status.status == SERVING:
                    break
            for service in ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]:
                assert (await check(request(service=service), timeout=TIMEOUT_S)).status == SERVING, service
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await check(request(service="no.such.Service"), timeout=TIMEOUT_S)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    run(go())


def test_completions_and_chat_are_picked_then_served_by_the_named_engine(cluster):
    engines = cluster["kv"]

    async def one(chan, client, path, body, stream):
        exchange = Exchange(chan)
        endpoints = await exchange.pick(path, body)
        # The pick and two fallbacks: every engine once, in the policy's order.
        assert sorted(endpoints) == sorted(engines), endpoints
        response = await client.post(f"http://{endpoints[0]}{path}", content=body)
        assert response.status_code == 200, response.text
        kind = response.headers["content-type"]
        pieces = [response.content[i : i + 64] for i in range(0, len(response.content), 64)]
        added = await exchange.respond(endpoints[0], content_type=kind, chunks=pieces)
        assert added["x-kvmesh-instance"] == f"http://{endpoints[0]}"
        assert f"instance=http://{endpoints[0]}" in added["x-kvmesh-route"], added
        await exchange.close()
        if stream:
            assert b"data: [DONE]" in response.content
        else:
            assert response.json()["choices"][0]["text" if path == "/v1/completions" else "message"]

    async def go():
        chat = lambda stream: json.dumps(  # noqa: E731
            {"model": KV, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3, "stream": stream}
        ).encode()
        async with channel(cluster) as chan, httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            for stream in (False, True):
                await one(chan, client, "/v1/completions", completion(list(range(40)), stream=stream), stream)
                await one(chan, client, "/v1/chat/completions", chat(stream), stream)

    run(go())


def test_a_conversations_turns_are_picked_onto_one_engine(cluster):
    async def finish(client, exchange, endpoint, body):
        response = await client.post(f"http://{endpoint}/v1/chat/completions", content=body)
        assert response.status_code == 200, response.text
        await exchange.respond(endpoint, chunks=[response.content])
        await exchange.close()
        return response.json()["choices"][0]["message"]["content"]

    def chat(messages):
        return json.dumps({"model": KV, "messages": messages, "max_tokens": 8}).encode()

    async def go():
        rng = random.Random(7)
        words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
        conversations = [
            [
                {"role": "system", "content": " ".join(rng.choice(words) for _ in range(300))},
                {"role": "user", "content": f"Question 0 of conversation {c}?"},
            ]
            for c in range(3)
        ]
        async with channel(cluster) as chan, httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            # First turns while the earlier ones are still in flight: load sends each to an
            # engine of its own.
            first = []
            for messages in conversations:
                exchange = Exchange(chan)
                body = chat(messages)
                first.append((exchange, (await exchange.pick("/v1/chat/completions", body))[0], body))
            homes = [endpoint for _, endpoint, _ in first]
            assert sorted(homes) == sorted(cluster["kv"]), homes
            for (exchange, endpoint, body), messages in zip(first, conversations):
                messages.append({"role": "assistant", "content": await finish(client, exchange, endpoint, body)})
            # Later turns, one at a time on idle engines: each goes where its prefix is cached.
            for n in range(1, 4):
                for home, messages in zip(homes, conversations):
                    messages.append({"role": "user", "content": f"Question {n}: {rng.choice(words)}?"})
                    exchange = Exchange(chan)
                    body = chat(messages)
                    endpoint = (await exchange.pick("/v1/chat/completions", body))[0]
                    assert endpoint == home, (n, messages[-1])
                    messages.append({"role": "assistant", "content": await finish(client, exchange, endpoint, body)})

    run(go())


def test_the_subset_hint_limits_the_pick_and_an_empty_choice_is_503(cluster):
    engines = cluster["kv"]

    async def go():
        async with channel(cluster) as chan:
            for allowed in ([engines[1]], [engines[2], engines[0]]):
                exchange = Exchange(chan)
                endpoints = await exchange.pick("/v1/completions", completion([1, 2, 3]), subset=allowed)
                assert sorted(endpoints) == sorted(allowed), (endpoints, allowed)
                await exchange.respond(endpoints[0])
                await exchange.close()
            for allowed in (["10.255.0.1:8000"], []):
                exchange = Exchange(chan)
                answer = await exchange.request("/v1/completions", completion([1, 2, 3]), subset=allowed)
                immediate = answer.immediate_response
                assert immediate.status.code == 503, answer
                assert json.loads(immediate.body)["error"]["code"] == "no_healthy_instance"
                assert await exchange.recv() == grpc.aio.EOF

    before = metric(cluster, f'kvmesh_epp_decisions_total{{model="{KV}",status="503"}}')
    run(go())
    assert metric(cluster, f'kvmesh_epp_decisions_total{{model="{KV}",status="503"}}') == before + 2


def test_a_prefill_only_engine_is_never_named_for_a_whole_request(cluster):
    """The picker leaves out what the spine leaves out: an engine registered prefill only
    takes no whole request, as the pick or as a fallback."""
    prefill, decode = cluster["pd"]

    async def go():
        async with channel(cluster) as chan:
            for n in range(6):
                exchange = Exchange(chan)
                endpoints = await exchange.pick("/v1/completions", completion([n, 1, 2, 3], model=PD))
                assert endpoints == [decode], (endpoints, prefill)
                await exchange.respond(endpoints[0])
                await exchange.close()

    run(go())


def test_a_models_pools_take_prompts_as_in_the_proxy(cluster):
    """The picker chooses the pool as the proxy's own path does: a prompt that fits the
    short pool is picked there, a longer one in the long pool, fallbacks included."""
    short, long = cluster["pooled"]

    async def go():
        async with channel(cluster) as chan:
            for tokens, engine in ((list(range(50)), short), (list(range(1000, 1300)), long)):
                exchange = Exchange(chan)
                endpoints = await exchange.pick("/v1/completions", completion(tokens, model=POOLED))
                assert endpoints == [engine], (len(tokens), endpoints)
                await exchange.respond(endpoints[0])
                await exchange.close()

    run(go())


def test_the_served_endpoint_carries_the_load_until_the_response_ends(cluster):
    body = completion(list(range(5000, 5064)))

    async def go():
        async with channel(cluster) as chan:
            exchange = Exchange(chan)
            picked, fallback, _ = await exchange.pick("/v1/completions", body)
            load = explain(cluster, body)
            assert (load[picked]["active_requests"], load[fallback]["active_requests"]) == (1, 0)
            # Envoy fell back: the fallback served, and now holds the request's load.
            message = ep.ProcessingRequest(
                response_headers=ep.HttpHeaders(headers=header_map([(":status", "200")]))
            )
            message.metadata_context.filter_metadata["envoy.lb"].update({SERVED_KEY: fallback})
            await exchange.send(message)
            added = set_headers((await exchange.recv()).response_headers.response)
            assert added["x-kvmesh-instance"] == f"http://{fallback}"
            load = explain(cluster, body)
            assert (load[picked]["active_requests"], load[fallback]["active_requests"]) == (0, 1)
            await exchange.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True)))
            await exchange.recv()
            load = explain(cluster, body)
            assert all(i["active_requests"] == 0 for i in load.values()), load
            await exchange.close()
            # A stream the gateway drops mid-way releases its load too.
            dropped = Exchange(chan)
            picked = (await dropped.pick("/v1/completions", body))[0]
            assert explain(cluster, body)[picked]["active_requests"] == 1
            dropped.call.cancel()
            deadline = asyncio.get_running_loop().time() + TIMEOUT_S
            while explain(cluster, body)[picked]["active_requests"] != 0:
                assert asyncio.get_running_loop().time() < deadline, "the load outlived its stream"
                await asyncio.sleep(0.05)

    fallback_line = f'kvmesh_epp_served_total{{endpoint="fallback",model="{KV}"}}'
    before = metric(cluster, fallback_line)
    run(go())
    assert metric(cluster, fallback_line) == before + 1


def test_bad_requests_get_immediate_openai_errors(cluster):
    async def refused(chan, body, path="/v1/completions", chunks=1):
        # One chunk unless the test needs two: a refusal answered before a later chunk is
        # written ends the stream under it (grpc's execute_batch error, seen in full runs).
        exchange = Exchange(chan)
        answer = await exchange.request(path, body, chunks=chunks)
        assert answer.WhichOneof("response") == "immediate_response", answer
        assert await exchange.recv() == grpc.aio.EOF
        immediate = answer.immediate_response
        headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
        assert headers["content-type"] == "application/json"
        return immediate.status.code, json.loads(immediate.body)["error"]

    async def go():
        async with channel(cluster) as chan:
            status, error = await refused(chan, b"{not json")
            assert (status, error["type"]) == (400, "invalid_request_error"), error
            status, error = await refused(chan, completion([1], model="no-such-model"))
            assert (status, error["code"]) == (404, "model_not_found"), error
            # Over the limit only with its second (last) chunk: the picker answers and ends the
            # stream when the limit is passed, and Envoy then writes no more; a chunk written
            # after that answer would race the stream's end.
            oversized = completion(list(range(MAX_BODY // 5)))
            assert MAX_BODY < len(oversized) < 2 * MAX_BODY
            status, error = await refused(chan, oversized, chunks=2)
            assert status == 413, error
            # The picker keeps serving after each refusal.
            exchange = Exchange(chan)
            assert len(await exchange.pick("/v1/completions", completion([9, 9, 9]))) == 3
            await exchange.respond(None)
            await exchange.close()

    before = metric(cluster, 'kvmesh_epp_decisions_total{model="",status="400"}')
    run(go())
    assert metric(cluster, 'kvmesh_epp_decisions_total{model="",status="400"}') == before + 1


def test_a_full_model_sheds_with_429_until_its_request_ends(cluster):
    async def go():
        async with channel(cluster) as chan:
            holder = Exchange(chan)
            endpoint = (await holder.pick("/v1/completions", completion([1, 2], model=LIMITED)))[0]
            assert endpoint == cluster["limited"][0]
            shed = Exchange(chan)
            answer = await shed.request("/v1/completions", completion([3, 4], model=LIMITED))
            immediate = answer.immediate_response
            assert immediate.status.code == 429, answer
            assert {h.header.key for h in immediate.headers.set_headers} >= {"retry-after"}
            await holder.respond(endpoint)
            await holder.close()
            again = Exchange(chan)
            assert (await again.pick("/v1/completions", completion([5, 6], model=LIMITED)))[0] == endpoint
            await again.respond(endpoint)
            await again.close()

    run(go())


def test_buffered_bodies_and_requests_without_a_body(cluster):
    async def go():
        async with channel(cluster) as chan:
            modes = (MODE.BUFFERED, MODE.BUFFERED)
            exchange = Exchange(chan)
            answer = await exchange.request("/v1/completions", completion([7, 8, 9]), modes=modes)
            assert answer.WhichOneof("response") == "request_body", answer
            endpoints = set_headers(answer.request_body.response)[DEST].split(",")
            assert len(endpoints) == 3 and not answer.request_body.response.HasField("body_mutation")
            assert answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value == ",".join(endpoints)
            await exchange.send(
                ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=header_map([(":status", "200")])))
            )
            assert (await exchange.recv()).WhichOneof("response") == "response_headers"
            await exchange.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True)))
            answer = await exchange.recv()
            assert not answer.response_body.response.HasField("body_mutation"), answer
            await exchange.close()
            # Headers alone: the model from x-gateway-model-name.
            bare = Exchange(chan)
            await bare.send(request_headers("/v1/models", [("x-gateway-model-name", LIMITED)], end_of_stream=True))
            answer = await bare.recv()
            assert set_headers(answer.request_headers.response)[DEST] == cluster["limited"][0]
            await bare.close()

    run(go())


def test_protocol_errors_end_only_their_stream(cluster):
    async def go():
        async with channel(cluster) as chan:
            wrong = Exchange(chan)
            await wrong.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=b"{}", end_of_stream=True)))
            with pytest.raises(grpc.aio.AioRpcError) as first_body:
                await wrong.recv()
            assert first_body.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            streamed = Exchange(chan)
            await streamed.send(request_headers("/v1/completions", modes=(MODE.STREAMED, MODE.STREAMED)))
            with pytest.raises(grpc.aio.AioRpcError) as unsupported:
                await streamed.recv()
            assert unsupported.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "FULL_DUPLEX_STREAMED" in unsupported.value.details()
            fine = Exchange(chan)
            assert len(await fine.pick("/v1/completions", completion([4, 2]))) == 3
            await fine.respond(None)
            await fine.close()

    run(go())


def test_a_burst_of_a_thousand_concurrent_exchanges(cluster):
    engines = cluster["kv"]
    picked_line = f'kvmesh_epp_decisions_total{{model="{KV}",status="200"}}'
    before = metric(cluster, picked_line)

    async def one(chan, n):
        exchange = Exchange(chan)
        endpoints = await exchange.pick("/v1/completions", completion([n, n + 1, n + 2] * 20))
        await exchange.respond(endpoints[0])
        await exchange.close()
        return endpoints[0]

    async def go():
        async with channel(cluster) as chan:
            return await asyncio.gather(*(one(chan, 100_000 + 3 * n) for n in range(1000)))

    picks = run(go())
    assert len(picks) == 1000
    assert set(picks) == set(engines), "the load spread over every engine"
    assert metric(cluster, picked_line) == before + 1000
    assert metric(cluster, "kvmesh_epp_exchanges_in_flight") == 0
    load = explain(cluster, completion([1, 2, 3]))
    assert all(i["active_requests"] == 0 for i in load.values()), load


def test_a_picker_alone_serves_tls_with_its_own_certificate(cluster, workdir):
    certs = workdir / "epp-certs"
    subprocess.run([str(BIN_DIR / "kvmesh-test-certs"), str(certs)], check=True, capture_output=True)
    config = workdir / "epp-tls.yaml"
    config.write_text(
        "listeners: []\nadmin:\n  address: 127.0.0.1:0\n"
        f"epp:\n  address: 127.0.0.1:0\n  tls:\n    cert: {certs / 'server.pem'}\n    key: {certs / 'server.key'}\n"
        f"models:\n  - name: {LIMITED}\n    backends:\n      - url: http://{cluster['limited'][0]}\n"
    )
    proxy = Proc("kvmesh-proxy", ["--config", str(config)], workdir)
    address = proxy.listeners["epp"]

    async def go():
        credentials = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(address, credentials) as chan:
            exchange = Exchange(chan)
            assert await exchange.pick("/v1/completions", completion([1], model=LIMITED)) == cluster["limited"]
            await exchange.respond(cluster["limited"][0])
            await exchange.close()
        async with grpc.aio.insecure_channel(address) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await Exchange(plain).request("/v1/completions", completion([1], model=LIMITED))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    try:
        run(go())
    finally:
        proxy.stop()
