"""The routing cost as pure functions: exact values and exact choices."""
import random

import pytest

from cluster.router.cost import (CostWeights, busy_pool, busy_weights, decode_cost, decode_node_cost,
                                 effective_cached_blocks, prefill_cost, select, should_prefill_locally,
                                 transfer_cost)

W = CostWeights()
MISS = W.uncached_token          # queued tokens one uncached token weighs (6: cost.py's module doc)
BS = 16


class NoRandom(random.Random):
    def random(self):  # pragma: no cover - must not be called
        raise AssertionError("temperature 0 must not draw randomness")

    def randrange(self, *a, **k):  # pragma: no cover
        raise AssertionError("temperature 0 must not draw randomness")


def test_prefill_cost_is_uncached_work_plus_queue():
    assert MISS == 6.0
    assert prefill_cost(10, 0, BS, W) == MISS * 160.0
    assert prefill_cost(10, 500, BS, W) == MISS * 160.0 + 500
    assert prefill_cost(0, 0, BS, W) == 0.0
    w = CostWeights(uncached_token=2.0, queued_token=0.5)
    assert prefill_cost(3, 100, 16, w) == 2.0 * 48 + 50


def test_a_pool_busy_everywhere_weighs_a_miss_busy_pool_miss_times_more():
    assert busy_pool([64, 1, 4000]) and not busy_pool([64, 0, 4000])
    bw = busy_weights(W)
    assert W.busy_pool_miss == 4.0 and bw.uncached_token == MISS * 4.0
    assert bw.queued_token == W.queued_token and bw.in_flight_hit == W.in_flight_hit
    # a holder of 90 of 100 blocks, its queue 15000 tokens longer: left at the idle-pool weight, kept at the busy one
    holder, other = (10, 15000 + 500), (100, 500)
    assert prefill_cost(*holder, BS, W) > prefill_cost(*other, BS, W)
    assert prefill_cost(*holder, BS, bw) < prefill_cost(*other, BS, bw)
    assert busy_weights(CostWeights(busy_pool_miss=1.0)) == CostWeights(busy_pool_miss=1.0)


def test_decode_cost_and_transfer_cost():
    assert decode_cost(0, 0.0, W) == 0.0
    assert decode_cost(3, 0.5, W) == 3 * 32.0 + 0.5 * 512.0
    assert transfer_cost(7, CostWeights(transfer_block=2.0)) == 14.0


@pytest.mark.parametrize("running,kv,missing,queued", [(0, 0.0, 0, 0), (3, 0.25, 40, 700), (64, 1.0, 125, 0)])
def test_decode_node_cost_is_the_sum_of_its_parts(running, kv, missing, queued):
    w = CostWeights(running=10.0, kv_usage=300.0, transfer_block=2.0, queued_token=0.5)
    expected = decode_cost(running, kv, w) + transfer_cost(missing, w) + prefill_cost(0, queued, BS, w)
    assert decode_node_cost(running, kv, missing, queued, w) == pytest.approx(expected)


def test_host_and_disk_hits_weigh_less_than_device_hits():
    assert effective_cached_blocks(10, 0, 0, W) == 10
    assert effective_cached_blocks(0, 10, 0, W) == pytest.approx(8.0)
    assert effective_cached_blocks(0, 0, 10, W) == pytest.approx(5.0)
    assert effective_cached_blocks(4, 2, 2, W) == pytest.approx(4 + 1.6 + 1.0)


@pytest.mark.parametrize("call", [
    lambda: prefill_cost(-1, 0, BS, W),
    lambda: prefill_cost(1, -5, BS, W),
    lambda: prefill_cost(1, 0, 0, W),
    lambda: decode_cost(-1, 0.0, W),
    lambda: decode_cost(1, -0.1, W),
    lambda: transfer_cost(-1, W),
    lambda: decode_node_cost(1, 0.1, -2, 0, W),
    lambda: CostWeights(running=-1.0),
    lambda: CostWeights(host_hit=1.5),
    lambda: CostWeights(busy_pool_miss=0.5),
    lambda: CostWeights(busy_pool_miss=float("nan")),
])
def test_bad_inputs_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def _prefill_choice(prompt_tokens, nodes):
    """nodes: list of (cached_blocks, queued_tokens) -> index chosen at temperature 0."""
    costs = [prefill_cost(prompt_tokens / BS - cached, queued, BS, W) for cached, queued in nodes]
    return select(costs, 0.0, NoRandom())


