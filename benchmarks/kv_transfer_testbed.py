"""KV over a network link: the KV of a 4096-token SmolLM2-135M prompt (256 blocks
of 737,280 bytes, fp32, through a fragmented block table) read from one test
host by another (cluster/tools/testbed: separate network, PID, IPC and mount
namespaces, so no shared-memory path exists), with the link capped by tc at
each `--gbit` rate, per backend. One JSON line: GB/s and the ratio to the cap.
`--gbit 0` leaves the link uncapped: what the two hosts' network stacks carry on this
machine's cores. The pseudo-backend `socket` (in `--backends`, or added by `--ceiling`)
streams the same bytes over one plain TCP socket (sendall / recv_into, no descriptors,
no transfer engine): the ceiling any TCP-based backend can reach on the same cores.

    sudo .venv/bin/python benchmarks/kv_transfer_testbed.py [--gbit 1,5,10] [--backends tcp,nixl] [--iters 3] [--ceiling]

Needs root (namespaces, tc); prints {"skipped": ...} elsewhere.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kv_transfer import KV_BLOCK, fragmented_table

ROOT = Path(__file__).resolve().parents[1]

NUM_BLOCKS, COUNT = 320, 4096 // 16
SECRET = "kv-transfer-testbed-benchmark-secret"


def socket_source(host: str, out: Path) -> None:
    """Serve the pool's bytes to each connection of the reader, over one plain TCP socket."""
    import socket
    data = memoryview(bytearray(os.urandom(1 << 20)) * (KV_BLOCK * COUNT >> 20))
    with socket.create_server((host, 0)) as srv:
        out.write_bytes(pickle.dumps(srv.getsockname()))
        srv.settimeout(1.0)
        while True:   # until the parent closes stdin (checked between connections)
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                if _stdin_closed():
                    return
                continue
            with conn:
                conn.sendall(data)


def _stdin_closed() -> bool:
    """The parent never writes to stdin: readable means it was closed."""
    import select
    return bool(select.select([sys.stdin], [], [], 0)[0])


def socket_reader(peer_file: Path, iters: int) -> None:
    import socket
    addr = pickle.loads(peer_file.read_bytes())
    nbytes = KV_BLOCK * COUNT
    buf = memoryview(bytearray(nbytes))
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        with socket.create_connection(addr) as conn:
            got = 0
            while got < nbytes:
                n = conn.recv_into(buf[got:])
                if not n:
                    raise RuntimeError(f"socket: the source closed after {got} of {nbytes} bytes")
                got += n
        times.append(time.perf_counter() - t0)
    t = statistics.median(times[1:])
    print(json.dumps({"bytes": nbytes, "descriptors": 1, "seconds": round(t, 4), "gbps": round(nbytes / t / 1e9, 3)}))


def source(backend: str, host: str, out: Path) -> None:
    if backend == "socket":
        return socket_source(host, out)
    import torch

    from kvtransfer.layout import KVPoolLayout
    from kvtransfer.settings import TransferSettings
    tensor = torch.randint(0, 256, (NUM_BLOCKS, KV_BLOCK), dtype=torch.uint8)
    eng = TransferSettings(backend=backend, host=host, secret=SECRET).create("bench-src")
    eng.register_pool(KVPoolLayout.from_tensor(tensor))
    out.write_bytes(pickle.dumps((eng.peer_info(), tensor[:, :64].clone())))
    while sys.stdin.read(1):   # serve (and progress the passive side) until stdin closes
        pass


