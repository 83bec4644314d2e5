"""engine-sim held to the real engine: the same requests to `kvmesh-engine-sim` and to the
suite's real vLLM, comparing what kvmesh depends on — the shapes and field names of answers
and SSE chunks, usage and `cached_tokens` (with vLLM's cap), status and body of bad requests,
the KV event encoding and the replay socket's framing, the metric names the agent reads, and
`kv_transfer_params`. Structure (keys, JSON types) is compared, never generated text.

The simulator runs as the suite's engines do (block size 32, 160 blocks, context 4096, the
Qwen3 tokenizer, prompt-token details, KV events with replay on topic `kv-events`) and with
engine-sim's own defaults for everything else: the event encoding is not named, so its
default must be vLLM's map form.
"""

import json
import random
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import (
    BLOCK_SIZE,
    CACHE_BLOCKS,
    MODEL,
    ROOT,
    TOKENIZER,
    http,
    metrics,
    wait_until,
)
from kvmesh_processes import Proc

DUMP = Path(__file__).with_name("kv_replay_dump.py")
MAX_MODEL_LEN = 4096  # scripts/vllm.sh serve's --max-model-len

# Keys vLLM 0.32 sends that engine-sim leaves out; kvmesh reads none of them. Anything else
# vLLM sends and the simulator does not, or anything the simulator sends that vLLM does not,
# fails the comparison.
VLLM_ONLY = {
    "completion": {"service_tier", "system_fingerprint", "ec_transfer_params", "metrics"},
    "completion.choice": {"token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts"},
    "chat": {
        "service_tier", "system_fingerprint", "ec_transfer_params", "metrics",
        "prompt_logprobs", "prompt_token_ids", "prompt_text",
    },
    "chat.choice": {"token_ids", "routed_experts"},
    "chat.message": {"refusal", "annotations", "audio", "function_call", "reasoning"},
    "usage": {"completion_tokens_details"},
    "usage.prompt_tokens_details": {"created_cache_tokens", "multimodal_tokens"},
    "completion.chunk": {"system_fingerprint"},
    "completion.chunk.choice": {"prompt_token_ids", "token_ids"},
    "chat.chunk": {"prompt_token_ids", "prompt_text", "system_fingerprint"},
    "chat.chunk.choice": {"token_ids"},
}

