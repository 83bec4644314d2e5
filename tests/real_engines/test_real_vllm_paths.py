"""Prefill/decode with the real NixlConnector, the KServe v2 gRPC frontend and the endpoint
picker, each in front of the suite's two real vLLM engines and checked against what the
engines themselves report. Runs after the tests that restart engines and agents; it relies
on the index only through waits on `POST /debug/route`, never on `events_settled`.

Prefill/decode runs through a second proxy over static backends (engine a prefills, b
decodes); gRPC and the picker through a third with the suite's etcd discovery and NATS
events, so the suite's own proxy keeps its config.
"""

import asyncio
import json
import queue
import random
import subprocess
import sys

import grpc
import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from conftest import (
    BLOCK_SIZE,
    MODEL,
    ROOT,
    Proc,
    disaggregated_proxy,
    get_json,
    http,
    listed_model,
    metric_sum,
    metrics,
    proxy_config,
    wait_until,
)
from test_real_vllm import cap, debug_route, reported_on, route_of, text

# xds-protos lives apart from the venv's packages (scripts/setup.sh says why).
sys.path.append(str(ROOT / ".venv" / "xds-protos"))

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402

# The first NixlConnector transfer between two CPU engines can take half a minute.
TRANSFER_TIMEOUT_S = 120


def counter(engine, name, **labels):
    return metric_sum(engine.metrics(), name, **labels)


def served(engine):
    """Requests the engine itself finished (any reason)."""
    return counter(engine, "vllm:request_success_total")


def engine_counts(cluster, name):
    return {e.name: counter(e, name) for e in cluster.engines}


def delta(after, before):
    return {k: after[k] - before[k] for k in after}


def openai_client(proxy):
    return openai.OpenAI(base_url=proxy.url("main") + "/v1", api_key="unused", max_retries=0, timeout=TRANSFER_TIMEOUT_S)


def streamed_chat(proxy, messages, max_tokens):
    """A streamed chat through `proxy`: (route dict, text, usage)."""
    raw = openai_client(proxy).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        pieces.extend(c.delta.content or "" for c in chunk.choices)
    return route_of(raw.headers), "".join(pieces), usage


def prefill_legs(proxy, outcome):
    page = metrics(proxy.url("admin") + "/metrics")
    return metric_sum(page, "kvmesh_prefill_legs_total", model=MODEL, outcome=outcome)


@pytest.fixture(scope="module")
def pd(cluster):
    """Engine a prefills, b decodes; a failed prefill leg is a 503, so it cannot hide."""
    prefill, decode = cluster.engines
    proxy = disaggregated_proxy(cluster.workdir, prefill.url, decode.url, on_prefill_failure="fail")
    yield proxy
    proxy.stop()


def test_prefill_on_one_real_engine_decode_on_the_other_and_both_store_the_same_blocks(cluster, pd):
    """A long prompt prefills on a (NixlConnector, `do_remote_decode`), b pulls its KV and
    decodes. b's BlockStored events, through its agent into the suite proxy's index, name
    the same blocks as a's; b computed none of the transferred tokens itself."""
    prefill, decode = cluster.engines
    messages = [{"role": "user", "content": text(random.Random(81), 400)}]
    assert reported_on(cluster, prefill, messages) == 0 and reported_on(cluster, decode, messages) == 0
    before = {e.name: (served(e), counter(e, "vllm:external_prefix_cache_hits_total")) for e in cluster.engines}
    route, answer, usage = streamed_chat(pd, messages, 8)
    assert route["prefill"].rstrip("/") == prefill.url, route
    assert route["instance"].rstrip("/") == decode.url, route
    assert usage.completion_tokens == 8 and answer
    blocks = usage.prompt_tokens // BLOCK_SIZE
    # Each engine stored the prompt's full blocks; the index holds them under both, from
    # each engine's own events (the agents hash the events' token ids and parent chain).
    wait_until("the prompt's blocks in the index under both engines", lambda: (
        reported_on(cluster, prefill, messages), reported_on(cluster, decode, messages)) == (blocks, blocks),
        timeout=30)
    # One request on each engine: the prefill leg on a, the decode leg on b, which took
    # the whole prompt's KV over NIXL (vLLM's external prefix cache hits, the partial last
    # block included) and reported none of it as its own cache's (cached_tokens 0).
    assert served(prefill) - before["a"][0] == 1 and served(decode) - before["b"][0] == 1
    pulled = counter(decode, "vllm:external_prefix_cache_hits_total") - before["b"][1]
    assert pulled == usage.prompt_tokens, (pulled, usage)
    assert counter(prefill, "vllm:external_prefix_cache_hits_total") == before["a"][1]
    assert usage.prompt_tokens_details.cached_tokens == 0
    page = metrics(cluster.admin + "/metrics")
    for status in ("parent_not_found", "block_not_found", "invalid"):
        assert metric_sum(page, "kvmesh_kv_events_applied_total", status=status) == 0, status
    assert prefill_legs(pd, "remote") == 1


