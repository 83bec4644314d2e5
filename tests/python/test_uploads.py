"""Multipart uploads through kvmesh-proxy, driven by the official `openai` client: an audio
transcription's form names its model in a field, streams through to an engine-sim (which
answers with the size and SHA-256 of the file it received), fails over from a refused
engine before anything beyond the form's start was sent, and is refused past the size
limit."""

import hashlib
import socket
import urllib.request

import openai
import pytest

from conftest import MODEL, Proc, proxy_config

LIMIT = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def upload_proxy(engines, workdir):
    # Bound and never listening: connecting is refused for as long as the socket lives.
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    engine = sorted(engines.listeners.items())[0][1]
    backends = [f"http://127.0.0.1:{dead.getsockname()[1]}", f"http://{engine}"]
    cfg = workdir / "upload-proxy.yaml"
    extra = f"limits:\n  max_body_bytes: {LIMIT}\nhealth_check:\n  enabled: false\n"
    cfg.write_text(proxy_config(backends, extra))
    proc = Proc("kvmesh-proxy", ["--config", str(cfg)], workdir)
    yield proc, backends[0]
    proc.stop()
    dead.close()


@pytest.fixture(scope="module")
def client(upload_proxy):
    proc, _ = upload_proxy
    return openai.OpenAI(base_url=proc.url("main") + "/v1", api_key="unused", max_retries=0, timeout=30)


def metric(proc, series):
    with urllib.request.urlopen(proc.url("admin") + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {series} in the metrics")


def audio(seed, size):
    return bytes((i * 31 + seed) % 256 for i in range(size))


def test_uploads_stream_to_the_engine_whole_and_fail_over_from_a_refused_one(client, upload_proxy):
    proc, dead = upload_proxy
    # One form within the 64 KiB the proxy reads before routing, two far past it (they stream).
    for seed, size in [(1, 1000), (2, 3 * 1024 * 1024), (3, 3 * 1024 * 1024)]:
        clip = audio(seed, size)
        answer = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", clip))
        assert answer.text == f"{size} bytes of clip.wav, sha256 {hashlib.sha256(clip).hexdigest()}"
    # Round robin offered the refused engine to the uploads: each refusal was tried again.
    refused = metric(proc, f'kvmesh_upstream_errors_total{{instance="{dead}",kind="connect",model="{MODEL}"}}')
    assert refused >= 1
    assert metric(proc, f'kvmesh_retries_total{{model="{MODEL}",reason="connect"}}') == refused
    route = 'protocol="http",route="/v1/audio/transcriptions"'
    assert metric(proc, f'kvmesh_requests_total{{model="{MODEL}",{route},status="200"}}') == 3


def test_an_upload_past_the_limit_is_413_in_openai_shape(client):
    with pytest.raises(openai.APIStatusError) as refused:
        client.audio.transcriptions.create(model=MODEL, file=("long.wav", audio(4, LIMIT + 1)))
    assert refused.value.status_code == 413
    assert refused.value.body["code"] == "request_too_large"
