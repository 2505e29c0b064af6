"""Layer progress of the step that completes a prefill_only prompt.

A prefill node that hands its KV to a decode node can let the decode node read
the prompt's last chunk layer group by layer group while that chunk still
computes (a layer-wise hand-off, as vLLM's layer-wise connectors and Mooncake do):
the pool is block-major, so layers ``[l0, l1)`` of one block are one contiguous
byte range. The engine knows nothing of transfers; it only reports, during the
forward, after which layers the prompt's K/V are complete: a tokenless
``StepDelta`` with ``computed_block_ids`` (all its prompt blocks) and
``computed_layers`` at each group boundary but the last (the last group's K/V
are complete when the first token is).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from engine.outputs import StepDelta

Emit = Callable[[list[StepDelta]], None]


def layer_marks(num_layers: int, groups: int) -> tuple[int, ...]:
    """The layer counts after which to report: ``groups`` groups of about equal size (the
    last one no larger than the others, since it is what is left after the forward), at most
    one per layer; () for one group."""
    if num_layers < 1 or groups < 1:
        raise ValueError(f"num_layers and groups must be >= 1, got {num_layers} and {groups}")
    g = min(groups, num_layers)
    return tuple(-(-k * num_layers // g) for k in range(1, g))


def device_sync(device: torch.device) -> Callable[[], None]:
    """What makes a layer's K/V visible to a reader: nothing on the CPU (the forward is
    synchronous); waiting for the device's queued work elsewhere."""
    if device.type == "cpu":
        return lambda: None
    return lambda: torch.accelerator.synchronize(device)


def layer_reporter(marks: tuple[int, ...], deltas: list[StepDelta], emit: Emit,
                   sync: Callable[[], None]) -> Callable[[int], None]:
    """The forward's ``on_layer``: at each of ``marks``, ``deltas`` with ``computed_layers`` set."""
    def on_layer(done: int) -> None:
        if done in marks:
            sync()
            emit([replace(d, computed_layers=done) for d in deltas])
    return on_layer