# What kvmesh (proxy, agent, bench) reads from an answer: present in both, same JSON types.
READ_BY_KVMESH = {
    "completion": {"id", "object", "model", "choices", "usage", "kv_transfer_params"},
    "completion.choice": {"index", "text", "finish_reason"},
    "chat": {"id", "object", "model", "choices", "usage", "kv_transfer_params"},
    "chat.choice": {"index", "message", "finish_reason"},
    "chat.message": {"role", "content"},
    "usage": {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"},
    "usage.prompt_tokens_details": {"cached_tokens"},
}

# The metrics the agent reads (worker-agent/src/load.rs, cache_config.rs), with the labels
# both engines put on them.
AGENT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def json_type(value):
    return {dict: "object", list: "array", str: "string", bool: "bool", type(None): "null",
            int: "number", float: "number"}[type(value)]


def compare(kind, real, sim, where, differences):
    """Appends to `differences` every way `sim` (an object of `kind`) differs from `real`."""
    allowed = VLLM_ONLY.get(kind, set())
    for key in sorted(set(sim) - set(real)):
        differences.append(f"{where}.{key}: engine-sim sends it, vLLM does not")
    for key in sorted(set(real) - set(sim) - allowed):
        differences.append(f"{where}.{key}: vLLM sends it ({json.dumps(real[key])[:60]}), engine-sim does not")
    for key in sorted(READ_BY_KVMESH.get(kind, set())):
        if key not in real or key not in sim:
            differences.append(f"{where}.{key}: kvmesh reads it; vLLM has it: {key in real}, engine-sim: {key in sim}")
    for key in sorted(set(real) & set(sim)):
        a, b = real[key], sim[key]
        # null against a value is a value's absence (stop_reason, content), not a shape change
        if a is not None and b is not None and json_type(a) != json_type(b):
            differences.append(f"{where}.{key}: vLLM {json_type(a)}, engine-sim {json_type(b)}")
            continue
        child = {
            ("completion", "choices"): "completion.choice",
            ("chat", "choices"): "chat.choice",
            ("chat.choice", "message"): "chat.message",
            ("completion", "usage"): "usage",
            ("chat", "usage"): "usage",
            ("completion.chunk", "usage"): "usage",
            ("chat.chunk", "usage"): "usage",
            ("usage", "prompt_tokens_details"): "usage.prompt_tokens_details",
            ("completion.chunk", "choices"): "completion.chunk.choice",
            ("chat.chunk", "choices"): "chat.chunk.choice",
            ("chat.chunk.choice", "delta"): "chat.chunk.delta",
        }.get((kind, key))
        if child is None or a is None or b is None:
            continue
        if isinstance(a, list):
            for i, (x, y) in enumerate(zip(a, b)):
                compare(child, x, y, f"{where}.{key}[{i}]", differences)
        else:
            compare(child, a, b, f"{where}.{key}", differences)


@pytest.fixture(scope="module")
def sim(cluster):
    proc = Proc(
        "kvmesh-engine-sim",
        ["--port", "0", "--model", MODEL, "--block-size", str(BLOCK_SIZE),
         "--num-gpu-blocks", str(CACHE_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN),
         "--enable-prompt-tokens-details", "--tokenizer", str(TOKENIZER / "tokenizer.json"),
         "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
         "--kv-events-topic", "kv-events", "--no-delay"],
        cluster.workdir,
    )
    proc.replay = "tcp://" + proc.listeners["kv-replay-0"]
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pair(cluster, sim):
    """(real engine URL, its replay endpoint, simulator URL, its replay endpoint)."""
    engine = cluster.engines[0]
    return engine.url, engine.replay, sim.url("engine-0"), sim.replay


def both(pair, path, body=None, raw=None, method="POST"):
    """The same request to the real engine and to the simulator: ((status, body), ...)."""
    out = []
    for base in (pair[0], pair[2]):
        if raw is not None:
            req = urllib.request.Request(base + path, data=raw, method=method)
            req.add_header("content-type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    out.append((resp.status, resp.read()))
            except urllib.error.HTTPError as err:
                out.append((err.code, err.read()))
        else:
            status, _, data = http(method, base + path, body, timeout=60)
            out.append((status, data))
    return out


def sse(data):
    """The `data:` payloads of an SSE body; the last must be `[DONE]`."""
    events = [line[len("data: "):] for line in data.decode().split("\n\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", data[-300:]
    return [json.loads(e) for e in events[:-1]]


def ids(rng, n):
    base = rng.randrange(10_000, 100_000)
    return list(range(base, base + n))


def test_answers_have_vllms_shapes(pair):
    rng = random.Random(31)
    differences = []
    for kind, path, body in (
        ("completion", "/v1/completions", {"model": MODEL, "prompt": ids(rng, 40), "max_tokens": 3}),
        ("completion", "/v1/completions", {"model": MODEL, "prompt": "hello conformance", "max_tokens": 2}),
        ("chat", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "hello conformance"}], "max_tokens": 3}),
        ("chat", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}),
    ):
        (rs, real), (ss, sim) = both(pair, path, {**body, "ignore_eos": True})
        assert (rs, ss) == (200, 200), (real[:300], sim[:300])
        real, sim = json.loads(real), json.loads(sim)
        compare(kind, real, sim, f"{path} {sorted(body)}", differences)
        # The key is there on every whole answer, null off a prefill leg.
        assert real["kv_transfer_params"] is None and sim["kv_transfer_params"] is None
        assert real["object"] == sim["object"]
        assert real["usage"]["completion_tokens"] == sim["usage"]["completion_tokens"] == body.get(
            "max_tokens", body.get("max_completion_tokens"))
    assert differences == [], "\n".join(differences)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_streams_have_vllms_chunks(pair, endpoint, include_usage):
    kind = "completion.chunk" if endpoint == "completions" else "chat.chunk"
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "ignore_eos": True}
    if endpoint == "completions":
        path, body["prompt"] = "/v1/completions", "stream conformance"
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "stream conformance"}]
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    (rs, real), (ss, sim) = both(pair, path, body)
    assert (rs, ss) == (200, 200)
    real, sim = sse(real), sse(sim)
    differences = []
    for name, chunks in (("vLLM", real), ("engine-sim", sim)):
        with_usage = [c for c in chunks if "usage" in c]
        if include_usage:
            # The last chunk carries the usage and no choice; no other chunk has usage.
            assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == [], (name, chunks[-2:])
            assert chunks[-1]["usage"]["completion_tokens"] == 4, (name, chunks[-1])
            assert isinstance(chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"], int), name
        else:
            assert with_usage == [], name
        content = [c for c in chunks if c["choices"]]
        finishing = [c for c in content if c["choices"][0]["finish_reason"] is not None]
        assert finishing == [content[-1]] and finishing[0]["choices"][0]["finish_reason"] == "length", name
        if endpoint == "chat":
            assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, (name, content[0])
    # Chunk by chunk role: the first, a middle one, the finishing one and the usage chunk.
    real_content = [c for c in real if c["choices"]]
    sim_content = [c for c in sim if c["choices"]]
    for role, a, b in (
        ("first", real_content[0], sim_content[0]),
        ("middle", real_content[1], sim_content[1]),
        ("finishing", real_content[-1], sim_content[-1]),
        *((("usage", real[-1], sim[-1]),) if include_usage else ()),
    ):
        compare(kind, a, b, f"{endpoint} {role} chunk", differences)
        if role == "usage":
            compare("usage", a["usage"], b["usage"], f"{endpoint} usage chunk usage", differences)
        elif endpoint == "chat":
            delta_keys = (sorted(a["choices"][0]["delta"]), sorted(b["choices"][0]["delta"]))
            if delta_keys[0] != delta_keys[1]:
                differences.append(f"{endpoint} {role} chunk delta keys: vLLM {delta_keys[0]}, engine-sim {delta_keys[1]}")
    # vLLM leaves the nulls out of the usage chunk's details (no created_cache_tokens: null)
    assert differences == [], "\n".join(differences)


def test_cached_tokens_agree_with_vllms_cap(pair):
    """Token-id prompts, so both engines see the same tokens: a second identical 64-token
    prompt is a full hit, reported as floor((64 - 1) / 32) = 1 block; 100 tokens sharing those
    64 then report both blocks."""
    rng = random.Random(47)
    prompt = ids(rng, 2 * BLOCK_SIZE)
    answers = []
    for tokens in (prompt, prompt, prompt + ids(rng, 36)):
        (rs, real), (ss, sim) = both(pair, "/v1/completions", {"model": MODEL, "prompt": tokens, "max_tokens": 1})
        assert (rs, ss) == (200, 200)
        real, sim = json.loads(real)["usage"], json.loads(sim)["usage"]
        assert real["prompt_tokens"] == sim["prompt_tokens"] == len(tokens)
        answers.append((real["prompt_tokens_details"]["cached_tokens"], sim["prompt_tokens_details"]["cached_tokens"]))
    cap = (2 * BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert answers == [(0, 0), (cap, cap), (2 * BLOCK_SIZE, 2 * BLOCK_SIZE)], answers


BAD_REQUESTS = [
    # (name, path, body or raw bytes, whether `param` must agree too)
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1}, True),
    ("unknown model, chat", "/v1/chat/completions",
     {"model": "nope", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, True),
    ("unknown model, stream", "/v1/completions",
     {"model": "nope", "prompt": "x", "max_tokens": 1, "stream": True}, True),
    ("bad JSON", "/v1/completions", b"{not json", False),
    ("bad JSON, chat", "/v1/chat/completions", b"{not json", False),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, True),
    ("zero max_tokens", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, True),
    ("negative max_tokens, chat", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, True),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": list(range(MAX_MODEL_LEN + 10)), "max_tokens": 1}, True),
    ("prompt too long, stream", "/v1/completions",
     {"model": MODEL, "prompt": list(range(MAX_MODEL_LEN + 10)), "max_tokens": 1, "stream": True}, True),
    ("prompt too long, chat", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "w " * (MAX_MODEL_LEN + 10)}], "max_tokens": 1}, True),
    ("missing prompt", "/v1/completions", {"model": MODEL, "max_tokens": 1}, False),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 1}, True),
    ("missing messages", "/v1/chat/completions", {"model": MODEL, "max_tokens": 1}, False),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 1}, True),
    ("max_tokens not a number", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "x"}, False),
    ("stream_options without stream", "/v1/completions",
     {"model": MODEL, "prompt": "x", "max_tokens": 1, "stream_options": {"include_usage": True}}, True),
    ("n of 0", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "n": 0}, False),
    ("empty cache_salt", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "cache_salt": ""}, True),
]