def test_node_holding_the_prefix_wins():
    # 2000-token prompt; node 1 holds 100 of its 125 blocks, both queues empty.
    assert _prefill_choice(2000, [(0, 0), (100, 0), (20, 0)]) == 1


def test_prefix_holder_still_wins_with_a_somewhat_longer_queue():
    # holder saves 1600 tokens of work; a 1000-token queue does not outweigh it
    assert _prefill_choice(2000, [(0, 0), (100, 1000)]) == 1


def test_prefix_holder_loses_when_its_queue_is_much_longer():
    # the holder saves 1600 uncached tokens: it loses once its queue is MISS x 1600 longer
    assert _prefill_choice(2000, [(0, 0), (100, int(MISS * 1600) + 1)]) == 0
    assert _prefill_choice(2000, [(0, 0), (100, int(MISS * 1600) - 1)]) == 1


def test_temperature_zero_is_argmin_with_first_index_tie_break():
    assert select([3.0, 1.0, 2.0], 0.0, NoRandom()) == 1
    assert select([5.0, 1.0, 1.0, 1.0], 0.0, NoRandom()) == 1
    assert select([2.0, 2.0], 0.0, NoRandom()) == 0
    assert select([7.0], 0.0, NoRandom()) == 0


def test_select_rejects_bad_input():
    with pytest.raises(ValueError):
        select([], 0.0, random.Random(0))
    with pytest.raises(ValueError):
        select([1.0], -0.5, random.Random(0))


def _histogram(costs, temperature, n=4000, seed=7):
    rng = random.Random(seed)
    counts = [0] * len(costs)
    for _ in range(n):
        counts[select(costs, temperature, rng)] += 1
    return counts


def test_positive_temperature_favours_lower_cost():
    counts = _histogram([100.0, 200.0, 300.0], 0.5)
    assert counts[0] > counts[1] > counts[2] > 0


def test_higher_temperature_spreads_choices_more():
    cold = _histogram([100.0, 200.0], 0.2)
    hot = _histogram([100.0, 200.0], 5.0)
    assert cold[1] < hot[1] < hot[0]


def test_equal_costs_at_positive_temperature_are_sampled_uniformly():
    counts = _histogram([50.0, 50.0, 50.0, 50.0], 1.0)
    assert all(800 < c < 1200 for c in counts), counts


def test_softmax_probabilities_match_the_formula():
    # costs normalised by range: p1/p0 = exp(-1/T)
    import math
    t = 1.0
    counts = _histogram([0.0, 10.0], t, n=20000)
    expected_p1 = math.exp(-1 / t) / (1 + math.exp(-1 / t))
    assert counts[1] / 20000 == pytest.approx(expected_p1, abs=0.02)


def test_same_seed_same_choices():
    assert _histogram([1.0, 2.0, 3.0], 1.0, n=200, seed=3) == _histogram([1.0, 2.0, 3.0], 1.0, n=200, seed=3)


@pytest.mark.parametrize("uncached,prompt,ratio,expected", [
    (32, 2000, 0.0, True),       # uncached part at or below the threshold
    (64, 2000, 0.0, True),       # exactly the threshold
    (65, 2000, 0.0, False),      # just above it, decode holds nothing
    (400, 2000, 0.8, True),      # decode holds 80% of the prompt
    (400, 2000, 0.79, False),
    (2000, 2000, 0.0, False),    # long cold prompt: disaggregate
    (10, 10, 0.0, True),         # short prompt
])
def test_should_prefill_locally(uncached, prompt, ratio, expected):
    assert should_prefill_locally(uncached, prompt, ratio, threshold=64, hit_ratio=0.8) is expected


def test_should_prefill_locally_validates():
    with pytest.raises(ValueError):
        should_prefill_locally(3000, 2000, 0.0, 64, 0.8)
    with pytest.raises(ValueError):
        should_prefill_locally(10, 2000, 1.5, 64, 0.8)
    with pytest.raises(ValueError):
        should_prefill_locally(10, 2000, 0.5, -1, 0.8)
