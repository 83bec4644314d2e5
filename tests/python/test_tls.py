"""TLS at the edge with the official `openai` client: https over HTTP/1.1 and
HTTP/2 (httpx with h2) trusting a CA generated for the test (rcgen, through
`kvmesh-test-certs`); a client trusting another CA fails; an mTLS listener
refuses a client without a certificate and serves one with it. On a raw `ssl`
socket, an HTTP/1.1 connection moves on from a request the fast path proxies to
one pingora serves (the framing corpus over TLS is in proxy/tests/framing.rs)."""

import json
import socket
import ssl
import subprocess

import httpx
import openai
import pytest

from conftest import BIN_DIR, MODEL, Proc, proxy_config


@pytest.fixture(scope="module")
def certs(workdir):
    directory = workdir / "certs"
    subprocess.run([str(BIN_DIR / "kvmesh-test-certs"), str(directory)], check=True, capture_output=True)
    return directory


def tls_proxy(engines, certs, workdir, name, extra_tls=""):
    backends = [f"http://{addr}" for _, addr in sorted(engines.listeners.items())]
    tls = (
        "    address: 127.0.0.1:0\n"
        "    tls:\n"
        f"      cert: {certs / 'server.pem'}\n"
        f"      key: {certs / 'server.key'}\n"
        f"{extra_tls}"
    )
    text = proxy_config(backends).replace("    address: 127.0.0.1:0\nadmin:", tls + "admin:", 1)
    path = workdir / f"{name}.yaml"
    path.write_text(text)
    return Proc("kvmesh-proxy", ["--config", str(path)], workdir)


def context(ca, identity=None):
    ctx = ssl.create_default_context(cafile=str(ca))
    if identity is not None:
        ctx.load_cert_chain(certfile=str(identity[0]), keyfile=str(identity[1]))
    return ctx


def client(proxy, ctx, http2=False):
    port = proxy.listeners["main"].rsplit(":", 1)[1]
    http = httpx.Client(verify=ctx, http2=http2, timeout=30)
    return openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, http_client=http)


@pytest.fixture(scope="module")
def https(engines, certs, workdir):
    proc = tls_proxy(engines, certs, workdir, "tls")
    yield proc
    proc.stop()


def chat(api):
    return api.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello over TLS"}], max_tokens=4
    )


@pytest.mark.parametrize("http2,version", [(False, "HTTP/1.1"), (True, "HTTP/2")])
def test_openai_client_over_https(https, certs, http2, version):
    raw = chat(client(https, context(certs / "ca.pem"), http2=http2))
    assert raw.http_response.http_version == version
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens == 4


def test_streaming_over_h2(https, certs):
    api = client(https, context(certs / "ca.pem"), http2=True)
    stream = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream over h2"}], max_tokens=5, stream=True
    )
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content


def test_a_client_trusting_another_ca_fails(https, certs):
    api = client(https, context(certs / "other-ca.pem"))
    with pytest.raises(openai.APIConnectionError):
        chat(api)


def test_mtls_listener_refuses_a_client_without_a_certificate(engines, certs, workdir):
    mtls = f"      client_ca: {certs / 'ca.pem'}\n      require_client_cert: true\n"
    proxy = tls_proxy(engines, certs, workdir, "mtls", mtls)
    try:
        with pytest.raises(openai.APIConnectionError):
            chat(client(proxy, context(certs / "ca.pem")))
        identity = (certs / "client.pem", certs / "client.key")
        raw = chat(client(proxy, context(certs / "ca.pem", identity), http2=True))
        assert raw.http_response.http_version == "HTTP/2"
        assert raw.parse().choices[0].message.content
    finally:
        proxy.stop()


def tls_exchange(proxy, ca, request):
    """Writes `request` on a TLS connection and reads until the proxy closes it (10 s)."""
    host, port = proxy.listeners["main"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as tcp:
        with context(ca).wrap_socket(tcp, server_hostname="localhost") as tls:
            tls.sendall(request)
            answer = b""
            while chunk := tls.recv(65536):
                answer += chunk
    return answer


def statuses(raw):
    """The status of each response in `raw` (each framed by its length), in order."""
    found = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
        raw = rest[int(fields.get(b"content-length", b"0")) :]
        found.append(int(head[9:12]))
    return found


BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "over TLS"}], "max_tokens": 2})
POST = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"


def test_a_tls_connection_goes_on_from_a_proxied_request_to_one_pingora_serves(https, certs):
    # Sent in one write: the second request's bytes arrive with the first, read by the fast
    # path, and must reach pingora, which serves `GET /v1/models`.
    proxied = f"{POST}Content-Length: {len(BODY)}\r\n\r\n{BODY}"
    listing = "GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    raw = tls_exchange(https, certs / "ca.pem", (proxied + listing).encode())
    assert statuses(raw) == [200, 200], raw
    assert b'"chat.completion"' in raw and b'"object":"list"' in raw
