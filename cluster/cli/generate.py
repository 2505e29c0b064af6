"""`pdserve generate "prompt"`: stream one completion to the terminal.

With `--target host:port` it talks to a running `pdserve serve` over gRPC;
without, it loads the model in this process (no server, no Ray).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import AsyncIterator

DEFAULT_MAX_TOKENS = 128


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt (streams to the terminal)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--target", help="host:port of a running pdserve gRPC endpoint, e.g. 127.0.0.1:50051; "
                   "omit to run the model in this process")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message, rendered "
                   "with the model's chat template")
    p.add_argument("--system", help="system message (implies --chat)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens to generate (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, help="make sampling reproducible")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    p.add_argument("--timeout", type=float, help="deadline in seconds for the whole request")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="API key sent as `authorization: Bearer` (default: env PDSERVE_API_KEY)")
    p.add_argument("--tls-ca", help="CA certificate (PEM) to verify the server; turns TLS on")
    p.add_argument("--tls-cert", help="client certificate (PEM) for mutual TLS")
    p.add_argument("--tls-key", help="client key (PEM) for mutual TLS")
    p.add_argument("--model", default="", help="without --target: HF directory or .gguf to load "
                   "(default: the bundled SmolLM2)")
    p.add_argument("--kv-cache-memory", default="256MiB",
                   help="without --target: KV cache budget, e.g. 256MiB (default)")
    p.add_argument("--quiet", action="store_true", help="do not print the usage line on stderr")
    p.set_defaults(func=run)


def _sampling(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos or None)


def _messages(args) -> list[dict] | None:
    if not (args.chat or args.system):
        return None
    sys_msg = [{"role": "system", "content": args.system}] if args.system else []
    return sys_msg + [{"role": "user", "content": args.prompt}]


def run(args) -> int:
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    try:
        return asyncio.run(_remote(args) if args.target else _local(args))
    except KeyboardInterrupt:
        return 130


async def _print_stream(chunks: AsyncIterator, quiet: bool) -> None:
    last = None
    async for text, final in chunks:
        sys.stdout.write(text)
        sys.stdout.flush()
        last = final or last
    sys.stdout.write("\n")
    if last and not quiet:
        print(last, file=sys.stderr)


async def _remote(args) -> int:
    import grpc

    from cluster.cli.client import ClientTls, GenerationClient

    tls = ClientTls(args.tls_ca, args.tls_cert, args.tls_key) if (args.tls_ca or args.tls_cert) else None
    messages = _messages(args)
    req = dict(messages=messages) if messages else dict(prompt=args.prompt)

    async def chunks():
        async for r in client.generate(timeout=args.timeout, **req, **_sampling(args)):
            final = None
            if r.finish_reason:
                u = r.usage
                final = (f"[{r.finish_reason}: prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), "
                         f"completion {u.completion_tokens}, ttft {r.timing.time_to_first_token_s:.3f}s, "
                         f"total {r.timing.elapsed_s:.3f}s]")
            yield r.text, final

    async with GenerationClient(args.target, api_key=args.api_key, tls=tls) as client:
        try:
            await _print_stream(chunks(), args.quiet)
        except grpc.aio.AioRpcError as e:
            sys.stdout.write("\n")
            print(f"pdserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


async def _local(args) -> int:
    """Run the engine in this process through the same validation and streaming path."""
    from cluster.frontends.admission import AdmissionController
    from cluster.orchestration.backend import BackendError
    from cluster.orchestration.local import LocalEngineBackend
    from cluster.observability.metrics import Metrics
    from cluster.frontends.runner import RequestRunner
    from cluster.frontends.validation import ChatMessage, GenerateInput, Limits, SamplingInput, ValidationError

    from cluster.config import parse_size
    from engine.config import CacheConfig, EngineConfig

    cache = CacheConfig(kv_cache_memory_bytes=parse_size(args.kv_cache_memory))
    backend = LocalEngineBackend(EngineConfig(model=args.model, cache=cache))
    await backend.start()
    try:
        runner = RequestRunner(backend, Metrics(), Limits.from_model(backend.model_info()),
                               AdmissionController(1, 1 << 62))
        messages = _messages(args)
        s = {k: v for k, v in _sampling(args).items() if v is not None}
        inp = GenerateInput(prompt=None if messages else args.prompt,
                            messages=tuple(ChatMessage(m["role"], m["content"]) for m in messages)
                            if messages else None, sampling=SamplingInput(**s))
        deadline = None if args.timeout is None else time.monotonic() + args.timeout

        async def chunks():
            async for c in runner.run(inp, deadline=deadline):
                final = None
                if c.finish_reason:
                    final = (f"[{c.finish_reason}: prompt {c.prompt_tokens} tokens ({c.cached_tokens} cached), "
                             f"completion {c.completion_tokens}, ttft {c.time_to_first_token_s or 0:.3f}s, "
                             f"total {c.elapsed_s:.3f}s]")
                yield c.text, final

        try:
            await _print_stream(chunks(), args.quiet)
        except (ValidationError, BackendError) as e:
            sys.stdout.write("\n")
            print(f"pdserve generate: {e}", file=sys.stderr)
            return 1
    finally:
        await backend.stop()
    return 0
