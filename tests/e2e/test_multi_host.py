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
import urllib.request

import pytest

from cluster.tools.testbed import TestBed
from cluster.tools.testbed.sys_cmd import need_root
from testbed_cluster import MultiHostServe, host_env
from testbed_faults import Tally, decode_host_kill, prefill_host_kill, prefill_host_partition, prompt_of, stream
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


_stream, _prompt = stream, prompt_of


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
    prefill_host_partition(bed, serve, hf, 0, Tally())


def test_killing_the_prefill_host_mid_transfer_recomputes_every_request(bed_serve, hf):
    bed, serve = bed_serve
    tally = Tally()
    prefill_host_kill(bed, serve, hf, 0, tally)
    if not tally.recomputed:
        # the kill found no read on the wire (seen once in a fresh-clone run, cause not known):
        # print how the requests went, then one more trial; a second miss fails
        print("no recompute in trial 0:", {f"pk0-{i}": serve.trace(f"pk0-{i}") for i in range(6)},
              serve.diagnose(), sep="\n")
        prefill_host_kill(bed, serve, hf, 1, tally)
    assert tally.finished == tally.requests and tally.recomputed >= 1, (tally, serve.diagnose())


def test_losing_a_whole_decode_host_migrates_every_request(bed_serve, hf):
    bed, serve = bed_serve
    tally = Tally()
    decode_host_kill(bed, serve, hf, 0, tally)
    assert tally.finished == tally.requests and tally.migrated >= 1, tally
