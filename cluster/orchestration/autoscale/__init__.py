"""SLO-driven autoscaling of the prefill and decode pools (issue 24).

- signals.py     `PrefillSignals` / `DecodeSignals` / `FleetSignals` (what the controller
                 reads each interval), `AutoscaleConfig` / `PoolBounds` (what the operator sets)
- controller.py  `decide(config, signals, state, now) -> (FleetDecision, ControllerState)`:
                 the pure decision with its `Reason`; which signals decide each pool and why

Pure: imports nothing from Ray, the frontends or the tools. The simulator
(cluster/tools/sim/autoscale.py) runs this same module on its virtual clock.
"""
from cluster.orchestration.autoscale.controller import (ControllerState, FleetDecision, PoolDecision, PoolState,
                                                        Reason, decide)
from cluster.orchestration.autoscale.signals import (AutoscaleConfig, DecodeSignals, FleetSignals, PoolBounds,
                                                     PrefillSignals)

__all__ = ["AutoscaleConfig", "ControllerState", "DecodeSignals", "FleetDecision", "FleetSignals", "PoolBounds",
           "PoolDecision", "PoolState", "PrefillSignals", "Reason", "decide"]