def test_bad_requests_get_vllms_status_and_error_shape(pair):
    differences = []
    for name, path, body, same_param in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else None
        (rs, real), (ss, sim) = both(pair, path, None if raw else body, raw=raw)
        if rs != ss:
            differences.append(f"{name}: vLLM {rs}, engine-sim {ss} ({sim[:120]!r})")
            continue
        real, sim = json.loads(real), json.loads(sim)
        shape = lambda e: sorted((k, json_type(v)) for k, v in e.get("error", {}).items())  # noqa: E731
        if sorted(real) != ["error"] or sorted(sim) != ["error"] or shape(real) != shape(sim):
            # `param` may be null on one side and a string on the other: compare the keys
            if sorted(real.get("error", {})) != sorted(sim.get("error", {})) or sorted(real) != sorted(sim):
                differences.append(f"{name}: vLLM {real}, engine-sim {sim}")
                continue
        if real["error"]["code"] != rs or sim["error"]["code"] != ss:
            differences.append(f"{name}: code field differs from the status: {real}, {sim}")
        if same_param and real["error"]["param"] != sim["error"]["param"]:
            differences.append(f"{name}: param vLLM {real['error']['param']!r}, engine-sim {sim['error']['param']!r}")
    assert differences == [], "\n".join(differences)
    # vLLM does not refuse a max_tokens past the context length: it stops there. So does the sim.
    prompt = list(range(MAX_MODEL_LEN - 5))
    for status, data in both(pair, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 50,
                                                       "ignore_eos": True}):
        assert status == 200, data[:300]
        answer = json.loads(data)
        assert answer["usage"]["completion_tokens"] == 5 and answer["choices"][0]["finish_reason"] == "length"


