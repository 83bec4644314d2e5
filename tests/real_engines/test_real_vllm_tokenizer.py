"""The proxy's tokenizer and chat template agree with the real engines' (`kv.tokenizer_check`,
docs/configuration.md "The tokenizer checks itself against the engines").

When each engine's agent registered it, the proxy sent the engine's `POST /tokenize` its
probes (a text prompt and two chats) and compared the ids with its own: both real vLLM
engines agree, so nothing is degraded and both are scored by their KV events. Order-free:
an engine restarted by an earlier test registers again and is checked again.
"""

import json

from conftest import MODEL, get_json, http, metric_sum, metrics, wait_until


def checks(cluster):
    page = metrics(cluster.admin + "/metrics")
    return {
        outcome: metric_sum(page, "kvmesh_route_tokenizer_checks_total", model=MODEL, outcome=outcome)
        for outcome in ("agreed", "mismatched", "unchecked")
    }


def test_the_proxy_tokenizes_as_both_real_engines(cluster):
    def agreed():
        health = get_json(cluster.admin + "/health")
        model = next(m for m in health["models"] if m["name"] == MODEL)
        seen = {
            engine.url: next(
                (i.get("tokenizer_check") for i in model["instances"] if i["url"].rstrip("/") == engine.url),
                None,
            )
            for engine in cluster.engines
        }
        return all(outcome == "agreed" for outcome in seen.values()) and (health, seen)

    health, _ = wait_until("both engines' tokenizer checks to agree", agreed, timeout=60)
    # The checks ran (at least once per engine), and none disagreed or went unchecked.
    counts = checks(cluster)
    assert counts["agreed"] >= 2, counts
    assert counts["mismatched"] == 0 and counts["unchecked"] == 0, counts
    page = metrics(cluster.admin + "/metrics")
    for engine in cluster.engines:
        assert metric_sum(page, "kvmesh_route_tokenizer_mismatch", model=MODEL, instance=engine.url) == 0
    assert not any("tokenizes" in line for line in health.get("degraded", [])), health

    # What the check relies on: vLLM 0.32's /tokenize shape, for a chat as the proxy renders it.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "How many tokens is this?"}],
        "add_generation_prompt": True,
    }
    status, _, raw = http("POST", cluster.engines[0].url + "/tokenize", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["count"] == len(answer["tokens"]) > 0, answer
    assert answer["max_model_len"] == 4096, answer
    # The proxy counts the same prompt tokens for that chat (its explanation, nothing forwarded).
    status, _, raw = http("POST", cluster.admin + "/debug/route", body)
    assert status == 200, raw
    assert json.loads(raw)["prompt_tokens"] == answer["count"], raw
