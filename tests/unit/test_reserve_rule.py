"""cluster/router/reserve.py: a hand-off's decode blocks are reserved at routing only when the
chosen prefill node has fewer than one step's tokens queued ahead of the prompt, counting its
report and what this router sent it since; decided from the router's real decision, by the
Python policy and by the C decider alike."""
from __future__ import annotations

import random

import pytest

from cluster.router import (DecisionKind, PolicyConfig, Router, RouterConfig, RoutingDecision, RoutingRequest,
                            WorkerLoad, native)
from cluster.router.reserve import reserve_at_routing

BS, STEP = 16, 512
DECIDERS = [False] + ([True] if native.module() is not None else [])


class Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


def _router(clock: Clock, native_decisions: bool, prefill: tuple[str, ...] = ("p0",)) -> Router:
    r = Router(RouterConfig(pending_ttl_s=1.0), rng=random.Random(0), clock=clock, native_decisions=native_decisions)
    for w in prefill:
        r.add_worker(w, "prefill")
        r.update_load(w, WorkerLoad())
    r.add_worker("d0", "decode")
    r.update_load("d0", WorkerLoad())
    assert (r._fast is not None) == native_decisions          # the C decider decides when asked
    return r


def _route(r: Router, i: int, tokens: int = 256) -> RoutingDecision:
    """A unique prompt of ``tokens`` tokens (nothing cached: prefilled remotely)."""
    n = tokens // BS
    return r.route(RoutingRequest(f"r{i}", tokens, tuple(range(1000 * i, 1000 * i + n)), BS))


@pytest.mark.parametrize("native_decisions", DECIDERS)
def test_a_prompt_at_an_idle_prefill_node_is_reserved_and_one_behind_a_backlog_is_not(native_decisions):
    clock = Clock()
    r = _router(clock, native_decisions)
    first, second, third = (_route(r, i) for i in range(3))
    assert all(d.kind is DecisionKind.REMOTE_PREFILL for d in (first, second, third))
    # 0 and 256 tokens sent ahead (not yet reported): within the 512-token step; 512: not
    assert [reserve_at_routing(d, STEP) for d in (first, second, third)] == [True, True, False]
    # the node reports a backlog (the sends lapsed): nothing reserved until it drains
    clock.t += 2.0
    r.update_load("p0", WorkerLoad(queued_prefill_tokens=4096))
    assert not reserve_at_routing(_route(r, 3), STEP)
    clock.t += 2.0
    r.update_load("p0", WorkerLoad(queued_prefill_tokens=STEP - 1))
    assert reserve_at_routing(_route(r, 4), STEP)


@pytest.mark.parametrize("native_decisions", DECIDERS)
def test_the_prompt_routed_past_a_backlogged_node_is_reserved(native_decisions):
    r = _router(Clock(), native_decisions, prefill=("p0", "p1"))
    r.update_load("p0", WorkerLoad(queued_prefill_tokens=8192))
    d = _route(r, 0)
    assert d.prefill_worker_id == "p1" and reserve_at_routing(d, STEP)


@pytest.mark.parametrize("native_decisions", DECIDERS)
def test_a_local_prefill_reserves_nothing(native_decisions):
    r = _router(Clock(), native_decisions)
    d = _route(r, 0, tokens=32)                  # under local_prefill_threshold: the decode node prefills
    assert d.kind is DecisionKind.LOCAL_PREFILL and not reserve_at_routing(d, STEP)


def test_the_step_budget_must_be_positive():
    d = _route(_router(Clock(), False), 0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        reserve_at_routing(d, 0)
