"""KV transfer benchmark: local memcpy vs every installed backend, one JSON line.

Cases: the KV of a 512- and a 4096-token SmolLM2-135M prompt (30 layers x 2 x
3 KV heads x 16 tokens x 64 dims x fp32 = 737280 bytes per block) read through
a realistic fragmented block table, and 256 MiB in 1 MiB blocks (shuffled:
one descriptor per block). Two processes: a source child per backend, the
reader here. Next to each backend's figure, measured right after it on the
same bytes: torch memcpy (``memcpy_gbps``, uses every intra-op thread), a
single-threaded memmove (``memcpy_1thread_gbps``) and one raw
``process_vm_readv`` syscall over the same descriptors from the source
process (``vm_readv_gbps``: the kernel copy UCX's cma transport performs, i.e.
the ceiling for a one-thread cross-process read on this host).

    .venv/bin/python benchmarks/kv_transfer.py [--iters 5] [--backends nixl,tcp] [--thp]
    .venv/bin/python benchmarks/kv_transfer.py --kv-cache-dtypes float32,bfloat16,int8,fp8_e4m3

``--kv-cache-dtypes``: the prompt cases again at each KV storage dtype's block
size (``engine.kv_pool.bytes_per_block``: int8 / fp8_e4m3 blocks carry their
scales, 190080 bytes), under ``by_kv_cache_dtype``.

``--thp`` allocates every pool (both processes) and memcpy buffer on
transparent huge pages (torch's ``THP_MEM_ALLOC_ENABLE=1``): the kernel's
cross-process copy then pins 2 MiB pages instead of 4 KiB ones.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import random
import statistics
import time


KV_BLOCK = 30 * 2 * 3 * 16 * 64 * 4          # 737280
MIB = 1 << 20
POOLS = {"kv": (320, KV_BLOCK), "bulk": (272, MIB)}
CASES = {"prompt_512": ("kv", 512 // 16), "prompt_4096": ("kv", 4096 // 16), "bulk_256MiB": ("bulk", 256)}


def kv_block_bytes(kv_cache_dtype: str) -> int:
    """One SmolLM2 block (16 tokens) as the engine's pool stores it at ``kv_cache_dtype``."""
    import torch
    from engine.config import ModelConfig
    from engine.kv_pool import bytes_per_block
    smol = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    if kv_cache_dtype in ("float32", "bfloat16"):
        return bytes_per_block(smol, 16, getattr(torch, kv_cache_dtype))
    return bytes_per_block(smol, 16, torch.float32, kv_cache_dtype)


def pools(kv_block: int = KV_BLOCK) -> dict:
    return {**POOLS, "kv": (POOLS["kv"][0], kv_block)}


def fragmented_table(rng: random.Random, num_blocks: int, count: int) -> list[int]:
    """Free-list after churn: runs of 1-8 consecutive blocks in random places."""
    runs, start = [], 0
    while start < num_blocks:
        length = rng.randint(1, 8)
        runs.append(list(range(start, min(start + length, num_blocks))))
        start += length
    rng.shuffle(runs)
    return [b for run in runs for b in run][:count]


def tables(case: str, seed: int = 0) -> tuple[list[int], list[int]]:
    pool, count = CASES[case]
    rng = random.Random(seed)
    n = POOLS[pool][0]     # block counts do not depend on the block size
    if pool == "bulk":
        return rng.sample(range(n), count), rng.sample(range(n), count)
    return fragmented_table(rng, n, count), fragmented_table(rng, n, count)


def engine_config(variant: str):
    if variant == "nixl_pthread_on":
        from kvtransfer.nixl_backend import NixlConfig
        return "nixl", NixlConfig(progress_thread=True, progress_delay_us=100)
    return variant, None


def make_pools(backend: str, variant: str, role: str, kv_block: int = KV_BLOCK):
    import torch
    from kvtransfer.layout import KVPoolLayout
    from kvtransfer.registry import create_engine
    backend, config = engine_config(variant)
    out = {}
    for pool, (n, bpb) in pools(kv_block).items():
        tensor = torch.randint(0, 256, (n, bpb), dtype=torch.uint8) if role == "src" else torch.zeros(n, bpb, dtype=torch.uint8)
        eng = create_engine(backend, f"{role}-{variant}-{pool}-{os.getpid()}", config)
        eng.register_pool(KVPoolLayout.from_tensor(tensor))
        out[pool] = (eng, tensor)
    return out


def source_main(variant: str, conn, kv_block: int = KV_BLOCK) -> None:
    src = make_pools(variant, variant, "src", kv_block)
    conn.send(({p: (e.peer_info(), t[:, :64].clone()) for p, (e, t) in src.items()}, os.getpid()))
    while not conn.poll(0.005):
        for eng, _ in src.values():
            eng.get_notifications()   # what a prefill worker's loop does
    for eng, _ in src.values():
        eng.close()


def memcpy_case(case: str, iters: int, kv_block: int = KV_BLOCK) -> dict:
    import torch
    pool, count = CASES[case]
    nbytes = count * pools(kv_block)[pool][1]
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times[1:])
    return {"gbps": round(nbytes / t / 1e9, 2), "latency_ms": round(t * 1e3, 3), "bytes": nbytes}


