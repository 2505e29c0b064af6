"""A plan's result object, rendered as a human-readable table or as JSON."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from cluster.tools.planner.capacity import Capacity, CapacityInputs
from cluster.tools.planner.interconnect import Transfer
from cluster.tools.planner.model_spec import ModelSpec
from cluster.tools.planner.pools import CapSplit, PoolPlan


@dataclass(frozen=True)
class PlanReport:
    model: ModelSpec
    inputs: CapacityInputs
    capacity: Capacity
    tp_sweep: tuple[Capacity, ...]
    prompt_len: int
    transfers: tuple[Transfer, ...]
    pools: PoolPlan | None
    notes: tuple[str, ...] = ()
    cap_split: CapSplit | None = None    # with --max-workers: the autoscaler's start split


def to_dict(report: PlanReport) -> dict:
    out = asdict(report)
    if report.pools is not None:
        out["pools"]["ratio"] = report.pools.ratio
    if report.cap_split is not None:
        out["cap_split"]["ratio"] = report.cap_split.ratio
    return out


def to_json(report: PlanReport) -> str:
    return json.dumps(to_dict(report), indent=2)


def fmt_bytes(n: float) -> str:
    """Binary units: 1073741824 -> '1.00 GiB'."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _header(report: PlanReport) -> list[str]:
    m, i = report.model, report.inputs
    params = f", {m.num_params / 1e9:.2f}B params" if m.num_params else ""
    return [
        f"pdserve plan: {m.name} ({m.source}): {m.num_layers} layers, {m.num_heads} heads, "
        f"{m.num_kv_heads} KV heads, head dim {m.head_dim}{params}",
        f"device {fmt_bytes(i.device_memory)}, weights {fmt_bytes(i.weights)}, reserve {fmt_bytes(i.reserve)}, "
        f"host lent to KV {fmt_bytes(i.host_memory)}, context {i.context_len}, "
        f"shared prefix {i.shared_prefix_len}, KV {i.kv_label}, TP {i.tp}",
    ]


def _capacity(report: PlanReport) -> list[str]:
    c, i = report.capacity, report.inputs
    per_gpu = " per GPU" if c.tp > 1 else ""
    rows = [["KV bytes per token (whole model)", f"{c.kv_bytes_per_token_model:,} B"]]
    if c.tp > 1:
        rows.append([f"KV bytes per token per GPU ({c.kv_heads_per_rank} heads)", f"{c.kv_bytes_per_token:,} B"])
    rows += [
        [f"KV per sequence at {i.context_len} tokens", fmt_bytes(c.kv_bytes_per_sequence)],
        ["device KV budget (device - weights - reserve)", fmt_bytes(c.device_kv_budget)],
        ["sequences, device only", str(c.sequences_device)],
        [f"sequences, + {fmt_bytes(c.host_kv_budget)} host{per_gpu}", str(c.sequences_with_host)],
        [f"sequences, + {i.shared_prefix_len}-token shared prefix ({fmt_bytes(c.shared_prefix_bytes)} once)",
         str(c.sequences_with_shared_prefix)],
    ]
    return ["", "KV capacity"] + _table(rows)


def _tp(report: PlanReport) -> list[str]:
    rows = [["TP", "KV heads/GPU", "replication", "KV/token/GPU", "weights/GPU", "seqs device", "seqs +host"]]
    for c in report.tp_sweep:
        rows.append([str(c.tp), str(c.kv_heads_per_rank), f"{c.kv_replication:.2f}x",
                     fmt_bytes(c.kv_bytes_per_token), fmt_bytes(c.weights_per_rank),
                     str(c.sequences_device), str(c.sequences_with_host)])
    return ["", "Tensor parallelism (per GPU; heads replicate once TP > KV heads)"] + _table(rows)


def _transfers(report: PlanReport) -> list[str]:
    if not report.transfers:
        return []
    nbytes = report.transfers[0].nbytes
    rows = [["interconnect", "GB/s", "time"]]
    rows += [[t.interconnect, f"{t.bytes_per_second / 1e9:.2f}", _fmt_seconds(t.seconds)]
             for t in report.transfers]
    return ["", f"KV of one {report.prompt_len}-token prompt ({fmt_bytes(nbytes)}, whole model) moved over"] \
        + _table(rows)


def _pools(report: PlanReport) -> list[str]:
    p = report.pools
    if p is None:
        return ["", "Pools: give --request-rate with --prefill-tps/--decode-tps (or --measure) to size them"]
    rows = [["pool", "demand tok/s", "per node tok/s", "nodes", "busy"],
            ["prefill", f"{p.prefill_demand_tps:,.0f}", f"{p.prefill_tps:,.0f}", str(p.prefill_nodes),
             f"{p.prefill_utilization:.0%}"],
            ["decode", f"{p.decode_demand_tps:,.0f}", f"{p.decode_tps:,.0f}", str(p.decode_nodes),
             f"{p.decode_utilization:.0%}"]]
    return ["", f"Pools at {p.request_rate:g} req/s, {p.input_len} in / {p.output_len} out "
                f"(speeds {p.speeds_source}): prefill:decode = {p.ratio}"] + _table(rows) + _cap_split(report)


def _cap_split(report: PlanReport) -> list[str]:
    c = report.cap_split
    if c is None:
        return []
    return ["", f"Start split under a fleet cap of {c.max_workers} workers (--autoscale): prefill:decode = "
                f"{c.ratio}",
            f"  decode holds the sequences in flight at {c.peak_request_rate:g} req/s (peak factor "
            f"{c.peak_factor:.2f} x the mean) at {c.target_kv_usage:.0%} KV; prefill gets the rest"]


def render_text(report: PlanReport) -> str:
    lines = _header(report) + _capacity(report) + _tp(report) + _transfers(report) + _pools(report)
    if report.notes:
        lines += ["", "Notes"] + [f"  - {n}" for n in report.notes]
    return "\n".join(lines)