def test_conditional_prefills_a_short_prompt_on_the_decode_engine(cluster, pd):
    """`mode: conditional`, `min_remote_prefill_tokens: 256`: a short prompt never reaches
    the prefill engine."""
    prefill, decode = cluster.engines
    before = {e.name: served(e) for e in cluster.engines}
    pulled_before = counter(decode, "vllm:external_prefix_cache_hits_total")
    route, _, usage = streamed_chat(pd, [{"role": "user", "content": text(random.Random(82), 30)}], 4)
    assert route["prefill"].startswith(f"local ({usage.prompt_tokens} uncached tokens < min_remote_prefill_tokens 256)"), route
    assert route["instance"].rstrip("/") == decode.url, route
    assert usage.completion_tokens == 4
    assert served(prefill) == before["a"] and served(decode) == before["b"] + 1
    assert counter(decode, "vllm:external_prefix_cache_hits_total") == pulled_before
    assert prefill_legs(pd, "local") == 1


def established(proxy, ports):
    """The proxy process's established TCP connections to 127.0.0.1 on `ports`."""
    out = subprocess.run(["ss", "-Htnp", "state", "established"], capture_output=True, text=True, check=True).stdout
    pid = f"pid={proxy.proc.pid},"
    return [line for line in out.splitlines() if pid in line and any(f"127.0.0.1:{p} " in line for p in ports)]


def test_a_prefill_leg_after_the_engines_closed_their_idle_connections_is_served(cluster, pd):
    """vLLM's uvicorn closes an idle keep-alive connection after 5 s. Once the engines have
    closed every connection the proxy pooled, a streamed long chat still prefills remotely
    (a stale pooled connection must not turn into 503 prefill_failed)."""
    prefill, decode = cluster.engines
    ports = (prefill.port, decode.port)
    # A long chat first, so that both engines' connections are pooled. A chat that outlasts
    # uvicorn's 5 s keep-alive (a slow first transfer) may find them closed already when it
    # ends (one CI run did): then a second one, on warm engines, pools them. Each is a prompt
    # of its own: the same one again would be cached on the decode engine and prefilled there.
    for attempt in range(2):
        route, _, _ = streamed_chat(pd, [{"role": "user", "content": text(random.Random(190 + attempt), 400)}], 4)
        assert route["prefill"].rstrip("/") == prefill.url, route
        if established(pd, ports):
            break
    else:
        pytest.fail("two chats left no pooled connection")
    # The engines' side of every pooled connection closed (a FIN after 5 s idle).
    wait_until("the engines to close the idle connections", lambda: not established(pd, ports), timeout=30, interval=0.2)
    route, _, usage = streamed_chat(pd, [{"role": "user", "content": text(random.Random(83), 400)}], 4)
    assert route["prefill"].rstrip("/") == prefill.url, route
    assert usage.completion_tokens == 4


