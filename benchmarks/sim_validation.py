"""The simulator against real pdserve on the same scaled-down Mooncake trace.

For each setup (1P+1D, 2P+2D) this starts a real local pdserve cluster (Ray
actors, gRPC, the real router) on a small random Llama (cluster/tools/tiny_models.py,
sized so engine steps, not Python overheads, dominate), and:

1. measures the real capacity: the first ``--requests`` trace requests sent at
   ``--capacity-overload`` x the simulator's estimate; capacity = finished
   requests / (last finish - first send);
2. at each load level (``--loads``, fractions of that capacity) sends the same
   requests (each level with its own cache salt, so levels share nothing) on
   the trace's own arrival pattern compressed to the level's rate, recording
   every routing decision the real router makes (its `route` is wrapped in
   this process; no pdserve code changes);
3. simulates the same requests with the same tokens, salts, block counts,
   batch limits, router policy and report interval, arriving at the moments
   the real client actually sent them, with a cost profile measured on the same
   model (`cluster.tools.sim.measure`, thread CPU time, fit+residual mode).

Definitions, identical on both sides: TTFT = send -> first token (the real
one from the client, so it includes gRPC and Ray hops the simulator does not
model); ITL = every gap between consecutive tokens of a request (the first
gap after a remote prefill includes the KV hand-off); hit rate = cached prompt
tokens / prompt tokens, where a request's cached tokens are the larger of the
prefill and decode nodes' prefix hits (what the real usage reports);
routing = (kind, prefill node, decode node) per request, nodes matched by
their rank in their pool.

Prints one JSON line per (setup, capacity or load level), real vs sim side by
side. Heavy: run it under the shared lock, one setup per run:

    flock /tmp/pdserve-heavy.lock .venv/bin/python benchmarks/sim_validation.py --setup 1p1d
    flock /tmp/pdserve-heavy.lock .venv/bin/python benchmarks/sim_validation.py --setup 2p2d
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cluster.router import PolicyConfig
from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
from cluster.tools.sim.cost_model import CostModel, ScaledCost, TableCostModel, TransferCost, load_cost_model
from cluster.tools.sim.insitu import Interference, fit_frontend, fit_interference, occupancy, step_kind
from cluster.tools.sim.step_fit import shape_sched
from cluster.tools.sim.measure import Grid, make_engine, measure_engine
from cluster.tools.sim.workload import PromptBuilder, TraceRequest, load_mooncake
from engine.step_trace import StepRecord

ROOT = Path(__file__).resolve().parents[1]

TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
SETUPS = {"1p1d": (1, 1), "2p2d": (2, 2)}
MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536,
             max_position_embeddings=4096)
PROFILE_GRID = Grid(prefill_new=(16, 64, 256, 1024, 2048), prefill_cached=(0, 512, 1536),
                    decode_batch=(1, 2, 3, 4, 5, 6, 8, 16), decode_context=(256, 1024, 3584),
                    prefill_batches=(((64, 0),) * 2, ((256, 0),) * 3, ((64, 0), (16, 512)), ((256, 512),) * 2),
                    mixed=((2, 512, 64, 0), (4, 2048, 256, 512)), repeats=2, rounds=2)
# Loopback hand-off: a few Ray/NIXL round trips + ~5 GB/s (docs/kvtransfer.md); assumed, not measured here.
TRANSFER = TransferCost(fixed_s=2e-3, per_descriptor_s=2e-5, bandwidth_bytes_per_s=5e9)


@dataclass(frozen=True)
class Cfg:
    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    tokens_per_id: int = 16
    max_input: int = 3000
    local_prefill_threshold: int = 64
    local_prefill_hit_ratio: float = 0.8


# ---------------------------------------------------------------- workload
def trace_requests(path: Path, n: int, cfg: Cfg) -> list[TraceRequest]:
    reqs = load_mooncake(path, n, tokens_per_id=cfg.tokens_per_id)
    return [replace(r, input_length=min(r.input_length, cfg.max_input)) for r in reqs]


def offsets_at_rate(reqs: list[TraceRequest], rate: float) -> list[float]:
    """The trace's own arrival pattern, compressed so the mean rate is ``rate``."""
    t0 = reqs[0].arrival_s
    span = reqs[-1].arrival_s - t0
    scale = (len(reqs) - 1) / (rate * span) if span > 0 else 0.0
    return [(r.arrival_s - t0) * scale for r in reqs]


