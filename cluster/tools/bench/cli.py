"""`pdserve bench`: load-test a running pdserve gRPC endpoint (--target host:port) or any
OpenAI-compatible server (--backend openai|openai-chat --base-url http://host:port).

Sends a dataset (random, shared-prefix, ShareGPT, or a Mooncake trace) open
loop on a Poisson / gamma / fixed schedule (or all at once), times every
token, and reports TTFT, TPOT, inter-token latency and end-to-end latency
(mean, p50, p90, p95, p99), throughput, goodput under SLOs, prefix-cache hit
rate and failures by gRPC code (HTTP status for OpenAI servers). --output writes
JSON, --save-result a JSON with `vllm bench serve`'s keys, --plot-dir PNGs,
--sweep runs one benchmark per request rate and plots latency vs throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cluster.tools.bench import arrivals, datasets as ds
from cluster.tools.bench.report import Slo, format_table, summarize, timeline
from cluster.tools.bench.runner import RunnerConfig, run_load
from cluster.tools.bench.vllm_result import vllm_result


@dataclass(frozen=True)
class ServerInfo:
    """What the benchmark needs to know about the server it drives."""
    model_name: str
    max_model_len: int
    max_prompt_tokens: int
    vocab_size: int                  # ids the server accepts
    block_size: int = 0              # 0 = unknown (no ideal prefix hit rate)
    tokenizer_vocab_size: int = 0    # ids with text (fewer for a padded vocabulary); 0 = vocab_size


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a request rate (a number of requests/s or inf)")
    if not v > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text}")
    return v


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="load-test a running pdserve endpoint", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _server_args(p)
    _load_args(p)
    _output_args(p)
    _dataset_args(p)
    p.set_defaults(func=run)


def _server_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--backend", choices=("grpc", "openai", "openai-chat"), default="grpc",
      help="grpc: pdserve's gRPC API at --target; openai / openai-chat: an OpenAI-compatible server at "
      "--base-url, via /v1/completions or /v1/chat/completions (default grpc)")
    a("--target", default="127.0.0.1:50051", help="host:port of the pdserve gRPC endpoint")
    a("--base-url", help="with --backend openai[-chat]: http(s)://host:port of the server (no /v1)")
    a("--endpoint", help="with --backend openai[-chat]: the API path (default /v1/completions, "
      "/v1/chat/completions for openai-chat)")
    a("--model", help="with --backend openai[-chat]: the model to ask for (default: the first of /v1/models)")
    a("--api-key", default=os.environ.get("PDSERVE_API_KEY"), help="sent as `authorization: Bearer` "
      "(default: env PDSERVE_API_KEY)")


def _load_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--dataset", choices=("random", "shared-prefix", "sharegpt", "trace"), default="random")
    a("--num-requests", type=int, default=100, help="requests to send (default 100)")
    a("--duration", type=float, default=0.0, help="stop sending after this many seconds (0 = no limit)")
    a("--drain-timeout", type=float, default=120.0, help="cancel what still runs when nothing has "
      "finished for this many seconds (or this long after --duration); default 120")
    a("--request-rate", type=_rate, default=None, help="requests/s, or inf to send all at once (default inf)")
    a("--arrival", choices=arrivals.PROCESSES, default=None, help="arrival process (default poisson; "
      "gamma when --burstiness is not 1)")
    a("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier (default 1)")
    a("--max-concurrency", type=int, default=0, help="cap on requests in flight (0 = none); the wait "
      "for a slot is reported as cap_wait, apart from latency")
    a("--connect-timeout", type=float, default=30.0, help="seconds to wait for the server (default 30)")
    a("--seed", type=int, default=0)
    a("--warmup-requests", type=int, default=0, help="unmeasured requests sent first (default 0)")
    a("--temperature", type=float, default=0.0, help="sampling temperature (default 0 = greedy)")
    a("--sweep", default="", help="comma list of request rates (e.g. 1,2,4,inf): one run per rate")


def _output_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--output", help="write the results JSON here")
    a("--save-result", action="store_true", help="also write the run as `vllm bench serve --save-result` "
      "does (its keys and units) into --result-dir")
    a("--result-dir", default=".", help="with --save-result: the directory (default .)")
    a("--result-filename", help="with --save-result: the file name (default BACKEND-RATEqps-MODEL-DATE.json)")
    a("--label", default="", help="with --save-result: a label stored in the result")
    a("--plot-dir", help="write PNG plots here")
    a("--detailed", action="store_true", help="with --output: every request's token times and gaps")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--slo-ttft-ms", type=float, help="goodput SLO on time to first token")
    a("--slo-tpot-ms", type=float, help="goodput SLO on time per output token")
    a("--slo-e2e-ms", type=float, help="goodput SLO on end-to-end latency")


def _dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("random dataset")
    g.add_argument("--random-input-len", type=int, default=128)
    g.add_argument("--random-output-len", type=int, default=32)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)] (default 0 = fixed)")
    g = p.add_argument_group("shared-prefix dataset (groups x prompts per group, shuffled)")
    g.add_argument("--sp-groups", type=int, default=4)
    g.add_argument("--sp-prompts-per-group", type=int, default=8)
    g.add_argument("--sp-system-len", type=int, default=256, help="shared system prompt tokens")
    g.add_argument("--sp-question-len", type=int, default=32, help="unique question tokens")
    g.add_argument("--sp-output-len", type=int, default=16)
    g.add_argument("--sp-tenants", type=int, default=1, help="prompts take turns among this many "
                   "tenants, each with its own cache salt")
    g = p.add_argument_group("sharegpt dataset")
    g.add_argument("--sharegpt-path", help="ShareGPT-format JSON (list of {conversations: [...]})")
    g.add_argument("--tokenizer", help="HF directory or .gguf for token counts, and with --backend openai[-chat] "
                   "for the vocabulary of random prompts and to decode them for chat (default: bundled SmolLM2)")
    g = p.add_argument_group("trace replay (Mooncake format)")
    g.add_argument("--trace-path", help="JSONL with timestamp, input_length, output_length, hash_ids")
    g.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="arrival = timestamp * scale (0.1 = ten times faster)")
    g.add_argument("--trace-block-len", type=int, default=ds.TRACE_BLOCK_TOKENS,
                   help="tokens per hash id; below 512 scales all lengths by block-len/512")
    g.add_argument("--trace-max-len", type=int, default=0, help="cap input tokens (0: the server's limit)")
    g.add_argument("--trace-max-output-len", type=int, default=0, help="cap output tokens (0 = none)")


def run(args) -> int:
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if args.warmup_requests < 0:
        raise ValueError("--warmup-requests must be >= 0")
    if args.dataset == "sharegpt" and not args.sharegpt_path:
        raise ValueError("--dataset sharegpt needs --sharegpt-path FILE.json")
    if args.dataset == "trace" and not args.trace_path:
        raise ValueError("--dataset trace needs --trace-path FILE.jsonl (e.g. the Mooncake traces)")
    rates = [_rate(r.strip()) for r in args.sweep.split(",") if r.strip()] if args.sweep else []
    if args.dataset == "trace" and (rates or args.request_rate is not None):
        raise ValueError("trace replay sends on the trace's timestamps: drop --request-rate/--sweep and "
                         "scale time with --trace-time-scale")
    if rates and args.request_rate is not None:
        raise ValueError("give either --request-rate or --sweep RATES, not both")
    rates = rates or [args.request_rate if args.request_rate is not None else math.inf]
    if args.backend != "grpc" and not args.base_url:
        raise ValueError(f"--backend {args.backend} needs --base-url http://HOST:PORT of the server")
    if args.backend == "grpc" and (args.base_url or args.endpoint or args.model):
        raise ValueError("--base-url, --endpoint and --model are for --backend openai / openai-chat; "
                         "the gRPC backend uses --target")
    specs = [arrivals.ArrivalSpec.from_flags(r, args.arrival, args.burstiness) for r in rates]
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    cfg = RunnerConfig(max_concurrency=args.max_concurrency, duration_s=args.duration,
                       drain_timeout_s=args.drain_timeout, temperature=args.temperature,
                       progress=not args.no_progress, api_key=args.api_key)
    try:
        return asyncio.run(_bench(args, specs, slo, cfg))
    except KeyboardInterrupt:
        return 130


async def _server_info(args) -> ServerInfo:
    if args.backend != "grpc":
        return await _openai_info(args)
    import grpc

    from cluster.cli.client import GenerationClient

    async with GenerationClient(args.target, api_key=args.api_key) as c:
        try:
            await c.wait_ready(timeout=args.connect_timeout)
            mi = await c.model_info(timeout=args.connect_timeout)
        except (TimeoutError, asyncio.TimeoutError, grpc.aio.AioRpcError) as e:
            raise ValueError(f"cannot reach pdserve at --target {args.target} ({type(e).__name__}); "
                             "is `pdserve serve` running there (and --api-key right)?") from None
    return ServerInfo(mi.model_name, mi.max_model_len, mi.max_prompt_tokens, mi.vocab_size, mi.block_size,
                      mi.tokenizer_vocab_size)


async def _openai_info(args) -> ServerInfo:
    from cluster.tools.bench.openai_sender import list_model
    card = await list_model(args.base_url, args.api_key, args.model, args.connect_timeout)
    max_len = card.max_model_len or 1 << 30   # a server that does not say: nothing is clipped
    return ServerInfo(card.name, max_len, max_len, _tokenizer(args).vocab_size)


def _tokenizer(args):
    from engine.tokenizer import Tokenizer
    if args.tokenizer:
        return Tokenizer.load(args.tokenizer)
    from engine.loader.default_model import default_model_path
    return Tokenizer.load(default_model_path())


def _sender(args, cfg: RunnerConfig, info: ServerInfo):
    """What run_load sends through: the gRPC target, or a fresh OpenAI sender (run_load closes it)."""
    if args.backend == "grpc":
        return args.target
    from cluster.tools.bench.openai_sender import ENDPOINTS, OpenAiSender, OpenAiTarget
    target = OpenAiTarget(args.base_url, info.model_name, args.endpoint or ENDPOINTS[args.backend], args.api_key)
    decode = None
    if target.chat:
        tok = _tokenizer(args)
        decode = (lambda ids: tok.decode(list(ids)))
    return OpenAiSender(target, cfg, decode)


async def _bench(args, specs, slo: Slo, cfg: RunnerConfig) -> int:
    info = await _server_info(args)
    limit = min(info.max_model_len, info.max_prompt_tokens or info.max_model_len)
    meta = {"backend": args.backend, "target": args.base_url or args.target, "model": info.model_name,
            "dataset": args.dataset, "seed": args.seed,
            "max_concurrency": args.max_concurrency or None, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if args.warmup_requests:
        warm = ds.random_dataset(ds.RandomSpec(min(args.random_input_len, limit // 2), 4),
                                 args.warmup_requests, prompt_vocab(info), args.seed + 7919)
        wr = await run_load(_sender(args, cfg, info), warm, [0.0] * len(warm),
                            replace(cfg, progress=False, duration_s=0.0,
                                    max_concurrency=min(len(warm), args.max_concurrency or 8)))
        meta["warmup"] = {"requests": len(warm), "failed": sum(1 for r in wr.results if not r.ok)}
    summaries, runs = [], []
    for i, spec in enumerate(specs):
        reqs, clipped = _dataset(args, info, args.seed + i, limit)
        offsets = ([r.arrival_s or 0.0 for r in reqs] if args.dataset == "trace"
                   else arrivals.schedule(spec, len(reqs), args.seed + i))
        run_meta = {**meta, "request_rate": "trace" if args.dataset == "trace" else _finite(spec.rate),
                    "arrivals": "trace timestamps" if args.dataset == "trace" else spec.describe(),
                    **({"clipped_to_max_model_len": clipped} if clipped else {})}
        if args.dataset in ("random", "shared-prefix", "trace") and info.block_size:
            run_meta["ideal_prefix_hit_rate"] = ds.ideal_prefix_hit_rate(reqs, info.block_size)
        result = await run_load(_sender(args, cfg, info), reqs, offsets, cfg)
        s = summarize(result, slo, run_meta)
        summaries.append(s)
        runs.append(result)
        print(("" if len(specs) == 1 else f"\n== request rate {spec.rate:g} ==\n") + format_table(s), flush=True)
        if args.save_result:
            _save_vllm_result(args, result, info, spec, len(reqs), s)
        if args.plot_dir:
            from cluster.tools.bench.plots import plot_run
            sub = Path(args.plot_dir) / (f"rate_{spec.rate:g}" if len(specs) > 1 else "")
            plot_run(result.results, timeline(result.results, result.elapsed_s), sub, args.dataset)
    if args.plot_dir and len(specs) > 1:
        from cluster.tools.bench.plots import plot_sweep
        plot_sweep(summaries, args.plot_dir)
    if args.output:
        _write(args, summaries, runs)
    return 0 if all(s["requests"]["failed"] == 0 for s in summaries) else 1


def prompt_vocab(info) -> int:
    """Synthetic prompts draw ids below this: ids the server accepts (ModelInfo.vocab_size) that the
    tokenizer also has tokens for (a padded vocabulary's extra ids have no text)."""
    return min(info.vocab_size, info.tokenizer_vocab_size or info.vocab_size)


def _save_vllm_result(args, result, info: ServerInfo, spec, num_prompts: int, summary: dict) -> None:
    rate = spec.rate if args.dataset != "trace" else math.inf
    out = vllm_result(result, backend=args.backend, model_id=info.model_name,
                      tokenizer_id=args.tokenizer or info.model_name, num_prompts=num_prompts,
                      request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      label=args.label, goodput=(summary["goodput"] or {}).get("requests"))
    rate_text = "inf" if math.isinf(rate) else f"{rate:g}"
    name = args.result_filename or (f"{args.backend}-{rate_text}qps-{Path(info.model_name).name}-"
                                    f"{out['date']}.json")
    if args.result_filename and args.sweep:
        name = f"{Path(name).stem}-{rate_text}qps{Path(name).suffix}"
    path = Path(args.result_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, allow_nan=False))
    print(f"vLLM-format result written to {path}", file=sys.stderr)