def memmove_1thread_gbps(nbytes: int, iters: int) -> float:
    import torch
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        times.append(time.perf_counter() - t0)
    return round(nbytes / statistics.median(times[1:]) / 1e9, 2)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def vm_readv_gbps(pid: int, descs, iters: int) -> float:
    """One process_vm_readv over ``descs`` (Linux; what UCX cma does per segment)."""
    libc = ctypes.CDLL(None, use_errno=True)
    nbytes, times = sum(d.nbytes for d in descs), []
    for start in range(iters + 1):
        t0 = time.perf_counter()
        for i in range(0, len(descs), 1024):   # IOV_MAX
            part = descs[i:i + 1024]
            local = (_Iovec * len(part))(*[_Iovec(d.dst_addr, d.nbytes) for d in part])
            remote = (_Iovec * len(part))(*[_Iovec(d.src_addr, d.nbytes) for d in part])
            if libc.process_vm_readv(pid, local, len(part), remote, len(part), 0) != sum(d.nbytes for d in part):
                return float("nan")   # no ptrace permission: not comparable
        times.append(time.perf_counter() - t0)
    return round(nbytes / statistics.median(times[1:]) / 1e9, 2)


def bench_memcpy(iters: int) -> dict:
    return {case: memcpy_case(case, iters) for case in CASES}


def bench_backend(variant: str, iters: int, kv_block: int = KV_BLOCK, cases=tuple(CASES)) -> dict:
    import torch
    from kvtransfer.descriptors import build_descriptors
    from kvtransfer.engine import TransferStatus
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=source_main, args=(variant, child, kv_block), daemon=True)
    proc.start()
    readers = make_pools(variant, variant, "dst", kv_block)
    peers, source_pid = conn.recv()
    out = {}
    try:
        for case in cases:
            pool = CASES[case][0]
            eng, tensor = readers[pool]
            info, heads = peers[pool]
            src_ids, dst_ids = tables(case)
            times, handle = [], None
            for i in range(iters + 1):
                tensor.zero_()
                t0 = time.perf_counter()
                handle = eng.read(info, src_ids, dst_ids, notify=f"{case}-{i}".encode())
                status = handle.wait(timeout=60)
                times.append(time.perf_counter() - t0)
                if status is not TransferStatus.DONE:
                    raise RuntimeError(f"{variant}/{case}: {status} {handle.error}")
            assert all(torch.equal(tensor[d, :64], heads[s]) for s, d in zip(src_ids, dst_ids))
            t = statistics.median(times[1:])
            gbps = handle.nbytes / t / 1e9
            # the host is shared: compare with a memcpy measured right now, not at start-up
            local = memcpy_case(case, iters, kv_block)["gbps"]
            one_thread = memmove_1thread_gbps(handle.nbytes, iters)
            kernel = vm_readv_gbps(source_pid, build_descriptors(info.layout, eng.layout, src_ids, dst_ids), iters)
            out[case] = {"bytes": handle.nbytes, "gbps": round(gbps, 2), "ratio_to_memcpy": round(gbps / local, 3),
                         "memcpy_gbps": local, "memcpy_1thread_gbps": one_thread, "vm_readv_gbps": kernel,
                         "ratio_to_vm_readv": round(gbps / kernel, 3),
                         "latency_ms": round(t * 1e3, 3), "best_gbps": round(handle.nbytes / min(times[1:]) / 1e9, 2),
                         "descriptors": handle.descriptors,
                         "bytes_per_descriptor": handle.nbytes // max(handle.descriptors, 1)}
    finally:
        conn.send("stop")
        proc.join(10)
        for eng, _ in readers.values():
            eng.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--backends", default="", help="comma list; default every installed one "
                        "(+ nixl_pthread_on: NIXL's progress thread with a 100 us delay)")
    parser.add_argument("--thp", action="store_true", help="allocate pools on transparent huge pages "
                        "(THP_MEM_ALLOC_ENABLE=1, inherited by the source processes)")
    parser.add_argument("--kv-cache-dtypes", default="",
                        help="comma list of float32, bfloat16, int8, fp8_e4m3: the prompt cases at each one's "
                             "block size (only these, with the given backends)")
    args = parser.parse_args()
    if args.thp:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"   # read by torch's CPU allocator at first use
    from kvtransfer.registry import available_backends
    variants = args.backends.split(",") if args.backends else available_backends()
    if not args.backends and "nixl" in variants:
        variants.insert(1, "nixl_pthread_on")
    if args.kv_cache_dtypes:
        result: dict = {"by_kv_cache_dtype": {}}
        for kv in args.kv_cache_dtypes.split(","):
            block = kv_block_bytes(kv)
            result["by_kv_cache_dtype"][kv] = {"block_bytes": block, **{
                v: bench_backend(v, args.iters, block, ("prompt_512", "prompt_4096")) for v in variants}}
    else:
        result = {"memcpy": bench_memcpy(args.iters)}
        for variant in variants:
            result[variant] = bench_backend(variant, args.iters)
    result["env"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    result["cpus"] = os.cpu_count()
    result["thp"] = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