def salted(reqs: list[TraceRequest], salt: str, offsets: list[float]) -> list[TraceRequest]:
    return [replace(r, salt=salt, arrival_s=o) for r, o in zip(reqs, offsets)]


# ---------------------------------------------------------------- model and profile
def model_dir(path: Path) -> str:
    if not (path / "config.json").exists():
        from cluster.tools.tiny_models import make_tiny_model
        make_tiny_model(path, "llama", **MODEL)
    return str(path)


def profile_for(model: str, path: Path, cfg: Cfg) -> TableCostModel:
    if path.exists():
        return load_cost_model(str(path))
    engine = make_engine(model, block_size=cfg.block_size, num_blocks=2048, max_model_len=cfg.max_model_len,
                         max_num_batched_tokens=cfg.max_num_batched_tokens)
    prof, _ = measure_engine(engine, PROFILE_GRID, name="validation-cpu", fit_mode="fit+residual")
    prof.transfer = TRANSFER
    prof.meta["source"] += "; transfer: assumed loopback figures (benchmarks/sim_validation.py)"
    prof.save(path)
    return load_cost_model(str(path))


# ---------------------------------------------------------------- simulator side
def simulate(reqs: list[TraceRequest], p: int, d: int, cost: CostModel, cfg: Cfg,
             interference: Interference | None = None) -> dict:
    sc = SimConfig(p, d, policy="prefix_aware", interference=interference,
                   policy_config=PolicyConfig(0.0, cfg.local_prefill_threshold, cfg.local_prefill_hit_ratio),
                   block_size=cfg.block_size, num_blocks=cfg.num_blocks,
                   max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                   max_model_len=cfg.max_model_len, report_interval_s=0.1, report_lag_s=0.002)
    builder = PromptBuilder(cfg.block_size, cfg.tokens_per_id, vocab_size=256, first_token=3)
    sim = _GapSim(sc, cost, reqs, builder)
    s = sim.run()
    index = {r.request_id: i for i, r in enumerate(reqs)}
    recs = sorted(sim.records, key=lambda r: index[r.request_id])
    done = [r for r in recs if r.finish_s is not None]
    ttft = [r.ttft for r in done]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(max(r.cached_tokens, r.decode_cached_tokens) for r in done)
    first = min(r.arrival_s for r in recs)
    return {"finished": len(done), "requests": len(recs), **_lat(ttft, None),
            "itl_mean_s": s["itl_s"]["mean"], "itl_p90_s": s["itl_s"]["p90"],
            "hit_rate": cached / prompt if prompt else 0.0,
            "throughput_rps": len(done) / (max(r.finish_s for r in done) - first) if done else 0.0,
            **_split_gaps([(sim.second[r.request_id] - r.first_token_s, r.last_token_s - sim.second[r.request_id],
                            r.tokens_out - 2) for r in done if r.request_id in sim.second]),
            "decisions": [(r.kind, _rank(r.prefill_node) if r.kind == "remote_prefill" else None,
                           _rank(r.decode_node)) for r in recs],
            "wall_s": s["sim"]["wall_s"]}


