"""Tier settings from ServeConfig to the engine, and tier figures to Prometheus."""
import pytest

from cluster.config import ServeConfig
from cluster.orchestration.launcher import engine_config
from cluster.observability.metrics import Metrics, TierStats, WorkerStats
from engine.llm_engine import EngineStats


def test_serve_config_tier_keys_reach_the_cache_config(tmp_path):
    cfg = ServeConfig.from_sources(env={"PDSERVE_HOST_KV_MEMORY": "64MiB", "PDSERVE_DISK_KV_DIR": str(tmp_path),
                                        "PDSERVE_DISK_KV_BYTES": "1GiB", "PDSERVE_PREEMPTION_MODE": "swap"})
    cache = engine_config(cfg).cache
    assert (cache.host_kv_memory_bytes, cache.disk_kv_dir, cache.disk_kv_bytes, cache.preemption_mode) == \
        (64 << 20, str(tmp_path), 1 << 30, "swap")
    off = engine_config(ServeConfig()).cache
    assert (off.host_kv_memory_bytes, off.disk_kv_bytes) == (0, 0)


def test_serve_config_rejects_bad_tier_settings():
    with pytest.raises(ValueError, match="auto, swap, recompute"):
        ServeConfig(preemption_mode="maybe")
    with pytest.raises(ValueError, match="disk_kv_dir is empty"):
        ServeConfig(disk_kv_bytes="1GiB")
    with pytest.raises(ValueError, match="cannot read size"):
        ServeConfig(host_kv_memory="lots")


def test_tier_figures_are_exported_per_worker_and_forgotten():
    engine = EngineStats(running=0, waiting=0, waiting_tokens=0, remote_waiting=0, held=0, kv_blocks_used=3,
                         kv_blocks_total=10, prefix_queried_tokens=0, prefix_hit_tokens=0, preemptions=5,
                         kv_host_blocks_used=7, kv_host_blocks_total=40, kv_disk_blocks_used=2,
                         kv_disk_blocks_total=80, kv_page_ins=11, kv_page_outs=13, kv_bytes_moved=4096,
                         swap_preemptions=4, recompute_preemptions=1)
    m = Metrics()
    m.observe_worker(WorkerStats("d0", "decode", 0, 0, 3, 10, 0, 0, preemptions=5,
                                 tiers=TierStats.from_engine(engine)))

    def value(name, **labels):
        return m.registry.get_sample_value(name, dict(worker="d0", pool="decode", **labels))

    assert [value("pdserve_kv_tier_blocks_used", tier=t) for t in ("device", "host", "disk")] == [3, 7, 2]
    assert [value("pdserve_kv_tier_blocks_capacity", tier=t) for t in ("device", "host", "disk")] == [10, 40, 80]
    assert (value("pdserve_kv_page_ins_total"), value("pdserve_kv_page_outs_total"), value("pdserve_kv_tier_bytes_moved_total")) \
        == (11, 13, 4096)
    assert (value("pdserve_preemptions_by_mode_total", mode="swap"),
            value("pdserve_preemptions_by_mode_total", mode="recompute")) == (4, 1)
    m.forget_worker("d0", "decode")
    assert value("pdserve_kv_tier_blocks_used", tier="host") is None and value("pdserve_kv_page_ins_total") is None
