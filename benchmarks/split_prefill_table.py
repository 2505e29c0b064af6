"""Per-load table of routing_sim.py sweeps: main against --split-prefill-* (cpp36, simulated).

    .venv/bin/python benchmarks/split_prefill_table.py BASE.json OPTION.json [OPTION2.json ...]

Each file is one routing_sim.py output with one weight (the same loads and seeds). For each file
and load: the median over seeds of the TTFT p90 ratio round-robin / prefix-aware (both arms from
that file), prefix-aware's hit rate over the ideal (mean, min), its TTFT p90 (median over seeds)
and mean TTFT (mean over seeds); for an option file also ``pa_only``: the median ratio of BASE's
round-robin p90 to the option's prefix-aware p90 (as if only prefix-aware had the feature; for
information). Prints one JSON line and a markdown table. Simulated figures.
"""
from __future__ import annotations

import json
import statistics
import sys


def per_seed(data: dict) -> dict[tuple[float, int], dict]:
    out: dict[tuple[float, int], dict] = {}
    for r in data["runs"]:
        d = out.setdefault((r["load"], r["seed"]), {})
        if r["policy"] == "round_robin":
            d["rr"], d["ideal"] = r["ttft_p90_s"], r["ideal_hit_rate"]
        else:
            d["pa"], d["pa_mean"], d["hit"] = r["ttft_p90_s"], r["ttft_mean_s"], r["hit_rate"]
    return out


def rows(data: dict, base: dict | None) -> dict[str, dict]:
    runs, ref = per_seed(data), per_seed(base) if base is not None else None
    loads = sorted({k[0] for k in runs})
    out = {}
    for load in loads + ["all"]:
        keys = [k for k in runs if load == "all" or k[0] == load]
        v = [runs[k] for k in keys]
        row = {"ratio_median": round(statistics.median(x["rr"] / x["pa"] for x in v), 2),
               "hit_over_ideal_mean": round(statistics.mean(x["hit"] / x["ideal"] for x in v), 3),
               "hit_over_ideal_min": round(min(x["hit"] / x["ideal"] for x in v), 3),
               "pa_p90_median_s": round(statistics.median(x["pa"] for x in v), 2),
               "pa_mean_s": round(statistics.mean(x["pa_mean"] for x in v), 2),
               "rr_p90_median_s": round(statistics.median(x["rr"] for x in v), 2)}
        if ref is not None:
            row["pa_only_ratio_median"] = round(statistics.median(ref[k]["rr"] / runs[k]["pa"] for k in keys), 2)
        out[str(load)] = row
    return out


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    files = sys.argv[1:]
    datas = [json.load(open(f)) for f in files]
    table = {f: rows(d, datas[0] if i else None) for i, (f, d) in enumerate(zip(files, datas))}
    print(json.dumps({"benchmark": "split_prefill_table", "simulated": True, "table": table}))
    print("| file | load | p90 ratio (median) | PA-only ratio | hit/ideal mean, min | PA p90 (s) | PA mean (s) | RR p90 (s) |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for f, t in table.items():
        for load, r in t.items():
            print(f"| {f.rsplit('/', 1)[-1]} | {load} | {r['ratio_median']} | {r.get('pa_only_ratio_median', '-')} | "
                  f"{r['hit_over_ideal_mean']}, {r['hit_over_ideal_min']} | {r['pa_p90_median_s']} | "
                  f"{r['pa_mean_s']} | {r['rr_p90_median_s']} |")


if __name__ == "__main__":
    main()
