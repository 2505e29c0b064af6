"""One tensor-parallel group over ``torch.distributed``: the collectives the sharded model and
the executor use.

Two process groups join the same ranks: the *device* group carries the model's all-reduces
and the logits gather (NCCL when the ranks hold CUDA devices, gloo on CPU: chosen by device),
and a gloo *control* group carries the per-step metadata from rank 0 (pickled, CPU). The
control group waits as long as the engine idles (days), while the device group keeps a
timeout that catches a rank lost inside a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

CONTROL_TIMEOUT = timedelta(days=30)      # ranks wait this long for rank 0's next step
DEVICE_TIMEOUT = timedelta(minutes=10)    # a collective inside one step


def backend_for(device: str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:(base + rank)`` on CUDA, the same CPU otherwise."""
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + rank}"


@dataclass
class Rendezvous:
    """Where a group's ranks meet: a ``torch.distributed`` store listening on ``host`` before any
    rank is told its address. The kernel picks the port as the store binds it, so nothing started
    meanwhile (Ray's processes, the ranks' model loading) can take it, as it could a port found
    free and bound later. Held by whoever spawns the ranks (rank 0's process in pdserve) for the
    group's life; the ranks join it by :attr:`address` (rank 0 may pass the object itself)."""
    host: str
    store: dist.TCPStore

    @classmethod
    def listen(cls, world_size: int, host: str = "127.0.0.1") -> "Rendezvous":
        store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=DEVICE_TIMEOUT)
        return cls(host, store)

    @property
    def address(self) -> str:
        """``tcp://host:port``, what a rank in another process passes to :meth:`TPGroup.connect`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.store.port}"


def _join_store(address: str, world_size: int) -> dist.TCPStore:
    """A client of the rendezvous store at ``tcp://host:port``."""
    url = urlparse(address)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"a rendezvous address is tcp://host:port (Rendezvous.address), got {address!r}")
    return dist.TCPStore(url.hostname, url.port, world_size, is_master=False, timeout=DEVICE_TIMEOUT)


@dataclass
class TPGroup:
    """Rank ``rank`` of ``world_size``. Made first, joined later (:meth:`connect`): a rank
    builds its shard, whose layers hold this group's collectives, before the ranks meet."""
    rank: int
    world_size: int
    device: str
    control: dist.ProcessGroup | None = None
    store: dist.Store | None = None      # the rendezvous store joined (rank 0's keeps the group's port)

    @property
    def connected(self) -> bool:
        return self.control is not None

    def connect(self, meet: "Rendezvous | str") -> None:
        """Join the group at ``meet`` (the :class:`Rendezvous`, or its address from another
        process); every rank calls this and it returns once all have. One group per process."""
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group: one "
                               "tensor-parallel engine per process (close the other LLM first)")
        store = meet.store if isinstance(meet, Rendezvous) else _join_store(meet, self.world_size)
        if torch.device(self.device).type == "cuda":
            torch.cuda.set_device(torch.device(self.device))
        dist.init_process_group(backend_for(self.device), store=store, rank=self.rank,
                                world_size=self.world_size, timeout=DEVICE_TIMEOUT)
        self.store = store
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    # ------------------------------------------------------------ the model's collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it."""
        dist.all_reduce(t)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' ``t`` concatenated along the last dimension; others: ``t``."""
        t = t.contiguous()
        if self.rank != 0:
            dist.gather(t, None, dst=0)
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.gather(t, parts, dst=0)
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------ control (rank 0 -> all)
    def broadcast(self, obj: object) -> object:
        """Rank 0 sends ``obj`` to every rank (pickled); every rank returns rank 0's object."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._control())
        return box[0]

    def all_gather(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._control())
        return out

    def _control(self) -> dist.ProcessGroup:
        if self.control is None:
            raise RuntimeError(f"rank {self.rank} has not joined its tensor-parallel group: call connect()")
        return self.control

    def destroy(self) -> None:
        """Leave the group (this process's torch.distributed state); idempotent."""
        if self.control is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.control = self.store = None
