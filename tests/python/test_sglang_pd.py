"""SGLang's prefill/decode protocol, kvmesh's reading of it held to sglang-router's own: the
same requests from the real `openai` client go first through sglang-router 0.3.2's PD mode
(`--pd-disaggregation`; pinned in tests/python/requirements.txt) and then through kvmesh-proxy
with `disaggregation.protocol: sglang`, each in front of a fresh pair of capture engines, and
the tests compare what each router sent each leg (docs/disaggregation.md, "The protocol").

The prefill engine answers a leg only once the decode leg of the same `bootstrap_room` has
come, as SGLang's prefill engine finishes once the decode engine joined its room; a router
that sent the decode leg only after the prefill leg's answer gets a 504 after
JOIN_DEADLINE_S instead. The decode engine answers at once, with a text and usage of its own,
which the client must get.
"""

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from conftest import Proc
from kvmesh_processes import free_port

MODEL = "sglang-pd-model"
BOOTSTRAP_PORT = 9123
JOIN_DEADLINE_S = 10
ROUTER_START_TIMEOUT_S = 60
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# The engines' answers: the client must get the decode engine's.
TEXT = {"prefill": "from the prefill engine", "decode": "from the decode engine"}
USAGE = {
    "prefill": {"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7},
    "decode": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9},
}

# What sglang-router 0.3.2 sends the legs beyond the client's fields, by path. It parses the
# request into its own typed request and serializes that again, so each leg carries:
# - RENAMED: client fields under another name (chat's deprecated `max_tokens` becomes
#   `max_completion_tokens`; an SGLang engine reads either: `max_completion_tokens or
#   max_tokens`, sglang python/sglang/srt/entrypoints/openai/protocol.py);
# - ROUTER_DEFAULTS: fields the client did not send, at their defaults, which are the
#   defaults of SGLang's own ChatCompletionRequest and CompletionRequest in that file, so an
#   engine reads the same request whether they are sent or not. kvmesh sends neither.
RENAMED = {CHAT: {"max_tokens": "max_completion_tokens"}, COMPLETIONS: {}}
ROUTER_DEFAULTS = {
    CHAT: {
        "logprobs": False,
        "stream": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
    },
    COMPLETIONS: {
        "stream": False,
        "echo": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "return_hidden_states": False,
    },
}

# The client's requests, each sent through both routers; each returns (text, usage) as the
# client read them.
CHAT_MESSAGES = [{"role": "user", "content": "Which leg answers this?"}]


def chat(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=5, temperature=0)
    return reply.choices[0].message.content, reply.usage.model_dump(exclude_none=True)


def chat_streamed(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT_MESSAGES,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.model_dump(exclude_none=True)


def completion_text(client):
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, seed=7)
    return reply.choices[0].text, reply.usage.model_dump(exclude_none=True)


def completion_tokens(client):
    reply = client.completions.create(model=MODEL, prompt=[9707, 11, 1879, 0], max_tokens=4)
    return reply.choices[0].text, reply.usage.model_dump(exclude_none=True)


REQUESTS = {
    "chat": chat,
    "chat streamed": chat_streamed,
    "completion, string prompt": completion_text,
    "completion, token ids": completion_tokens,
}
# sglang-router 0.3.2 answers a completion whose prompt is token ids 422 without sending a
# leg (its prompt type takes strings only: "data did not match any variant of untagged enum
# StringOrArray"), though SGLang's engines take them (`prompt: Union[List[int], ...]`):
# kvmesh's legs for it are held to the client's request alone.
SGLANG_ROUTER_REFUSES = {"completion, token ids"}
COMPARED = [name for name in REQUESTS if name not in SGLANG_ROUTER_REFUSES]



