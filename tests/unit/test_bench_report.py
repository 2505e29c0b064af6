"""Report math against hand-computed values; goodput; timeline bins."""
from __future__ import annotations

import pytest

from cluster.tools.bench.report import Slo, format_table, latency_stats, summarize, timeline
from cluster.tools.bench.runner import INCOMPLETE, RequestResult, RunResult


def _ok(i, ttft, e2e, out, prompt=10, cached=0, itl=(), sent=0.0):
    return RequestResult(i, sent, sent_s=sent, prompt_tokens=prompt, output_tokens=out, cached_tokens=cached,
                         ttft_s=ttft, e2e_s=e2e, itl_s=list(itl))


def _failed(i, code):
    return RequestResult(i, 0.0, error_code=code, error=f"{code} happened", prompt_tokens=10)


def test_latency_stats_interpolate_linearly():
    s = latency_stats([0.001, 0.002, 0.003, 0.004, None])
    assert s["count"] == 4
    assert s["mean"] == pytest.approx(2.5)
    assert s["p50"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(3.7)     # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert s["p99"] == pytest.approx(3.97)
    assert latency_stats([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p95": None, "p99": None}


def test_tpot_excludes_the_first_token():
    assert _ok(0, 0.1, 0.5, 5).tpot_s == pytest.approx(0.1)
    assert _ok(0, 0.1, 0.1, 1).tpot_s is None


def _run():
    rs = [_ok(0, 0.10, 0.50, 5, prompt=100, cached=50, itl=[0.1] * 4),
          _ok(1, 0.30, 0.70, 3, prompt=50, cached=0, itl=[0.2, 0.2]),
          _ok(2, 0.05, 0.05, 1, prompt=50, cached=25),
          _failed(3, "UNAVAILABLE"), _failed(4, "UNAVAILABLE"), _failed(5, "RESOURCE_EXHAUSTED"),
          RequestResult(6, 0.0, error_code=INCOMPLETE, output_tokens=2, prompt_tokens=10)]
    return RunResult(rs, elapsed_s=2.0, not_sent=4)


def test_summary_counts_throughput_and_hit_rate():
    s = summarize(_run(), meta={"dataset": "random"})
    assert s["dataset"] == "random"
    assert s["requests"] == {"sent": 7, "finished": 3, "failed": 3, "incomplete": 1, "not_sent": 4}
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(9 / 2)                # only finished requests count
    assert s["total_token_throughput"] == pytest.approx((200 + 9) / 2)
    assert s["prefix_cache_hit_rate"] == pytest.approx(75 / 200)
    assert s["failures"] == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 2}
    assert s["failure_examples"]["UNAVAILABLE"] == "UNAVAILABLE happened"
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["tpot_ms"]["count"] == 2 and s["tpot_ms"]["mean"] == pytest.approx(150.0)   # (100 + 200) / 2
    assert s["itl_ms"]["count"] == 6 and s["itl_ms"]["p50"] == pytest.approx(100.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(500.0)
    assert s["goodput"] is None


def test_goodput_needs_every_slo_and_a_finished_request():
    s = summarize(_run(), Slo(ttft_ms=200))
    assert s["goodput"]["requests"] == 2 and s["goodput"]["request_rate"] == pytest.approx(1.0)
    assert s["goodput"]["fraction"] == pytest.approx(2 / 7)
    s = summarize(_run(), Slo(ttft_ms=200, tpot_ms=150, e2e_ms=600))
    assert s["goodput"]["requests"] == 2              # request 2 has no TPOT: it meets the TPOT SLO
    s = summarize(_run(), Slo(tpot_ms=99))
    assert s["goodput"]["requests"] == 1 and s["goodput"]["slo_ms"] == {"tpot_ms": 99}


def test_slo_must_be_positive():
    with pytest.raises(ValueError, match="--slo-ttft-ms"):
        Slo(ttft_ms=0)


def test_timeline_bins_tokens_and_finishes():
    a = _ok(0, 0.2, 1.4, 3, sent=0.1)
    a.token_times_s = [0.3, 0.9, 1.5]
    b = _ok(1, 0.1, 0.2, 2, sent=1.0)
    b.token_times_s = [1.1, 1.2]
    t = timeline([a, b], elapsed_s=1.9, bin_s=1.0)
    assert t["t_s"] == [0.0, 1.0]
    assert t["output_tok_s"] == [2.0, 3.0]
    assert t["requests_s"] == [0.0, 2.0]
    assert t["ttft_ms_mean"] == [None, pytest.approx(150.0)]
    assert t["e2e_ms_mean"][1] == pytest.approx(800.0)
    assert len(timeline([a], elapsed_s=20.0)["t_s"]) == 40      # default: ~40 bins of 0.5 s


def test_table_mentions_the_headline_figures():
    text = format_table(summarize(_run(), Slo(ttft_ms=200)))
    assert "3 finished, 3 failed, 1 incomplete, 4 not sent" in text
    assert "prefix cache hit rate: 37.5%" in text and "goodput: 2 requests" in text
    assert "UNAVAILABLE" in text