def _dataset(args, info, seed: int, limit: int) -> tuple[list[ds.BenchRequest], int]:
    n, vocab = args.num_requests, prompt_vocab(info)
    if args.dataset == "random":
        reqs = ds.random_dataset(ds.RandomSpec(args.random_input_len, args.random_output_len,
                                               args.random_range_ratio), n, vocab, seed)
    elif args.dataset == "shared-prefix":
        spec = ds.SharedPrefixSpec(args.sp_groups, args.sp_prompts_per_group, args.sp_system_len,
                                   args.sp_question_len, args.sp_output_len, args.sp_tenants)
        reqs = ds.shared_prefix_dataset(spec, vocab, seed)[:n]
    elif args.dataset == "sharegpt":
        from engine.tokenizer import Tokenizer
        if args.tokenizer:
            tok = Tokenizer.load(args.tokenizer)
        else:
            from engine.loader.default_model import default_model_path
            tok = Tokenizer.load(default_model_path())
        reqs = ds.sharegpt_dataset(args.sharegpt_path, n, lambda t: tok.encode(t, add_special_tokens=False),
                                   seed, max_len=info.max_model_len)
    else:
        spec = ds.TraceSpec(args.trace_block_len, args.trace_time_scale, args.trace_max_len or limit - 1,
                            args.trace_max_output_len)
        reqs = ds.trace_dataset(args.trace_path, n, spec, vocab)
        fit = [replace(r, output_len=max(1, min(r.output_len, info.max_model_len - r.prompt_len))) for r in reqs]
        return fit, sum(1 for a, b in zip(reqs, fit) if a.output_len != b.output_len)
    worst = max(reqs, key=lambda r: r.prompt_len + r.output_len)
    if worst.prompt_len > limit or worst.prompt_len + worst.output_len > info.max_model_len:
        raise ValueError(f"a request of {worst.prompt_len} prompt + {worst.output_len} output tokens does not "
                         f"fit the server (max_model_len {info.max_model_len}, max prompt {limit}): "
                         "lower the dataset's length options")
    return reqs, 0


def _write(args, summaries: list[dict], runs) -> None:
    def per_request(r):
        d = {k: v for k, v in asdict(r).items() if k not in ("itl_s", "token_times_s")}
        if args.detailed:
            d.update(itl_s=r.itl_s, token_times_s=r.token_times_s)
        return d
    out: dict = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}}
    if len(summaries) == 1:
        out["summary"] = summaries[0]
        out["timeline"] = timeline(runs[0].results, runs[0].elapsed_s)
        out["requests"] = [per_request(r) for r in runs[0].results]
    else:
        out["sweep"] = summaries
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(_finite(out), indent=1, allow_nan=False))
    print(f"results written to {args.output}", file=sys.stderr)


def _finite(v):
    """inf (a request rate) as the string "inf": strict JSON has no Infinity."""
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v
