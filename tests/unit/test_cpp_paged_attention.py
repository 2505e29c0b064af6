"""The fused C++ decode kernel agrees with the torch paged path."""
from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionShape, get_attention_backend
from engine.batch import AttentionMetadata

pytestmark = pytest.mark.slow   # compiles a C++ extension the first time (~1 min)


def _decode_meta(ctx: list[int], tables: torch.Tensor, bs: int) -> AttentionMetadata:
    n = len(ctx)
    slots = [int(tables[i, (c - 1) // bs]) * bs + (c - 1) % bs for i, c in enumerate(ctx)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_lens=torch.ones(n, dtype=torch.long),
        context_lens=torch.tensor(ctx), query_start_loc=torch.arange(n + 1), block_tables=tables,
        num_prefills=0, num_prefill_tokens=0, max_query_len=1, max_context_len=max(ctx), block_size=bs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpp_decode_matches_torch(dtype, tol):
    shape = AttentionShape(num_layers=3, num_heads=6, num_kv_heads=2, head_dim=32, block_size=8)
    g = torch.Generator().manual_seed(0)
    nb = 40
    pool = torch.randn(nb, 3, 2, 2, 8, 32, generator=g).to(dtype)
    ctx = [1, 8, 9, 37, 20]                                    # block edges and partial blocks
    tables = torch.randperm(nb - 1, generator=g)[:5 * 5].view(5, 5) + 1
    meta = _decode_meta(ctx, tables, 8)
    q = torch.randn(5, 6, 32, generator=g).to(dtype)
    k = torch.randn(5, 2, 32, generator=g).to(dtype)
    v = torch.randn(5, 2, 32, generator=g).to(dtype)
    outs = []
    for name in ("torch_paged", "cpp_paged"):
        backend = get_attention_backend(name, shape)
        p = pool.clone()
        outs.append(backend.forward(backend.plan(meta, p), 1, q, k, v).float())
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