class _GapSim(ClusterSim):
    """Also records when each request's second token came (to split off the first gap)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.second: dict[str, float] = {}

    def on_tokens(self, node, requests, ends) -> None:
        for r in requests:
            rec = self.live[r.request_id].rec
            if r.request_id not in self.second:
                if rec.first_token_s is not None:
                    self.second[r.request_id] = float(ends[0])
                elif len(ends) > 1:
                    self.second[r.request_id] = float(ends[1])
        super().on_tokens(node, requests, ends)


def _split_gaps(per_request: list[tuple[float, float, int]]) -> dict:
    """Mean first gap (first -> second token: the hand-off after a remote prefill)
    and mean of the later gaps, from (first gap, second -> last token, later gaps)."""
    firsts = [f for f, _, _ in per_request]
    rest_n = sum(n for _, _, n in per_request if n > 0)
    rest_t = sum(t for _, t, n in per_request if n > 0)
    return {"first_gap_mean_s": float(np.mean(firsts)) if firsts else None,
            "later_itl_mean_s": rest_t / rest_n if rest_n else None}


def _rank(node: str) -> int:
    return int(node[1:])


def _lat(ttft: list[float], itl: list[float] | None) -> dict:
    out = {"ttft_mean_s": float(np.mean(ttft)) if ttft else None,
           "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else None}
    if itl is not None:
        out.update({"itl_mean_s": float(np.mean(itl)) if itl else None,
                    "itl_p90_s": float(np.percentile(itl, 90)) if itl else None})
    return out


# ---------------------------------------------------------------- real side
class CpuSampler:
    """This process's CPU time (every thread: gRPC frontend, router, Ray client,
    the load client) and the whole host's busy CPU time, sampled every
    ``interval`` seconds on a thread."""

    def __init__(self, interval: float = 0.02) -> None:
        import threading
        self.interval = interval
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def start(self) -> "CpuSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _host_busy() -> float:
        """CPU seconds the whole host has been busy (every core, every process)."""
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

    def _sample(self) -> None:
        self.samples.append([round(time.time(), 4), round(time.process_time(), 5), round(self._host_busy(), 2)])

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):
                self._sample()
                return


class RealCluster:
    def __init__(self, model: str, p: int, d: int, cfg: Cfg, ray_dir: str) -> None:
        from cluster.config import ServeConfig
        with socket.socket() as sock:   # a free port for gRPC (grpc_port 0 would turn it off)
            sock.bind(("127.0.0.1", 0))
            grpc_port = sock.getsockname()[1]
        self.serve = ServeConfig(model=model, block_size=cfg.block_size, num_kv_blocks=cfg.num_blocks,
                                 max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                                 max_num_batched_tokens=cfg.max_num_batched_tokens, grpc_port=grpc_port, metrics_port=0,
                                 http_port=0, prefill_workers=p, decode_workers=d,
                                 cpus_per_worker=min(1.0, (os.cpu_count() or 2) / (p + d)), torch_threads=1,
                                 router_policy="prefix_aware", router_temperature=0.0,
                                 local_prefill_threshold=cfg.local_prefill_threshold,
                                 local_prefill_hit_ratio=cfg.local_prefill_hit_ratio, ray_temp_dir=ray_dir,
                                 log_level="WARNING", step_trace_size=1 << 17,
                                 first_token_release="prefill",   # the simulator streams P's first token at once
                                 # workers and frontend share the cores as equals: the simulator's
                                 # host model is processor sharing (Ray's default would nice workers to 15)
                                 worker_niceness=0)
        self.stack = None
        self.decisions: dict[str, tuple] = {}
        self.ranks: dict[str, int] = {}

    async def start(self) -> None:
        from cluster.server_stack import start_stack
        self.stack = await start_stack(self.serve)
        router = self.stack.backend.router
        for pool in ("prefill", "decode"):
            ids = sorted(w for w, ref in self.stack.backend.workers.items() if ref.pool == pool)
            self.ranks.update({w: i for i, w in enumerate(ids)})
        route = router.route

        def recording_route(request):       # the real decision, recorded per request id (bounded by the run)
            dec = route(request)
            self.decisions[request.request_id] = (
                dec.kind.value, self.ranks.get(dec.prefill_worker_id) if dec.prefill_worker_id else None,
                self.ranks.get(dec.decode_worker_id))
            return dec
        router.route = recording_route

    async def run(self, reqs: list[TraceRequest], builder: PromptBuilder) -> tuple[dict, list[float]]:
        from cluster.tools.bench.datasets import BenchRequest
        from cluster.tools.bench.runner import RunnerConfig, run_load
        bench = [BenchRequest(tuple(builder.tokens(r)), r.output_length, prompt_len=r.input_length,
                              cache_salt=r.salt or "") for r in reqs]
        tag = f"v{int(time.time() * 1000) % 10 ** 8}"
        self.decisions.clear()
        await self.step_traces()                     # drop the steps of earlier phases
        unix0 = time.time()
        sampler = CpuSampler().start()
        try:
            res = await run_load(self.stack.grpc.target, bench, [r.arrival_s for r in reqs],
                                 RunnerConfig(progress=False, drain_timeout_s=120.0, channels=2), tag=tag)
        finally:
            sampler.stop()
        by_index = {r.index: r for r in res.results}
        ok = [r for r in res.results if r.ok]
        ttft = [r.ttft_s for r in ok]
        itl = [g for r in ok for g in r.itl_s]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        ends = [r.sent_s + r.e2e_s for r in ok]
        first = min(r.sent_s for r in res.results)
        out = {"finished": len(ok), "requests": len(reqs), **_lat(ttft, itl),
               "hit_rate": cached / prompt if prompt else 0.0,
               "throughput_rps": len(ok) / (max(ends) - first) if ok else 0.0,
               **_split_gaps([(r.itl_s[0], sum(r.itl_s[1:]), len(r.itl_s) - 1) for r in ok if r.itl_s]),
               "errors": sorted({r.error_code for r in res.results if not r.ok}),
               "decisions": [self.decisions.get(f"bench-{tag}-{i}") for i in range(len(reqs))]}
        sent = [by_index[i].sent_s if i in by_index else reqs[i].arrival_s for i in range(len(reqs))]
        out["steps"] = await self.step_traces()
        out["token_times"] = {str(r.index): [round(r.sent_s, 5)] + [round(t, 5) for t in r.token_times_s] for r in ok}
        out["unix0"] = unix0                         # client times are seconds after this (time.time())
        # [time.time(), this process's CPU seconds (frontend + client), the host's busy CPU seconds]
        out["frontend_cpu"] = sampler.samples
        span = sampler.samples[-1][0] - sampler.samples[0][0]
        out["host_busy_cores"] = (sampler.samples[-1][2] - sampler.samples[0][2]) / span if span > 0 else None
        return out, sent

    async def step_traces(self) -> dict:
        """Every worker's engine steps since the last call, keyed p<rank> / d<rank>."""
        refs = list(self.stack.backend.workers.values())
        got = await asyncio.gather(*[asyncio.wrap_future(r.actor.step_trace.remote().future()) for r in refs])
        return {f"{r.pool[0]}{self.ranks[r.worker_id]}": g["records"] for r, g in zip(refs, got)}

    async def stop(self) -> None:
        import ray
        try:
            await self.stack.drain_and_stop(1.0)
        finally:
            ray.shutdown()


