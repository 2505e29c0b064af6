"""Ranks 1..N-1 of a tensor-parallel engine as processes on this host (``spawn``).

Each process builds its shard, reports it (or its error) to the parent over a pipe, joins the
group and serves steps (engine/parallel/rank.py). The parent learns of a rank that fails or
dies while loading without waiting on a collective; a rank whose parent dies exits by itself
(a watchdog thread), so no rank outlives its engine. :meth:`LocalRanks.shutdown` stops them:
rank 0 broadcasts the stop, then each process is joined (terminated, then killed, if slow).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.parallel.group import TPGroup, rank_device
from engine.parallel.rank import RankMemory, build_rank_runner, rank_memory, serve_rank

log = logging.getLogger("pdserve.engine.tp")

READY_TIMEOUT_S = 600.0       # loading a shard
JOIN_TIMEOUT_S = 10.0         # a stopped rank exits


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="tp-parent-watchdog", daemon=True).start()


def _parent_gone(parent_pid: int, wait_s: float = 1.0) -> bool:
    """Whether the parent has exited (its sockets close a moment before this process is re-parented)."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent_pid:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def rank_process_main(config: EngineConfig, rank: int, world_size: int, rendezvous: str,
                      parent_pid: int, conn: Connection) -> None:
    """The body of rank ``rank``'s process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the parent's to handle
    _exit_with_parent(parent_pid)
    if torch.device(config.device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    group = TPGroup(rank=rank, world_size=world_size, device=rank_device(config.device, rank))
    try:
        runner = build_rank_runner(config, group)
    except Exception as e:
        conn.send(f"rank {rank}: {type(e).__name__}: {e}")
        return
    conn.send(rank_memory(runner, rank))
    conn.close()
    group.connect(rendezvous)
    try:
        serve_rank(runner, group)
    except Exception:
        if _parent_gone(parent_pid):        # rank 0 died: its connections closed under us
            os._exit(1)
        raise
    finally:
        group.destroy()


@dataclass
class LocalRanks:
    """The processes of ranks 1..N-1 and the parent's ends of their pipes."""
    group: TPGroup                                     # rank 0's
    procs: list[BaseProcess]
    conns: list[Connection]
    memory: list[RankMemory] = field(default_factory=list)
    _stopped: bool = False

    @classmethod
    def spawn(cls, config: EngineConfig, group: TPGroup, rendezvous: str) -> "LocalRanks":
        ctx = mp.get_context("spawn")
        procs: list[BaseProcess] = []
        conns: list[Connection] = []
        for rank in range(1, group.world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=rank_process_main, name=f"pdserve-tp-rank{rank}", daemon=True,
                            args=(config, rank, group.world_size, rendezvous, os.getpid(), child_end))
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        return cls(group, procs, conns)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> list[RankMemory]:
        """Each rank's report once it has built its shard; RuntimeError naming a rank that failed."""
        deadline = time.monotonic() + timeout_s
        out = []
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.1):
                if not p.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {p.exitcode}) while loading")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not load its shard in {timeout_s:.0f} s")
            try:
                report = conn.recv()
            except EOFError:
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {p.exitcode}) while loading") from None
            if not isinstance(report, RankMemory):
                raise RuntimeError(f"tensor-parallel {report}")
            out.append(report)
        self.memory = out
        return out

    def shutdown(self) -> None:
        """Stop every rank and leave the group; idempotent, never raises."""
        if self._stopped:
            return
        self._stopped = True
        if self.group.connected and all(p.is_alive() for p in self.procs):
            try:
                self.group.broadcast(None)
            except Exception as e:           # a rank already gone: the joins below end it
                log.warning("stopping the tensor-parallel ranks: %s", e)
        for p in self.procs:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.terminate()
                p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.group.destroy()
