"""pdserve_decode_reservations_total{outcome} (the head's count of what became of each
hand-off's decode reservation at routing) and pdserve_decode_reservation_expiries_total
(per decode worker, from its reports), read through the Prometheus text format."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.observability.metrics import RESERVATION_OUTCOMES, Metrics, WorkerStats


def _samples(m: Metrics, family: str) -> dict[tuple, float]:
    (f,) = [f for f in text_string_to_metric_families(generate_latest(m.registry).decode()) if f.name == family]
    assert f.type == "counter"
    return {tuple(sorted(s.labels.items())): s.value for s in f.samples if s.name == family + "_total"}


def test_every_outcome_is_exported_from_the_start_and_counted_by_its_label():
    m = Metrics()
    assert _samples(m, "pdserve_decode_reservations") == {(("outcome", o),): 0.0 for o in RESERVATION_OUTCOMES}
    for outcome in ("reserved", "reserved", "skipped_backlog", "refused"):
        m.count_decode_reservation(outcome)
    got = _samples(m, "pdserve_decode_reservations")
    assert got == {(("outcome", "reserved"),): 2.0, (("outcome", "refused"),): 1.0,
                   (("outcome", "failed"),): 0.0, (("outcome", "skipped_backlog"),): 1.0}


def test_an_unknown_outcome_is_refused():
    with pytest.raises(ValueError, match="use one of"):
        Metrics().count_decode_reservation("expired")


def test_reservation_expiries_are_a_per_worker_counter_from_the_reports():
    m = Metrics()
    m.observe_worker(WorkerStats("d0", "decode", 0, 0, 0, 10, 0, 0, reservation_expiries=3))
    m.observe_worker(WorkerStats("p0", "prefill", 0, 0, 0, 10, 0, 0))
    assert _samples(m, "pdserve_decode_reservation_expiries") == {
        (("pool", "decode"), ("worker", "d0")): 3.0, (("pool", "prefill"), ("worker", "p0")): 0.0}
