"""`router_config`: the serve configuration's routing keys as a `RouterConfig`.

The router depends on nothing above it, so the mapping from `ServeConfig`
lives here, on the side that builds the router.
"""
from __future__ import annotations

from cluster.config import ServeConfig
from cluster.router import CostWeights, PolicyConfig, RouterConfig


def policy_config(cfg: ServeConfig, weights: CostWeights | None = None) -> PolicyConfig:
    return PolicyConfig(temperature=cfg.router_temperature,
                        local_prefill_threshold=cfg.local_prefill_threshold,
                        local_prefill_hit_ratio=cfg.local_prefill_hit_ratio,
                        colocated=cfg.colocated,
                        weights=weights or CostWeights(min_hit_share=cfg.router_min_hit_share))


def router_config(cfg: ServeConfig) -> RouterConfig:
    # a prefix stays in flight until its prefill ends (handoff.py reports it); the bound for one whose
    # end is lost: no request, so no prefill, outlives request_timeout (0: no deadline, the default)
    ttl = {"in_flight_max_s": cfg.request_timeout} if cfg.request_timeout > 0 else {}
    return RouterConfig(policy=cfg.router_policy, policy_config=policy_config(cfg),
                        track_in_flight=cfg.router_track_in_flight, **ttl)
