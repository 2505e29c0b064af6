"""Prefix-aware routing: which prefill and decode node serve a request.

- index.py   `PrefixIndex`: block hash -> workers holding it, fed by KV events
- inflight.py `InFlightPrefixes`: prefixes sent to a node, not yet reported by it
- sends.py   `OpenSends`: routed requests whose prefill has not ended, kept in flight until it does
- cost.py    pure cost functions and softmax-with-temperature selection
- policy.py  `RoutingPolicy` + `prefix_aware` / `round_robin` / `least_loaded`
- cost_vector.py `RoleCosts`: one role's load-only costs as an array (prefix_aware costs all workers at once)
- router.py  `Router`: index + load view + policy, the object the backend holds
- native.py  builds csrc/*.c on first use: the C tables behind the index's match and the in-flight map,
             and the C decider (native_router.py: a whole prefix_aware decision in one call)
- load.py    a worker's load report and the router's optimistic additions to it
"""
from cluster.router.cost import CostWeights
from cluster.router.inflight import InFlightMatch, InFlightPrefixes
from cluster.router.index import ApplyResult, MatchInfo, PrefixIndex
from cluster.router.policy import (POLICIES, ClusterView, CostInputs, DecisionKind, NoWorkerAvailable,
                                   PolicyConfig, RoutingDecision, RoutingPolicy, RoutingRequest,
                                   WorkerLoad, WorkerView, make_policy)
from cluster.router.load import LoadReport, load_from_stats
from cluster.router.router import Router, RouterConfig

__all__ = [
    "ApplyResult", "ClusterView", "CostInputs", "CostWeights", "DecisionKind", "InFlightMatch",
    "InFlightPrefixes", "LoadReport", "MatchInfo",
    "NoWorkerAvailable", "POLICIES", "PolicyConfig", "PrefixIndex", "Router", "RouterConfig",
    "RoutingDecision", "RoutingPolicy", "RoutingRequest", "WorkerLoad", "WorkerView",
    "load_from_stats", "make_policy",
]
