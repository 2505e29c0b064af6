"""Two real processes per backend: a source child serving its pool, the test
process reading into its own pool. Parametrized over every installed backend."""
from __future__ import annotations

import itertools
import multiprocessing as mp
import random
import time

import pytest
import torch

from kv_peer import NUM_BLOCKS, BLOCK_BYTES, PeerSpec, block_table, make_pool, reader_main, source_main
from kvtransfer.engine import TransferStatus
from kvtransfer.layout import KVPoolLayout
from kvtransfer.registry import available_backends, create_engine

BACKENDS = available_backends()
CTX = mp.get_context("spawn")
_seeds = itertools.count(101)


class Source:
    """A source engine in a child process, driven over a pipe."""

    def __init__(self, spec: PeerSpec) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=source_main, args=(spec, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("source process did not start")
        self.info = self.conn.recv()
        self.seed = spec.seed

    def call(self, *cmd, timeout: float = 10.0):
        self.conn.send(cmd)
        assert self.conn.poll(timeout), f"source did not answer {cmd[0]}"
        return self.conn.recv()

    def wait_for(self, predicate, timeout: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.call("stats")
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop")
            except (AssertionError, OSError, EOFError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def spec(backend: str, **kw) -> PeerSpec:
    seed = next(_seeds)
    return PeerSpec(backend=backend, name=f"src-{seed}", seed=seed, **kw)


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request):
    backend = request.param
    source = Source(spec(backend))
    reader = create_engine(backend, f"reader-{backend}")
    pool = torch.zeros(NUM_BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    reader.register_pool(KVPoolLayout.from_tensor(pool))
    yield backend, source, reader, pool
    reader.close()
    source.stop()


def test_random_tables_byte_exact_and_lease_released_by_notification(pair):
    backend, source, reader, pool = pair
    ref = make_pool(source.seed)
    rng = random.Random(7)
    for i, count in enumerate((1, 9, 24)):
        src_ids, dst_ids = block_table(rng, count)
        rid = f"{backend}-req-{i}"
        source.call("pin", rid, src_ids, 30.0)
        pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8))
        expected = pool.clone()
        expected[dst_ids] = ref[src_ids]
        handle = reader.read(source.info, src_ids, dst_ids, notify=rid.encode())
        assert handle.wait(timeout=10) is TransferStatus.DONE, handle.error
        assert handle.descriptors <= count - count // 3 + 1   # the run was merged
        assert torch.equal(pool, expected)   # right bytes landed, nothing else changed
        stats = source.wait_for(lambda s: (rid, "notified") in s["released"])
        assert (reader.name, rid.encode()) in stats["notifs"]
        assert (rid, "notified") in stats["released"]
    assert source.call("stats")["active"] == 0


def test_leases_expire_and_double_release_is_harmless(pair):
    backend, source, _, _ = pair
    source.call("pin", "expiring", [1, 2, 3], 0.2)
    stats = source.wait_for(lambda s: ("expiring", "expired") in s["released"])
    assert ("expiring", "expired") in stats["released"] and stats["expiries"] >= 1
    source.call("pin", "explicit", [4], 30.0)
    assert source.call("release", "explicit") is True
    assert source.call("release", "explicit") is False
    assert source.call("stats")["released"].count(("explicit", "released")) == 1


def test_read_from_dead_peer_fails_within_timeout(pair):
    backend, _, reader, _ = pair
    dead = Source(spec(backend))
    dead.proc.kill()
    dead.proc.join(5)
    start = time.monotonic()
    handle = reader.read(dead.info, [0, 1, 5], [2, 3, 9], notify=b"never")
    status = handle.wait(timeout=3.0)
    assert status in (TransferStatus.FAILED, TransferStatus.TIMEOUT)
    assert time.monotonic() - start < 3.0 + 2.0


def test_out_of_range_blocks_rejected_before_posting(pair):
    _, source, reader, _ = pair
    with pytest.raises(ValueError, match="out of range"):
        reader.read(source.info, [NUM_BLOCKS], [0])


# --- NIXL traps -------------------------------------------------------------

nixl_only = pytest.mark.skipif("nixl" not in BACKENDS, reason="nixl not installed")


def test_idle_engine_does_not_spin_a_core(pair):
    """An idle engine sleeps (NIXL's zero-delay thread would cost ~1.0 CPU s per s)."""
    _, source, _, _ = pair
    assert source.call("idle_cpu", 1.0) < 0.3


@pytest.mark.skipif("nixl" not in BACKENDS, reason="nixl not installed")
def test_nixl_progress_thread_has_a_delay_and_transfers():
    """Trap 1: with NIXL's progress thread on, we set pthrDelay so it does not spin."""
    from kvtransfer.nixl_backend import NixlConfig
    config = NixlConfig(progress_thread=True, progress_delay_us=100)
    source = Source(spec("nixl", config=config))
    reader = create_engine("nixl", "reader-thread", config)
    try:
        pool = torch.zeros(NUM_BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
        reader.register_pool(KVPoolLayout.from_tensor(pool))
        assert reader.read(source.info, [1, 2, 7], [0, 1, 2]).wait(10) is TransferStatus.DONE
        assert torch.equal(pool[:3], make_pool(source.seed)[[1, 2, 7]])
        assert source.call("idle_cpu", 1.0) < 0.3
    finally:
        reader.close()
        source.stop()


@nixl_only
@pytest.mark.parametrize("expecting", [True, False], ids=["reads-expected", "idle-slow-poll"])
def test_nixl_progress_thread_off_passive_side_is_progressed(expecting):
    """Trap 2: the source never calls get_notifications; our poller thread progresses it, at
    full rate while reads are expected and, told none are (expect_reads(False): an idle prefill
    worker), still progresses a read that comes anyway, at its slow idle rate."""
    from kvtransfer.nixl_backend import NixlConfig
    config = NixlConfig(progress_thread=False)
    source = Source(spec("nixl", config=config, passive_idle=True))
    reader = create_engine("nixl", f"reader-nothread-{expecting}", config)
    try:
        pool = torch.zeros(NUM_BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
        reader.register_pool(KVPoolLayout.from_tensor(pool))
        source.call("expect_reads", expecting)
        src_ids, dst_ids = block_table(random.Random(3), 12)
        source.call("pin", "idle-req", src_ids, 30.0)
        handle = reader.read(source.info, src_ids, dst_ids, notify=b"idle-req")
        assert handle.wait(timeout=10) is TransferStatus.DONE, handle.error
        ref = make_pool(source.seed)
        assert all(torch.equal(pool[d], ref[s]) for s, d in zip(src_ids, dst_ids))
        source.call("drain")
        assert ("idle-req", "notified") in source.call("stats")["released"]
    finally:
        reader.close()
        source.stop()


@nixl_only
def test_nixl_shared_memory_only_tls_works():
    """Trap 3: UCX_TLS=sm,self needs error handling 'none', picked automatically."""
    env = {"UCX_TLS": "sm,self"}
    source = Source(spec("nixl", env=env))
    try:
        src_ids, dst_ids = block_table(random.Random(5), 10)
        conn, child = CTX.Pipe()
        proc = CTX.Process(target=reader_main, daemon=True, args=(
            PeerSpec("nixl", "reader-sm", 0, env=env), source.info, src_ids, dst_ids, 10.0, child))
        proc.start()
        assert conn.poll(60), "reader process did not report"
        assert conn.recv() == ("done", True)
        proc.join(5)
    finally:
        source.stop()


# --- NIXL metadata side channel --------------------------------------------

@nixl_only
def test_nixl_metadata_is_fetched_over_the_side_channel_from_another_process():
    from kvtransfer import side_channel
    source = Source(spec("nixl"))
    try:
        info = source.info
        assert info.metadata == b"" and info.host == "127.0.0.1" and info.port > 0 and info.incarnation
        reply = side_channel.fetch_metadata(info.host, info.port, info.agent_name, timeout=5)
        assert reply.incarnation == info.incarnation
        assert info.agent_name.encode() in reply.metadata   # NIXL's agent metadata blob
        with pytest.raises(ConnectionError, match="does not serve agent"):
            side_channel.fetch_metadata(info.host, info.port, "someone-else", timeout=5)
        # nothing in the source process listens on a wildcard address (no NIXL listener)
        addrs = source.call("listening")
        assert addrs and not [a for a in addrs if a in ("0.0.0.0", "::")], addrs
    finally:
        source.stop()


@nixl_only
def test_nixl_restarted_peer_metadata_is_refetched():
    """Same agent name, new process (new incarnation): the cached metadata is dropped."""
    reader = create_engine("nixl", "reader-restart")
    pool = torch.zeros(NUM_BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    reader.register_pool(KVPoolLayout.from_tensor(pool))
    first = Source(PeerSpec("nixl", "src-restarting", next(_seeds)))
    try:
        assert reader.read(first.info, [3, 4], [0, 1]).wait(10) is TransferStatus.DONE
        assert torch.equal(pool[:2], make_pool(first.seed)[[3, 4]])
        old_info = first.info
        first.stop()
        second = Source(PeerSpec("nixl", "src-restarting", next(_seeds)))
        try:
            assert second.info.incarnation != old_info.incarnation
            stale = reader.read(old_info, [3, 4], [0, 1]).wait(5)
            assert stale in (TransferStatus.FAILED, TransferStatus.TIMEOUT)
            handle = reader.read(second.info, [3, 4, 9], [0, 1, 2])
            assert handle.wait(10) is TransferStatus.DONE, handle.error
            assert torch.equal(pool[:3], make_pool(second.seed)[[3, 4, 9]])
        finally:
            second.stop()
    finally:
        reader.close()
        first.stop()
