"""Start (or join) a Ray cluster and the prefill / decode actor pools."""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from cluster.config import ServeConfig, parse_size
from cluster.orchestration.tp_placement import TPPlacement, check_tp_sizes, place_tp_worker
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvtransfer.settings import TransferSettings
from worker_api.messages import ReadyInfo
from worker_api.protocol import DecodeWorkerHandle, PrefillWorkerHandle

log = logging.getLogger("pdserve.launcher")


@dataclass
class WorkerRef:
    worker_id: str
    pool: str            # "prefill" | "decode" | "colocated"
    # a Ray actor handle: a PrefillWorker's for the "prefill" pool, else a DecodeWorker's
    actor: PrefillWorkerHandle | DecodeWorkerHandle
    alive: bool = True
    placement: TPPlacement | None = None   # a tensor-parallel worker's placement group and ranks 1..N-1

    def kill(self, no_restart: bool = True) -> None:
        """Stop the worker (and its ranks); never raises."""
        import ray

        try:
            ray.kill(self.actor, no_restart=no_restart)
        except Exception:
            pass
        if self.placement is not None and no_restart:
            self.placement.remove()


def engine_config(cfg: ServeConfig, pool: str = "decode") -> EngineConfig:
    """One `pool`'s engine (its tensor-parallel size; --no-ray's one engine is a decode pool's)."""
    return EngineConfig(
        model=cfg.model, device=cfg.device, dtype=cfg.dtype, tensor_parallel_size=cfg.pool_tp_size(pool),
        cache=CacheConfig(block_size=cfg.block_size, num_blocks=cfg.num_kv_blocks or None,
                          kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
                          host_kv_memory_bytes=parse_size(cfg.host_kv_memory), disk_kv_dir=cfg.disk_kv_dir,
                          disk_kv_bytes=parse_size(cfg.disk_kv_bytes), preemption_mode=cfg.preemption_mode,
                          kv_cache_dtype=cfg.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=cfg.max_num_batched_tokens,
                                  max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                                  max_waiting=cfg.max_worker_queue, queue_order=cfg.queue_order,
                                  queue_max_pass_s=cfg.queue_max_pass_s,
                                  final_chunk_unpadded=cfg.final_chunk_unpadded),
        step_trace_size=cfg.step_trace_size, prompt_layer_groups=_layer_groups(cfg, pool))


def _layer_groups(cfg: ServeConfig, pool: str) -> int:
    """A prefill engine reports its last chunk's layer groups when a pipelined hand-off reads them."""
    return cfg.handoff_layer_groups if pool == "prefill" and cfg.pipelined_handoff and cfg.reserve_decode_blocks else 1


def transfer_settings(cfg: ServeConfig) -> TransferSettings:
    """Where each worker binds (and advertises) its KV side channel. Joining a cluster
    (`--address`), or asked for every interface (a wildcard `host`): no host, so each worker
    binds its own node's address (Ray's node IP where it runs), which is what peers on other
    machines reach; `--host` is the head's address there, which a worker on another machine
    could not bind. A local cluster started here with a concrete `host` (127.0.0.1 by
    default): that address, since every worker runs on this machine."""
    local = not cfg.address and cfg.host not in ("0.0.0.0", "::", "")
    return TransferSettings(backend=_backend(cfg), host=cfg.host if local else "",
                            lease_ttl=cfg.lease_ttl, timeout=cfg.transfer_timeout, secret=cluster_secret(cfg))


def _backend(cfg: ServeConfig) -> str:
    """The configured backend; "auto" with tensor parallelism skips ucxx, which cannot read head ranges."""
    tp = max(cfg.pool_tp_size("prefill"), cfg.pool_tp_size("decode"))
    if cfg.transfer_backend != "auto" or tp == 1:
        return cfg.transfer_backend
    from kvtransfer.registry import available_backends
    return next(b for b in available_backends() if b != "ucxx")


