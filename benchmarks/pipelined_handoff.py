"""Pipelined hand-off over a slow link: a long prompt (4096 tokens of SmolLM2-135M,
chunked prefill of 512) prefilled on one test host and decoded on another, the
prefill host's link capped by tc (1 Gbit/s by default), in up to three modes one
after the other, each on a fresh bed: `layerwise` (the default: each chunk's blocks
read while the next chunk computes, and the last chunk's in `--layer-groups` layer
groups while it computes, all but the last group before the first token;
`layerwise:N` for N groups), `pipelined` (the same without layer groups: the last
chunk's blocks all after the first token) and `after_first_token` (every block read
after the first token).

With `first_token_release: prefill` (set here) the first token streams from the
prefill node, so the transfer does not delay the TTFT: it delays the second token
(with the default, `decode`, the same time moves into the TTFT). Per mode this prints the client's
TTFT and first gap (first to second token), the steady gap (later tokens), the
hand-off's extra time (first gap minus a steady gap), the server's stages
(pdserve_handoff_seconds) and what the link needs for the whole prompt's KV and
for the last chunk's alone. Goal: the extra time is no more than the last chunk's
transfer.

    sudo .venv/bin/python benchmarks/pipelined_handoff.py [--gbit 1] [--prompts 3] [--input-len 4096] [--chunk 512]
        [--modes layerwise,pipelined,after_first_token] [--layer-groups 8]

Needs root (cluster/tools/testbed); prints {"skipped": ...} elsewhere. One JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import time
from pathlib import Path

from cluster.tools.testbed.sys_cmd import need_root

BLOCK = 16
STAGES = ("join", "room", "pull", "first_step", "total")


async def timed_stream(target: str, rid: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times (seconds from the send) of each streamed token."""
    from cluster.cli.client import GenerationClient, build_request

    t0, times = time.monotonic(), []
    async with GenerationClient(target) as c:
        req = build_request(prompt_token_ids=prompt, request_id=rid, max_tokens=max_tokens, temperature=0.0,
                            ignore_eos=True)
        async for r in c.generate(req, timeout=600):
            times.extend([time.monotonic() - t0] * len(r.token_ids))
    return times


def stage_sums(serve) -> dict[str, tuple[float, float]]:
    out = {}
    for st in STAGES:
        n = serve.metric("pdserve_handoff_seconds_count", stage=st) or 0.0
        s = serve.metric("pdserve_handoff_seconds_sum", stage=st) or 0.0
        out[st] = (n, s)
    return out


def mode_settings(mode: str, layer_groups: int) -> dict:
    """A mode's serve settings: `layerwise[:N]`, `pipelined` or `after_first_token`."""
    name, _, groups = mode.partition(":")
    if name == "layerwise":
        return {"pipelined_handoff": True, "handoff_layer_groups": int(groups or layer_groups)}
    if name in ("pipelined", "after_first_token") and not groups:
        return {"pipelined_handoff": name == "pipelined", "handoff_layer_groups": 1}
    raise ValueError(f"unknown mode {mode!r}: use layerwise, layerwise:N, pipelined or after_first_token")


def run_mode(model: Path, args, mode: str) -> dict:
    from cluster.tools.testbed import TestBed
    from cluster.tools.testbed.multi_host import MultiHostServe

    with TestBed.up(3) as bed:   # a fresh bed per mode: Ray and the link start alike
        bed.host("h2").limit(args.gbit)
        serve = MultiHostServe(bed, model, transfer_backend=args.backend, **mode_settings(mode, args.layer_groups),
                               max_model_len=args.input_len + 64, num_kv_blocks=3 * (args.input_len // BLOCK + 8),
                               max_num_batched_tokens=args.chunk, lease_ttl=120.0, transfer_timeout=120.0,
                               log_level="WARNING,pdserve.requests=DEBUG", first_token_release="prefill")
        return _measure(serve, args, mode)


def _measure(serve, args, mode: str) -> dict:
    try:
        vocab = 49152
        before = stage_sums(serve)
        runs, traces = [], []
        for i in range(args.prompts + 1):   # the first one warms up: not counted
            prompt = [(i * 7919 + j * 104729) % (vocab - 200) + 100 for j in range(args.input_len)]
            rid = f"pipe-{mode.replace(':', '-')}-{i}"
            times = asyncio.run(timed_stream(serve.grpc_target, rid, prompt, args.output_len))
            if i:
                runs.append(times)
                # the server's view of this hand-off: what the submit read, and the gap by stage
                traces.append([re.sub(r", blocks \[[^]]*\]", "", t) for t in serve.trace(rid)
                               if t.startswith(("joined", "second token"))])
            if i == 0:
                before = stage_sums(serve)
        after = stage_sums(serve)
    finally:
        serve.stop()
    ttft = [t[0] for t in runs]
    first_gap = [t[1] - t[0] for t in runs]
    steady = [b - a for t in runs for a, b in zip(t[1:], t[2:])]
    steady_med = statistics.median(steady)
    stages = {}
    for st in STAGES:
        n = after[st][0] - before[st][0]
        stages[st] = round(1e3 * (after[st][1] - before[st][1]) / n, 1) if n else None
    return {"ttft_s": [round(x, 3) for x in ttft], "first_gap_s": [round(x, 3) for x in first_gap],
            "steady_gap_ms_median": round(1e3 * steady_med, 1),
            "handoff_extra_s": [round(g - steady_med, 3) for g in first_gap],
            "stages_mean_ms": stages, "traces": traces}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gbit", type=float, default=1.0, help="cap of the prefill host's link")
    p.add_argument("--prompts", type=int, default=3, help="measured prompts per mode (after one warm-up)")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens: the prefill chunk")
    p.add_argument("--backend", default="tcp", help="KV transfer backend (tcp, nixl, ucxx)")
    p.add_argument("--model", default="", help="HF dir or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--modes", default="layerwise,pipelined,after_first_token",
                   help="comma-separated: layerwise, layerwise:N (N layer groups), pipelined, after_first_token")
    p.add_argument("--layer-groups", type=int, default=8,
                   help="layer groups of the layerwise mode (the serve default, handoff_layer_groups)")
    args = p.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        mode_settings(m, args.layer_groups)   # a bad name fails before any bed comes up
    if need_root():
        print(json.dumps({"benchmark": "pipelined_handoff", "skipped": need_root()}))
        return
    from engine.loader.load import resolve_model_path

    model = Path(resolve_model_path(args.model or None))
    kv_per_token = 30 * 2 * 3 * 64 * 4   # SmolLM2-135M: layers x (K, V) x kv heads x head dim x fp32
    link = args.gbit * 1e9 / 8
    out = {"benchmark": "pipelined_handoff", "gbit": args.gbit, "backend": args.backend,
           "workload": {"input_len": args.input_len, "chunk": args.chunk, "output_len": args.output_len,
                        "prompts": args.prompts},
           "link_s_whole_prompt": round(args.input_len // BLOCK * BLOCK * kv_per_token / link, 3),
           "link_s_last_chunk": round(args.chunk * kv_per_token / link, 3),
           "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "loadavg_start": os.getloadavg()[0],
           "modes": {}}
    for mode in modes:
        out["modes"][mode if mode != "layerwise" else f"layerwise:{args.layer_groups}"] = run_mode(model, args, mode)
    out["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
