import pytest
from hypothesis import given, strategies as st

from kvtransfer.descriptors import BlockRun, Descriptor, build_descriptors, coalesce_runs
from kvtransfer.layout import KVPoolLayout

BPB = 737280
SRC = KVPoolLayout(base_addr=1 << 20, num_blocks=100, bytes_per_block=BPB)
DST = KVPoolLayout(base_addr=1 << 40, num_blocks=50, bytes_per_block=BPB)


def test_empty():
    assert build_descriptors(SRC, DST, [], []) == []


def test_single():
    assert build_descriptors(SRC, DST, [3], [7]) == [Descriptor(SRC.block_addr(3), DST.block_addr(7), BPB)]


def test_long_run_is_one_descriptor():
    d = build_descriptors(SRC, DST, list(range(10, 50)), list(range(0, 40)))
    assert d == [Descriptor(SRC.block_addr(10), DST.block_addr(0), 40 * BPB)]


def test_reversed_runs_do_not_merge():
    assert coalesce_runs([5, 4, 3], [0, 1, 2]) == [BlockRun(5, 0, 1), BlockRun(4, 1, 1), BlockRun(3, 2, 1)]
    assert len(build_descriptors(SRC, DST, [5, 4, 3], [2, 1, 0])) == 3


def test_consecutive_on_one_side_only_does_not_merge():
    assert len(coalesce_runs([1, 2, 3], [7, 9, 11])) == 3
    assert len(coalesce_runs([1, 5, 9], [7, 8, 9])) == 3


def test_interleaved_runs():
    runs = coalesce_runs([0, 1, 10, 11, 2, 3], [0, 1, 2, 3, 4, 5])
    assert runs == [BlockRun(0, 0, 2), BlockRun(10, 2, 2), BlockRun(2, 4, 2)]


@pytest.mark.parametrize("src,dst,match", [
    ([1, 2], [1], "one destination block per source"),
    ([100], [0], "out of range"),
    ([0], [50], "out of range"),
    ([-1], [0], "out of range"),
    ([0, 1], [3, 3], "repeat"),
])
def test_validation_says_how_to_fix(src, dst, match):
    with pytest.raises(ValueError, match=match):
        build_descriptors(SRC, DST, src, dst)


def test_block_size_mismatch():
    other = KVPoolLayout(base_addr=1 << 30, num_blocks=10, bytes_per_block=BPB * 2)
    with pytest.raises(ValueError, match="same block shape"):
        build_descriptors(SRC, other, [0], [0])


def test_head_slice_never_merges_and_moves_only_the_slice():
    s = KVPoolLayout(1 << 20, 10, 1000, slice_offset=250, slice_bytes=250)
    d = KVPoolLayout(1 << 30, 10, 1000, slice_offset=500, slice_bytes=250)
    out = build_descriptors(s, d, [0, 1], [4, 5])
    assert out == [Descriptor((1 << 20) + 250, (1 << 30) + 4500, 250),
                   Descriptor((1 << 20) + 1250, (1 << 30) + 5500, 250)]


@given(st.lists(st.integers(0, 99), unique=True, max_size=60).flatmap(
    lambda src: st.tuples(st.just(src), st.permutations(range(len(src))))))
def test_descriptors_cover_exactly_the_pairs(case):
    src, dst = case
    descs = build_descriptors(SRC, DST, src, list(dst))
    pairs = []
    for d in descs:
        assert d.nbytes % BPB == 0
        for k in range(d.nbytes // BPB):
            pairs.append(((d.src_addr - SRC.base_addr) // BPB + k, (d.dst_addr - DST.base_addr) // BPB + k))
    assert pairs == list(zip(src, dst))
    # fewest: no two adjacent descriptors could have been merged
    for a, b in zip(descs, descs[1:]):
        assert not (b.src_addr == a.src_addr + a.nbytes and b.dst_addr == a.dst_addr + a.nbytes)
