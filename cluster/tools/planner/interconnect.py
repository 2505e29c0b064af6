"""Named interconnects and the time to move one prompt's KV over them.

Bandwidths are one direction, in bytes per second with GB = 1e9 bytes (link
rates are decimal), theoretical peaks: real transfers reach 70-90 % of them,
which is why a measured local figure sits beside them.

- PCIe x16, one direction, after 128b/130b encoding (PCI-SIG): Gen3 8 GT/s ->
  15.75 GB/s, Gen4 16 GT/s -> 31.5 GB/s, Gen5 32 GT/s -> 63 GB/s.
- NVLink: A100 (NVLink3) 12 links x 25 GB/s = 300 GB/s per direction (600 GB/s
  total); H100 SXM (NVLink4) 18 links x 25 GB/s = 450 GB/s per direction (900 total).
- InfiniBand per port: HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s.
- Ethernet: 100 GbE = 12.5 GB/s, 400 GbE = 50 GB/s.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.config import parse_size

LOCAL = "local"


@dataclass(frozen=True)
class Interconnect:
    name: str
    bytes_per_second: float
    note: str

    def __post_init__(self) -> None:
        if self.bytes_per_second <= 0:
            raise ValueError(f"interconnect {self.name!r}: bandwidth must be positive, e.g. '25GB' per second")


@dataclass(frozen=True)
class Transfer:
    interconnect: str
    bytes_per_second: float
    nbytes: int
    seconds: float


def named_interconnects() -> tuple[Interconnect, ...]:
    return (
        Interconnect("pcie3-x16", 15.75e9, "PCIe Gen3 x16, one direction"),
        Interconnect("pcie4-x16", 31.5e9, "PCIe Gen4 x16, one direction"),
        Interconnect("pcie5-x16", 63e9, "PCIe Gen5 x16, one direction"),
        Interconnect("nvlink3", 300e9, "NVLink3 (A100), one direction"),
        Interconnect("nvlink4", 450e9, "NVLink4 (H100 SXM), one direction"),
        Interconnect("ib-hdr", 25e9, "InfiniBand HDR 200 Gb/s"),
        Interconnect("ib-ndr", 50e9, "InfiniBand NDR 400 Gb/s"),
        Interconnect("eth-100g", 12.5e9, "100 Gigabit Ethernet"),
        Interconnect("eth-400g", 50e9, "400 Gigabit Ethernet"),
    )


def interconnect_names() -> list[str]:
    return [i.name for i in named_interconnects()] + [LOCAL]


def transfer_seconds(nbytes: int, bytes_per_second: float) -> float:
    if bytes_per_second <= 0:
        raise ValueError(f"bandwidth must be positive, got {bytes_per_second}")
    return nbytes / bytes_per_second


def measure_local_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Best-of-N memcpy bandwidth between two host buffers, bytes/s (numpy, no torch)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9)


def select_interconnects(spec: str, local_bandwidth: float | None = None) -> list[Interconnect]:
    """Comma-separated names, 'all', or custom rates such as '16GB' (bytes per second).

    'local' is a memcpy measured on this machine, or `local_bandwidth` when given.
    """
    by_name = {i.name: i for i in named_interconnects()}
    wanted: list[str] = []
    for item in (s.strip() for s in (spec or "all").split(",")):
        for name in interconnect_names() if item.lower() == "all" else [item] if item else []:
            if name.lower() not in (w.lower() for w in wanted):
                wanted.append(name)
    out: list[Interconnect] = []
    for item in wanted:
        key = item.lower()
        if key in by_name:
            out.append(by_name[key])
        elif key == LOCAL:
            measured = local_bandwidth is None
            rate = measure_local_bandwidth() if measured else local_bandwidth
            out.append(Interconnect(LOCAL, rate, "memcpy measured on this machine" if measured
                                    else "local figure given by --local-bandwidth"))
        else:
            out.append(_custom(item))
    return out


def _custom(item: str) -> Interconnect:
    try:
        rate = parse_size(item.removesuffix("/s"))
    except ValueError:
        raise ValueError(f"unknown interconnect {item!r}; choose from {', '.join(interconnect_names())}, "
                         "'all', or a rate such as '16GB' (bytes per second)") from None
    return Interconnect(f"{item}/s" if not item.endswith("/s") else item, float(rate), "given rate")


def transfers(nbytes: int, links: list[Interconnect]) -> list[Transfer]:
    return [Transfer(i.name, i.bytes_per_second, nbytes, transfer_seconds(nbytes, i.bytes_per_second))
            for i in links]
