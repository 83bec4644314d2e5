"""Closed-loop HTTP/1.1 load over TLS for benches/tls.sh: REQUESTS chat completions (16 output
tokens, streamed or not) on CONCURRENCY keep-alive connections, one thread each, each request
read to its end. Prints the requests per second. The standard library only (`ssl`), so the
same client runs against every proxy binary.

Usage: tls_load.py ADDRESS CA_FILE REQUESTS CONCURRENCY stream|non-stream
"""

import json
import socket
import ssl
import sys
import threading
import time


def main():
    address, ca, requests, concurrency, mode = sys.argv[1:6]
    host, port = address.rsplit(":", 1)
    requests, concurrency = int(requests), int(concurrency)
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["http/1.1"])
    body = json.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hello " * 8}],
            "max_tokens": 16,
            "stream": mode == "stream",
        }
    )
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    failures = []

    def worker(count):
        try:
            with socket.create_connection((host, int(port))) as tcp:
                with context.wrap_socket(tcp, server_hostname="localhost") as tls:
                    rest = b""
                    for _ in range(count):
                        tls.sendall(request)
                        rest = read_response(tls, rest)
        except Exception as error:  # reported below: a failed lane must not look fast
            failures.append(repr(error))

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(requests // concurrency,)) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    if failures:
        sys.exit(f"{len(failures)} connections failed: {failures[0]}")
    print(f"{requests // concurrency * concurrency / elapsed:.0f}")


def read_response(tls, buffered):
    """Reads one 200 response (framed by its length, or chunked); returns what came after it."""
    while b"\r\n\r\n" not in buffered:
        buffered += receive(tls)
    head, _, rest = buffered.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode(errors="replace"))
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    if b"content-length" in fields:
        length = int(fields[b"content-length"])
        while len(rest) < length:
            rest += receive(tls)
        return rest[length:]
    while b"\r\n0\r\n\r\n" not in rest and not rest.startswith(b"0\r\n\r\n"):
        rest += receive(tls)
    end = rest.find(b"0\r\n\r\n") if rest.startswith(b"0\r\n\r\n") else rest.find(b"\r\n0\r\n\r\n") + 2
    return rest[end + 5 :]


def receive(tls):
    data = tls.recv(65536)
    if not data:
        raise RuntimeError("the proxy closed the connection")
    return data


if __name__ == "__main__":
    main()