@pytest.fixture(scope="module")
def front(cluster):
    """A proxy with the KServe gRPC listener and the endpoint picker, on the suite's
    discovery and events."""
    cfg = cluster.workdir / "front.yaml"
    cfg.write_text(proxy_config(
        cluster.etcd.url, cluster.nats.url, listed_model(),
        "grpc:\n  address: 127.0.0.1:0\nepp:\n  address: 127.0.0.1:0\n  fallbacks: 1\n",
    ))
    proxy = Proc("kvmesh-proxy", ["--config", str(cfg)], cluster.workdir)

    def both_listed():
        health = json.dumps(get_json(proxy.url("admin") + "/health"))
        return all(e.url in health for e in cluster.engines)

    wait_until("both engines in the front proxy", both_listed, timeout=30)
    yield proxy
    proxy.stop()


def explain_json(proxy, prompt):
    """`POST /debug/route` for a completions prompt, as the proxy answers it."""
    status, _, body = http("POST", proxy.url("admin") + "/debug/route?route=completions",
                           {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert status == 200, body
    return json.loads(body)


def explain_completion(proxy, prompt):
    """`POST /debug/route` for a completions prompt: {engine URL: reported_blocks}."""
    return {i["instance"].rstrip("/"): i["reported_blocks"] for i in explain_json(proxy, prompt)["instances"]}


def text_inputs(prompt, streaming=None):
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs = [tensor]
    if streaming is not None:
        flag = grpcclient.InferInput("streaming", [1], "BOOL")
        flag.set_data_from_numpy(np.array([streaming], dtype=bool))
        inputs.append(flag)
    return inputs


def param(result, name):
    parameter = result.get_response().parameters.get(name)
    return None if parameter is None else getattr(parameter, parameter.WhichOneof("parameter_choice"))


def the_engine_that_served(cluster, before):
    """The one engine whose own finished-request count grew by one since `before`."""
    grown = delta(engine_counts(cluster, "vllm:request_success_total"), before)
    assert sorted(grown.values()) == [0, 1], grown
    return next(e for e in cluster.engines if grown[e.name] == 1)


def test_kserve_grpc_infer_and_stream_infer_reach_a_real_engine_and_route_by_its_cache(cluster, front):
    """tritonclient's ModelInfer, then ModelStreamInfer with the same prompt: each is served
    by a real engine (its own counters), the second where the first left its blocks, and
    that engine reports the prompt cached."""
    # Long (about 1,200 tokens), so that its cached copy outweighs a learned speed set by one
    # slow first request (the proxy is new, and an engine restarted earlier starts cold).
    prompt = text(random.Random(91), 1200)
    with grpcclient.InferenceServerClient(url=front.listeners["grpc"]) as client:
        before = engine_counts(cluster, "vllm:request_success_total")
        prompt_before = engine_counts(cluster, "vllm:prompt_tokens_total")
        first = client.infer(MODEL, text_inputs(prompt), parameters={"max_tokens": 4})
        assert param(first, "completion_tokens") == 4 and first.as_numpy("text_output")[0]
        home = the_engine_that_served(cluster, before)
        prompt_tokens = param(first, "prompt_tokens")
        assert delta(engine_counts(cluster, "vllm:prompt_tokens_total"), prompt_before)[home.name] == prompt_tokens
        blocks = prompt_tokens // BLOCK_SIZE
        wait_until("the prompt's blocks in the front proxy's index",
                   lambda: explain_completion(front, prompt)[home.url] == blocks, timeout=30)

        before = engine_counts(cluster, "vllm:request_success_total")
        hits_before = counter(home, "vllm:prefix_cache_hits_total")
        decision = explain_json(front, prompt)
        results = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            client.async_stream_infer(MODEL, text_inputs(prompt, True), request_id="again", parameters={"max_tokens": 6})
            pieces, final = [], None
            while final is None:
                result, error = results.get(timeout=60)
                assert error is None, error
                pieces.append(result.as_numpy("text_output")[0].decode())
                if param(result, "triton_final_response"):
                    final = result
        finally:
            client.stop_stream()
    assert len(pieces) >= 6 and "".join(pieces)
    assert param(final, "completion_tokens") == 6
    assert the_engine_that_served(cluster, before) is home, json.dumps(decision)
    assert counter(home, "vllm:prefix_cache_hits_total") - hits_before == min(blocks, cap(prompt_tokens)) * BLOCK_SIZE


MODE = processing_mode_pb2.ProcessingMode
DEST = "x-gateway-destination-endpoint"


class Exchange:
    """One ext_proc stream written and read in Envoy's order (full duplex, as the Inference
    Extension configures it); tests/python/test_epp.py drives every other case."""

    def __init__(self, chan):
        self.call = ep_grpc.ExternalProcessorStub(chan).Process()

    async def recv(self):
        return await asyncio.wait_for(self.call.read(), 30)

    async def pick(self, body):
        pairs = [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")]
        await self.call.write(ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(headers=header_map(pairs)),
            protocol_config=ep.ProtocolConfiguration(
                request_body_mode=MODE.FULL_DUPLEX_STREAMED, response_body_mode=MODE.FULL_DUPLEX_STREAMED),
        ))
        await self.call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
        first = await self.recv()
        assert first.WhichOneof("response") == "request_headers", first
        endpoints = set_headers(first.request_headers.response)[DEST]
        echoed = (await self.recv()).request_body.response.body_mutation.streamed_response
        assert (echoed.body, echoed.end_of_stream) == (body, True)
        return endpoints.split(",")

    async def respond(self, served_by, response):
        """Relays the engine's `response` (httpx) as Envoy would; returns the headers the
        picker adds to the client's response."""
        message = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=header_map(
            [(":status", str(response.status_code)), ("content-type", response.headers["content-type"])])))
        message.metadata_context.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": served_by})
        await self.call.write(message)
        added = set_headers((await self.recv()).response_headers.response)
        await self.call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=response.content, end_of_stream=True)))
        echo = (await self.recv()).response_body.response.body_mutation.streamed_response
        assert echo.body == response.content and echo.end_of_stream
        await self.call.done_writing()
        assert await self.recv() == grpc.aio.EOF
        return added


