"""Certificates rotated under load on the real `kvmesh-proxy`.

One proxy terminates TLS on a data listener (`main`; the KServe gRPC listener serves the same
certificate) and on the endpoint picker's listener (`epp.tls`, its own certificate). Sixteen
clients hold long streams through it while both certificates are replaced:

- `main`'s files are a Kubernetes Secret volume: `tls.crt` and `tls.key` are links into
  `..data`, itself a link to a timestamped directory, and the kubelet swaps `..data` with one
  rename (both files change at once);
- the picker's files are replaced one by one with a rename each, key first (a writer that
  replaces plain files): between the two the key does not go with the certificate, which the
  proxy must refuse while it keeps serving the old pair.

Clients: 6 `openai` streams over HTTP/1.1 and 4 over HTTP/2 (httpx), 3 `tritonclient`
`ModelStreamInfer` streams, and 3 ext_proc exchanges with the picker that relay the picked
engine's stream through it as Envoy does. Engines: two real-time `kvmesh-engine-sim`, decoding
at a quarter speed so a stream of `STREAM_TOKENS` tokens lasts through the rotation.

The rotation is seen through `kvmesh_tls_certificate_expiry_timestamp_seconds{listener}` and
`kvmesh_tls_certificate_reloads_total{listener,result}` (each new certificate expires on
another day than the one it replaces), polled with a deadline. Checked: every stream ends whole
(all its tokens, `finish_reason: length`) after the rotation took effect; each client's next
request, on a new connection, succeeds; new handshakes on every listener get the new
certificate (serial and expiry); a connection opened before keeps its certificate and serves
another request; no handshake failed and no request got anything but 200.

The certificates are made here with `openssl` (scripts/setup.sh installs it), as the CA's key
is needed to sign the second one.
"""

import asyncio
import concurrent.futures
import json
import os
import queue
import socket
import ssl
import subprocess
import threading
import time

import grpc
import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from conftest import MODEL, Proc, proxy_config
from test_epp import DEST, Exchange, ep, header_map

STREAM_TOKENS = 300
AFTER_TOKENS = 4
H1_STREAMS, H2_STREAMS, GRPC_STREAMS, EPP_STREAMS = 6, 4, 3, 3
CLIENTS = H1_STREAMS + H2_STREAMS + GRPC_STREAMS + EPP_STREAMS
# Generous: a CI run may share the machine's two cores with builds.
DEADLINE_S = 60
POLL_INTERVAL = "100ms"


class Pki:
    """A CA and the leaf certificates it signs (openssl), in `directory`."""

    def __init__(self, directory):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca = self.dir / "ca.pem"
        self.ca_key = self.dir / "ca.key"
        openssl("req", "-x509", *EC_KEY, "-nodes", "-days", "3650", "-subj", "/CN=kvmesh rotation CA",
                "-keyout", self.ca_key, "-out", self.ca)

    def server(self, name, serial, days):
        """A certificate for `localhost` and 127.0.0.1: (PEM, key PEM, serial, notAfter in Unix s)."""
        key, csr, cert = self.dir / f"{name}.key", self.dir / f"{name}.csr", self.dir / f"{name}.pem"
        extensions = self.dir / "server.ext"
        extensions.write_text(
            "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
        )
        openssl("req", "-new", *EC_KEY, "-nodes", "-subj", "/CN=localhost", "-keyout", key, "-out", csr)
        openssl("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", self.ca_key, "-set_serial", str(serial),
                "-days", str(days), "-extfile", extensions, "-out", cert)
        end = openssl("x509", "-noout", "-enddate", "-in", cert).strip().split("=", 1)[1]
        return cert.read_bytes(), key.read_bytes(), serial, int(ssl.cert_time_to_seconds(end))


EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256")


def openssl(*args):
    return subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, text=True).stdout


class SecretVolume:
    """A directory laid out as the kubelet projects a Secret: `tls.crt` -> `..data/tls.crt`,
    `..data` -> `..<generation>`; `publish` swaps `..data` with one rename."""

    def __init__(self, directory):
        self.dir = directory
        self.dir.mkdir(parents=True)
        self.generation = 0
        self.cert, self.key = self.dir / "tls.crt", self.dir / "tls.key"

    def publish(self, cert, key):
        self.generation += 1
        target = self.dir / f"..{self.generation}"
        target.mkdir()
        (target / "tls.crt").write_bytes(cert)
        (target / "tls.key").write_bytes(key)
        staged = self.dir / "..data_tmp"
        os.symlink(target.name, staged)
        os.replace(staged, self.dir / "..data")
        if self.generation == 1:
            os.symlink("..data/tls.crt", self.cert)
            os.symlink("..data/tls.key", self.key)


