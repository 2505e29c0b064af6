"""Trace expansion: equal hash ids give equal tokens and equal pdserve block
hashes; time compression and overlays."""
import json
import math

import pytest

from cluster.tools.sim.workload import (PromptBuilder, TraceRequest, compress_time, load_mooncake, overlay,
                                  swing_rate, synthetic_shared_prefix)
from engine.block_hash import block_hashes, packed_tokens
from engine.block_manager import prompt_blocks
from engine.request import Request
from engine.sampling_params import SamplingParams


def _req(rid, ids, n, salt=None):
    return TraceRequest(rid, 0.0, n, 4, tuple(ids), salt)


@pytest.mark.parametrize("bs", [16, 64, 512])
def test_equal_ids_give_equal_block_hashes_and_match_the_engine(bs):
    b = PromptBuilder(bs)
    a, c = _req("a", [7, 8, 9], 1536), _req("c", [7, 8, 10], 1536)
    ta, tc = b.tokens(a), b.tokens(c)
    assert len(ta) == len(tc) == 1536
    assert ta[:1024] == tc[:1024] and ta[1024:] != tc[1024:]
    ha, hc = b.hashes(a, ta), b.hashes(c, tc)
    assert ha == block_hashes(ta, bs) and hc == block_hashes(tc, bs)     # memo == the engine's function
    shared = 1024 // bs
    assert ha[:shared] == hc[:shared]
    assert ha[shared] != hc[shared]


def test_same_id_at_another_position_or_salt_does_not_share():
    b = PromptBuilder(512)
    x, y = _req("x", [1, 2], 1024), _req("y", [2, 1], 1024)
    hx, hy = b.hashes(x, b.tokens(x)), b.hashes(y, b.tokens(y))
    assert hx[0] != hy[1] and hx[1] != hy[0]        # chained: position matters
    s = _req("s", [1, 2], 1024, salt="copy1")
    assert set(b.hashes(s, b.tokens(s))).isdisjoint(hx)


def test_block_size_must_divide_tokens_per_id():
    with pytest.raises(ValueError, match="divide"):
        PromptBuilder(block_size=48)


def test_load_mooncake_scales_lengths(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1500, "input_length": 1000, "output_length": 64, "hash_ids": [0, 1]}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    full = load_mooncake(p)[0]
    assert (full.arrival_s, full.input_length, full.output_length, full.hash_ids) == (1.5, 1000, 64, (0, 1))
    small = load_mooncake(p, tokens_per_id=16)[0]
    assert small.input_length == 32 and small.output_length == 2
    with pytest.raises(ValueError, match="not found"):
        load_mooncake(tmp_path / "missing.jsonl")


def test_load_mooncake_window_from_an_offset(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps({"timestamp": 1000 * i, "input_length": 512, "output_length": 8 + i,
                                        "hash_ids": [i]}) for i in range(10)))
    window = load_mooncake(p, limit=4, offset=4)
    assert [(r.request_id, r.arrival_s, r.output_length) for r in window] == [
        (f"r{i}", float(i), 8 + i) for i in range(4, 8)]
    assert len(load_mooncake(p, limit=4, offset=8)) == 2
    with pytest.raises(ValueError, match="offset below its line count"):
        load_mooncake(p, limit=4, offset=10)


def test_compress_and_overlay():
    reqs = synthetic_shared_prefix(10, rate=2.0, num_prefixes=2, prefix_ids=2, suffix_ids=1, output_length=4)
    fast = compress_time(reqs, 4.0)
    assert [r.arrival_s * 4 for r in fast] == pytest.approx([r.arrival_s for r in reqs])
    three = overlay(reqs, 3)
    assert len(three) == 30 and len({r.request_id for r in three}) == 30
    assert {r.salt for r in three} == {"copy0", "copy1", "copy2"}
    assert [r.arrival_s for r in three] == sorted(r.arrival_s for r in three)


def _level(n: int, gap_s: float, t0: float = 3.0) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", t0 + i * gap_s, 16, 4, (i,), None) for i in range(n)]