def header_map(pairs):
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def set_headers(common):
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def test_the_endpoint_picker_names_a_real_engine_and_picks_a_repeated_prompt_where_its_blocks_are(cluster, front):
    """The picker names real engines (`ip:port`); the request forwarded to its pick is
    served there (the engine's own count), then the same conversation is picked onto the
    same engine, whose stream reports the prompt cached as the picker predicted. The
    suite's proxy is a replica of the picker: one of the two decides for the other."""
    # Long for the same reason as the gRPC test's prompt.
    messages = [{"role": "user", "content": text(random.Random(92), 1200)}]
    addresses = sorted(e.url.removeprefix("http://") for e in cluster.engines)
    asks_before = front_asks(front)
    trace = {}
    decided_before = metric_sum(metrics(cluster.admin + "/metrics"), "kvmesh_route_decided_for_replicas_total")

    async def go():
        async with grpc.aio.insecure_channel(front.listeners["epp"]) as chan, httpx.AsyncClient(
            timeout=60, headers={"content-type": "application/json"}
        ) as client:
            body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()
            exchange = Exchange(chan)
            endpoints = await exchange.pick(body)
            assert sorted(endpoints) == addresses, endpoints
            before = engine_counts(cluster, "vllm:request_success_total")
            response = await client.post(f"http://{endpoints[0]}/v1/chat/completions", content=body)
            assert response.status_code == 200, response.text
            home = the_engine_that_served(cluster, before)
            assert home.url == f"http://{endpoints[0]}"
            added = await exchange.respond(endpoints[0], response)
            assert added["x-kvmesh-instance"].rstrip("/") == home.url
            trace["first_route"] = added.get("x-kvmesh-route")
            prompt_tokens = response.json()["usage"]["prompt_tokens"]
            blocks = prompt_tokens // BLOCK_SIZE
            await asyncio.to_thread(wait_until, "the blocks in the picker's index",
                                    lambda: reported_on_front(front, messages, home) == blocks, 30)
            # Wait until both proxies (replicas: one decides for the other) count nothing on the
            # home engine, so the repeat is placed by its cached blocks alone.
            await asyncio.to_thread(wait_until, "the first request's end on every proxy",
                                    lambda: all(idle_on(admin, messages, home)
                                                for admin in (front.url("admin"), cluster.admin)), 30)

            trace["explained_before"] = {name: debug_route(admin, messages)
                                         for name, admin in (("front", front.url("admin")), ("cluster", cluster.admin))}
            streamed = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True,
                                   "stream_options": {"include_usage": True}}).encode()
            exchange = Exchange(chan)
            endpoints = await exchange.pick(streamed)
            assert endpoints[0] == home.url.removeprefix("http://"), json.dumps({
                "picked": endpoints, "home": home.url, **trace,
                "explained": {name: debug_route(admin, messages)
                              for name, admin in (("front", front.url("admin")), ("cluster", cluster.admin))},
                "decider": {name: {series: value for series, value in metrics(admin + "/metrics").items()
                                   if "decide" in series or "share_wait" in series or "ask" in series}
                            for name, admin in (("front", front.url("admin")), ("cluster", cluster.admin))},
            }, indent=1)
            response = await client.post(f"http://{endpoints[0]}/v1/chat/completions", content=streamed)
            assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
            added = await exchange.respond(endpoints[0], response)
            trace["repeat_route"] = added["x-kvmesh-route"]
            route = route_of({"x-kvmesh-route": added["x-kvmesh-route"]})
            assert int(route["reported_blocks"]) == blocks, route
            usage = [json.loads(line[6:]) for line in response.text.splitlines()
                     if line.startswith("data: {")][-1]["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == min(blocks, cap(prompt_tokens)) * BLOCK_SIZE

    asyncio.run(asyncio.wait_for(go(), 180))
    asked = {outcome: count - asks_before.get(outcome, 0) for outcome, count in front_asks(front).items()}
    asked = {outcome: count for outcome, count in asked.items() if count}
    decided = metric_sum(metrics(cluster.admin + "/metrics"), "kvmesh_route_decided_for_replicas_total") - decided_before
    # Every pick the picker asked its decider about was decided there, once; the rest it
    # routed alone (it is the decider itself, or its choice was decisive).
    assert asked.get("chosen", 0) == decided and set(asked) <= {"chosen", "decisive"}, json.dumps(
        {"decided": decided, "asked": asked, **trace}, indent=1)


def front_asks(front):
    """The picker's asks of its decider so far, by outcome."""
    page = metrics(front.url("admin") + "/metrics")
    outcomes = ("chosen", "declined", "timeout", "unavailable", "skipped", "decisive")
    return {outcome: metric_sum(page, "kvmesh_route_decider_asks_total", outcome=outcome) for outcome in outcomes}


def idle_on(admin, messages, engine):
    """Whether the proxy at `admin` counts no request on `engine` (its own or other replicas')."""
    load = next(i for i in debug_route(admin, messages)["instances"] if i["instance"].rstrip("/") == engine.url)
    return load["active_requests"] == 0 and load["active_prefill_tokens"] == 0


def reported_on_front(front, messages, engine):
    instances = debug_route(front.url("admin"), messages)["instances"]
    return next(i["reported_blocks"] for i in instances if i["instance"].rstrip("/") == engine.url)
