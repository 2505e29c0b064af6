"""PNG plots of a sweep: latency vs load, goodput vs P:D ratio, hit rate vs
cache size, one line per routing policy. Each plot is drawn only when its
axis was swept."""
from __future__ import annotations

from pathlib import Path

LOAD_KEYS = ("copies", "time_scale")


def _series(runs: list[dict], x_of, y_of) -> dict[str, list[tuple[float, float]]]:
    lines: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        p, s = run["params"], run["summary"]
        y = y_of(s)
        if y is None:
            continue
        lines.setdefault(p["policy"], []).append((x_of(p), y))
    return {k: sorted(v) for k, v in lines.items()}


def _plot(path: Path, title: str, xlabel: str, ylabel: str, lines: dict, logy: bool = False) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in sorted(lines.items()):
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.set_title(title + " (simulated)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(runs: list[dict], swept: set[str], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = []
    if swept & set(LOAD_KEYS):
        load = lambda p: p["copies"] * p["time_scale"]   # noqa: E731
        made.append(_plot(out / "latency_vs_load.png", "Mean TTFT vs load", "load (x trace rate)",
                          "mean TTFT (s)", _series(runs, load, lambda s: s["ttft_s"]["mean"]), logy=True))
        made.append(_plot(out / "itl_vs_load.png", "p90 ITL vs load", "load (x trace rate)", "p90 ITL (s)",
                          _series(runs, load, lambda s: s["itl_s"]["p90"])))
    if swept & {"pd", "prefill_nodes", "decode_nodes"}:
        frac = lambda p: p["prefill_nodes"] / (p["prefill_nodes"] + p["decode_nodes"])   # noqa: E731
        made.append(_plot(out / "goodput_vs_pd.png", "Goodput vs P:D", "prefill share of nodes P/(P+D)",
                          "goodput (requests/s within SLO)",
                          _series(runs, frac, lambda s: s["goodput"]["requests_per_s"])))
    if "num_blocks" in swept:
        made.append(_plot(out / "hit_rate_vs_cache.png", "Prefix hit rate vs cache size",
                          "KV blocks per node", "hit rate (tokens)",
                          _series(runs, lambda p: p["num_blocks"], lambda s: s["hit_rate_tokens"])))
    return made
