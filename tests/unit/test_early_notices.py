"""Read-ahead notices kept until their reservation is made (decode_worker/early_notices.py):
read back in the order they came, forgotten once taken or dropped, and bounded in time
and in count so that notices no reservation follows do not pile up."""
from __future__ import annotations

import pytest

from decode_worker.early_notices import EarlyNotices, Notice
from kvtransfer.engine import PeerInfo
from kvtransfer.layout import KVPoolLayout

PEER = PeerInfo("tcp", "prefill-0", KVPoolLayout(4096, 64, 1024), host="127.0.0.1", port=5)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _notice(first: int, layers=None) -> Notice:
    return Notice(PEER, first, (first + 10, first + 11), 0, layers)


def test_kept_notices_come_back_in_order_once():
    early = EarlyNotices(5.0, clock=Clock())
    sent = [_notice(0), _notice(2), _notice(4, (0, 1)), _notice(4, (1, 3))]
    for n in sent:
        early.keep("a", n)
    early.keep("b", _notice(0))
    assert early.take("a") == sent
    assert early.take("a") == [], "taken notices are forgotten"
    early.drop("b")
    assert early.take("b") == [] and len(early) == 0


def test_notices_older_than_the_keep_time_are_dropped():
    clock = Clock()
    early = EarlyNotices(5.0, clock=clock)
    early.keep("old", _notice(0))
    clock.now += 3
    early.keep("young", _notice(0))
    clock.now += 2.5   # "old" kept 5.5 s, "young" 2.5 s
    assert early.take("old") == []
    assert early.take("young") == [_notice(0)]


def test_at_most_max_requests_are_kept_the_oldest_going_first():
    early = EarlyNotices(60.0, max_requests=2, max_per_request=2, clock=Clock())
    for rid in ("a", "b", "c"):
        early.keep(rid, _notice(0))
    for _ in range(3):
        early.keep("c", _notice(2))
    assert len(early) == 2 and early.take("a") == []
    assert early.take("c") == [_notice(0), _notice(2)], "at most max_per_request notices a request"
    assert early.take("b") == [_notice(0)]


@pytest.mark.parametrize("args", [(0.0,), (1.0, 0), (1.0, 4, 0)])
def test_bad_bounds_are_a_clear_error(args):
    with pytest.raises(ValueError, match="keep_seconds > 0"):
        EarlyNotices(*args)
