import pytest

from kvtransfer.leases import LeaseTable, ReleaseCause


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def table():
    clock = Clock()
    freed = []
    return LeaseTable(clock, lambda lease, cause: freed.append((lease.request_id, lease.block_ids, cause))), clock, freed


def test_notification_releases_once(table):
    t, _, freed = table
    lease = t.pin("r1", [3, 4], ttl=5)
    assert lease.expires_at == 105.0
    assert t.release_by_notification(b"r1") is True
    assert t.release_by_notification(b"r1") is False
    assert t.release("r1") is False
    assert freed == [("r1", (3, 4), ReleaseCause.NOTIFIED)]
    assert t.releases[ReleaseCause.NOTIFIED] == 1 and len(t) == 0


def test_expiry_with_injected_clock(table):
    t, clock, freed = table
    t.pin("a", [1], ttl=1)
    t.pin("b", [2], ttl=10)
    assert t.expire_due() == []
    clock.now += 1.0
    assert [l.request_id for l in t.expire_due()] == ["a"]
    assert t.expire_due(now=clock.now + 100)[0].request_id == "b"
    assert t.expiries == 2
    assert t.release("a") is False and t.release_by_notification(b"b") is False
    assert [f[2] for f in freed] == [ReleaseCause.EXPIRED, ReleaseCause.EXPIRED]


def test_explicit_release_counted(table):
    t, _, freed = table
    t.pin("x", [9], ttl=3)
    assert t.release("x") and not t.release("x")
    assert t.releases == {ReleaseCause.RELEASED: 1} and len(freed) == 1


def test_pin_validation(table):
    t, _, _ = table
    with pytest.raises(ValueError, match="ttl"):
        t.pin("r", [1], ttl=0)
    t.pin("r", [1], ttl=1)
    with pytest.raises(ValueError, match="already holds a lease"):
        t.pin("r", [2], ttl=1)


def test_read_of_an_ended_lease_is_refused(table):
    t, clock, freed = table
    t.pin("a", [1], ttl=1)
    clock.now += 2
    t.expire_due()
    assert t.begin_read("a") is False
    assert t.begin_read("never-pinned") is False
    assert freed == [("a", (1,), ReleaseCause.EXPIRED)]


def test_lease_expiring_during_a_read_keeps_its_blocks_until_the_read_ends(table):
    t, clock, freed = table
    t.pin("a", [1, 2], ttl=1)
    assert t.begin_read("a") is True
    clock.now += 5
    assert [l.request_id for l in t.expire_due()] == ["a"]
    assert t.expiries == 1 and len(t) == 0        # counted as expired at once
    assert freed == [] and t.unfreed == 1          # but the blocks are still being sent
    assert t.begin_read("a") is False              # no new read of it starts
    t.end_read("a")
    assert freed == [("a", (1, 2), ReleaseCause.EXPIRED)] and t.unfreed == 0
    t.end_read("a")                                # unmatched: harmless
    assert len(freed) == 1


def test_release_during_two_reads_frees_after_the_last(table):
    t, _, freed = table
    t.pin("a", [7], ttl=10)
    assert t.begin_read("a") and t.begin_read("a")
    assert t.release("a") is True and t.release("a") is False
    t.end_read("a")
    assert freed == []
    t.end_read("a")
    assert freed == [("a", (7,), ReleaseCause.RELEASED)]
    assert t.pins == sum(t.releases.values())


def test_expiry_grace_delays_the_free_not_the_count():
    clock, freed = Clock(), []
    t = LeaseTable(clock, lambda lease, cause: freed.append(lease.request_id), expiry_grace=3)
    t.pin("a", [1], ttl=1)
    t.pin("b", [2], ttl=100)
    clock.now += 1
    t.expire_due()
    assert t.expiries == 1 and freed == [] and t.unfreed == 1
    assert t.begin_read("a") is False
    t.release("b")                                 # an explicit release is not delayed
    assert freed == ["b"]
    clock.now += 3
    t.expire_due()
    assert freed == ["b", "a"] and t.unfreed == 0
    with pytest.raises(ValueError, match="expiry_grace"):
        LeaseTable(clock, lambda *a: None, expiry_grace=-1)
