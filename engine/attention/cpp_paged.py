"""Torch paged attention with a fused C++ decode kernel.

Prefill-like sequences go through the torch path; decodes (one query per
sequence) read K/V in place from the pool tiles with an online softmax, so
the per-layer gather copy disappears. The kernel is compiled on first use
with torch's C++ extension builder (a C++ compiler is needed, ~1 minute once,
then cached under ``TORCH_EXTENSIONS_DIR``).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine.attention.backend import AttentionShape
from engine.attention.torch_paged import TorchPagedAttention, TorchPagedPlan

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@functools.lru_cache(maxsize=1)
def load_kernel():
    """Build (or load the cached build of) the extension; ValueError if it cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        return load(name="pdserve_paged_decode", sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
    except Exception as e:  # compiler missing, headers missing, ...
        raise ValueError(f"cannot build the cpp_paged attention kernel ({e}); install a C++ "
                         "compiler or use attention_backend='torch_paged'") from e


class CppPagedAttention(TorchPagedAttention):
    name = "cpp_paged"

    def __init__(self, shape: AttentionShape) -> None:
        super().__init__(shape)
        if shape.block_size > 64 or shape.head_dim > 256 or shape.group_size > 16:
            raise ValueError("cpp_paged supports block_size <= 64, head_dim <= 256 and at most 16 "
                             "query heads per KV head; use attention_backend='torch_paged'")
        self._kernel = load_kernel()

    def _decode(self, plan: TorchPagedPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
        s, d = self.shape, plan.decode
        if q.dtype not in (torch.float32, torch.bfloat16) or q.device.type != "cpu":
            return super()._decode(plan, layer, q)
        qg = q.reshape(d.num_seqs, s.num_kv_heads, s.group_size, s.head_dim).contiguous()
        out = self._kernel.paged_decode(qg, plan.pool_tiles, d.read_rows[layer], d.context_lens,
                                        s.scale, s.block_size)
        return out.view(d.num_seqs, s.num_heads * s.head_dim)