# ---------------------------------------------------------------- comparison
def compare(real: dict, sim: dict) -> dict:
    rel = {}
    for k in ("ttft_mean_s", "ttft_p90_s", "itl_mean_s", "itl_p90_s"):
        a, b = real.get(k), sim.get(k)
        rel[k] = None if not a or b is None else round((b - a) / a, 4)
    pairs = [(a, b) for a, b in zip(real["decisions"], sim["decisions"]) if a is not None]
    same = sum(tuple(a) == tuple(b) for a, b in pairs)
    same_kind = sum(a[0] == b[0] for a, b in pairs)
    return {"sim_vs_real_rel": rel, "hit_rate_points": round(100 * (sim["hit_rate"] - real["hit_rate"]), 2),
            "routing_identical": round(same / len(pairs), 4) if pairs else None,
            "routing_same_kind": round(same_kind / len(pairs), 4) if pairs else None,
            "within_target": {"latency_10pct": all(v is not None and abs(v) <= 0.10 for v in rel.values()),
                              "hit_rate_2pts": abs(sim["hit_rate"] - real["hit_rate"]) <= 0.02}}


def sampling_spread(token_times: dict, rounds: int = 400, seed: int = 0) -> dict:
    """How much each real figure moves with *which* requests the window holds:
    the relative standard deviation of mean / p90 TTFT and ITL over bootstrap
    resamples of the finished requests (``token_times``: request -> [send,
    token times...]). A figure whose own spread is 10% cannot be matched within
    10% reliably, by a simulator or by a second real run."""
    rows = [t for t in token_times.values() if len(t) > 1]
    if len(rows) < 2:
        return {}
    ttft = np.array([t[1] - t[0] for t in rows])
    gaps = [np.diff(t[1:]) for t in rows]
    rng = np.random.default_rng(seed)
    stats = np.empty((rounds, 4))
    for i in range(rounds):
        idx = rng.integers(0, len(rows), len(rows))
        tf = ttft[idx]
        g = np.concatenate([gaps[j] for j in idx])
        stats[i] = (tf.mean(), np.percentile(tf, 90), g.mean() if len(g) else np.nan,
                    np.percentile(g, 90) if len(g) else np.nan)
    rel = stats.std(axis=0) / np.abs(stats.mean(axis=0))
    return {k: round(float(v), 4) for k, v in zip(("ttft_mean_s", "ttft_p90_s", "itl_mean_s", "itl_p90_s"), rel)
            if np.isfinite(v)}


