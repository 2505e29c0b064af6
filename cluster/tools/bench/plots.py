"""PNG plots of a benchmark run (matplotlib, Agg backend: no display needed).

One run: ttft_cdf.png, itl_cdf.png, throughput_over_time.png,
latency_over_time.png. A sweep: latency_vs_throughput.png.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from cluster.tools.bench.runner import RequestResult


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    if not len(values_ms):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(np.asarray(values_ms, dtype=float))
    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)
    for p in (50, 99):
        ax.axvline(np.percentile(xs, p), ls=":", lw=0.8, color="gray")
    ax.set_ylim(0, 1.01)
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def plot_run(results: Sequence[RequestResult], timeline: dict, out_dir: str | Path,
             title: str = "") -> list[Path]:
    """The four per-run plots; returns their paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in results if r.ok]
    paths = []
    for name, values, xlabel in (
            ("ttft_cdf.png", [r.ttft_s * 1000 for r in done if r.ttft_s is not None], "TTFT (ms)"),
            ("itl_cdf.png", [g * 1000 for r in done for g in r.itl_s], "inter-token latency (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        _cdf(ax, values, xlabel)
        ax.set_xlabel(xlabel + "  (dotted: p50, p99)")
        ax.set_title(f"{title} {xlabel} CDF".strip())
        paths.append(_save(fig, out / name))

    t = timeline["t_s"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, timeline["output_tok_s"], label="output tok/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s")
    ax2 = ax.twinx()
    ax2.plot(t, timeline["requests_s"], color="tab:orange", label="finished req/s")
    ax2.set_ylabel("finished requests / s")
    ax.set_title(f"{title} throughput over time".strip())
    fig.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "throughput_over_time.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    starts = [r.sent_s for r in done]
    ax.scatter(starts, [r.e2e_s * 1000 for r in done], s=8, label="end-to-end")
    ax.scatter([r.sent_s for r in done if r.ttft_s is not None],
               [r.ttft_s * 1000 for r in done if r.ttft_s is not None], s=8, label="TTFT")
    ax.set_xlabel("send time since start (s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"{title} latency over time".strip())
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "latency_over_time.png"))
    return paths


def plot_sweep(summaries: Sequence[dict], out_dir: str | Path) -> Path:
    """Latency percentiles against achieved output throughput, one point per request rate."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    x = [s["output_throughput"] for s in summaries]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for p in ("p50", "p99"):
            ys = [s[key][p] if s[key][p] is not None else np.nan for s in summaries]
            ax.plot(x, ys, marker="o", label=p)
        for s, xi in zip(summaries, x):
            ax.annotate(f"{s['request_rate']} req/s", (xi, s[key]["p50"] or 0), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("achieved output throughput (tok/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("latency vs throughput (request-rate sweep)")
    return _save(fig, out / "latency_vs_throughput.png")