def cluster_secret(cfg: ServeConfig) -> str:
    """The secret every worker of this deployment proves membership with on the KV side
    channels: the file's contents (e.g. a mounted Kubernetes Secret: every node's workers then
    share it across restarts of the head), or a random one that only this launch's workers get
    (through Ray, in their constructor arguments)."""
    if not cfg.cluster_secret_file:
        return os.urandom(32).hex()
    try:
        secret = Path(cfg.cluster_secret_file).read_text().strip()
    except OSError as e:
        raise ValueError(f"cluster_secret_file {cfg.cluster_secret_file!r} cannot be read ({e.strerror}): "
                         "point it at a file holding the cluster's secret") from None
    if len(secret) < 16:
        raise ValueError(f"cluster_secret_file {cfg.cluster_secret_file!r} holds {len(secret)} characters: "
                         "use at least 16 (e.g. `openssl rand -hex 32`)")
    return secret


def init_ray(cfg: ServeConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True,
                                  runtime_env={"env_vars": {"PYTHONPATH": _pythonpath()}})
    if cfg.address:
        ray.init(address=cfg.address, **kwargs)
        return
    # room for the largest pools autoscaling may grow to
    workers = cfg.pool_bounds("decode")[1] * cfg.pool_tp_size("decode") + \
        (0 if cfg.colocated else cfg.pool_bounds("prefill")[1] * cfg.pool_tp_size("prefill"))   # ranks
    resources = {r: 1000 for r in (cfg.prefill_resource, cfg.decode_resource) if r}
    if cfg.worker_niceness != 15:   # Ray nices worker processes (the engine actors) to 15; docs/deploy.md
        kwargs["_system_config"] = {"worker_niceness": cfg.worker_niceness}
    ray.init(num_cpus=max(os.cpu_count() or 1, int(workers * cfg.cpus_per_worker + 0.999)),
             resources=resources, _node_ip_address="127.0.0.1",
             **({"_temp_dir": cfg.ray_temp_dir} if cfg.ray_temp_dir else {}), **kwargs)


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parents[2])   # the repository: cluster/orchestration/launcher.py
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


