"""vLLM's own routes through kvmesh (`engine_routes`), against the suite's real engines: the
engine answers them as it would directly, and the prompt-bearing ones (`/tokenize`,
`/inference/v1/generate`, kvmesh's `/v1/responses`) are routed by KV overlap from prompts
rendered and tokenized exactly as the engine does (its own answers prove it: the token ids
it returns, the cached tokens it reports)."""

import json
import random

from conftest import BLOCK_SIZE, MODEL, http, wait_until
from test_real_vllm import cap, chat, reported_on, route_of, text


def post(cluster, path, body):
    status, headers, raw = http("POST", cluster.base + path, body, timeout=60)
    return status, headers, json.loads(raw) if raw else None


def cached_chat(cluster, messages):
    """A chat through the proxy, once its engine's events put its blocks in the index:
    (route, usage)."""
    route, usage, _ = chat(cluster, messages)
    engine = cluster.engine_by_url(route["instance"])
    blocks = usage.prompt_tokens // BLOCK_SIZE
    wait_until("the chat's blocks in the index", lambda: reported_on(cluster, engine, messages) == blocks)
    return route, usage


def test_tokenize_and_detokenize_pass_through_and_tokenize_routes_by_the_chat_s_blocks(cluster):
    rng = random.Random(71)
    messages = [
        {"role": "system", "content": text(rng, 200)},
        {"role": "user", "content": text(rng, 20)},
    ]
    route, usage = cached_chat(cluster, messages)
    home = route["instance"]
    status, headers, tokenized = post(cluster, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, tokenized
    # The engine's own tokens of the rendered chat: as many as the chat's prompt.
    assert tokenized["count"] == usage.prompt_tokens
    tokenize_route = route_of(headers)
    assert tokenize_route["instance"] == home, "the engine caching the chat"
    assert int(tokenize_route["prompt_blocks"]) == usage.prompt_tokens // BLOCK_SIZE
    assert int(tokenize_route["reported_blocks"]) == usage.prompt_tokens // BLOCK_SIZE
    status, _, detokenized = post(cluster, "/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]})
    assert status == 200, detokenized
    assert messages[0]["content"] in detokenized["prompt"]


def test_responses_render_as_the_engine_renders_and_hit_the_chat_s_cache(cluster):
    rng = random.Random(73)
    instructions, question = text(rng, 300), text(rng, 20)
    route, usage = cached_chat(
        cluster,
        [{"role": "system", "content": instructions}, {"role": "user", "content": question}],
    )
    status, headers, response = post(
        cluster,
        "/v1/responses",
        {"model": MODEL, "instructions": instructions, "input": question, "max_output_tokens": 1},
    )
    assert status == 200, response
    responses_route = route_of(headers)
    # kvmesh rendered the same prompt vLLM renders for the chat: the same blocks, on the
    # engine that caches them, and that engine reports them cached.
    assert responses_route["prompt_blocks"] == route["prompt_blocks"]
    assert responses_route["instance"] == route["instance"]
    assert response["usage"]["input_tokens"] == usage.prompt_tokens
    cached = response["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached == cap(usage.prompt_tokens) * BLOCK_SIZE, response["usage"]


def test_generate_takes_token_ids_and_routes_by_them(cluster):
    rng = random.Random(79)
    status, _, tokenized = post(cluster, "/tokenize", {"model": MODEL, "prompt": text(rng, 150)})
    assert status == 200, tokenized
    ids = tokenized["tokens"]
    body = {"model": MODEL, "token_ids": ids, "sampling_params": {"max_tokens": 2}}
    status, headers, first = post(cluster, "/inference/v1/generate", body)
    assert status == 200, first
    route = route_of(headers)
    assert int(route["prompt_blocks"]) == len(ids) // BLOCK_SIZE
    status, headers, again = post(cluster, "/inference/v1/generate", body)
    assert status == 200, again
    assert route_of(headers)["instance"] == route["instance"], "the engine that cached it"


def test_admin_routes_need_a_key_allowed_them(cluster):
    status, _, body = post(cluster, "/reset_prefix_cache", {"model": MODEL})
    assert status == 403, body
    assert body["error"]["code"] == "route_not_allowed"
