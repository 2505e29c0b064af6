"""Tensor-parallel workers on Ray: N actors, one rank each, in one placement group.

A worker of TP size N is one STRICT_PACK placement group of N bundles (one node: the ranks'
all-reduces stay inside it), each bundle one rank's `cpus_per_worker` CPUs, `gpus_per_worker`
GPUs (1 on CUDA: Ray shows each rank its own device) and the pool's custom resource. Bundle
0 hosts the ordinary prefill / decode worker actor (rank 0: scheduler, KV leases, streaming);
bundles 1..N-1 host TPRankActors (worker_api/rank_actor.py), whose handles rank 0 gets in its
constructor. Removing the group (scale-in, shutdown) ends every actor in it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from cluster.config import ServeConfig
from engine.config import EngineConfig
from kvtransfer.settings import TransferSettings

log = logging.getLogger("pdserve.launcher")
_FLAGS = {"prefill": "--prefill-tensor-parallel-size", "decode": "--decode-tensor-parallel-size",
          "colocated": "--decode-tensor-parallel-size"}


def check_tp_sizes(cfg: ServeConfig) -> None:
    """Refuse at start-up a TP size the model does not split into (engine/parallel/sharding.py's
    rule), naming the flag and the sizes that work."""
    from engine.loader.load import load_model_config
    from engine.parallel.sharding import check_tp_size

    pools = ("colocated",) if cfg.colocated else ("prefill", "decode")
    if all(cfg.pool_tp_size(p) == 1 for p in pools):
        return
    model = load_model_config(cfg.model or None)
    for pool in pools:
        try:
            check_tp_size(model, cfg.pool_tp_size(pool))
        except ValueError as e:
            raise ValueError(f"{_FLAGS[pool]} (or --tensor-parallel-size) {cfg.pool_tp_size(pool)}: {e}") from None


@dataclass
class TPPlacement:
    """One TP worker's placement group and its rank actors 1..N-1."""
    group: Any                    # ray.util.placement_group.PlacementGroup
    ranks: list[Any]              # TPRankActor handles, rank order

    def rank0_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """`options` of the worker actor, scheduled into bundle 0."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {**options, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=0)}

    def remove(self) -> None:
        """End the group and every actor in it; never raises."""
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        except Exception as e:
            log.warning("removing a tensor-parallel placement group: %s", e)


def place_tp_worker(cfg: ServeConfig, name: str, worker_id: str, resource: str, tp: int,
                    engine: EngineConfig, transfer: TransferSettings, options: dict[str, Any]) -> TPPlacement:
    """Reserve `tp` bundles on one node and start ranks 1..tp-1 in them (they load their shards
    in the background; rank 0, started by the caller in bundle 0, waits for them)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from worker_api.rank_actor import TPRankActor

    bundle: dict[str, float] = {"CPU": cfg.cpus_per_worker}
    if cfg.gpus_per_worker:
        bundle["GPU"] = cfg.gpus_per_worker
    if resource:
        bundle[resource] = 1
    group = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK", name=f"{name}-tp")
    ranks = []
    for rank in range(1, tp):
        opts = {**options, "name": f"{name}-rank{rank}", "max_concurrency": 4,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)}
        ranks.append(ray.remote(TPRankActor).options(**opts).remote(
            worker_id, rank, tp, engine, transfer, cfg.torch_threads))
    return TPPlacement(group, ranks)
