"""Weights in 16-output panels, for linear layers of a few rows (decode steps of batch 1 to 8).

A decode step at batch 1 is a matrix-vector product per projection: it reads every weight
once, so its speed is how fast the weights stream from memory. oneDNN's kernel on its packed
layout (engine/model/packed_linear.py, best from 8 rows up) streamed SmolLM2's weights at
~20 GB/s on this repo's 2-core hosts, which read memory at ~30 GB/s. The kernel
``torch.ops.pdserve.panel_linear`` (engine/attention/csrc/panel_linear.cpp) reads a weight
laid out as ``[P, K, 16]`` (``panels[p, k, j] = W[16 p + j, k]``) front to back, one
contiguous run of panels per thread (benchmarks/small_linear.py, docs/benchmarks.md).

All of a model's panels share one buffer on transparent huge pages (engine/huge_pages.py):
on 4 KiB pages the stream misses the TLB every 4 KiB (huge pages read them 6-8% faster here).

The panels are a second copy of the weights, next to the oneDNN-packed one: they cost the
weights' memory again. ``EngineConfig.panel_weights`` decides ("auto": when that copy is at
most an eighth of the machine's memory, or of the container's limit where lower).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from engine import huge_pages

PANEL = 16
MAX_ROWS = 8        # steps of at most this many rows use the panels: 1.25-1.4x oneDNN up to 8,
                    # level at 16, slower from 32 (benchmarks/small_linear.py)
AUTO_MEMORY_SHARE = 8   # "auto": on when the copy is at most 1/8 of the process's memory


def panel_shape(weight: torch.Tensor) -> tuple[int, int, int]:
    n, k = weight.shape
    return -(-n // PANEL), k, PANEL


def to_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, K]`` weight -> ``[ceil(N/16), K, 16]`` panels (the last one zero-padded), into
    ``out`` (contiguous, that shape) when given."""
    n, k = weight.shape
    if out is None:
        out = torch.empty(panel_shape(weight), dtype=weight.dtype, device=weight.device)
    full = n // PANEL
    out[:full].copy_(weight.detach()[:full * PANEL].view(full, PANEL, k).transpose(1, 2))
    if full < out.shape[0]:
        out[full:].zero_()
        out[full, :, :n - full * PANEL].copy_(weight.detach()[full * PANEL:].t())
    return out


def panels_on_huge_pages(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Panels of each weight, all views of one buffer advised onto 2 MiB pages."""
    shapes = [panel_shape(w) for w in weights]
    sizes = [a * b * c for a, b, c in shapes]
    buf = huge_pages.zeros((sum(sizes),), dtype=weights[0].dtype, device=weights[0].device)
    out, offset = [], 0
    for w, shape, size in zip(weights, shapes, sizes):
        out.append(to_panels(w, buf[offset:offset + size].view(shape)))
        offset += size
    return out


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``x`` of shape ``[M, K]``, from ``to_panels(W)``."""
    return torch.ops.pdserve.panel_linear(x, panels, bias, n)


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max",                      # cgroup v2
                  "/sys/fs/cgroup/memory/memory.limit_in_bytes")     # cgroup v1


def process_memory_bytes(cgroup_files: tuple[str, ...] = _CGROUP_LIMITS) -> int:
    """This process's memory: the machine's physical memory, or its container's (cgroup)
    limit when lower (a pod on a large node); 0 when unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    for path in cgroup_files:
        try:
            text = Path(path).read_text().strip()      # "max" when unlimited
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (total or int(text) + 1):
            total = int(text)
    return total


def check_panel_mode(mode: str) -> None:
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"panel_weights must be 'auto', 'on' or 'off', got {mode!r}")


def resolve_panel_weights(mode: str, weight_bytes: int, memory_bytes: int | None = None) -> bool:
    """``"on"``/``"off"`` as given; ``"auto"``: on when ``weight_bytes`` (the copy) is at most
    1/8 of ``memory_bytes`` (default: ``process_memory_bytes()``, the container's limit where lower)."""
    check_panel_mode(mode)
    if mode != "auto":
        return mode == "on"
    memory = process_memory_bytes() if memory_bytes is None else memory_bytes
    return 0 < weight_bytes * AUTO_MEMORY_SHARE <= memory