_BULKY = ("decisions", "steps", "token_times", "frontend_cpu")


def _brief(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items() if k not in _BULKY}


def _line(setup: str, ph: dict, real: dict, sim: dict) -> str:
    """The JSON line (returned) and a markdown row real / sim (printed to stderr)."""
    head = {k: ph[k] for k in ("phase", "load", "rate_rps", "capacity_rps", "sim_estimate_rps") if k in ph}
    cmp = compare(real, sim)
    label = "capacity run" if ph["phase"] == "capacity" else f"{ph['load']:.0%} ({ph['rate_rps']:.2f} req/s)"
    ms = lambda x: f"{x * 1e3:.1f}"   # noqa: E731
    s2 = lambda x: f"{x:.2f}"         # noqa: E731
    cols = [f"{f(real[k])} / {f(sim[k])}" for k, f in (("ttft_mean_s", s2), ("ttft_p90_s", s2), ("itl_mean_s", ms),
                                                         ("itl_p90_s", ms), ("throughput_rps", s2))]
    print(f"| {setup} | {label} | " + " | ".join(cols[:4]) + f" | {100 * real['hit_rate']:.2f} / "
          f"{100 * sim['hit_rate']:.2f} | {100 * (cmp['routing_identical'] or 0):.0f}% | {cols[4]} |", file=sys.stderr)
    spread = sampling_spread(real["token_times"]) if real.get("token_times") else None
    return json.dumps({"benchmark": "sim_validation", "setup": setup, **head, "real": _brief(real),
                       "sim": _brief(sim), **cmp, "real_sampling_rel_sd": spread})


async def run_setup(args, cfg: Cfg, model: str, cost: CostModel) -> None:
    """Real runs (saved with their actual send times to ``real_<setup>.json`` in the
    work dir, so `--resimulate` can redo the simulator side alone) and the simulator."""
    p, d = SETUPS[args.setup]
    reqs = trace_requests(Path(args.trace), args.requests, cfg)
    builder = PromptBuilder(cfg.block_size, cfg.tokens_per_id, vocab_size=256, first_token=3)
    # the simulator's capacity estimate (a burst at a rate far above it) picks the overload rate
    est = simulate(salted(reqs, "est", offsets_at_rate(reqs, 1000.0)), p, d, cost, cfg)["throughput_rps"]
    cluster = RealCluster(model, p, d, cfg, tempfile.mkdtemp(prefix="pdserve-val-ray-"))
    saved = {"setup": args.setup, "requests": args.requests, "phases": []}
    out = Path(args.work_dir) / f"real_{args.setup}.json"
    await cluster.start()
    try:
        warm = salted(reqs[:4], "warm", [0.5 * i for i in range(4)])
        await cluster.run(warm, builder)
        rate = args.capacity_overload * est
        plan = [("capacity", None, "cap")] + [("load", x, f"l{x}") for x in args.loads]
        capacity = None
        for phase, load, salt in plan:
            if phase == "load":
                rate = load * capacity
            real, sent = await cluster.run(salted(reqs, salt, offsets_at_rate(reqs, rate)), builder)
            ph = {"phase": phase, "load": load, "rate_rps": round(rate, 3), "salt": salt, "sent": sent, "real": real}
            if phase == "capacity":
                capacity = real["throughput_rps"]
                ph["sim_estimate_rps"] = round(est, 3)
            ph["capacity_rps"] = round(capacity, 3)
            saved["phases"].append(ph)
            out.write_text(json.dumps(saved) + "\n")
            sim = simulate(salted(reqs, salt, sent), p, d, cost, cfg)
            print(_line(args.setup, ph, real, sim), flush=True)
    finally:
        await cluster.stop()


def load_saved(path: str) -> dict:
    """A saved real run (``real_<setup>.json``, or gzipped ``.json.gz`` as kept in docs/sim/validation)."""
    raw = Path(path).read_bytes()
    if path.endswith(".gz"):
        import gzip
        raw = gzip.decompress(raw)
    return json.loads(raw)


