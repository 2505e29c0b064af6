"""Faults across test hosts, one trial each, counted like the chaos suite: a whole
decode host killed under load, a prefill host killed while its KV is on the wire,
a prefill host cut off for 10 s. Each trial leaves the bed as it found it (a
killed host is booted again and rejoins Ray; Ray restarts its actors), so a
module can run many. Used by tests/e2e/test_multi_host.py (one trial each) and
tests/chaos/test_multi_host_faults.py (the full counts)."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from cluster.cli.client import GenerationClient, build_request
from tiny_models import hf_greedy

# bytes the prefill host sends before the kill: 40% of one prompt's KV (368 KB), ~0.6 s into
# the reads at 2 Mbit/s, far more than the requests and Ray's reports send meanwhile
KV_ON_WIRE = 150_000


@dataclass
class Tally:
    trials: int = 0
    requests: int = 0
    finished: int = 0
    migrated: int = 0
    recomputed: int = 0
    errors: Counter = field(default_factory=Counter)

    def row(self) -> str:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "-"
        return (f"trials {self.trials}, requests {self.requests}, finished {self.finished}, migrated "
                f"{self.migrated}, recomputed {self.recomputed}, errors {errs}, leaked blocks 0")


async def stream(target: str, rid: str, prompt: list[int], max_tokens: int, timeout: float,
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


def prompt_of(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i * i + 3 * i) % 370 + 5 for i in range(n)]


def _check(serve, hf, prompts: dict, outs, max_tokens: int, deadline: float, allowed: set[str],
           tally: Tally) -> None:
    for (rid, p), (tokens, code, took) in zip(prompts.items(), outs):
        assert took < deadline + 10, f"{rid} hung: {took:.1f}s (deadline {deadline}s)"
        tally.requests += 1
        if not code:
            tally.finished += 1
            assert tokens == hf_greedy(hf, p, max_tokens), (rid, serve.trace(rid))
        else:
            assert code in allowed, (rid, code, serve.trace(rid))
            tally.errors[code] += 1
        trace = serve.trace(rid)
        tally.migrated += sum(t.startswith("migrating") for t in trace)
        tally.recomputed += sum("recomputed" in t for t in trace)


def _wait_gone(serve, worker_id: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while serve.metric("pdserve_kv_blocks_capacity", worker=worker_id) is not None:
        assert time.monotonic() < end, f"the frontend still routes to {worker_id} after its host died"
        time.sleep(0.2)


def _restart(serve, host: str, worker_id: str) -> None:
    _wait_gone(serve, worker_id)
    serve.restart_host(host)
    serve.wait_routable(worker_id)


def decode_host_kill(bed, serve, hf, trial: int, tally: Tally, host: str = "h3") -> None:
    """16 streams; the decode host `host` dies whole after ~20 tokens each. Every request
    finishes token-identical on the other decode host or ends UNAVAILABLE by its deadline;
    the prefill host's leases end and no live decode worker keeps a block."""
    victim = serve.worker_on(host)
    prompts = {f"dk{trial}-{i}": prompt_of(1000 * trial + i, 40) for i in range(16)}
    streamed, killed = [0], []

    def on_token(n):
        streamed[0] += n
        if streamed[0] >= 16 * 20 and not killed:
            killed.append(time.monotonic())
            bed.host(host).kill()

    async def load():
        return await asyncio.gather(*[stream(serve.grpc_target, rid, p, 160, 120, on_token)
                                      for rid, p in prompts.items()])
    outs = asyncio.run(load())
    assert killed and not bed.host(host).alive, "the fault never fired"
    _check(serve, hf, prompts, outs, 160, 120, {"UNAVAILABLE"}, tally)
    serve.wait_idle()
    _restart(serve, host, victim)
    tally.trials += 1


def prefill_host_kill(bed, serve, hf, trial: int, tally: Tally, host: str = "h2") -> None:
    """The prefill host dies whole while the KV hand-offs are on the wire (its link slowed
    to 2 Mbit/s: a 480-token prompt of the tiny model is 368 KB of KV, about 1.5 s at that
    rate, six prompts about 9 s). The kill fires once the host has sent KV_ON_WIRE bytes
    since the load began (the requests' own bytes and Ray's reports are a few KB), or at
    the client's first token if that comes first: with the default first_token_release=
    decode the first token reaches the client only after its KV is in, so the token alone
    would fire after the reads. The decode side gives up the read, the requests are
    recomputed there, token-identical; no decode block leaks."""
    victim = serve.worker_on(host)
    h = bed.host(host)
    prompts = {f"pk{trial}-{i}": prompt_of(2000 * trial + i, 480) for i in range(6)}
    killed: list[float] = []
    lock = threading.Lock()

    def kill_once() -> None:
        with lock:
            if not killed:
                killed.append(time.monotonic())
                h.kill()

    def on_token(n):
        kill_once()

    def watch(sent_before: int, done: threading.Event) -> None:
        while not done.wait(0.01) and not killed:
            if h.link_bytes()[0] - sent_before >= KV_ON_WIRE:
                kill_once()

    async def load():
        return await asyncio.gather(*[stream(serve.grpc_target, rid, p, 16, 120, on_token)
                                      for rid, p in prompts.items()])
    h.limit(0.002)
    done = threading.Event()
    watcher = threading.Thread(target=watch, args=(h.link_bytes()[0], done), daemon=True)
    watcher.start()
    try:
        outs = asyncio.run(load())
    finally:
        done.set()
        watcher.join()
        h.unlimit()
    assert killed, "the fault never fired"
    _check(serve, hf, prompts, outs, 16, 120, set(), tally)
    serve.wait_idle()
    _restart(serve, host, victim)
    tally.trials += 1


def prefill_host_partition(bed, serve, hf, trial: int, tally: Tally, host: str = "h2") -> None:
    """The prefill host's link is down for 10 s while 4 requests arrive: none hangs past its
    30 s deadline (each finishes token-identical or ends with DEADLINE_EXCEEDED /
    UNAVAILABLE); once the link is back the host takes hand-offs again and Ray counts
    every node."""
    h = bed.host(host)
    prompts = {f"pt{trial}-{i}": prompt_of(3000 * trial + i, 60) for i in range(4)}

    async def during_cut():
        h.cut()
        try:
            tasks = [asyncio.create_task(stream(serve.grpc_target, rid, p, 16, 30)) for rid, p in prompts.items()]
            await asyncio.sleep(10)
        finally:
            h.restore()
        return await asyncio.gather(*tasks)

    outs = asyncio.run(during_cut())
    _check(serve, hf, prompts, outs, 16, 30, {"DEADLINE_EXCEEDED", "UNAVAILABLE"}, tally)
    end, n = time.monotonic() + 120, 0
    while True:
        n += 1
        rid, p = f"pt{trial}-back-{n}", prompt_of(3000 * trial + 100 + n, 48)
        tokens, code, _ = asyncio.run(stream(serve.grpc_target, rid, p, 8, 60))
        assert (tokens, code) == (hf_greedy(hf, p, 8), ""), (rid, code, serve.trace(rid))
        if any(t.startswith(f"prefilled on {serve.worker_on(host)}") for t in serve.trace(rid)):
            break
        assert time.monotonic() < end, (f"{host} never took a request after the partition: "
                                        f"{serve.trace(rid)}\n{serve.diagnose()}")
        time.sleep(1)
    assert serve.ray_active_nodes() == len(bed.hosts), serve.diagnose()
    serve.wait_idle()
    tally.trials += 1
