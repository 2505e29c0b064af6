"""`pdserve plan --model PATH_OR_PRESET [options]`: see docs/planner.md."""
from __future__ import annotations

import argparse
import dataclasses
import math

from cluster.config import parse_size
from cluster.orchestration.autoscale.signals import AutoscaleConfig
from cluster.tools.planner.capacity import KV_CACHE_DTYPES, KV_DTYPE_BYTES, CapacityInputs, plan_capacity, tp_sweep
from cluster.tools.planner.interconnect import interconnect_names, select_interconnects, transfers
from cluster.tools.planner.model_spec import ModelSpec, default_model_path, resolve_model
from cluster.tools.planner.pools import CapSplit, PoolPlan, cap_split, measure_speeds, size_pools
from cluster.tools.planner.report import PlanReport, fmt_bytes, render_text, to_json

# the KV share the autoscaler keeps decode at (its controller's default)
TARGET_KV_USAGE = next(f.default for f in dataclasses.fields(AutoscaleConfig) if f.name == "target_kv_usage")


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="size KV capacity, TP, KV transfer and prefill:decode pools",
                              description="Capacity planner: every figure is per GPU unless it says otherwise. "
                                          "Sizes accept '80GiB', '16GB' or bytes.")
    p.add_argument("--model", default="", help="preset name, HF directory with config.json, or .gguf file "
                                               "(default: the bundled SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--device-memory", default="80GiB", help="accelerator memory per GPU (default 80GiB)")
    p.add_argument("--weights", default=None, help="weight bytes of the whole model (default: from the model)")
    p.add_argument("--reserve", default="0", help="per-GPU memory kept for activations/workspace (default 0)")
    p.add_argument("--host-memory", default="0", help="host DRAM lent to KV for the TP group (default 0)")
    p.add_argument("--context-len", type=int, default=None, help="tokens per sequence (default: model max)")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a prefix every sequence shares")
    p.add_argument("--kv-dtype", default="fp16", help=f"KV cache dtype: {', '.join(KV_DTYPE_BYTES)} (default fp16)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="as `pdserve serve --kv-cache-dtype`: int8 / fp8_e4m3 store 1 byte a value plus a "
                        "2-byte scale per token and KV head; auto = --kv-dtype (default auto)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--interconnect", default="all",
                   help=f"comma-separated: {', '.join(interconnect_names())}, or a rate like '16GB' per second")
    p.add_argument("--local-bandwidth", default=None, help="bytes/s for 'local' instead of measuring a memcpy")
    p.add_argument("--prompt-len", type=int, default=4096, help="prompt tokens whose KV is moved (default 4096)")
    p.add_argument("--request-rate", type=float, default=None, help="requests/s to size pools for")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (default 1024)")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request (default 256)")
    p.add_argument("--prefill-tps", type=float, default=None, help="per-node prefill tokens/s")
    p.add_argument("--decode-tps", type=float, default=None,
                   help="per-node decode tokens/s at its max concurrent sequences")
    p.add_argument("--measure", action="store_true", help="measure prefill/decode tokens/s here with engine.LLM")
    p.add_argument("--measure-concurrency", type=int, default=8, help="sequences per measured batch (default 8)")
    p.add_argument("--max-workers", type=int, default=None,
                   help="a fleet cap (both pools): print the prefill:decode split `pdserve serve --autoscale` "
                        "should start with under it (needs --request-rate)")
    p.add_argument("--peak-request-rate", type=float, default=None,
                   help="with --max-workers: requests/s of the busiest window about one sequence's decode "
                        "lifetime long (default: --request-rate, a peak factor of 1)")
    p.add_argument("--target-kv-usage", type=float, default=TARGET_KV_USAGE,
                   help=f"with --max-workers: the KV share the autoscaler keeps decode at (default {TARGET_KV_USAGE})")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = build_report(args)
    print(to_json(report) if args.json else render_text(report))
    return 0


