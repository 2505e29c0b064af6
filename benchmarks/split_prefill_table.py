"""Per-load table of routing_sim.py sweeps: main against --split-prefill-* (cpp36, simulated).

    .venv/bin/python benchmarks/split_prefill_table.py BASE.json OPTION.json [OPTION2.json ...]

Each file is one routing_sim.py output with one weight (the same loads and seeds). For each file
and load: the median over seeds of the TTFT p90 ratio round-robin / prefix-aware (both arms from
that file), prefix-aware's hit rate over the ideal (mean, min), its TTFT p90 (median over seeds)
and mean TTFT (mean over seeds); for an option file also ``pa_only``: the median ratio of BASE's
round-robin p90 to the option's prefix-aware p90 (as if only prefix-aware had the feature; for
information), and ``ratio_up_runs``: in how many (load, seed) runs its ratio beats BASE's. Prints one JSON line and a markdown table. Simulated figures.

Given routing_tail.py outputs instead, per file, load and policy: the median TTFT p90 over seeds,
the tail's (requests at or above each run's p90) means weighted by request, its share split, and
the splits and helper seconds lent per run.
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
            # paired by seed: in how many runs the option's ratio beats BASE's
            row["ratio_up_runs"] = f"{sum(runs[k]['rr'] / runs[k]['pa'] > ref[k]['rr'] / ref[k]['pa'] for k in keys)}/{len(keys)}"
        out[str(load)] = row
    return out


TAIL_KEYS = ("ttft", "wait", "compute", "alone", "uncached", "cold_share", "split_share")


def tail_rows(data: dict) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for load in sorted({r["load"] for r in data["runs"]}):
        for policy in ("round_robin", "prefix_aware"):
            runs = [r for r in data["runs"] if r["load"] == load and r["policy"] == policy]
            n = sum(r["tail"]["n"] for r in runs)
            row = {"p90_median_s": round(statistics.median(r["ttft_p90_s"] for r in runs), 2),
                   **{k: round(sum(r["tail"][k] * r["tail"]["n"] for r in runs) / n, 2)
                      for k in TAIL_KEYS if k in runs[0]["tail"]}}
            if "split_prefill" in runs[0]:
                row["splits_per_run"] = statistics.mean(r["split_prefill"]["splits"] for r in runs)
                row["eligible_per_run"] = statistics.mean(r["split_prefill"].get("eligible", 0) for r in runs)
                row["requests_per_run"] = statistics.mean(r["all"]["n"] for r in runs)
                row["helper_lent_s_per_run"] = round(statistics.mean(r["split_prefill"]["helper_lent_s"]
                                                                     for r in runs), 1)
            out[f"{load}/{policy}"] = row
    return out


def main_tail(files: list[str], datas: list[dict]) -> None:
    table = {f: tail_rows(d) for f, d in zip(files, datas)}
    print(json.dumps({"benchmark": "split_prefill_table", "simulated": True, "tail": table}))
    markdown(table, ["load/policy", "p90 (s)", "tail TTFT = wait + compute (s)", "alone (s)", "uncached",
                     "cold, split share", "splits / eligible / requests, helper s lent per run"],
             lambda key, r: [key, r["p90_median_s"], f"{r['ttft']} = {r['wait']} + {r['compute']}", r["alone"],
                             r["uncached"], f"{r['cold_share']}, {r.get('split_share', 0)}",
                             f"{r.get('splits_per_run', '-')} / {r.get('eligible_per_run', '-')} / "
                             f"{r.get('requests_per_run', '-')}, {r.get('helper_lent_s_per_run', '-')}"])


def markdown(table: dict[str, dict[str, dict]], columns: list[str], cells) -> None:
    """One markdown row per (file, key) of ``table``: the file's name, then ``cells(key, row)``."""
    print("| " + " | ".join(["file", *columns]) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for f, t in table.items():
        for key, r in t.items():
            print("| " + " | ".join(str(c) for c in [f.rsplit("/", 1)[-1], *cells(key, r)]) + " |")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    files = sys.argv[1:]
    datas = [json.load(open(f)) for f in files]
    if datas[0].get("benchmark") == "routing_tail":
        main_tail(files, datas)
        return
    table = {f: rows(d, datas[0] if i else None) for i, (f, d) in enumerate(zip(files, datas))}
    print(json.dumps({"benchmark": "split_prefill_table", "simulated": True, "table": table}))
    markdown(table, ["load", "p90 ratio (median)", "ratio up (runs)", "PA-only ratio", "hit/ideal mean, min",
                     "PA p90 (s)", "PA mean (s)", "RR p90 (s)"],
             lambda load, r: [load, r["ratio_median"], r.get("ratio_up_runs", "-"), r.get("pa_only_ratio_median", "-"),
                              f"{r['hit_over_ideal_mean']}, {r['hit_over_ideal_min']}", r["pa_p90_median_s"],
                              r["pa_mean_s"], r["rr_p90_median_s"]])


if __name__ == "__main__":
    main()
