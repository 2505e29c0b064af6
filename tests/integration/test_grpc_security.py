"""API keys (UNAUTHENTICATED, health exempt, tenant-scoped cache salt) and TLS / mutual TLS."""
from __future__ import annotations

import asyncio
import subprocess

import grpc
import pytest

from cluster.cli.client import ClientTls, GenerationClient
from cluster.frontends.auth import ApiKeys, TlsConfig
from grpc_harness import start_frontend

LONG_PROMPT = "Paged attention stores keys and values in fixed blocks of tokens. " * 3


@pytest.fixture(scope="module")
def fe(tiny_llama_dir):
    f = start_frontend(tiny_llama_dir)
    yield f
    f.close()


@pytest.fixture(scope="module")
def keyed(fe, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("# key tenant\nkey-alice alice\nkey-bob bob\n")
    return fe.serve_another(api_keys=ApiKeys.from_file(path))


def run(coro):
    return asyncio.run(coro)


async def _call(target, api_key=None, tls=None, **kw):
    async with GenerationClient(target, api_key=api_key, tls=tls) as c:
        return await c.complete(timeout=60, **kw)


async def _code(target, api_key=None, tls=None, **kw) -> grpc.StatusCode:
    try:
        await _call(target, api_key=api_key, tls=tls, **kw)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_keys_file_and_env_parsing(tmp_path):
    keys = ApiKeys.from_env({"PDSERVE_API_KEYS": "k1:alice, k2"})
    assert keys.tenant([("authorization", "Bearer k1")]) == "alice"
    assert keys.tenant([("authorization", "bearer k2")]).startswith("key-")
    assert keys.tenant([("authorization", "Bearer nope")]) is None and keys.tenant([]) is None
    assert ApiKeys.from_env({}) is None
    bad = tmp_path / "bad.txt"
    bad.write_text("a b c\n")
    with pytest.raises(ValueError, match="two words"):
        ApiKeys.from_file(bad)


def test_missing_or_wrong_key_is_unauthenticated_and_health_is_exempt(fe, keyed):
    assert run(_code(keyed.target, prompt="hi", max_tokens=1)) == grpc.StatusCode.UNAUTHENTICATED
    assert run(_code(keyed.target, api_key="wrong", prompt="hi", max_tokens=1)) == grpc.StatusCode.UNAUTHENTICATED

    async def unauthenticated_model_info_and_health():
        async with GenerationClient(keyed.target) as c:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await c.model_info(timeout=30)
            return ei.value.code(), await c.health(timeout=30)

    code, health = run(unauthenticated_model_info_and_health())
    assert code == grpc.StatusCode.UNAUTHENTICATED and health == "SERVING"
    assert run(_call(keyed.target, api_key="key-alice", prompt="hi", max_tokens=2)).finish_reason
    assert run(_call(fe.target, prompt="no keys on this one", max_tokens=1)).finish_reason


def test_tenant_from_key_scopes_the_prefix_cache(keyed):
    kw = dict(prompt=LONG_PROMPT, max_tokens=1, cache_salt="shared-by-the-client")
    run(_call(keyed.target, api_key="key-alice", **kw))
    again = run(_call(keyed.target, api_key="key-alice", **kw))
    assert again.usage[0].cached_tokens > 0            # positive control: same tenant hits
    other = run(_call(keyed.target, api_key="key-bob", **kw))
    assert other.usage[0].cached_tokens == 0           # same client salt, other tenant: never


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=pdserve-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    return d


def test_tls_and_mutual_tls(fe, certs):
    c = {n: str(certs / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}
    tls_only = fe.serve_another(tls=TlsConfig(c["server.pem"], c["server.key"]))
    mtls = fe.serve_another(tls=TlsConfig(c["server.pem"], c["server.key"], client_ca_file=c["ca.pem"]))
    server_ca = ClientTls(ca_file=c["ca.pem"])
    with_cert = ClientTls(c["ca.pem"], c["client.pem"], c["client.key"])
    assert run(_call(tls_only.target, tls=server_ca, prompt="secure", max_tokens=2)).finish_reason
    assert run(_code(tls_only.target, prompt="plaintext", max_tokens=1)) == grpc.StatusCode.UNAVAILABLE
    assert run(_call(mtls.target, tls=with_cert, prompt="mutual", max_tokens=2)).finish_reason
    assert run(_code(mtls.target, tls=server_ca, prompt="no client cert", max_tokens=1)) != grpc.StatusCode.OK
