"""Cross-TP hand-off over real transfer engines (tcp, and nixl where installed): each
destination rank reads its KV heads from the source ranks' own pools (read_segments), then one
notify-only read ends the source's lease; a lease that ended meanwhile fails the hand-off
(tcp, whose source sees reads) instead of passing stale bytes."""
from __future__ import annotations

import time

import pytest
import torch

from kvtransfer.engine import TransferStatus
from kvtransfer.handle import RankSource
from kvtransfer.head_plan import head_shards
from kvtransfer.head_read import notify_source, plan_rank_read, read_heads
from kvtransfer.layout import KVPoolLayout
from kvtransfer.leases import LeaseTable, ReleaseCause
from kvtransfer.registry import available_backends, create_engine
from kvtransfer.tcp_backend import TcpEngine

LAYERS, BLOCK, HEAD_DIM, BLOCKS = 3, 4, 8, 12
SRC_IDS, DST_IDS = [7, 8, 9, 2], [0, 1, 2, 5]
BACKENDS = [b for b in ("tcp", "nixl") if b in available_backends()]


class _Side:
    """One worker's ranks: a pool per rank (its heads of `full`, or zeros) on its own engine."""

    def __init__(self, name: str, num_kv_heads: int, tp: int, full: torch.Tensor | None = None,
                 backend: str = "tcp") -> None:
        self.shards = head_shards(num_kv_heads, tp)
        self.pools = [full[:, :, :, s.first_head:s.end].contiguous() if full is not None
                      else torch.zeros(BLOCKS, LAYERS, 2, s.num_heads, BLOCK * HEAD_DIM) for s in self.shards]
        self.engines = [create_engine(backend, f"{name}-{backend}-rank{r}") for r in range(tp)]
        for e, p in zip(self.engines, self.pools):
            e.register_pool(KVPoolLayout.from_tensor(p))
        self.sources = [RankSource(e.peer_info(), s) for e, s in zip(self.engines, self.shards)]

    def close(self) -> None:
        for e in self.engines:
            e.close()


@pytest.fixture
def sides():
    made: list[_Side] = []

    def make(*args, **kw) -> _Side:
        made.append(_Side(*args, **kw))
        return made[-1]
    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,p_tp,d_tp", [(2, 2, 1), (2, 1, 2), (2, 2, 2), (1, 2, 1), (1, 1, 2), (4, 2, 4)])
def test_each_rank_reads_its_heads(sides, backend, heads, p_tp, d_tp):
    full = torch.randn(BLOCKS, LAYERS, 2, heads, BLOCK * HEAD_DIM)
    src, dst = sides("p", heads, p_tp, full, backend), sides("d", heads, d_tp, backend=backend)
    leases = LeaseTable(time.monotonic, lambda lease, cause: None)
    src.engines[0].set_read_guard(leases)
    leases.pin("req", SRC_IDS, 30.0)
    total = 0
    for rank, (engine, shard) in enumerate(zip(dst.engines, dst.shards)):
        res = read_heads(engine, src.sources, shard, rank, LAYERS, SRC_IDS, DST_IDS, 10.0)
        assert res.ok, res.error
        total += res.nbytes
    assert total == len(SRC_IDS) * full[0].numel() * 4 * d_tp // (d_tp if heads >= d_tp else heads)
    for shard, pool in zip(dst.shards, dst.pools):
        assert torch.equal(pool[DST_IDS], full[SRC_IDS][:, :, :, shard.first_head:shard.end])
        assert not pool[[b for b in range(BLOCKS) if b not in DST_IDS]].any()
    assert len(leases) == 1                                # no rank's read ended the lease
    note = notify_source(dst.engines[0], src.sources[0].peer, b"req", 10.0)
    assert note.ok and note.nbytes == 0
    deadline = time.monotonic() + 5
    while len(leases):
        for n in src.engines[0].get_notifications():
            leases.release_by_notification(n.message)
        assert time.monotonic() < deadline, "the notification never reached the source's rank 0"
    assert leases.releases[ReleaseCause.NOTIFIED] == 1


def test_matching_splits_read_whole_blocks(sides):
    full = torch.randn(BLOCKS, LAYERS, 2, 2, BLOCK * HEAD_DIM)
    src, dst = sides("p", 2, 2, full), sides("d", 2, 2)
    plans = [plan_rank_read(src.sources, s, r, dst.engines[r].layout, LAYERS) for r, s in enumerate(dst.shards)]
    assert [[p.agent_name for p, _ in plan] for plan in plans] == [["p-tcp-rank0"], ["p-tcp-rank1"]]
    res = read_heads(dst.engines[1], src.sources, dst.shards[1], 1, LAYERS, SRC_IDS, DST_IDS, 10.0)
    assert res.ok and res.descriptors == 2                 # runs 7-9 -> 0-2 and 2 -> 5


def test_mismatched_splits_cost_a_descriptor_per_layer_and_kv(sides):
    full = torch.randn(BLOCKS, LAYERS, 2, 2, BLOCK * HEAD_DIM)
    src, dst = sides("p", 2, 2, full), sides("d", 2, 1)
    res = read_heads(dst.engines[0], src.sources, dst.shards[0], 0, LAYERS, SRC_IDS, DST_IDS, 10.0)
    assert res.ok and res.descriptors == 2 * len(SRC_IDS) * 2 * LAYERS    # from each of 2 ranks


def test_a_lease_that_ended_fails_the_hand_off(sides):
    full = torch.randn(BLOCKS, LAYERS, 2, 2, BLOCK * HEAD_DIM)
    src, dst = sides("p", 2, 2, full), sides("d", 2, 1)
    leases = LeaseTable(time.monotonic, lambda lease, cause: None)
    src.engines[0].set_read_guard(leases)
    leases.pin("req", SRC_IDS, 30.0)
    assert read_heads(dst.engines[0], src.sources, dst.shards[0], 0, LAYERS, SRC_IDS, DST_IDS, 10.0).ok
    leases.release("req", ReleaseCause.RELEASED)           # expired or released while the ranks read
    note = notify_source(dst.engines[0], src.sources[0].peer, b"req", 10.0)
    assert note.status is TransferStatus.FAILED and "no longer holds" in note.error


def test_pools_that_store_heads_differently_are_refused(sides):
    src = sides("p", 2, 2, torch.randn(BLOCKS, LAYERS, 2, 2, BLOCK * HEAD_DIM))
    odd = torch.zeros(BLOCKS, LAYERS, 2, 1, BLOCK * HEAD_DIM * 2)          # twice the tile per head
    engine = TcpEngine("d-odd")
    try:
        engine.register_pool(KVPoolLayout.from_tensor(odd))
        res = read_heads(engine, src.sources, head_shards(2, 2)[0], 0, LAYERS, SRC_IDS, DST_IDS, 10.0)
        assert res.status is TransferStatus.FAILED and "same model, dtype" in res.error
    finally:
        engine.close()
