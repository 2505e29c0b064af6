"""SLO-driven autoscaling of the prefill and decode pools (issue 24).

- signals.py     `PrefillSignals` / `DecodeSignals` / `FleetSignals` (what the controller
                 reads each interval), `AutoscaleConfig` / `PoolBounds` (what the operator sets)
- controller.py  `decide(config, signals, state, now) -> (FleetDecision, ControllerState)`:
                 the pure decision with its `Reason`; which signals decide each pool and why
- trade.py       `workers_to_trade` (at the fleet cap, how many workers decode gives prefill: the
                 TTFT misses one more prefill worker saves against the KV room one fewer decode
                 worker costs)
- wait_miss.py   `wait_miss` (did a request miss TTFT by waiting: the one definition of
                 `PrefillSignals.ttft_wait_miss_fraction`, live head and simulator) and its window

Pure: imports nothing from Ray, the frontends or the tools. The simulator
(cluster/tools/sim/autoscale.py) runs this same module on its virtual clock.
"""
from cluster.orchestration.autoscale.controller import (ControllerState, FleetDecision, PoolDecision, PoolState,
                                                        Reason, decide)
from cluster.orchestration.autoscale.signals import (AutoscaleConfig, DecodeSignals, FleetSignals, PoolBounds,
                                                     PrefillSignals)
from cluster.orchestration.autoscale.wait_miss import WaitMisses, prefill_alone_at_rate, wait_miss

__all__ = ["AutoscaleConfig", "ControllerState", "DecodeSignals", "FleetDecision", "FleetSignals", "PoolBounds",
           "PoolDecision", "PoolState", "PrefillSignals", "Reason", "WaitMisses", "decide", "prefill_alone_at_rate",
           "wait_miss"]