def replace(path, content):
    """Writes `content` over `path` with a rename, as an atomic writer does."""
    staged = path.with_name(path.name + ".tmp")
    staged.write_bytes(content)
    os.replace(staged, path)


def metric(proxy, name, **labels):
    """The value of the series `name{labels}` on the proxy's /metrics (None when absent)."""
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    text = httpx.get(proxy.url("admin") + "/metrics", timeout=10).text
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == wanted:
            return float(value)
    return None


def series(proxy, name):
    """Every series of `name`: {labels text: value}."""
    text = httpx.get(proxy.url("admin") + "/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name):].rpartition(" ")
            found[labels] = float(value)
    return found


def wait_for(condition, what):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.05)


def tls_context(ca, alpn=None):
    ctx = ssl.create_default_context(cafile=str(ca))
    if alpn:
        ctx.set_alpn_protocols([alpn])
    return ctx


def served(address, ca, alpn):
    """(serial, notAfter) of the certificate a new handshake on `address` gets, offering `alpn`."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as tcp:
        with tls_context(ca, alpn).wrap_socket(tcp, server_hostname="localhost") as tls:
            assert tls.selected_alpn_protocol() == alpn
            return peer(tls)


def peer(tls):
    cert = tls.getpeercert()
    return int(cert["serialNumber"], 16), int(ssl.cert_time_to_seconds(cert["notAfter"]))


class KeptConnection:
    """An HTTP/1.1 keep-alive connection over TLS to a data listener, opened once."""

    def __init__(self, address, ca):
        host, port = address.rsplit(":", 1)
        tcp = socket.create_connection((host, int(port)), timeout=DEADLINE_S)
        self.tls = tls_context(ca, "http/1.1").wrap_socket(tcp, server_hostname="localhost")
        self.buffer = b""

    def list_models(self):
        """Sends `GET /v1/models` and returns (status, body)."""
        self.tls.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        while b"\r\n\r\n" not in self.buffer:
            self.read()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
        assert b"transfer-encoding" not in fields, head
        length = int(fields[b"content-length"])
        while len(self.buffer) < length:
            self.read()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(head[9:12]), json.loads(body)

    def read(self):
        chunk = self.tls.recv(65536)
        assert chunk, "the proxy closed the connection"
        self.buffer += chunk

    def close(self):
        self.tls.close()


@pytest.fixture(scope="module")
def slow_engines(workdir):
    # A quarter of the simulated decode speed: STREAM_TOKENS take several seconds.
    proc = Proc("kvmesh-engine-sim", ["--engines", "2", "--port", "0", "--model", MODEL,
                                      "--decode-speedup-ratio", "0.25"], workdir)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def rotation(slow_engines, workdir):
    root = workdir / "rotation"
    pki = Pki(root / "pki")
    certs = {
        "main": (pki.server("main-1", 0x1001, 30), pki.server("main-2", 0x1002, 90)),
        "epp": (pki.server("epp-1", 0x2001, 20), pki.server("epp-2", 0x2002, 80)),
    }
    volume = SecretVolume(root / "main-secret")
    volume.publish(*certs["main"][0][:2])
    epp_dir = root / "epp-files"
    epp_dir.mkdir()
    epp_cert, epp_key = epp_dir / "tls.crt", epp_dir / "tls.key"
    replace(epp_cert, certs["epp"][0][0])
    replace(epp_key, certs["epp"][0][1])

    backends = [f"http://{addr}" for _, addr in sorted(slow_engines.listeners.items())]
    tls = f"    tls:\n      cert: {volume.cert}\n      key: {volume.key}\nadmin:"
    config = proxy_config(
        backends,
        "grpc:\n  address: 127.0.0.1:0\n"
        f"epp:\n  address: 127.0.0.1:0\n  tls:\n    cert: {epp_cert}\n    key: {epp_key}\n"
        f"reload:\n  poll_interval: {POLL_INTERVAL}\n",
    ).replace("admin:", tls, 1)
    path = root / "proxy.yaml"
    path.write_text(config)
    proxy = Proc("kvmesh-proxy", ["--config", str(path)], workdir)
    yield {
        "proxy": proxy,
        "ca": pki.ca,
        "certs": certs,
        "volume": volume,
        "epp_files": (epp_cert, epp_key),
        "engines": set(slow_engines.listeners.values()),
    }
    proxy.stop()


class Clients:
    """The sixteen clients, each on its own thread (the picker's on one asyncio thread)."""

    def __init__(self, rotation):
        self.proxy, self.ca = rotation["proxy"], rotation["ca"]
        self.engines = rotation["engines"]
        self.started = threading.Semaphore(0)
        self.rotated = threading.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(CLIENTS - EPP_STREAMS + 1)
        self.futures = [self.pool.submit(self.openai_client, i, False) for i in range(H1_STREAMS)]
        self.futures += [self.pool.submit(self.openai_client, i, True) for i in range(H2_STREAMS)]
        self.futures += [self.pool.submit(self.triton_client, i) for i in range(GRPC_STREAMS)]
        self.epp = self.pool.submit(lambda: asyncio.run(asyncio.wait_for(self.epp_clients(), 3 * DEADLINE_S)))

    def wait_started(self):
        """Until every client has its stream's first chunk (failing with a client's error)."""
        deadline = time.monotonic() + DEADLINE_S
        for _ in range(CLIENTS):
            while not self.started.acquire(timeout=0.1):
                for future in [*self.futures, self.epp]:
                    if future.done():
                        future.result()
                assert time.monotonic() < deadline, "the streams did not all start"

    def results(self):
        """Each client's record, after it finished (raising the first failure)."""
        records = [f.result(timeout=3 * DEADLINE_S) for f in self.futures]
        records += self.epp.result(timeout=3 * DEADLINE_S)
        self.pool.shutdown()
        return records

    def after_rotation(self):
        assert self.rotated.wait(3 * DEADLINE_S), "the rotation never finished"

    def openai_client(self, i, http2):
        port = self.proxy.listeners["main"].rsplit(":", 1)[1]

        def api():
            http = httpx.Client(verify=tls_context(self.ca), http2=http2, timeout=DEADLINE_S)
            return openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                 http_client=http), http

        client, http = api()
        record = {"client": f"{'h2' if http2 else 'h1'}-{i}", "deltas": 0, "finish": None}
        with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"a long story, number {i}"}],
            max_tokens=STREAM_TOKENS, stream=True, stream_options={"include_usage": True},
        ) as raw:
            record["version"] = raw.http_version
            streaming = False
            for chunk in raw.parse():
                if chunk.usage is not None:
                    record["tokens"] = chunk.usage.completion_tokens
                if not streaming:
                    streaming = True
                    self.started.release()
                for choice in chunk.choices:
                    record["deltas"] += bool(choice.delta.content)
                    record["finish"] = choice.finish_reason or record["finish"]
        record["ended"] = time.monotonic()
        http.close()
        self.after_rotation()
        client, http = api()
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "after the rotation"}], max_tokens=AFTER_TOKENS
        )
        http.close()
        record["after"] = answer.usage.completion_tokens
        return record

    def triton_client(self, i):
        def connect():
            # A channel of its own (gRPC shares connections between equal channels by default).
            return grpcclient.InferenceServerClient(
                self.proxy.listeners["grpc"], ssl=True, root_certificates=str(self.ca),
                channel_args=[("grpc.use_local_subchannel_pool", 1)],
            )

        record = {"client": f"grpc-{i}", "deltas": 0, "version": "grpc"}
        results = queue.Queue()
        client = connect()
        client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=3 * DEADLINE_S)
        client.async_stream_infer(MODEL, text_inputs(f"a long story, number {i}", True), request_id=f"long-{i}",
                                  parameters={"max_tokens": STREAM_TOKENS})
        streaming = False
        while "tokens" not in record:
            result, error = results.get(timeout=DEADLINE_S)
            assert error is None, error
            if not streaming:
                streaming = True
                self.started.release()
            record["deltas"] += bool(result.as_numpy("text_output")[0])
            if param(result, "triton_final_response"):
                record["tokens"] = param(result, "completion_tokens")
                record["finish"] = result.as_numpy("finish_reason")[0].decode()
        record["ended"] = time.monotonic()
        client.stop_stream()
        client.close()
        self.after_rotation()
        with connect() as client:
            answer = client.infer(MODEL, text_inputs("after the rotation"), parameters={"max_tokens": AFTER_TOKENS},
                                  client_timeout=DEADLINE_S)
        record["after"] = param(answer, "completion_tokens")
        return record

    async def epp_clients(self):
        return await asyncio.gather(*(self.epp_client(i) for i in range(EPP_STREAMS)))

    async def epp_client(self, i):
        """An Envoy that asks the picker over TLS, calls the engine it names and relays the
        engine's stream through the picker (ext_proc full duplex)."""
        record = {"client": f"epp-{i}", "version": "ext_proc"}
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"a long story, number {i}"}],
                           "max_tokens": STREAM_TOKENS, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        async with httpx.AsyncClient(timeout=DEADLINE_S) as http:
            async with picker_channel(self.proxy, self.ca) as channel:
                exchange = Exchange(channel)
                pick = (await exchange.pick("/v1/chat/completions", body))[0]
                assert pick in self.engines, pick
                relayed = b""
                async with http.stream("POST", f"http://{pick}/v1/chat/completions", content=body,
                                       headers={"content-type": "application/json"}) as response:
                    assert response.status_code == 200
                    await relay_headers(exchange, pick)
                    async for chunk in response.aiter_raw():
                        await relay_body(exchange, chunk, False)
                        if not relayed:
                            self.started.release()
                        relayed += chunk
                await relay_body(exchange, b"", True)
                await exchange.close()
            record.update(sse_summary(relayed))
            record["ended"] = time.monotonic()
            await asyncio.to_thread(self.after_rotation)
            async with picker_channel(self.proxy, self.ca) as channel:
                exchange = Exchange(channel)
                short = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "after"}],
                                    "max_tokens": AFTER_TOKENS}).encode()
                pick = (await exchange.pick("/v1/chat/completions", short))[0]
                answer = await http.post(f"http://{pick}/v1/chat/completions", content=short,
                                         headers={"content-type": "application/json"})
                await relay_headers(exchange, pick)
                await relay_body(exchange, answer.content, True)
                await exchange.close()
            record["after"] = answer.json()["usage"]["completion_tokens"]
        return record