def resimulate(args, cfg: Cfg, cost: CostModel) -> None:
    """The simulator side again, on saved real runs (same requests and send times)."""
    saved = load_saved(args.resimulate)
    p, d = SETUPS[saved["setup"]]
    reqs = trace_requests(Path(args.trace), saved["requests"], cfg)
    for ph in saved["phases"]:
        sim = simulate(salted(reqs, ph["salt"], ph["sent"]), p, d, cost, cfg)
        print(_line(saved["setup"], ph, ph["real"], sim), flush=True)


def calibrate(args, cfg: Cfg, base: CostModel) -> None:
    """Least squared log error of mean / p90 TTFT and ITL over the chosen saved phases."""
    saved = load_saved(args.calibrate)
    p, d = SETUPS[saved["setup"]]
    reqs = trace_requests(Path(args.trace), saved["requests"], cfg)
    want = set(args.calibrate_phases.split(","))
    phases = [ph for ph in saved["phases"] if ph["phase"] in want or str(ph["load"]) in want]
    keys = ("ttft_mean_s", "ttft_p90_s", "itl_mean_s", "itl_p90_s")
    best = None
    for factor in np.arange(1.0, 4.01, 0.25):
        for add_ms in (0.0, 5.0, 10.0, 20.0, 30.0, 40.0, 60.0, 80.0):
            for fixed_ms in (2.0, 50.0, 150.0):
                cost = ScaledCost(with_transfer_fixed(base, fixed_ms / 1e3), float(factor), add_ms / 1e3)
                err = 0.0
                for ph in phases:
                    sim = simulate(salted(reqs, ph["salt"], ph["sent"]), p, d, cost, cfg)
                    err += sum(np.log(sim[k] / ph["real"][k]) ** 2 for k in keys)
                if best is None or err < best[0]:
                    best = (err, round(float(factor), 2), add_ms, fixed_ms)
    print(json.dumps({"benchmark": "sim_validation", "phase": "calibration", "setup": saved["setup"],
                      "fitted_on": sorted(want), "step_scale": best[1], "step_add_ms": best[2],
                      "transfer_fixed_ms": best[3],
                      "rms_log_error": round(float(np.sqrt(best[0] / (len(keys) * len(phases)))), 4)}), flush=True)


def insitu(args, cfg: Cfg, base: TableCostModel) -> None:
    """Fit host interference (cluster/tools/sim/insitu.py) from the workers' step traces
    of the chosen saved phases, and the hand-off's fixed cost from their mean
    first token gap; then simulate every phase with both (the others held out)."""
    saved = load_saved(args.insitu)
    source = load_saved(args.fit_from) if args.fit_from else saved
    if (source["setup"], source["requests"]) != (saved["setup"], saved["requests"]):
        raise SystemExit(f"--fit-from {args.fit_from}: a run of setup {source['setup']} with {source['requests']} "
                         f"requests; give one of {saved['setup']} with {saved['requests']}, like {args.insitu}")
    p, d = SETUPS[saved["setup"]]
    reqs = trace_requests(Path(args.trace), saved["requests"], cfg)
    want = set(args.calibrate_phases.split(","))
    fitted = [ph for ph in source["phases"] if ph["phase"] in want or str(ph["load"]) in want]
    if not fitted or any(not ph["real"].get("steps") for ph in fitted):
        raise SystemExit(f"{args.fit_from or args.insitu}: phases {sorted(want)} have no step traces (record "
                         f"them again with this script: it runs the workers with step_trace_size > 0)")
    runs = [{n: [StepRecord.from_json(r) for r in recs] for n, recs in ph["real"]["steps"].items()} for ph in fitted]
    roles = {n: {"p": "prefill", "d": "decode"}[n[0]] for run in runs for n in run}
    fe, work = None, []
    if all(ph["real"].get("frontend_cpu") for ph in fitted) and not args.no_frontend:
        for ph in fitted:
            u0, tt = ph["real"]["unix0"], ph["real"]["token_times"].values()
            work.append(([u0 + t[0] for t in tt], [u0 + x for t in tt for x in t[1:]]))
        fe = fit_frontend([(ph["real"]["frontend_cpu"], *w) for ph, w in zip(fitted, work)])
    inter = fit_interference(runs, roles, base, fe, work, by_load=args.host_model == "shared",
                             jitter=args.jitter, monotone=not args.free_factors)
    # the hand-off: the fixed cost whose simulated mean first gap is nearest the real one
    best = None
    for fixed_ms in np.arange(0.0, 301.0, 5.0):
        cost = with_transfer_fixed(base, fixed_ms / 1e3)
        err = 0.0
        for ph in fitted:
            sim = simulate(salted(reqs, ph["salt"], ph["sent"]), p, d, cost, cfg, inter)
            err += np.log(sim["first_gap_mean_s"] / ph["real"]["first_gap_mean_s"]) ** 2
        if best is None or err < best[0]:
            best = (err, float(fixed_ms))
    cost = with_transfer_fixed(base, best[1] / 1e3)
    print(json.dumps({"benchmark": "sim_validation", "phase": "insitu-fit", "setup": saved["setup"],
                      "fitted_on": sorted(want), "interference": inter.to_json(),
                      "transfer_fixed_ms": best[1]}), flush=True)
    if args.save_interference:
        Path(args.save_interference).write_text(json.dumps({**inter.to_json(), "transfer_fixed_ms": best[1]}) + "\n")
    for ph in saved["phases"]:
        sim = simulate(salted(reqs, ph["salt"], ph["sent"]), p, d, cost, cfg, inter)
        line = json.loads(_line(saved["setup"], ph, ph["real"], sim))
        line["held_out"] = ph not in fitted          # a phase of another run (--fit-from) is always held out
        print(json.dumps(line), flush=True)


