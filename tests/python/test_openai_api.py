"""The OpenAI API through kvmesh-proxy, driven by the official `openai` client."""

import json

import httpx
import openai
import pytest

from conftest import ALIAS, MODEL


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


def test_models_lists_names_and_aliases(client):
    ids = {m.id for m in client.models.list()}
    assert {MODEL, ALIAS} <= ids


def test_chat_non_streaming(client, engines):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello to the mesh."}],
        max_tokens=7,
    )
    chat = raw.parse()
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 7
    assert chat.usage.prompt_tokens > 0
    served = raw.headers["x-kvmesh-instance"]
    assert served in {f"http://{a}" for a in engines.listeners.values()}
    assert raw.headers.get("x-request-id")


def test_chat_by_alias_is_deterministic(client):
    args = dict(messages=[{"role": "user", "content": "same prompt"}], max_tokens=5)
    a = client.chat.completions.create(model=ALIAS, **args)
    b = client.chat.completions.create(model=MODEL, **args)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream me some words."}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9


def test_completions_with_token_id_prompt(client):
    prompt = list(range(100, 164))
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == 4
    assert resp.choices[0].text


def test_completions_streaming(client):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True)
    texts = [c.choices[0].text for c in stream if c.choices]
    assert "".join(texts)


def test_embeddings_are_deterministic(client):
    a = client.embeddings.create(model=MODEL, input=["kv cache", "mesh"])
    b = client.embeddings.create(model=MODEL, input="kv cache")
    assert len(a.data) == 2
    assert a.data[0].embedding == b.data[0].embedding
    assert a.data[0].embedding != a.data[1].embedding


def test_unknown_model_is_404_listing_known_models(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    body = err.value.body
    assert body["code"] == "model_not_found" or err.value.code == "model_not_found"
    assert MODEL in err.value.message


def error_of(resp):
    body = resp.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_invalid_json_is_400(base_url):
    resp = httpx.post(f"{base_url}/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert error_of(resp)["message"]


def test_missing_model_is_400(base_url):
    resp = httpx.post(f"{base_url}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 400
    assert "model" in error_of(resp)["message"]


def test_body_too_large_is_413(base_url):
    big = json.dumps({"model": MODEL, "prompt": "x" * 100_000})
    resp = httpx.post(f"{base_url}/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413
    error_of(resp)


def test_wrong_method_is_405(base_url):
    resp = httpx.get(f"{base_url}/chat/completions")
    assert resp.status_code == 405
    assert "POST" in resp.headers.get("allow", "")
    error_of(resp)


def test_unknown_path_is_404(base_url):
    resp = httpx.post(f"{base_url}/no/such/route", json={"model": MODEL})
    assert resp.status_code == 404
    error_of(resp)


def test_bad_input_is_counted_and_proxy_keeps_serving(client, proxy, base_url):
    httpx.post(f"{base_url}/chat/completions", content=b"[", headers={"content-type": "application/json"})
    metrics = httpx.get(proxy.url("admin") + "/metrics").text
    assert "kvmesh_client_errors_total" in metrics
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still up?"}], max_tokens=2)
