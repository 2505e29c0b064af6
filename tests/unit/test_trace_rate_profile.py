"""benchmarks/trace_rate_profile.py: per-bin rates of a trace, the partial last bin left out."""
from __future__ import annotations

import pytest

from bench_scripts import load_bench_script


def test_profile_counts_whole_bins_and_reads_the_swing():
    bench = load_bench_script("trace_rate_profile")
    # 10 s bins: 4 requests of 100 tokens in the first, 2 of 300 in the second, 1 in the partial third
    rows = [{"timestamp": t, "input_length": n} for t, n in
            [(0, 100), (2000, 100), (5000, 100), (9999, 100), (10000, 300), (15000, 300), (20000, 7)]]
    out = bench.profile(rows, 10.0)
    assert out["whole_bins"] == 2 and out["span_s"] == 20.0
    assert out["requests"]["per_s"] == [0.4, 0.2] and out["requests"]["max_over_min"] == 2.0
    assert out["prompt_tokens"]["per_s"] == [40.0, 60.0] and out["prompt_tokens"]["cv"] == 0.2
    with pytest.raises(ValueError, match="two whole bins"):
        bench.profile(rows, 15.0)
    with pytest.raises(ValueError, match="--bin-s must be > 0"):
        bench.profile(rows, 0.0)