def _options(cfg: ServeConfig, name: str, resource: str) -> dict[str, Any]:
    opts: dict[str, Any] = dict(name=name, num_cpus=cfg.cpus_per_worker, max_restarts=-1, max_task_retries=0,
                                max_concurrency=1000,
                                runtime_env={"env_vars": {
                                    "OMP_NUM_THREADS": str(cfg.torch_threads),
                                    # large CPU tensors (the KV pool) on transparent huge pages:
                                    # cross-process KV reads ran 2.5-3x faster (docs/kvtransfer.md)
                                    "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "1")}})
    if cfg.gpus_per_worker:
        opts["num_gpus"] = cfg.gpus_per_worker
    if resource:
        opts["resources"] = {resource: 1}
    return opts


class WorkerLauncher:
    """Creates worker actors for one deployment: the pools at start-up, and one more of a
    pool later (scale-out). Every worker gets the same engine and transfer settings, so
    their KV caches agree (checked as each becomes ready)."""

    def __init__(self, cfg: ServeConfig) -> None:
        check_tp_sizes(cfg)
        init_ray(cfg)
        self.cfg = cfg
        self._engines = {pool: engine_config(cfg, pool) for pool in ("prefill", "decode", "colocated")}
        self._transfer = transfer_settings(cfg)
        self._tag = os.urandom(3).hex()
        self._next: dict[str, int] = {}           # pool -> the next worker number
        self._layout: tuple[str, ReadyInfo] | None = None   # the first ready worker's KV layout

    def create(self, pool: str) -> WorkerRef:
        """Start one actor of `pool` ("prefill", "decode" or "colocated"); it loads its model
        in the background (`wait_ready`)."""
        import ray

        from decode_worker.worker import DecodeWorker
        from prefill_worker.worker import PrefillWorker

        n = self._next.get(pool, 0)
        self._next[pool] = n + 1
        wid = f"{pool}-{n}"
        cfg, name = self.cfg, f"pdserve-{self._tag}-{wid}"
        resource = cfg.prefill_resource if pool == "prefill" else cfg.decode_resource
        opts, tp, engine = _options(cfg, name, resource), cfg.pool_tp_size(pool), self._engines[pool]
        placement = None
        if tp > 1:
            placement = place_tp_worker(cfg, name, wid, resource, tp, engine, self._transfer, opts)
            opts = placement.rank0_options(opts)
        ranks = placement.ranks if placement else []
        if pool == "prefill":
            actor = ray.remote(PrefillWorker).options(**opts) \
                .remote(wid, engine, self._transfer, cfg.torch_threads, ranks)
        else:
            actor = ray.remote(DecodeWorker).options(**opts) \
                .remote(wid, engine, self._transfer, cfg.torch_threads, pool, ranks)
        return WorkerRef(worker_id=wid, pool=pool, actor=actor, placement=placement)

    async def wait_ready(self, refs: list[WorkerRef]) -> None:
        """Wait until each has loaded its model; refuse (and stop them) if their KV caches
        disagree with each other or with the workers already serving."""
        import ray

        infos: list[ReadyInfo] = await gather_reporting(
            {r.worker_id: r.actor.ready.remote() for r in refs}, every_s=READY_REPORT_S,
            describe=lambda: f"free in the Ray cluster: {ray.available_resources()}")
        for r, info in zip(refs, infos):
            log.info("worker %s ready: %s", r.worker_id, asdict(info))   # a dict: tests/testbed_cluster.py reads it
        named = [(r.worker_id, info) for r, info in zip(refs, infos)]
        try:
            check_kv_agreement(([self._layout] if self._layout else []) + named)
        except ValueError:
            for r in refs:
                r.kill()
            raise
        self._layout = self._layout or (named[0] if named else None)


READY_REPORT_S = 30.0    # how often a start-up that waits for its workers says which and why


async def gather_reporting(waits: dict[str, Awaitable[Any]], every_s: float,
                           describe: Callable[[], str]) -> list[Any]:
    """`asyncio.gather` over named awaitables that also logs, every `every_s` seconds, the names
    still pending and `describe()` (for workers: what the cluster has free, so a worker that
    Ray cannot place, e.g. no node offers its pool's resource, is visible rather than a silent
    hang). The first failure is raised at once and the rest are cancelled."""
    futs = {name: asyncio.ensure_future(w) for name, w in waits.items()}
    start = asyncio.get_running_loop().time()
    while True:
        done, pending = await asyncio.wait(futs.values(), timeout=every_s, return_when=asyncio.FIRST_EXCEPTION)
        failed = [f for f in done if not f.cancelled() and f.exception() is not None]
        if failed:
            for f in pending:
                f.cancel()
            raise failed[0].exception()  # type: ignore[misc]
        if not pending:
            return [f.result() for f in futs.values()]
        waiting = sorted(n for n, f in futs.items() if not f.done())
        log.warning("still waiting after %.0f s for %s to start; %s", asyncio.get_running_loop().time() - start,
                    ", ".join(waiting), describe())


async def launch_workers(cfg: ServeConfig) -> tuple[WorkerLauncher, list[WorkerRef]]:
    """Create the start-up pools and wait until each worker has loaded its model."""
    launcher = WorkerLauncher(cfg)
    pools = [("colocated", cfg.decode_workers)] if cfg.colocated else \
        [("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers)]
    refs = [launcher.create(pool) for pool, count in pools for _ in range(count)]
    await launcher.wait_ready(refs)
    return launcher, refs


def check_kv_agreement(infos: list[tuple[str, ReadyInfo]]) -> None:
    """Workers hand KV blocks to each other byte for byte, and the router matches their
    block hashes: every worker must store K/V alike (kv_cache_dtype, block size, bytes
    per block and KV head). Refuses at start-up, naming who disagrees, rather than at the first hand-off."""
    layouts: dict[tuple, list[str]] = {}
    for worker_id, info in infos:
        # per KV head: a tensor-parallel rank's block holds its heads only
        key = (info.kv_cache_dtype, info.block_size, info.kv_bytes_per_head_block or info.kv_bytes_per_block)
        layouts.setdefault(key, []).append(worker_id)
    if len(layouts) > 1:
        described = "; ".join(f"{', '.join(ids)}: kv_cache_dtype={kv}, block_size={bs}, {nbytes} B/block/KV head"
                              for (kv, bs, nbytes), ids in layouts.items())
        raise ValueError(f"the workers' KV caches disagree ({described}): a block moved between them would be "
                         "misread. Start every pool with the same --kv-cache-dtype, --dtype, --block-size "
                         "and model")
