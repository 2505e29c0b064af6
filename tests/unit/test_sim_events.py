"""Virtual clock and event loop of the fleet simulator."""
import pytest

from cluster.tools.sim.clock import VirtualClock
from cluster.tools.sim.events import EventLoop


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append(("b", loop.now)))
    loop.at(1.0, lambda: seen.append(("a", loop.now)))
    loop.at(2.0, lambda: seen.append(("c", loop.now)))
    assert loop.run() == 3
    assert seen == [("a", 1.0), ("b", 2.0), ("c", 2.0)]
    assert loop.clock() == 2.0


def test_events_scheduled_from_events_and_until_stops_the_clock():
    loop, seen = EventLoop(), []

    def tick(i):
        seen.append(i)
        loop.after(1.0, tick, i + 1)

    loop.at(0.0, tick, 0)
    loop.run(until=3.5)
    assert seen == [0, 1, 2, 3]
    assert loop.now == 3.5
    assert len(loop) == 1          # the tick at 4.0 is still pending


def test_cannot_go_back_in_time():
    clock = VirtualClock(5.0)
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance_to(4.0)
    loop = EventLoop(clock)
    with pytest.raises(ValueError, match="already"):
        loop.at(1.0, lambda: None)
    with pytest.raises(ValueError, match="delay"):
        loop.after(-1.0, lambda: None)


def test_clock_is_what_the_scheduler_and_router_read():
    import random

    from cluster.router import Router, RouterConfig
    from engine.config import CacheConfig, SchedulerConfig
    from engine.scheduler import Scheduler

    loop = EventLoop()
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=16, num_blocks=8), 8, 128, clock=loop.clock)
    Router(RouterConfig(), rng=random.Random(0), clock=loop.clock)
    loop.at(42.0, lambda: None)
    loop.run()
    assert sched._clock() == 42.0