def size_arg(flag: str, value: str | int) -> int:
    if str(value).strip().startswith("-"):
        raise ValueError(f"{flag} must not be negative, got {value!r}: write e.g. '80GiB' or a byte count")
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def build_report(args: argparse.Namespace) -> PlanReport:
    model = resolve_model(args.model)
    context_len = args.context_len if args.context_len is not None else (model.max_context or 4096)
    inputs = CapacityInputs(
        device_memory=size_arg("--device-memory", args.device_memory),
        weights=model.weight_bytes if args.weights is None else size_arg("--weights", args.weights),
        context_len=context_len, kv_dtype=args.kv_dtype.lower(),
        host_memory=size_arg("--host-memory", args.host_memory), reserve=size_arg("--reserve", args.reserve),
        shared_prefix_len=args.shared_prefix_len, tp=args.tp, kv_cache_dtype=args.kv_cache_dtype)
    if args.prompt_len < 1:
        raise ValueError(f"--prompt-len must be >= 1 token, got {args.prompt_len}")
    capacity = plan_capacity(model, inputs)
    local = None if args.local_bandwidth is None else size_arg("--local-bandwidth", args.local_bandwidth)
    links = select_interconnects(args.interconnect, None if local is None else float(local))
    prompt_bytes = capacity.kv_bytes_per_token_model * args.prompt_len
    pools = _pools(args, model)
    return PlanReport(model=model, inputs=inputs, capacity=capacity, tp_sweep=tuple(tp_sweep(model, inputs)),
                      prompt_len=args.prompt_len, transfers=tuple(transfers(prompt_bytes, links)),
                      pools=pools, notes=tuple(_notes(model, inputs, capacity)), cap_split=_cap_split(args, pools))


def _cap_split(args: argparse.Namespace, pools: PoolPlan | None) -> CapSplit | None:
    if args.max_workers is None:
        if args.peak_request_rate is not None:
            raise ValueError("--peak-request-rate sets the start split under a fleet cap: give --max-workers too")
        return None
    if pools is None:
        raise ValueError("--max-workers splits the pools the plan sizes: give --request-rate with "
                         "--prefill-tps and --decode-tps (or --measure)")
    return cap_split(args.max_workers, pools, args.peak_request_rate, args.target_kv_usage)


def _pools(args: argparse.Namespace, model: ModelSpec) -> PoolPlan | None:
    if args.request_rate is None:
        if args.measure:
            raise ValueError("--measure sizes pools: give --request-rate too")
        return None
    if args.measure:
        if model.source == "preset":
            raise ValueError(f"--measure runs the model on this machine, but {model.name!r} is a preset "
                             "without weights: give --model an HF directory or .gguf file, or pass "
                             "--prefill-tps and --decode-tps")
        speeds = measure_speeds(args.model or str(default_model_path()), args.input_len, args.output_len,
                                args.measure_concurrency)
        return size_pools(args.request_rate, args.input_len, args.output_len, speeds.prefill_tps,
                          speeds.decode_tps, speeds_source="measured")
    if args.prefill_tps is None or args.decode_tps is None:
        raise ValueError("--request-rate needs per-node speeds: give --prefill-tps and --decode-tps, "
                         "or --measure to measure them on this machine")
    return size_pools(args.request_rate, args.input_len, args.output_len, args.prefill_tps, args.decode_tps)


def _notes(model: ModelSpec, inputs: CapacityInputs, capacity) -> list[str]:
    notes = []
    if capacity.device_kv_budget < 0:
        room = inputs.device_memory - inputs.reserve
        need = math.ceil(inputs.weights / room) if room > 0 else None
        fix = f"use --tp {need} or more, " if need else ""
        notes.append(f"weights per GPU ({fmt_bytes(capacity.weights_per_rank)}) plus reserve exceed device "
                     f"memory ({fmt_bytes(inputs.device_memory)}): {fix}a larger --device-memory, "
                     "or smaller --weights (quantized)")
    if model.max_context and inputs.context_len > model.max_context:
        notes.append(f"--context-len {inputs.context_len} exceeds the model's {model.max_context} positions")
    if inputs.tp > model.num_kv_heads:
        notes.append(f"TP {inputs.tp} > {model.num_kv_heads} KV heads: each GPU still holds one whole head, "
                     f"so KV is replicated {capacity.kv_replication:.2f}x across the group")
    if inputs.shared_prefix_len and inputs.host_memory:
        notes.append("the shared-prefix figure uses device and host KV budgets together, prefix stored once")
    return notes