def host_report(args, base: TableCostModel) -> None:
    """Per saved phase: how busy the host was (cores: all, engine threads, the
    frontend process, the rest), and per node role and step kind the steps'
    wall and CPU time over the profile's isolated cost, split by whether
    another node was mid-step for most of the step."""
    saved = load_saved(args.host_report)
    for ph in saved["phases"]:
        real = ph["real"]
        if not real.get("steps") or not real.get("frontend_cpu"):
            raise SystemExit(f"{args.host_report}: phase {ph['phase']} has no step traces / CPU samples")
        traces = {n: [StepRecord.from_json(r) for r in recs] for n, recs in real["steps"].items()}
        fc = real["frontend_cpu"]
        span = fc[-1][0] - fc[0][0]
        engine = sum(r.cpu_s for recs in traces.values() for r in recs) / span
        frontend = (fc[-1][1] - fc[0][1]) / span
        host = real.get("host_busy_cores")
        ratios: dict[str, list[float]] = {}
        for n, fracs in occupancy(traces).items():
            role = {"p": "prefill", "d": "decode"}[n[0]]
            for r, frac in zip(traces[n], fracs):
                pred = base.step_seconds(shape_sched(r.shape))
                key = f"{role}/{step_kind(r.shape)}/{'others_busy' if frac[0] < 0.5 else 'alone'}"
                acc = ratios.setdefault(key, [0.0, 0.0, 0.0, 0])
                acc[0] += r.wall_s
                acc[1] += r.cpu_s
                acc[2] += pred
                acc[3] += 1
        print(json.dumps({"benchmark": "sim_validation", "phase": "host-report", "setup": saved["setup"],
                          "load": ph["load"] if ph["phase"] == "load" else "capacity",
                          "host_busy_cores": round(host, 2) if host is not None else None,
                          "engine_thread_cores": round(engine, 2), "frontend_cores": round(frontend, 2),
                          "other_cores": round(host - engine - frontend, 2) if host is not None else None,
                          "steps": {k: {"n": v[3], "wall_over_isolated": round(v[0] / v[2], 2),
                                        "cpu_over_isolated": round(v[1] / v[2], 2)}
                                    for k, v in sorted(ratios.items()) if v[2] > 0}}), flush=True)


