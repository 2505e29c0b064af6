"""The OpenAI-compatible HTTP port over TLS, with the gRPC port's certificate flags
(tls_cert_file, tls_key_file, tls_client_ca_file): a whole `pdserve serve --no-ray` stack
(start_stack), certificates made by openssl in the test, real TLS clients (the standard
library's and the openai client's)."""
from __future__ import annotations

import json
import socket
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest

from cluster.config import ServeConfig
from cluster.server_stack import start_stack
from grpc_harness import LoopThread


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=pdserve-http-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                      ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    (d / "keys.txt").write_text("key-alice alice\n")
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def _stack(loop, model_dir, certs, **tls):
    cfg = ServeConfig(model=str(model_dir), ray=False, host="127.0.0.1", grpc_port=0, metrics_port=0,
                      http_port=_free_port(), num_kv_blocks=64, max_model_len=256,
                      api_keys_file=str(certs / "keys.txt"),
                      tls_cert_file=str(certs / "server.pem"), tls_key_file=str(certs / "server.key"), **tls)
    return loop.run(start_stack(cfg), timeout=120)


@pytest.fixture(scope="module")
def tls_stack(loop, tiny_llama_dir, certs):
    stack = _stack(loop, tiny_llama_dir, certs)
    yield stack
    loop.run(stack.drain_and_stop(1.0))


def _get(url: str, context: ssl.SSLContext | None, key: str | None = "key-alice") -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_https_serves_openai_routes_to_a_verifying_client(tls_stack, certs):
    url = tls_stack.http.url
    assert url.startswith("https://127.0.0.1:")
    ca = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    status, models = _get(url + "/v1/models", ca)
    assert status == 200 and models["data"][0]["id"]
    assert _get(url + "/v1/models", ca, key=None)[0] == 401   # the key still matters, now encrypted

    openai = pytest.importorskip("openai")
    import httpx
    client = openai.OpenAI(base_url=url + "/v1", api_key="key-alice", max_retries=0, timeout=60,
                           http_client=httpx.Client(verify=ca))
    out = client.completions.create(model=models["data"][0]["id"], prompt="hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3

    # an inference gateway scrapes the serving port: over TLS, with vLLM's names
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30, context=ca) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    (running,) = families["vllm:num_requests_running"].samples
    assert running.labels == {"model_name": models["data"][0]["id"]}
    assert families["vllm:generation_tokens"].samples[0].value >= 3


def test_https_port_refuses_plain_http_and_unknown_certificates(tls_stack):
    port = tls_stack.http.port
    with pytest.raises((urllib.error.URLError, ConnectionError, http_client_errors())):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read()
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=10,
                               context=ssl.create_default_context())   # the system CAs do not know ours


def http_client_errors():
    import http.client
    return http.client.HTTPException


def test_mutual_tls_needs_a_client_certificate(loop, tiny_llama_dir, certs):
    stack = _stack(loop, tiny_llama_dir, certs, tls_client_ca_file=str(certs / "ca.pem"))
    try:
        url = stack.http.url + "/health"
        with_cert = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with_cert.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
        assert _get(url, with_cert)[0] == 200
        without = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _get(url, without)
    finally:
        loop.run(stack.drain_and_stop(1.0))


def test_unreadable_tls_files_are_refused_with_a_clear_error(certs):
    from cluster.frontends.auth import TlsConfig
    from cluster.frontends.http.server import uvicorn_tls
    with pytest.raises(ValueError, match="key matches the certificate"):
        uvicorn_tls(TlsConfig(str(certs / "server.pem"), str(certs / "client.key")))