def picker_channel(proxy, ca):
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    return grpc.aio.secure_channel(proxy.listeners["epp"], credentials,
                                   options=[("grpc.use_local_subchannel_pool", 1)])


async def relay_headers(exchange, served_endpoint):
    message = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(headers=header_map([(":status", "200"), ("content-type", "text/event-stream")]))
    )
    message.metadata_context.filter_metadata["envoy.lb"].update({f"{DEST}-served": served_endpoint})
    await exchange.send(message)
    answer = await exchange.recv()
    assert answer.WhichOneof("response") == "response_headers", answer


async def relay_body(exchange, chunk, last):
    await exchange.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk, end_of_stream=last)))
    echo = (await exchange.recv()).response_body.response.body_mutation.streamed_response
    assert (echo.body, echo.end_of_stream) == (chunk, last)


def sse_summary(raw):
    """Content deltas, completion tokens and finish reason of a chat completion stream."""
    summary = {"deltas": 0}
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        chunk = json.loads(event)
        if chunk.get("usage"):
            summary["tokens"] = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            summary["deltas"] += bool(choice["delta"].get("content"))
            summary["finish"] = choice.get("finish_reason") or summary.get("finish")
    return summary


def text_inputs(prompt, streaming=None):
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs = [text]
    if streaming is not None:
        flag = grpcclient.InferInput("streaming", [1], "BOOL")
        flag.set_data_from_numpy(np.array([streaming], dtype=bool))
        inputs.append(flag)
    return inputs


