"""One simulated node: decode runs, calls arriving inside them, against one event per step."""
import pytest

from cluster.tools.sim.cost_model import Table2D, TableCostModel, TransferCost
from cluster.tools.sim.events import EventLoop
from cluster.tools.sim.node import SimNode
from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 16


class _Listener:
    def __init__(self) -> None:
        self.tokens: dict[str, list[float]] = {}
        self.finished: dict[str, float] = {}

    def on_tokens(self, node, requests, ends) -> None:
        for r in requests:
            self.tokens.setdefault(r.request_id, []).extend(float(t) for t in ends)

    def on_finished(self, node, request, t) -> None:
        self.finished[request.request_id] = t


def _node(collapse: bool) -> tuple[SimNode, EventLoop, _Listener]:
    cost = TableCostModel("t", Table2D("prefill", [1, 1024], [0, 1024], [[0.002, 0.003], [0.05, 0.06]]),
                          Table2D("decode", [1, 16], [0, 4096], [[0.002, 0.004], [0.004, 0.008]]),
                          0.001, TransferCost(1e-4, 1e-5, 1e9), 1000, 4096)
    loop = EventLoop()
    sched = Scheduler(SchedulerConfig(512, 16), CacheConfig(block_size=BS, num_blocks=64), 64, 2048,
                      clock=loop.clock)
    listener = _Listener()
    return SimNode("d0", "decode", sched, cost, loop, listener, collapse=collapse), loop, listener


def _request(rid: str, n: int, out: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=out, ignore_eos=True))


@pytest.mark.parametrize("queues_a_request", [False, True])
def test_a_keeps_batch_call_inside_a_run_matches_step_by_step(queues_a_request):
    """A call posted with keeps_batch inside a decode run runs at the end of the step
    in flight. If it only touches the KV manager (reserves blocks) the run goes on;
    if it queues a request after all, the run is cut there. Either way every token
    time, the KV manager and the finish times equal one event per step."""
    results = []
    for collapse in (True, False):
        node, loop, listener = _node(collapse)
        a = _request("a", 20, 40)          # after its prefill, a run of 12 decode steps (block fills at 32)
        node.post(lambda n: n.scheduler.add_request(a))
        loop.run(until=0.0125)             # inside that run
        assert node.busy
        seen = {}

        def call(n, seen=seen):
            seen["free"], seen["t"] = n.scheduler.kv.num_free_blocks, n.loop.now
            blocks = n.scheduler.kv.pool.get_new_blocks(2)       # what a hand-off's reservation does
            n.scheduler.kv.pool.free_blocks(blocks)
            if queues_a_request:
                n.scheduler.add_request(_request("b", 8, 5))

        node.post(call, keeps_batch=True)
        loop.run()
        node.scheduler.check_integrity()
        results.append((listener.tokens, listener.finished, seen, node.events, node.deferred))
    (fast_tokens, fast_fin, fast_seen, fast_events, deferred), (slow_tokens, slow_fin, slow_seen, slow_events, _) = results
    assert deferred == 1 and fast_events < slow_events
    assert fast_seen == pytest.approx(slow_seen)
    assert fast_tokens.keys() == slow_tokens.keys() == ({"a", "b"} if queues_a_request else {"a"})
    for rid in fast_tokens:
        assert fast_tokens[rid] == pytest.approx(slow_tokens[rid])
    assert fast_fin == pytest.approx(slow_fin)
