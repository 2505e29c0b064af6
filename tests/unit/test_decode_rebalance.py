"""The decode rebalance plan: hand-offs waiting on one decode worker move to free batch slots
elsewhere, never more than there are free slots, the longest queue first."""
import pytest

from cluster.config import ServeConfig
from cluster.orchestration.rebalance import Move, plan_moves


def test_a_backlog_on_one_worker_fills_the_free_slots_of_new_ones():
    loads = {"d0": (4, 150), "d1": (0, 0), "d2": (1, 0)}
    assert plan_moves(loads, 4) == [Move("d0", "d1", 4), Move("d0", "d2", 3)]


def test_nothing_moves_without_waiting_work_or_without_free_slots():
    assert plan_moves({"d0": (4, 0), "d1": (0, 0)}, 4) == []
    assert plan_moves({"d0": (4, 9), "d1": (4, 2)}, 4) == []
    assert plan_moves({}, 4) == []


def test_the_longest_queue_goes_first_and_a_queue_is_never_moved_past_its_length():
    loads = {"a": (4, 1), "b": (4, 5), "c": (0, 0), "d": (2, 0)}
    moves = plan_moves(loads, 4)
    assert moves == [Move("b", "c", 4), Move("b", "d", 1), Move("a", "d", 1)]
    for source in ("a", "b"):
        assert sum(m.count for m in moves if m.source == source) <= loads[source][1]


def test_a_worker_with_waiting_work_is_never_a_target():
    # "b" has a free slot by count but something waits on it (its KV is full): it takes nothing
    moves = plan_moves({"a": (4, 3), "b": (1, 1), "c": (3, 0)}, 4)
    assert all(m.target != "b" for m in moves) and sum(m.count for m in moves) == 1


def test_config_rejects_a_negative_interval():
    with pytest.raises(ValueError, match="decode_rebalance_interval"):
        ServeConfig(decode_rebalance_interval=-1)
