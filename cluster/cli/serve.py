"""`pdserve serve`: the disaggregated cluster behind gRPC and OpenAI-compatible HTTP endpoints.

With no arguments: a local Ray cluster, the bundled SmolLM2-135M-Instruct,
1 prefill and 1 decode worker on the CPU, gRPC on 127.0.0.1:50051, HTTP on
127.0.0.1:8000 and Prometheus metrics on 127.0.0.1:9400. --grpc-port 0 or
--http-port 0 turns that endpoint off (not both). Every option is also a key of the
YAML file given to --config and an env var PDSERVE_<KEY>; flags win over
env, env over the file.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys

from cluster.config import ServeConfig
from cluster.observability.log_levels import configure_logging

HELP = {
    "model": "HF model directory, .gguf file, or a Hugging Face model id already in the local HF cache "
             "($HF_HOME; read offline) (default: the bundled SmolLM2-135M-Instruct GGUF)",
    "served_model_name": "names requests may give as \"model\" (aliases); the first is the one /v1/models "
                         "and ModelInfo report (default: the model id, or the directory's / .gguf's name "
                         "without extension; SmolLM2-135M-Instruct for the bundled model)",
    "device": "torch device of the workers: cpu, cuda, cuda:1 ...",
    "dtype": "weights and KV dtype: float32, bfloat16 or float16",
    "block_size": "tokens per KV block (power of two)",
    "kv_cache_memory": "KV pool size per worker, e.g. 512MiB, 4GiB",
    "num_kv_blocks": "KV blocks per worker; > 0 overrides --kv-cache-memory",
    "kv_cache_dtype": "how the KV pool stores K/V: auto (the model's dtype), int8 or fp8_e4m3 (1 byte a value "
                      "plus a scale per token and KV head; docs/kv_quantization.md); every worker must agree",
    "max_model_len": "longest prompt + output in tokens (0 = the model's own context length)",
    "max_num_seqs": "sequences a worker runs at once",
    "max_num_batched_tokens": "token budget of one engine step (chunked prefill above it)",
    "queue_order": "order each worker admits its waiting requests in: fcfs, or fewest_uncached (fewest prompt "
                   "tokens not in its prefix cache first; docs/benchmarks.md, sched35)",
    "queue_max_pass_s": "fewest_uncached: seconds a request may be passed over by shorter ones; after that it "
                        "goes in arrival order",
    "final_chunk_unpadded": "a step that finishes a prompt's prefill is not filled up with chunks that would not "
                            "finish theirs (whole prompts and decodes still join); for CPU workers "
                            "(docs/benchmarks.md, fin35)",
    "host": "address the endpoints (and KV side channels) bind to",
    "grpc_port": "gRPC port (0 = off: HTTP only; --http-port must then be set)",
    "metrics_port": "Prometheus metrics port (0 = any free port)",
    "http_port": "OpenAI-compatible HTTP port (0 = off: gRPC only; --grpc-port must then be set)",
    "prefill_workers": "prefill actors",
    "autoscale": "size the prefill and decode pools to --slo-ttft-ms / --slo-itl-ms while serving, each within "
                 "its --min/--max-*-workers (docs/autoscaling.md); the *_workers flags are the start sizes",
    "slo_ttft_ms": "time to first token (p90, ms) the prefill pool is sized for (--autoscale)",
    "slo_itl_ms": "inter-token latency (p90, ms) the decode pool is sized for (--autoscale)",
    "min_prefill_workers": "fewest prefill workers autoscaling keeps",
    "max_prefill_workers": "most prefill workers autoscaling starts (0 = --prefill-workers)",
    "min_decode_workers": "fewest decode workers autoscaling keeps",
    "max_decode_workers": "most decode workers autoscaling starts (0 = --decode-workers)",
    "autoscale_interval": "seconds between autoscaling decisions",
    "autoscale_cooldown_s": "seconds of low load before a scale-in, and between a change and the next "
                            "scale-in (half of it between scale-outs)",
    "autoscale_prefill_tokens_per_s": "prompt tokens/s one prefill worker sustains (`pdserve plan --measure` measures it; "
                                      "0 = measured from the workers' reports)",
    "autoscale_decode_seqs_per_worker": "sequences one decode worker holds (0 = measured: its KV blocks over "
                                        "the blocks a running sequence holds, capped by --max-num-seqs)",
    "autoscale_ttft_miss_budget": "part of the requests that may miss --slo-ttft-ms by waiting (of those whose "
                                  "prefill alone fits it); > 0: this decides the prefill pool's SLO instead of the "
                                  "TTFT p90 (0: the p90; docs/autoscaling.md)",
    "autoscale_max_total_workers": "both pools together hold at most this many workers, draining ones included "
                                   "(the GPUs the fleet owns); at the cap a worker moves to the pool that gains "
                                   "more (0 = no cap: each pool within its own bounds; docs/autoscaling.md)",
    "decode_workers": "decode actors (colocated workers with --colocated)",
    "tensor_parallel_size": "ranks one worker's model is split over, in both pools (Ray actors in one placement "
                            "group, one node; docs/tensor_parallel.md)",
    "prefill_tensor_parallel_size": "ranks per prefill worker (0 = --tensor-parallel-size)",
    "decode_tensor_parallel_size": "ranks per decode (or colocated) worker (0 = --tensor-parallel-size)",
    "colocated": "workers run both phases; no KV handoff (for comparison)",
    "cpus_per_worker": "Ray CPUs each worker actor (each rank of a tensor-parallel worker) reserves",
    "worker_niceness": "nice level of the worker actors when pdserve starts Ray itself (15, Ray's default: the "
                       "frontend keeps streaming promptly when engines saturate the cores; 0: engines get equal "
                       "priority); an existing cluster: set RAY_worker_niceness before `ray start`",
    "gpus_per_worker": "Ray GPUs each worker actor (each rank of a tensor-parallel worker: 1) reserves (set with --device cuda)",
    "torch_threads": "torch threads inside each worker",
    "prefill_resource": "Ray custom resource prefill actors request ('' = none)",
    "decode_resource": "Ray custom resource decode actors request ('' = none)",
    "router_policy": "prefix_aware, round_robin or least_loaded",
    "router_temperature": "softmax temperature among near-equal nodes (0 = cheapest)",
    "local_prefill_threshold": "uncached prompt tokens at or below which the decode node prefills itself",
    "local_prefill_hit_ratio": "share of the prompt the decode node holds above which it prefills itself",
    "router_track_in_flight": "count prefixes already sent to a node before its KV events arrive (--no-router-track-in-flight: only reported ones)",
    "router_min_hit_share": "a prefill node's cached prefix under this share of the prompt counts as no hit "
                            "(a short preamble every conversation shares then does not place new ones; 0 = "
                            "every hit counts)",
    "prefill_queue_limit": "hold arriving requests at the frontend (one FIFO) while every prefill node has more "
                           "than this many prompt tokens outstanding (sent, prefill not ended), routing each "
                           "when a prefill ends and leaves room: late binding, which keeps a burst off nodes "
                           "busy with long prompts (0: one prompt per node at a time; -1 = route on arrival; "
                           "docs/http.md)",
    "transfer_backend": "KV transfer backend: auto, nixl, ucxx or tcp",
    "lease_ttl": "seconds a prefill node keeps handed-off blocks pinned for the reader",
    "transfer_timeout": "seconds a KV pull may take before the decode node recomputes",
    "reserve_decode_blocks": "reserve the decode node's KV blocks while the prompt is prefilled, so the "
                             "hand-off pulls at once (--no-reserve-decode-blocks: allocate after the prefill)",
    "pipelined_handoff": "with reserved decode blocks, read each prompt block as soon as the prefill node "
                         "completes it (chunked prefill), not all after the first token",
    "handoff_layer_groups": "with pipelined_handoff: the decode node reads the last prefill chunk's KV in this "
                            "many layer groups while that chunk computes, all but the last before the first "
                            "token (1: the last chunk's blocks all after it)",
    "first_token_release": "when a handed-off request's first token reaches the client: 'prefill' (as the "
                           "prefill node samples it) or 'decode' (held until the decode node has taken the "
                           "request into its running batch: the second token then follows one decode step "
                           "later; TTFT grows by the pull's rest and the wait for a step; docs/kvtransfer.md)",
    "max_queued_requests": "requests admitted at once; more get RESOURCE_EXHAUSTED",
    "max_queued_tokens": "prompt + output tokens admitted at once; more get RESOURCE_EXHAUSTED",
    "max_worker_queue": "requests one worker queues before refusing more (sent to another worker; "
                        "all full: RESOURCE_EXHAUSTED); 0 = no bound",
    "decode_rebalance_interval": "seconds between checks that move hand-offs waiting for a batch slot on "
                                 "one decode worker to decode workers with free slots (a pool that grew "
                                 "under a backlog); 0 = off",
    "step_trace_size": "each worker keeps its last N engine steps' timings and shapes (0 = off; "
                       "read with the workers' step_trace method)",
    "request_timeout": "default deadline in seconds when the client sets none",
    "stream_write_timeout": "seconds one streamed response may wait for a client that reads nothing before "
                            "the call is cancelled and its request aborted (0 = no bound)",
    "max_migrations": "times a request may continue on another decode worker after its own died",
    "drain_timeout": "on SIGTERM, seconds in-flight requests get to finish",
    "prefill_failure_policy": "a prefill node lost before its KV was read: 'recompute' on the decode node, "
                              "or 'reprefill' on another prefill node",
    "api_keys_file": "file of 'key tenant' lines; requests then need authorization: Bearer <key>",
    "tls_cert_file": "server certificate (PEM): turns TLS on for the gRPC and the HTTP port",
    "tls_key_file": "server private key (PEM)",
    "tls_client_ca_file": "CA (PEM) client certificates must chain to: turns mutual TLS on",
    "address": "existing Ray cluster to join ('auto', 'ray://...', host:port); empty = start one",
    "ray": "use Ray (--no-ray: one colocated engine in this process, for a laptop or debugging)",
    "ray_temp_dir": "Ray's temp/session directory",
    "cluster_secret_file": "file holding the secret workers prove on the KV side channels (HMAC); every node "
                           "must see the same one (a Kubernetes Secret); empty = a random one per deployment",
    "log_level": "DEBUG, INFO, WARNING ...; per logger after a comma, e.g. INFO,pdserve.requests=DEBUG "
                 "(each request's route, hand-off and join)",
}


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the cluster and its gRPC / HTTP endpoints", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file of the keys below (flags override it)")
    defaults = ServeConfig()
    for f in dataclasses.fields(ServeConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        text = f"{HELP.get(f.name, '')} (default: {default!r})"
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif f.type.startswith("tuple"):
            p.add_argument(flag, nargs="+", metavar="NAME", default=None, help=text)
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            p.add_argument(flag, type=kind, default=None, help=text)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)}
    return ServeConfig.from_sources(args.config, overrides=overrides)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    configure_logging(cfg.log_level)
    return asyncio.run(serve(cfg))


async def serve(cfg: ServeConfig, ready: asyncio.Event | None = None) -> int:
    from cluster.server_stack import start_stack

    stack = await start_stack(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    print(stack.banner(), flush=True)
    if ready is not None:
        ready.set()
    await stop.wait()
    print("pdserve: draining (new requests get UNAVAILABLE) ...", file=sys.stderr, flush=True)
    await stack.drain_and_stop(cfg.drain_timeout)
    return 0