def replay(endpoint, start=0, timeout_s=5):
    python = subprocess.run(
        [str(ROOT / "scripts" / "vllm.sh"), "python"], check=True, capture_output=True, text=True
    ).stdout.strip().splitlines()[-1]
    out = subprocess.run([python, str(DUMP), endpoint, str(start), str(timeout_s)], check=True,
                         capture_output=True, text=True, timeout=timeout_s + 30)
    return json.loads(out.stdout)


def stores_of(dump, first_token):
    """The BlockStored events (as sent) whose tokens start with `first_token`, with their reply."""
    found = []
    for reply in dump["replies"]:
        for event in (reply.get("batch") or [None, []])[1]:
            tokens = event.get("token_ids") if isinstance(event, dict) else (event[3] if len(event) > 3 else None)
            if tokens and tokens[0] == first_token:
                found.append((reply, event))
    return found


def test_kv_events_and_replay_are_encoded_as_vllm_sends_them(pair):
    """A salted 100-token prompt on both engines: the BlockStored each publishes (read back from
    its replay socket, whose framing is compared too) has the same form, keys in the same order,
    the same value types, the same tokens, block size and extra keys."""
    rng = random.Random(53)
    tokens = ids(rng, 100)
    for status, data in both(pair, "/v1/completions",
                             {"model": MODEL, "prompt": tokens, "max_tokens": 1, "cache_salt": "tenant-conformance"}):
        assert status == 200, data[:300]
    found = {}
    for name, endpoint in (("vLLM", pair[1]), ("engine-sim", pair[3])):
        # The engine publishes a step's events after the step: wait for the store to be buffered.
        found[name] = wait_until(f"{name}'s BlockStored in its replay buffer",
                                 lambda: stores_of(replay(endpoint), tokens[0]), timeout=20, interval=0.2)
        dump = replay(endpoint)
        assert dump["ended"], f"{name}: no end-of-replay marker"
        end = dump["replies"][-1]
        # [empty delimiter, empty topic, seq -1, empty payload]
        assert end["end"] == ["", "", "ff" * 8, ""], (name, end)
    (real_reply, real), (sim_reply, sim) = found["vLLM"][0], found["engine-sim"][0]
    for reply in (real_reply, sim_reply):
        assert reply["frames"] == 4 and reply["topic"] == "kv-events" and reply["lengths"][2] == 8, reply
    assert isinstance(real, dict), f"vLLM sent {type(real).__name__}"
    assert isinstance(sim, dict), f"engine-sim sent the positional form by default: {sim}"
    assert list(sim) == list(real), (list(real), list(sim))
    for key in real:
        if real[key] is not None or sim[key] is not None:
            assert json_type(real[key]) == json_type(sim[key]), (key, real[key], sim[key])
    assert sim["token_ids"] == real["token_ids"] == tokens[: 3 * BLOCK_SIZE]
    assert (sim["block_size"], sim["parent_block_hash"], sim["medium"]) == (BLOCK_SIZE, None, "GPU")
    assert (real["block_size"], real["parent_block_hash"], real["medium"]) == (BLOCK_SIZE, None, "GPU")
    assert sim["extra_keys"] == real["extra_keys"] == [["tenant-conformance"], None, None]
    assert len(sim["block_hashes"]) == len(real["block_hashes"]) == 3
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in real["block_hashes"] + sim["block_hashes"])
    # The batch: [timestamp (float), events, data-parallel rank 0].
    for reply in (real_reply, sim_reply):
        ts, events, rank = reply["batch"]
        assert isinstance(ts, float) and isinstance(events, list) and rank == 0