def reader(backend: str, host: str, peer_file: Path, iters: int) -> None:
    if backend == "socket":
        return socket_reader(peer_file, iters)
    import random

    import torch

    from kvtransfer.engine import TransferStatus
    from kvtransfer.layout import KVPoolLayout
    from kvtransfer.settings import TransferSettings
    info, heads = pickle.loads(peer_file.read_bytes())
    tensor = torch.zeros(NUM_BLOCKS, KV_BLOCK, dtype=torch.uint8)
    eng = TransferSettings(backend=backend, host=host, secret=SECRET).create("bench-dst")
    eng.register_pool(KVPoolLayout.from_tensor(tensor))
    rng = random.Random(0)
    src, dst = fragmented_table(rng, NUM_BLOCKS, COUNT), fragmented_table(rng, NUM_BLOCKS, COUNT)
    times, handle = [], None
    for i in range(iters + 1):
        tensor.zero_()
        t0 = time.perf_counter()
        handle = eng.read(info, src, dst)
        status = handle.wait(timeout=120)
        times.append(time.perf_counter() - t0)
        if status is not TransferStatus.DONE:
            raise RuntimeError(f"{backend}: {status} {handle.error}")
    assert all(torch.equal(tensor[d, :64], heads[s]) for s, d in zip(src, dst)), "bytes differ"
    t = statistics.median(times[1:])
    print(json.dumps({"bytes": handle.nbytes, "descriptors": handle.descriptors, "seconds": round(t, 4),
                      "gbps": round(handle.nbytes / t / 1e9, 3)}))
    eng.close()


def run(gbits: list[float], backends: list[str], iters: int) -> dict:
    from cluster.tools.testbed import TestBed
    from cluster.tools.testbed.sys_cmd import need_root
    why = need_root()
    if why:
        return {"skipped": why}
    out: dict = {"bytes_per_prompt": KV_BLOCK * COUNT, "cases": {}}
    me = [sys.executable, str(Path(__file__).resolve())]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with TestBed.up(2) as bed:
        a, b = bed.hosts
        for gbit in gbits:
            for host in (a, b):
                host.limit(gbit) if gbit > 0 else host.unlimit()
            for backend in backends:
                peer_file = bed.shared_dir / f"peer-{backend}-{gbit}.pkl"
                src = a.popen(me + ["--role", "source", "--backend", backend, "--host", a.address,
                                    "--peer-file", str(peer_file)], stdin=subprocess.PIPE, env=env, text=True)
                try:
                    end = time.monotonic() + 120
                    while not peer_file.exists():
                        if src.poll() is not None or time.monotonic() > end:
                            raise RuntimeError(f"{backend} source did not start")
                        time.sleep(0.1)
                    res = b.run(me + ["--role", "reader", "--backend", backend, "--host", b.address,
                                      "--peer-file", str(peer_file), "--iters", str(iters)], timeout=600, env=env)
                    if res.returncode != 0:
                        raise RuntimeError(f"{backend} reader failed: {res.stderr[-2000:]}")
                    r = json.loads(res.stdout.strip().splitlines()[-1])
                    r["gbit_per_s"] = round(r["gbps"] * 8, 2)
                    if gbit > 0:
                        r["ratio_to_link"] = round(r["gbps"] * 8 / gbit, 3)
                    out["cases"][f"{backend}@{gbit:g}gbit" if gbit > 0 else f"{backend}@uncapped"] = r
                finally:
                    src.stdin.close()
                    src.wait(30)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("bench", "source", "reader"), default="bench")
    p.add_argument("--backend", default="tcp")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--peer-file", type=Path)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--gbit", default="1,5,10")
    p.add_argument("--backends", default="")
    p.add_argument("--ceiling", action="store_true", help="also run the plain-socket ceiling (backend 'socket')")
    a = p.parse_args()
    if a.role == "source":
        return source(a.backend, a.host, a.peer_file)
    if a.role == "reader":
        return reader(a.backend, a.host, a.peer_file, a.iters)
    from kvtransfer.registry import available_backends
    backends = [b for b in (a.backends.split(",") if a.backends else available_backends()) if b]
    if a.ceiling and "socket" not in backends:
        backends.append("socket")
    if any(float(g) < 0 for g in a.gbit.split(",")):
        raise SystemExit("--gbit takes link speeds in Gbit/s, or 0 for an uncapped link")
    print(json.dumps(run([float(g) for g in a.gbit.split(",")], backends, a.iters)))


if __name__ == "__main__":
    main()
