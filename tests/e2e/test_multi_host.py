"""pdserve across four test hosts (Linux namespaces: own network, PID, IPC, UTS
and mount namespace each): Ray head and frontend on h1, the prefill pool on h2,
one decode worker on each of h3 and h4, KV over the veth links. Greedy outputs
against transformers over gRPC and HTTP, the KV bytes seen on the prefill host's
link, a partition of the prefill host and the loss of a whole decode host.
Needs root; skips elsewhere. The backend is tcp (PDSERVE_TESTBED_BACKEND=nixl
runs the same on NIXL)."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request

import grpc
import pytest

from cluster.client import GenerationClient, build_request
from cluster.testbed import TestBed
from cluster.testbed.sys_cmd import need_root
from testbed_cluster import MultiHostServe, host_env
from tiny_models import hf_greedy, load_hf_model

pytestmark = [pytest.mark.ray, pytest.mark.skipif(bool(need_root()), reason=need_root() or "root")]
BACKEND = os.environ.get("PDSERVE_TESTBED_BACKEND", "tcp")


@pytest.fixture(scope="module")
def bed_serve(tiny_llama_dir):
    with TestBed.up(4) as bed:
        serve = MultiHostServe(bed, tiny_llama_dir, decode_hosts=("h3", "h4"), decode_workers=2,
                               slots_per_host=1, transfer_backend=BACKEND, lease_ttl=5.0, transfer_timeout=5.0)
        try:
            yield bed, serve
        finally:
            serve.stop()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


async def _stream(target: str, rid: str, prompt: list[int], max_tokens: int, timeout: float,
                  on_token=None) -> tuple[list[int], str, float]:
    """(tokens, gRPC code name or '' when finished, seconds taken)."""
    t0, tokens = time.monotonic(), []
    async with GenerationClient(target) as c:
        req = build_request(prompt_token_ids=prompt, request_id=rid, max_tokens=max_tokens, temperature=0.0,
                            ignore_eos=True)
        try:
            async for r in c.generate(req, timeout=timeout):
                tokens.extend(r.token_ids)
                if on_token:
                    on_token(len(r.token_ids))
            return tokens, "", time.monotonic() - t0
        except grpc.aio.AioRpcError as e:
            return tokens, e.code().name, time.monotonic() - t0


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i * i + 3 * i) % 370 + 5 for i in range(n)]


def test_pools_land_on_their_hosts_and_bind_their_own_addresses(bed_serve):
    bed, serve = bed_serve
    workers = serve.workers()
    assert {w: (i["hostname"], i["address"]) for w, i in workers.items()} in (
        {"prefill-0": ("h2", bed.host("h2").address), "decode-0": ("h3", bed.host("h3").address),
         "decode-1": ("h4", bed.host("h4").address)},
        {"prefill-0": ("h2", bed.host("h2").address), "decode-0": ("h4", bed.host("h4").address),
         "decode-1": ("h3", bed.host("h3").address)})
    assert workers["prefill-0"]["backend"] == BACKEND
    head = bed.host("h1").address
    assert serve.grpc_target.startswith(head + ":")
    assert serve.http_url.startswith(f"http://{head}:") and serve.metrics_url.startswith(f"http://{head}:")


def test_greedy_over_grpc_and_http_equals_transformers_and_kv_crosses_the_link(bed_serve, hf):
    bed, serve = bed_serve
    prompt = _prompt(1, 300)
    want = hf_greedy(hf, prompt, 12)
    sent_before = bed.host("h2").link_bytes()[0]
    tokens, code, _ = asyncio.run(_stream(serve.grpc_target, "wire-1", prompt, 12, 120))
    assert (tokens, code) == (want, "")
    sent = bed.host("h2").link_bytes()[0] - sent_before
    kv_bytes = 300 // 16 * 16 * 3 * 2 * 2 * 16 * 4   # full blocks x layers x (K, V) x kv heads x head dim x fp32
    assert sent >= kv_bytes, f"the prefill host sent {sent} bytes, less than the prompt's KV ({kv_bytes})"
    assert any("hands off 300 tokens" in t for t in serve.trace("wire-1")), serve.trace("wire-1")
    body = json.dumps({"prompt": prompt[:40], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                       "logprobs": 0, "return_tokens_as_token_ids": True}).encode()
    req = urllib.request.Request(serve.http_url + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        tokens = json.loads(r.read())["choices"][0]["logprobs"]["tokens"]
    assert [int(t.removeprefix("token_id:")) for t in tokens] == hf_greedy(hf, prompt[:40], 8)


_STRANGER = """
import sys, torch
from kvtransfer.engine import PeerInfo
from kvtransfer.layout import KVPoolLayout
from kvtransfer.tcp_backend import TcpConfig, TcpEngine
from kvtransfer import side_channel
host, port, backend, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].encode()
if backend == "tcp":
    dst = torch.zeros(2, 4096, dtype=torch.uint8)
    me = TcpEngine("stranger", TcpConfig(host="127.0.0.1", secret=secret, io_timeout_s=5))
    me.register_pool(KVPoolLayout.from_tensor(dst))
    h = me.read(PeerInfo("tcp", "prefill-0", KVPoolLayout.from_tensor(dst), host=host, port=port), [0], [1])
    print(h.wait(10).value, h.error, int(dst.sum()))
