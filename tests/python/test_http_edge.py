"""The HTTP/1.1 edge with Python's standard library, whose clients do what the official
`openai` client does not: `urllib` writes a whole request body before it reads the
answer (an early 413 must still be read, which takes the proxy's lingering close), and
sends an iterable body chunked. A request framed two ways gets 400 on a raw socket."""

import json
import socket
import urllib.error
import urllib.request

import pytest

from conftest import MODEL


def chat_body(content):
    message = {"role": "user", "content": content}
    return json.dumps({"model": MODEL, "messages": [message], "max_tokens": 2}).encode()


def chat_url(proxy):
    return proxy.url("main") + "/v1/chat/completions"


def test_urllib_reads_a_413_after_writing_its_whole_body(proxy):
    # Far over the session proxy's 64 KiB limit and the socket buffers.
    body = b"x" * (16 * 1024 * 1024)
    request = urllib.request.Request(chat_url(proxy), data=body, headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 413
    assert json.load(caught.value)["error"]["code"] == "request_too_large"


def test_urllib_sends_an_iterable_body_chunked(proxy):
    body = chat_body("sent in chunks")
    pieces = iter([body[:7], body[7:20], body[20:]])
    request = urllib.request.Request(chat_url(proxy), data=pieces, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        assert json.load(response)["object"] == "chat.completion"


def test_length_and_chunked_together_get_400_and_a_closed_connection(proxy):
    host, port = proxy.listeners["main"].rsplit(":", 1)
    body = chat_body("smuggled")
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (host.encode(), len(chunked), chunked)
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer
    assert b"connection: close" in head.lower()
    assert json.loads(rest)["error"]["code"] == "invalid_framing"
