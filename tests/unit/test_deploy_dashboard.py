"""deploy/grafana/pdserve.json: it loads, and every metric it queries is one pdserve exports."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.observability.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"
METRIC_RE = re.compile(r"\bpdserve_[A-Za-z0-9_]+")
# Grafana variables -> something PromQL parses, for promtool.
GRAFANA_VARS = {"$__rate_interval": "5m", "$namespace": ".*"}

# What the dashboard must show (issue 6): a family per topic.
REQUIRED = {
    "TTFT": "pdserve_time_to_first_token_seconds_bucket",
    "ITL": "pdserve_inter_token_latency_seconds_bucket",
    "throughput": "pdserve_generation_tokens_total",
    "queue depth": "pdserve_frontend_queue_depth",
    "KV usage": "pdserve_kv_blocks_used",
    "transfer bytes": "pdserve_kv_transfer_bytes_sum",
    "transfer seconds": "pdserve_kv_transfer_seconds_bucket",
    "prefix hits": "pdserve_prefix_cache_hit_tokens_total",
    "prefix queries": "pdserve_prefix_cache_queried_tokens_total",
    "lease expiries": "pdserve_lease_expiries_total",
    "requests by outcome": "pdserve_requests_total",
    "routing decisions": "pdserve_routing_decisions_total",
}


def exported_series_names() -> set[str]:
    """Series names a scrape can contain, by family type (labelled families have no samples
    until first use, so derive the names instead of reading samples)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",), "summary": ("", "_sum", "_count")}
    names = set()
    for family in Metrics().registry.collect():
        names.update(family.name + s for s in suffixes[family.type])
    return names


def expressions(node) -> list[str]:
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                out.append(value)
            elif key == "query" and isinstance(value, str) and "pdserve_" in value:
                out.append(value)
            else:
                out.extend(expressions(value))
    elif isinstance(node, list):
        for item in node:
            out.extend(expressions(item))
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_loads_with_panels_and_unique_ids(dashboard):
    assert dashboard["title"] and dashboard["uid"]
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert sum(1 for p in panels if p["type"] != "row") >= 12
    for p in panels:
        if p["type"] != "row":
            assert p["targets"], p["title"]


def test_every_queried_metric_is_exported(dashboard):
    exported = exported_series_names()
    queried = {m for e in expressions(dashboard) for m in METRIC_RE.findall(e)}
    assert queried, "the dashboard queries no pdserve_ metric"
    unknown = sorted(queried - exported)
    assert not unknown, f"dashboard queries metrics cluster/observability/metrics.py does not export: {unknown}"


def test_dashboard_covers_required_topics(dashboard):
    queried = {m for e in expressions(dashboard) for m in METRIC_RE.findall(e)}
    missing = {topic: name for topic, name in REQUIRED.items() if name not in queried}
    assert not missing


def test_histogram_buckets_only_inside_histogram_quantile_by_le(dashboard):
    for expr in expressions(dashboard):
        if "_bucket" in expr:
            assert "histogram_quantile(" in expr and re.search(r"by \(le\b", expr), expr


def test_rate_and_increase_only_read_counters(dashboard):
    """rate() of a gauge is meaningless (and of a cumulative gauge wrong after a restart):
    every series under rate()/increase()/irate() is a counter or a histogram's counters."""
    kinds = {}
    for family in Metrics().registry.collect():
        if family.type == "counter":
            kinds[family.name + "_total"] = "counter"
        elif family.type == "histogram":
            kinds.update({family.name + s: "counter" for s in ("_bucket", "_sum", "_count")})
        else:
            kinds[family.name] = family.type
    rated = [(fn, name) for e in expressions(dashboard)
             for fn, name in re.findall(r"\b(rate|irate|increase)\(\s*(pdserve_[A-Za-z0-9_]+)", e)]
    assert rated
    wrong = sorted({name for fn, name in rated if kinds.get(name) != "counter"})
    assert not wrong, f"{wrong} are not counters: apply rate()/increase() to counters only"


def test_promtool_parses_every_expression(dashboard, tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool not installed (Debian package `prometheus`): PromQL syntax not checked")
    rules = []
    for i, expr in enumerate(expressions(dashboard)):
        if expr.startswith("label_values("):   # a Grafana variable query, not PromQL
            continue
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"pdserve:dashboard_expr_{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