def test_the_metrics_the_agent_reads_have_vllms_names_and_labels(pair):
    pages = {name: metrics(url + "/metrics") for name, url in (("vLLM", pair[0]), ("engine-sim", pair[2]))}
    for name, page in pages.items():
        for metric in AGENT_METRICS:
            series = [s for s in page if s.partition("{")[0] == metric]
            assert series, f"{name} has no {metric}"
            assert all(f'model_name="{MODEL}"' in s and 'engine="0"' in s for s in series), (name, series)
        info = [s for s in page if s.startswith("vllm:cache_config_info{")]
        assert len(info) == 1, (name, info)
        assert f'block_size="{BLOCK_SIZE}"' in info[0] and f'num_gpu_blocks="{CACHE_BLOCKS}"' in info[0], info
        for counter in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            assert any(s.partition("{")[0] == counter for s in page), (name, counter)


# What a vLLM 0.32 prefill engine with NixlConnector answers (../shared/reference/real-vllm.md).
RECORDED_KV_TRANSFER_PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "localhost", "remote_port": 5601,
    "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 300, "remote_blocks_expiry_time": None,
    "transfer_mode": "pull", "remote_prefill_cached_tokens": 0,
}


def test_a_prefill_legs_kv_transfer_params_have_vllms_shape(pair):
    """`do_remote_decode` on both: the answer's `kv_transfer_params`, key by key. When the
    suite's engines run without a KV connector (vLLM then answers null), the simulator's
    answer is compared with the one recorded from a vLLM 0.32 engine with NixlConnector."""
    rng = random.Random(59)
    body = {"model": MODEL, "prompt": ids(rng, 70), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    (rs, real), (ss, sim) = both(pair, "/v1/completions", body)
    assert (rs, ss) == (200, 200), (real[:300], sim[:300])
    real = json.loads(real)["kv_transfer_params"] or RECORDED_KV_TRANSFER_PARAMS
    sim = json.loads(sim)["kv_transfer_params"]
    assert sorted(sim) == sorted(real), (sorted(real), sorted(sim))
    for key in real:
        if real[key] is not None or sim[key] is not None:
            assert json_type(real[key]) == json_type(sim[key]), (key, real[key], sim[key])
    assert isinstance(sim["remote_block_ids"][0], list) and len(sim["remote_block_ids"]) == 1, sim
    assert len(real["remote_block_ids"]) == 1
    assert (sim["do_remote_prefill"], sim["do_remote_decode"], sim["transfer_mode"]) == (True, False, "pull")
    assert sim["remote_num_tokens"] == 70