def answer(path, request, role):
    """An OpenAI server's answer to `request`, with `role`'s text and usage."""
    head = {"id": f"{role}-1", "created": 1, "model": MODEL}
    if path == CHAT and request.get("stream"):
        chunk = {**head, "object": "chat.completion.chunk"}
        events = [
            {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": TEXT[role]}}]},
            {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ]
        if (request.get("stream_options") or {}).get("include_usage"):
            events.append({**chunk, "choices": [], "usage": USAGE[role]})
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return "text/event-stream", body
    if path == CHAT:
        message = {"role": "assistant", "content": TEXT[role]}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return "application/json", json.dumps({**head, "object": "chat.completion", "choices": [choice], "usage": USAGE[role]})
    choice = {"index": 0, "text": TEXT[role], "finish_reason": "stop", "logprobs": None}
    return "application/json", json.dumps({**head, "object": "text_completion", "choices": [choice], "usage": USAGE[role]})


class Engines:
    """A prefill and a decode capture engine on loopback, recording every leg (path, JSON body)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.legs = {"prefill": [], "decode": []}
        self.failures = []
        self.joined = {}  # bootstrap_room -> Event, set once the decode leg came
        self.servers = {role: self._serve(role) for role in ("prefill", "decode")}
        self.url = {role: f"http://127.0.0.1:{s.server_address[1]}" for role, s in self.servers.items()}

    def _serve(self, role):
        engines = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def reply(self, status, ctype, body):
                data = body.encode()
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                # sglang-router's registration (/server_info, /model_info) and both routers'
                # health checks.
                info = {"model_path": MODEL, "served_model_name": MODEL, "is_generation": True}
                if role == "prefill":
                    info["disaggregation_bootstrap_port"] = BOOTSTRAP_PORT
                self.reply(200, "application/json", json.dumps(info))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                room = body.get("bootstrap_room")
                with engines.cond:
                    engines.legs[role].append({"path": self.path, "body": body})
                    engines.cond.notify_all()
                    joined = engines.joined.setdefault(json.dumps(room), threading.Event())
                if role == "decode":
                    joined.set()
                elif not joined.wait(JOIN_DEADLINE_S):
                    failure = f"the decode leg of room {room} did not come within {JOIN_DEADLINE_S} s"
                    engines.failures.append(failure)
                    return self.reply(504, "application/json", json.dumps({"error": {"message": failure}}))
                self.reply(200, *answer(self.path, body, role))

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def take(self):
        """The one request's (prefill leg, decode leg) since the last take, once both came (kvmesh
        reads the prefill leg's answer after the decode's, so it may come after the client's)."""
        with self.cond:
            both = self.cond.wait_for(lambda: self.legs["prefill"] and self.legs["decode"], timeout=JOIN_DEADLINE_S)
            assert both, f"legs that came: {self.legs}"
            prefill, decode = self.legs["prefill"], self.legs["decode"]
            assert (len(prefill), len(decode)) == (1, 1), f"one leg each, got {self.legs}"
            self.legs = {"prefill": [], "decode": []}
        return prefill[0], decode[0]

    def stop(self):
        for server in self.servers.values():
            server.shutdown()
            server.server_close()


def exchange(base_url, engines, refused=()):
    """Sends every request of REQUESTS through the router at `base_url`; per request: the body
    and path the client sent, what it read, and the two legs the engines got. The router
    must answer those named in `refused` 422 without sending a leg; they are left out."""
    sent = []

    def record(request):
        sent.append((request.url.path, json.loads(request.content)))

    http = httpx.Client(event_hooks={"request": [record]})
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30, http_client=http)
    results = {}
    with http:
        for name, request in REQUESTS.items():
            sent.clear()
            if name in refused:
                with pytest.raises(openai.UnprocessableEntityError):
                    request(client)
                with engines.cond:
                    assert engines.legs == {"prefill": [], "decode": []}, name
                continue
            text, usage = request(client)
            ((path, body),) = sent
            prefill, decode = engines.take()
            results[name] = {"path": path, "client": body, "text": text, "usage": usage, "prefill": prefill, "decode": decode}
    assert engines.failures == []
    return results


class SglangRouter:
    """sglang-router's PD mode over `engines`, up once it reports both workers healthy."""

    def __init__(self, engines, workdir):
        self.port = free_port()
        self.log_path = workdir / "sglang-router.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", engines.url["prefill"], str(BOOTSTRAP_PORT),
                "--decode", engines.url["decode"],
                "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--policy", "round_robin", "--disable-retries",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sglang-router did not get ready: {self.log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(0.1)

    def _ready(self):
        try:
            reply = httpx.get(f"{self.url}/readiness", timeout=2)
        except httpx.TransportError:
            return False
        return reply.status_code == 200 and reply.json().get("healthy_workers") == 2

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


def kvmesh_config(engines):
    return f"""listeners:
  - name: main
    address: 127.0.0.1:0
admin:
  address: 127.0.0.1:0
models:
  - name: {MODEL}
    policy: kv
    disaggregation:
      protocol: sglang
      mode: enforce
      on_prefill_failure: fail
    backends:
      - url: {engines.url["prefill"]}
        role: prefill
        bootstrap_port: {BOOTSTRAP_PORT}
      - url: {engines.url["decode"]}
        role: decode
"""


@pytest.fixture(scope="module")
def runs(workdir):
    """Per router, per request: what the client sent and read, and what each leg carried."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        pytest.fail("sglang-router is missing from the venv: run scripts/setup.sh")
    found = {}
    engines = Engines()
    router = SglangRouter(engines, workdir)
    try:
        found["sglang-router"] = exchange(router.url, engines, SGLANG_ROUTER_REFUSES)
    finally:
        router.stop()
        engines.stop()
    engines = Engines()
    cfg = workdir / "sglang-pd.yaml"
    cfg.write_text(kvmesh_config(engines))
    proxy = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    try:
        found["kvmesh"] = exchange(proxy.url("main"), engines)
    finally:
        proxy.stop()
        engines.stop()
    return found


ROUTERS = ("sglang-router", "kvmesh")


@pytest.mark.parametrize("router", ROUTERS)
def test_the_client_gets_the_decode_engines_answer(runs, router):
    for name, run in runs[router].items():
        assert (run["text"], run["usage"]) == (TEXT["decode"], USAGE["decode"]), name


@pytest.mark.parametrize("router", ROUTERS)
def test_both_legs_go_to_the_clients_path(runs, router):
    for name, run in runs[router].items():
        path = CHAT if name.startswith("chat") else COMPLETIONS
        assert run["prefill"]["path"] == run["decode"]["path"] == run["path"] == path, name


@pytest.mark.parametrize("router", ROUTERS)
def test_one_room_per_request_shared_by_its_legs(runs, router):
    rooms = []
    for name, run in runs[router].items():
        room = run["prefill"]["body"].get("bootstrap_room")
        assert isinstance(room, int) and 0 <= room < 1 << 63, (name, room)
        assert run["decode"]["body"].get("bootstrap_room") == room, name
        rooms.append(room)
    assert len(set(rooms)) == len(runs[router]), rooms


def test_bootstrap_host_and_port_are_sglang_routers(runs):
    for name in COMPARED:
        for leg in ("prefill", "decode"):
            ours, theirs = (runs[r][name][leg]["body"] for r in ("kvmesh", "sglang-router"))
            assert (ours.get("bootstrap_host"), ours.get("bootstrap_port")) == ("127.0.0.1", BOOTSTRAP_PORT), (name, leg)
            assert (theirs["bootstrap_host"], theirs["bootstrap_port"]) == ("127.0.0.1", BOOTSTRAP_PORT), (name, leg)


def test_the_clients_fields_reach_both_routers_legs(runs):
    for name in COMPARED:
        client, path = runs["kvmesh"][name]["client"], runs["kvmesh"][name]["path"]
        assert runs["sglang-router"][name]["client"] == client, f"{name}: the client sent the same request"
        for leg in ("prefill", "decode"):
            ours, theirs = runs["kvmesh"][name][leg]["body"], runs["sglang-router"][name][leg]["body"]
            for field, value in client.items():
                assert ours.get(field) == value, (name, leg, field)
                renamed = RENAMED[path].get(field, field)
                assert theirs.get(renamed) == value, (name, leg, field, renamed)


def test_kvmesh_sends_the_clients_body_plus_the_bootstrap_fields(runs):
    for name, run in runs["kvmesh"].items():
        for leg in ("prefill", "decode"):
            body = dict(run[leg]["body"])
            assert set(BOOTSTRAP_FIELDS) <= body.keys(), (name, leg)
            for field in BOOTSTRAP_FIELDS:
                del body[field]
            assert body == run["client"], (name, leg)


def test_sglang_router_adds_only_its_documented_renames_and_defaults(runs):
    """Everything sglang-router sends beyond kvmesh's legs is listed in RENAMED and
    ROUTER_DEFAULTS: nothing an SGLang engine needs is missing from kvmesh's."""
    for name, run in runs["sglang-router"].items():
        path, client = run["path"], run["client"]
        expected = {**ROUTER_DEFAULTS[path], **{RENAMED[path].get(k, k): v for k, v in client.items()}}
        for leg in ("prefill", "decode"):
            body = {k: v for k, v in run[leg]["body"].items() if k not in BOOTSTRAP_FIELDS}
            assert body == expected, (name, leg)