else:
    try:
        side_channel.fetch_metadata(host, port, "prefill-0", timeout=5, secret=secret)
        print("done metadata")
    except ConnectionError as e:
        print("failed", e)
"""


def test_a_stranger_on_another_host_gets_nothing_from_the_kv_side_channel(bed_serve):
    bed, serve = bed_serve
    info = serve.workers()["prefill-0"]
    for secret in ("", "a-guessed-secret-0123456789"):
        res = bed.host("h1").run([sys.executable, "-c", _STRANGER, info["address"], str(info["kv_port"]), BACKEND,
                                  secret], env=host_env(), timeout=60)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.startswith("failed") and "does not hold the cluster's secret" in res.stdout, res.stdout


def test_the_head_binds_its_endpoints_to_its_own_address_only(bed_serve):
    bed, serve = bed_serve
    head = bed.host("h1")
    listening = _listening(head)
    from urllib.parse import urlsplit
    for url in (serve.grpc_target, serve.http_url, serve.metrics_url):
        port = urlsplit(url if "//" in url else f"//{url}").port
        assert listening.get(port) == {head.address}, (url, listening.get(port))


def _listening(host) -> dict[int, set[str]]:
    """port -> the addresses its listening TCP sockets bind (IPv4 and IPv6), inside `host`."""
    import ipaddress
    out: dict[int, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in host.run(["cat", table]).stdout.splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":
                continue
            addr, port = local.split(":")
            raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))
            ip = ipaddress.ip_address(raw)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
                ip = ip.ipv4_mapped
            out.setdefault(int(port, 16), set()).add(str(ip))
    return out


def test_partition_of_the_prefill_host_hangs_nothing_and_it_rejoins(bed_serve, hf):
    bed, serve = bed_serve
    h2 = bed.host("h2")
    prompts = {f"cut-{i}": _prompt(10 + i, 60) for i in range(4)}

    async def during_cut():
        h2.cut()
        try:
            tasks = [asyncio.create_task(_stream(serve.grpc_target, rid, p, 16, 30)) for rid, p in prompts.items()]
            await asyncio.sleep(10)
        finally:
            h2.restore()
        return await asyncio.gather(*tasks)

    outs = asyncio.run(during_cut())
    for (rid, p), (tokens, code, took) in zip(prompts.items(), outs):
        assert took < 30 + 10, f"{rid} took {took:.1f}s past its 30 s deadline"
        if not code:
            assert tokens == hf_greedy(hf, p, 16), (rid, serve.trace(rid))
        else:
            assert code in ("DEADLINE_EXCEEDED", "UNAVAILABLE"), (rid, code)
    # the link is back: the prefill host takes hand-offs again, and Ray sees all four nodes
    end, n = time.monotonic() + 90, 0
    while True:
        n += 1
        rid, p = f"back-{n}", _prompt(100 + n, 48)
        tokens, code, _ = asyncio.run(_stream(serve.grpc_target, rid, p, 8, 60))
        assert (tokens, code) == (hf_greedy(hf, p, 8), ""), (rid, code, serve.trace(rid))
        if any(t.startswith("prefilled on prefill-0") for t in serve.trace(rid)):
            break
        assert time.monotonic() < end, f"prefill-0 never took a request after the partition: {serve.trace(rid)}"
        time.sleep(1)
    assert serve.ray_active_nodes() == 4


def test_losing_a_whole_decode_host_migrates_or_ends_every_request(bed_serve, hf):
    """Last in this module: the host stays dead."""
    bed, serve = bed_serve
    victim_id = next(w for w, i in serve.workers().items() if i["hostname"] == "h3")
    prompts = {f"kill-{i}": _prompt(200 + i, 40) for i in range(16)}
    streamed = [0]
    migrations_before = serve.metric("pdserve_request_migrations_total") or 0.0

    async def load():
        killed = asyncio.Event()

        def on_token(n):
            streamed[0] += n
            if streamed[0] >= 16 * 20 and not killed.is_set():
                killed.set()
                bed.host("h3").kill()
        return await asyncio.gather(*[_stream(serve.grpc_target, rid, p, 160, 120, on_token)
                                      for rid, p in prompts.items()])

    outs = asyncio.run(load())
    assert not bed.host("h3").alive
    finished = 0
    for (rid, p), (tokens, code, took) in zip(prompts.items(), outs):
        assert took < 120 + 10, f"{rid} hung: {took:.1f}s"
        if not code:
            finished += 1
            assert tokens == hf_greedy(hf, p, 160), (rid, serve.trace(rid))
        else:
            assert code == "UNAVAILABLE", (rid, code, serve.trace(rid))
    migrated = (serve.metric("pdserve_request_migrations_total") or 0.0) - migrations_before
    assert finished == len(prompts) and migrated >= 1, (finished, migrated, victim_id)
    # the prefill host's leases all end; the surviving decode worker frees every block
    survivor = "decode-1" if victim_id == "decode-0" else "decode-0"
    end = time.monotonic() + 60
    while (serve.metric("pdserve_leases_active", worker="prefill-0"),
           serve.metric("pdserve_kv_blocks_used", worker=survivor)) != (0.0, 0.0):
        assert time.monotonic() < end, (serve.metric("pdserve_leases_active", worker="prefill-0"),
                                        serve.metric("pdserve_kv_blocks_used", worker=survivor))
        time.sleep(0.5)
