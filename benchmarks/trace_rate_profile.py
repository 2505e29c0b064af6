"""How much a Mooncake-format trace's load moves over its span: requests and prompt tokens per
second in bins of ``--bin-s``, with each series' coefficient of variation and max / min. An
autoscaler can only save what the load gives it to follow; this says how much that is (issue 24).
Prints one JSON line.

    .venv/bin/python benchmarks/trace_rate_profile.py --trace ../shared/traces/mooncake/conversation_trace.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean, pstdev

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def profile(rows: list[dict], bin_s: float) -> dict:
    """Per whole bin of ``bin_s`` from the first arrival (a last partial bin is left out: its rate
    would read low), requests/s and prompt tokens/s; their CV and max / min."""
    if bin_s <= 0:
        raise ValueError(f"--bin-s must be > 0, got {bin_s}")
    if not rows:
        raise ValueError("the trace has no requests")
    t0 = min(r["timestamp"] for r in rows) / 1000.0
    span = max(r["timestamp"] for r in rows) / 1000.0 - t0
    bins = int(span // bin_s)
    if bins < 2:
        raise ValueError(f"the trace spans {span:.0f} s: give --bin-s under half of it to get two whole bins")
    reqs, tokens = [0] * bins, [0] * bins
    for r in rows:
        k = int((r["timestamp"] / 1000.0 - t0) // bin_s)
        if k < bins:
            reqs[k] += 1
            tokens[k] += int(r["input_length"])

    def series(xs: list[int]) -> dict:
        per_s = [x / bin_s for x in xs]
        return {"per_s": [round(x, 2) for x in per_s], "mean": round(mean(per_s), 2),
                "cv": round(pstdev(per_s) / mean(per_s), 3), "max_over_min": round(max(per_s) / min(per_s), 3)}

    return {"span_s": round(span, 1), "bin_s": bin_s, "whole_bins": bins, "requests": series(reqs),
            "prompt_tokens": series(tokens)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--bin-s", type=float, default=300.0)
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.trace).read_text().splitlines() if line.strip()]
    print(json.dumps({"trace": args.trace, **profile(rows, args.bin_s)}))


if __name__ == "__main__":
    main()
