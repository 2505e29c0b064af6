"""Child-process side of the kvtransfer integration tests (spawn-safe)."""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any, Optional

NUM_BLOCKS = 64
BLOCK_BYTES = 4096 + 512


@dataclass(frozen=True)
class PeerSpec:
    backend: str
    name: str
    seed: int
    config: Any = None
    env: Optional[dict] = None
    passive_idle: bool = False   # never call get_notifications (NIXL trap 2)


def make_pool(seed: int, num_blocks: int = NUM_BLOCKS):
    import torch
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, BLOCK_BYTES), dtype=torch.uint8, generator=gen)


def block_table(rng: random.Random, count: int, n_src: int = NUM_BLOCKS, n_dst: int = NUM_BLOCKS):
    """Random non-contiguous table whose first third is one run on both sides."""
    run = count // 3
    s0, d0 = rng.randrange(n_src - run), rng.randrange(n_dst - run)
    src = list(range(s0, s0 + run)) + rng.sample([b for b in range(n_src) if not s0 <= b < s0 + run], count - run)
    dst = list(range(d0, d0 + run)) + rng.sample([b for b in range(n_dst) if not d0 <= b < d0 + run], count - run)
    return src, dst


def source_main(spec: PeerSpec, conn) -> None:
    os.environ.update(spec.env or {})
    from kvtransfer.layout import KVPoolLayout
    from kvtransfer.leases import LeaseTable
    from kvtransfer.registry import create_engine
    engine = create_engine(spec.backend, spec.name, spec.config)
    pool = make_pool(spec.seed)
    engine.register_pool(KVPoolLayout.from_tensor(pool))
    released: list[tuple[str, str]] = []
    leases = LeaseTable(time.monotonic, lambda lease, cause: released.append((lease.request_id, cause.value)))
    notifs: list[tuple[str, bytes]] = []

    def drain() -> None:
        for n in engine.get_notifications():
            notifs.append((n.peer_name, n.message))
            leases.release_by_notification(n.message)

    conn.send(engine.peer_info())
    while True:
        if not conn.poll(None if spec.passive_idle else 0.005):
            drain()
            leases.expire_due()
            continue
        cmd, *args = conn.recv()
        if cmd == "pin":
            leases.pin(args[0], args[1], args[2])
            conn.send(True)
        elif cmd == "release":
            conn.send(leases.release(args[0]))
        elif cmd == "expect_reads":
            engine.expect_reads(args[0])
            conn.send(True)
        elif cmd == "drain":
            drain()
            conn.send(True)
        elif cmd == "stats":
            conn.send({"released": list(released), "notifs": list(notifs), "active": len(leases),
                       "expiries": leases.expiries})
        elif cmd == "idle_cpu":
            t0 = time.process_time()
            time.sleep(args[0])
            conn.send(time.process_time() - t0)
        elif cmd == "listening":
            conn.send(listening_addresses(os.getpid()))
        elif cmd == "stop":
            engine.close()
            conn.send(True)
            return


def reader_main(spec: PeerSpec, peer, src_ids, dst_ids, timeout: float, conn) -> None:
    """Read once in a fresh process (its own UCX env) and report (status, data ok)."""
    os.environ.update(spec.env or {})
    import torch
    from kvtransfer.layout import KVPoolLayout
    from kvtransfer.registry import create_engine
    engine = create_engine(spec.backend, spec.name, spec.config)
    pool = torch.zeros(NUM_BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    engine.register_pool(KVPoolLayout.from_tensor(pool))
    status = engine.read(peer, src_ids, dst_ids, notify=b"r").wait(timeout)
    ref = make_pool(peer_seed_of(peer))
    ok = all(torch.equal(pool[d], ref[s]) for s, d in zip(src_ids, dst_ids))
    engine.close()
    conn.send((status.value, ok))


def peer_seed_of(peer) -> int:
    return int(peer.agent_name.rsplit("-", 1)[1])


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of the TCP sockets process ``pid`` listens on (IPv4 and IPv6, from /proc; Linux)."""
    import ipaddress
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for proto in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{proto}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:   # LISTEN
                    hexip, hexport = fields[1].split(":")
                    raw = bytes.fromhex(hexip)
                    # /proc prints each 32-bit word in host (little-endian) order
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    out.add((str(ipaddress.ip_address(words)), int(hexport, 16)))
    return out


def listening_addresses(pid: int) -> list[str]:
    """IPs of the TCP sockets process ``pid`` listens on."""
    return [ip for ip, _ in listening_sockets(pid)]