def param(result, name):
    parameter = result.get_response().parameters.get(name)
    return None if parameter is None else getattr(parameter, parameter.WhichOneof("parameter_choice"))


@pytest.mark.timeout(300)
def test_certificates_rotate_under_load(rotation):
    proxy, ca, certs = rotation["proxy"], rotation["ca"], rotation["certs"]
    (main_old, main_new), (epp_old, epp_new) = certs["main"], certs["epp"]
    address = {name: proxy.listeners[name] for name in ("main", "grpc", "epp")}
    assert main_old[3] != main_new[3] and epp_old[3] != epp_new[3], "each rotation changes the expiry"

    def expiry(listener):
        return metric(proxy, "kvmesh_tls_certificate_expiry_timestamp_seconds", listener=listener)

    def reloads(listener, result):
        return metric(proxy, "kvmesh_tls_certificate_reloads_total", listener=listener, result=result)

    # Before: every listener serves the first certificates.
    assert expiry("main") == main_old[3] and expiry("epp") == epp_old[3]
    for name, alpn in (("main", "http/1.1"), ("main", "h2"), ("grpc", "h2")):
        assert served(address[name], ca, alpn) == main_old[2:]
    assert served(address["epp"], ca, "h2") == epp_old[2:]

    clients = Clients(rotation)
    try:
        clients.wait_started()
        kept = KeptConnection(address["main"], ca)
        assert kept.list_models()[0] == 200
        assert peer(kept.tls) == main_old[2:]

        # main: the kubelet's ..data swap, both files at once.
        rotation["volume"].publish(*main_new[:2])
        # epp: the key first; the pair does not match until the certificate follows.
        epp_cert, epp_key = rotation["epp_files"]
        replace(epp_key, epp_new[1])
        wait_for(lambda: reloads("epp", "rejected") == 1, "the mismatched picker key refused")
        assert expiry("epp") == epp_old[3]
        assert served(address["epp"], ca, "h2") == epp_old[2:], "the old pair stays in use"
        replace(epp_cert, epp_new[0])
        wait_for(lambda: expiry("main") == main_new[3], "main's new certificate in the expiry metric")
        wait_for(lambda: expiry("epp") == epp_new[3], "the picker's new certificate in the expiry metric")
        rotated = time.monotonic()
        assert reloads("main", "ok") == 1 and reloads("main", "rejected") == 0
        assert reloads("epp", "ok") == 1 and reloads("epp", "rejected") == 1

        # After: new handshakes get the new certificates; the connection opened before
        # keeps its certificate and serves on.
        for name, alpn in (("main", "http/1.1"), ("main", "h2"), ("grpc", "h2")):
            assert served(address[name], ca, alpn) == main_new[2:], name
        assert served(address["epp"], ca, "h2") == epp_new[2:]
        status, listing = kept.list_models()
        assert status == 200 and [m["id"] for m in listing["data"]][0] == MODEL
        assert peer(kept.tls) == main_old[2:]
        kept.close()
    finally:
        clients.rotated.set()
    records = clients.results()

    assert len(records) == CLIENTS
    versions = sorted(r["version"] for r in records)
    assert versions.count("HTTP/1.1") == H1_STREAMS and versions.count("HTTP/2") == H2_STREAMS
    for record in records:
        whole = (STREAM_TOKENS, STREAM_TOKENS, "length")
        assert (record["deltas"], record["tokens"], record["finish"]) == whole, record
        assert record["ended"] > rotated, f"{record['client']} finished before the rotation took effect"
        assert record["after"] == AFTER_TOKENS, record

    assert set(series(proxy, "kvmesh_tls_handshake_errors_total").values()) == {0.0}
    requests = series(proxy, "kvmesh_requests_total")
    assert {labels: n for labels, n in requests.items() if 'status="200"' not in labels and n} == {}
    # Through the proxy: 10 streams and 10 later requests over HTTP, 3 + 3 over gRPC.
    assert sum(n for labels, n in requests.items() if 'protocol="http"' in labels and MODEL in labels) == 20
    assert sum(n for labels, n in requests.items() if 'protocol="grpc"' in labels) == 6
    assert metric(proxy, "kvmesh_epp_decisions_total", model=MODEL, status="200") == 2 * EPP_STREAMS

    # What the operator reads in the log: one line per reload, one warning for the mismatch.
    log = proxy.log_path.read_text(errors="replace").splitlines()
    assert [line.split(": ", 1)[1] for line in log if "TLS certificate reloaded" in line] == [
        "TLS certificate reloaded listener=main",
        "TLS certificate reloaded listener=epp",
    ]
    refused = [line for line in log if "the previous certificate stays in use" in line]
    assert len(refused) == 1 and " WARN " in refused[0] and "listener=epp" in refused[0], refused
    assert f"epp.tls.key: {epp_key}: does not go with the certificate in {epp_cert}" in refused[0]
