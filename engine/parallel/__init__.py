"""Tensor parallelism inside one worker: sharding rules (sharding.py), the rank's shard of the
model (sharded_model.py), the group's collectives (group.py), what a rank runs (rank.py), rank
processes on this host (local_ranks.py) and rank 0's runner (executor.py)."""
from engine.parallel.sharding import ShardLayout, check_tp_size, valid_tp_sizes

__all__ = ["ShardLayout", "check_tp_size", "valid_tp_sizes"]
