"""CostWeights.min_hit_share: a prefill node's hit under that share of the prompt counts as none.
A new conversation that shares only a short preamble with what a node holds is then placed by
queue and the tie rule (the least-assigned node), not by the preamble; a later turn, whose hit
is most of its prompt, still goes home. Off (0), the preamble's holder takes every new one."""
import random

import pytest

from cluster.router import CostWeights, PolicyConfig, Router, RouterConfig, RoutingRequest, WorkerLoad
from engine.block_hash import block_hashes
from engine.kv_events import KVEvent, KVEventKind

BS = 16
PREAMBLE = list(range(7, 7 + 2 * BS))    # two blocks every conversation starts with


def _req(rid: str, tokens: list[int]) -> RoutingRequest:
    return RoutingRequest(rid, len(tokens), tuple(block_hashes(tokens, BS)), BS)


def _conv(i: int, n: int) -> list[int]:
    return PREAMBLE + [10_000 + 1_000 * i + t for t in range(n)]


def _router(min_hit_share: float, native: bool = True) -> Router:
    pc = PolicyConfig(local_prefill_threshold=0, local_prefill_hit_ratio=1.0,
                      weights=CostWeights(min_hit_share=min_hit_share))
    r = Router(RouterConfig(policy_config=pc), rng=random.Random(0), clock=lambda: 100.0,
               native_decisions=native)
    for wid in ("p0", "p1", "p2", "p3"):
        r.add_worker(wid, "prefill")
    r.add_worker("d0", "decode")
    return r


def _placements(min_hit_share: float, native: bool = True) -> tuple[list[str], str]:
    """Four new conversations of 480 tokens, one after the other on an idle pool (each prefill
    ends, its node reports the blocks and an empty queue), then conversation 0's second turn."""
    r = _router(min_hit_share, native)
    homes = []
    for i in range(4):
        req = _req(f"c{i}", _conv(i, 448))
        home = r.route(req).prefill_worker_id
        homes.append(home)
        r.on_prefill_end(req.request_id, computed=True)
        r.on_events(home, [KVEvent(i + 1, KVEventKind.STORED, req.block_hashes)])
        r.update_load(home, WorkerLoad())
    follow = r.route(_req("c0-2", _conv(0, 448) + [5] * 64)).prefill_worker_id
    return homes, follow


@pytest.mark.parametrize("native", [True, False])
def test_off_a_shared_preamble_pulls_new_conversations_to_the_nodes_holding_it(native):
    homes, follow = _placements(0.0, native)
    assert len(set(homes[1:])) == 1 and homes[1] == homes[0], homes   # the preamble's home takes them all
    assert follow == homes[0]


@pytest.mark.parametrize("native", [True, False])
def test_min_hit_shares_spread_new_conversations_and_later_turns_still_go_home(native):
    homes, follow = _placements(0.2, native)
    assert sorted(homes) == ["p0", "p1", "p2", "p3"], homes   # 32 of 480 tokens hit: under 20%, none
    assert follow == homes[0]                                 # 480 of 544 hit


def test_min_hit_shares_are_decided_in_c_and_bad_values_are_a_clear_error():
    assert _router(0.2)._fast is not None and _router(0.0)._fast is not None
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="min_hit_share"):
            CostWeights(min_hit_share=bad)
