"""The per-request hand-off's state machine and the recovery journal (cluster/orchestration)."""
from __future__ import annotations

import pytest

from cluster.orchestration.backend import GenerateJob
from cluster.orchestration.handoff import NEXT_STAGES, Handoff, Hooks, Shared, Stage
from cluster.orchestration.journal import Journal, Recovery, RecoveryCounters, attempt_id, client_id
from engine.sampling_params import SamplingParams


def handoff(by_wid: dict) -> Handoff:
    shared = Shared(config=None, pool=None, journal=Journal(), metrics=None, hooks=Hooks(), by_wid=by_wid)
    return Handoff(shared, GenerateJob("req-1", (1, 2, 3), SamplingParams(max_tokens=4)))


def test_every_stage_is_reachable_from_routed_and_finished_is_terminal():
    seen, todo = {Stage.ROUTED}, [Stage.ROUTED]
    while todo:
        for nxt in NEXT_STAGES[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(Stage)
    assert NEXT_STAGES[Stage.FINISHED] == frozenset()
    assert all(Stage.FINISHED in nexts for stage, nexts in NEXT_STAGES.items() if stage is not Stage.FINISHED)


def test_a_disaggregated_path_and_a_migration_are_legal_transitions():
    by_wid: dict = {}
    h = handoff(by_wid)
    assert by_wid == {"req-1": h} and h.stage is Stage.ROUTED
    for stage in (Stage.PREFILLING, Stage.HANDED_OFF, Stage.DECODING, Stage.MIGRATING, Stage.PREFILLING,
                  Stage.HANDED_OFF, Stage.DECODING, Stage.FINISHED):
        h._to(stage)
    assert h.stage is Stage.FINISHED


@pytest.mark.parametrize("path", [(Stage.DECODING, Stage.PREFILLING), (Stage.DECODING, Stage.HANDED_OFF),
                                  (Stage.HANDED_OFF,), (Stage.FINISHED, Stage.DECODING)])
def test_an_illegal_transition_is_refused(path):
    h = handoff({})
    *before, bad = path
    for stage in before:
        h._to(stage)
    with pytest.raises(AssertionError, match="->"):
        h._to(bad)


def test_journal_counts_each_kind_and_keeps_events_per_client_request():
    j = Journal()
    j.note("a", Recovery.MIGRATION)
    j.note(attempt_id("a", 1), Recovery.MIGRATION)
    j.note("b", Recovery.BUSY)
    j.note("a", Recovery.LEASE_RENEWAL, count_only=True)
    j.trace(attempt_id("a", 2), "joined decode-1")
    assert j.counters == RecoveryCounters(migrations=2, busy=1, lease_renewals=1)
    assert j.request_events("a") == ["migrations", "migrations", "joined decode-1"]
    assert j.request_events(attempt_id("b", 3)) == ["busy"]
    assert client_id(attempt_id("a", 7)) == "a"


def test_journal_keeps_a_bounded_event_log():
    j = Journal(max_events=3)
    for i in range(5):
        j.trace("r", f"e{i}")
    assert j.request_events("r") == ["e2", "e3", "e4"]