def with_transfer_fixed(cost: TableCostModel, fixed_s: float) -> TableCostModel:
    """The same profile with another fixed cost per KV hand-off."""
    out = cost.with_mode(cost.fit_mode)
    out.transfer = TransferCost(fixed_s, cost.transfer.per_descriptor_s, cost.transfer.bandwidth_bytes_per_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", choices=sorted(SETUPS), default="1p1d")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=100, help="first N trace requests (per level)")
    ap.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.85, 1.1])
    ap.add_argument("--capacity-overload", type=float, default=3.0)
    ap.add_argument("--work-dir", default="/tmp/pdserve-sim-validation",
                    help="model and measured profile are kept here between runs")
    ap.add_argument("--profile", help="a measured profile JSON (default: measure into the work dir once)")
    ap.add_argument("--step-scale", type=float, default=1.0,
                    help="simulate with every engine step this many times as long (a calibration; 1 = none)")
    ap.add_argument("--step-add-ms", type=float, default=0.0,
                    help="and this much longer (per-step work outside LLMEngine.step(); 0 = none)")
    ap.add_argument("--transfer-fixed-ms", type=float,
                    help="fixed cost of a KV hand-off (default: the profile's; a calibration)")
    ap.add_argument("--calibrate", metavar="REAL_JSON",
                    help="no real cluster: grid-search --step-scale / --step-add-ms on the saved real runs of this "
                         "file (phases --calibrate-phases) and print the best; then --resimulate with them")
    ap.add_argument("--calibrate-phases", default=None,
                    help="phases --calibrate / --insitu fit on (default: capacity,0.5 / capacity)")
    ap.add_argument("--insitu", metavar="REAL_JSON",
                    help="no real cluster: fit host interference from the workers' step traces saved in this "
                         "file (phases --calibrate-phases) and the hand-off's fixed cost, then simulate every phase")
    ap.add_argument("--host-model", choices=("shared", "constant"), default="shared",
                    help="with --insitu: step slowdown by how many other parties are busy (shared), or one "
                         "mean slowdown per role and step kind (constant)")
    ap.add_argument("--no-frontend", action="store_true",
                    help="with --insitu: do not model the frontend process as a party on the host")
    ap.add_argument("--fit-from", metavar="REAL_JSON",
                    help="with --insitu: fit on these phases of this other saved run of the same setup, and "
                         "simulate every phase of the --insitu run (all held out)")
    ap.add_argument("--jitter", action="store_true",
                    help="with --insitu: also fit each step kind's residual spread and draw every simulated "
                         "step's time from it (default: each step takes its modelled mean time)")
    ap.add_argument("--free-factors", action="store_true",
                    help="with --insitu: fit each number of busy parties' factor on its own (default: factors "
                         "that do not fall as more parties are busy)")
    ap.add_argument("--host-report", metavar="REAL_JSON",
                    help="no real cluster: per saved phase, host CPU use and in-situ step slowdowns")
    ap.add_argument("--save-interference", metavar="JSON", help="with --insitu: write the fitted table here")
    ap.add_argument("--resimulate", metavar="REAL_JSON",
                    help="no real cluster: simulate again the saved real runs of this file (real_<setup>.json)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = Cfg()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = model_dir(work / "model")
    t0 = time.perf_counter()
    cost = base = load_cost_model(args.profile) if args.profile else profile_for(model, work / "profile.json", cfg)
    fit_mode = cost.fit_mode
    if args.transfer_fixed_ms is not None:
        cost = base = with_transfer_fixed(base, args.transfer_fixed_ms / 1e3)
    if args.step_scale != 1.0 or args.step_add_ms:
        cost = ScaledCost(cost, args.step_scale, args.step_add_ms / 1e3)
    print(json.dumps({"benchmark": "sim_validation", "phase": "profile", "fit_mode": fit_mode,
                      "step_scale": args.step_scale, "step_add_ms": args.step_add_ms,
                      "transfer_fixed_ms": base.transfer.fixed_s * 1e3,
                      "fit": dict(zip(base.step_fit.to_json()["terms"], base.step_fit.coef)) if base.step_fit else None,
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    if args.calibrate_phases is None:
        args.calibrate_phases = "capacity" if args.insitu else "capacity,0.5"
    if args.host_report:
        host_report(args, base)
    elif args.insitu:
        insitu(args, cfg, base)
    elif args.calibrate:
        calibrate(args, cfg, base)
    elif args.resimulate:
        resimulate(args, cfg, cost)
    else:
        asyncio.run(run_setup(args, cfg, model, cost))


if __name__ == "__main__":
    main()