def test_swing_rate_follows_the_cosine_cycle_and_keeps_the_requests():
    reqs = _level(6001, 0.1)                                    # 10 req/s, level, over 600 s
    swung = swing_rate(reqs, 0.5)                               # one cycle over the span: trough, peak, trough
    assert [r.request_id for r in swung] == [r.request_id for r in reqs]
    assert [(r.input_length, r.hash_ids) for r in swung] == [(r.input_length, r.hash_ids) for r in reqs]
    times = [r.arrival_s for r in swung]
    assert times == sorted(times) and times[0] == 3.0 and times[-1] == pytest.approx(603.0)
    per_bin = [sum(3.0 + 60 * k <= t < 3.0 + 60 * (k + 1) for t in times) for k in range(10)]
    # expected count per 60 s bin: 10 req/s x the integral of 1 - 0.5 cos(2 pi t / 600) over the bin
    want = [10 * (60 - 0.5 * 600 / (2 * math.pi) * (math.sin(2 * math.pi * 60 * (k + 1) / 600)
                                                     - math.sin(2 * math.pi * 60 * k / 600))) for k in range(10)]
    assert per_bin == pytest.approx(want, abs=2)
    assert max(per_bin) / min(per_bin) > 2.5                     # peak / trough of the bins: (1.5 - ) / (0.5 + )


def test_swing_rate_period_amplitude_zero_and_bad_input():
    reqs = _level(1201, 0.5)                                    # 2 req/s over 600 s
    two = swing_rate(reqs, 0.8, period_s=300.0)                 # two cycles: troughs at 0, 300 and 600 s
    times = [r.arrival_s - 3.0 for r in two]
    assert sum(t < 30 for t in times) < sum(120 <= t < 180 for t in times) / 4
    assert sum(300 <= t < 330 for t in times) < sum(420 <= t < 480 for t in times) / 4
    assert swing_rate(reqs, 0.0) == reqs
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"amplitude must be in \[0, 1\)"):
            swing_rate(reqs, bad)
    with pytest.raises(ValueError, match="period must be > 0"):
        swing_rate(reqs, 0.5, period_s=0.0)


@pytest.mark.parametrize("bs,tpi", [(16, 16), (16, 64), (64, 512), (512, 512)])
def test_memoised_hashes_equal_the_engine_on_random_shared_prompts(bs, tpi):
    import random
    rng = random.Random(bs + tpi)
    b = PromptBuilder(bs, tpi)
    for i in range(150):                       # shared heads (memo hits), then misses, partial tails
        n = rng.randint(1, 6)
        ids = tuple(rng.randrange(8) if j < 3 else rng.randrange(1000) for j in range(n))
        r = TraceRequest(f"x{i}", 0.0, rng.randint(1, n * tpi), 1, ids, salt=rng.choice([None, "a"]))
        t = b.tokens(r)
        assert b.hashes(r, t) == block_hashes(t, bs, r.salt)
        blocks = tuple(packed_tokens(t[k * bs:(k + 1) * bs]) for k in range(len(t) // bs))
        assert b.prompt(r) == (t, block_hashes(t, bs, r.salt), packed_tokens(t), blocks)   # memo hits or not


def test_token_memo_bounded_gives_the_same_prompts():
    small = PromptBuilder(16, 64, cache_entries=12)       # keeps 3 ids' tokens: cleared again and again
    big = PromptBuilder(16, 64)
    reqs = [TraceRequest(f"m{i}", 0.0, 64 * 3, 1, (i % 5, 7, (3 * i) % 11)) for i in range(30)]
    for r in reqs:
        assert small.tokens(r) == big.tokens(r) and small.prompt(r) == big.prompt(r)


def test_overlaid_copies_share_one_prompt_and_keep_their_own_hashes():
    """Copies of a trace request differ only in salt: the builder hands every copy the
    same packed tokens (one bytes object) and each copy its own salted hashes, as a
    fresh builder per copy would; the memo is bounded (1024 prompts) without effect."""
    reqs = overlay([TraceRequest(f"o{i}", float(i), 64 * 2 + i, 1, (i, 1000 + i, 7)) for i in range(1100)], 3)
    b = PromptBuilder(16, 64)
    by_original: dict[str, bytes] = {}
    for r in reqs:
        p = b.prompt(r)
        fresh = PromptBuilder(16, 64).prompt(r)
        assert p == fresh and p.hashes == block_hashes(list(p.tokens), 16, r.salt)
        first = by_original.setdefault(r.request_id.split("c")[0], p)
        # shared, unless the memo was just cleared
        assert (p.packed is first.packed and p.blocks is first.blocks) or len(b._prompts) <= 1
        assert p.blocks == prompt_blocks(Request(r.request_id, list(p.tokens), SamplingParams(max_tokens=1)), 16)
    assert len({PromptBuilder(16, 64).prompt(r).hashes[0] for r in reqs[:3]}) == 3   # three salts
