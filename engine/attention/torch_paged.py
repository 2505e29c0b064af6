"""Paged attention in plain torch.

Block layout inside the pool ``[num_blocks, num_layers, 2, kv_heads,
block_size, head_dim]``: for one (block, layer, k|v, head) the ``block_size x
head_dim`` tile is contiguous. We view the pool as rows of such tiles and, per
step, compute row indices once for all layers; per layer that leaves

- one ``index_put_`` each for the new K and V (rows of ``head_dim``),
- for decodes, one ``index_select`` that gathers K and V straight into
  ``[2, seqs, kv_heads, ctx, head_dim]`` (contiguous, no permute copy), up to
  the longest decode context only, then two matmuls with GQA folded into the
  query length (``[seqs, kv_heads, group, head_dim]``): no repeat_interleave;
- for prefill-like sequences, a padded batch with a causal-with-prefix mask,
  or, for a single prompt without a cached prefix, causal SDPA on the new K/V.

Pool access goes through a view (:mod:`engine.attention.pool_views`): a
quantized cache quantizes on write and dequantizes the gathered tiles to the
model dtype; the single-prompt path attends over the quantize-dequantize
round trip of its new K/V, so every path reads the values the pool holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.pool_views import PlainPoolView, QuantPoolView, make_pool_view
from engine.batch import AttentionMetadata
from engine.kv_quant import KVCodec


@dataclass
class _DecodePlan:
    read_rows: torch.Tensor      # int64 [L, 2, S, KVH, MB] tile rows
    mask: torch.Tensor           # float32 additive [S, 1, 1, MB*BS]: 0 or -inf
    num_seqs: int
    kv_len: int                  # MB * BS
    context_lens: torch.Tensor   # int64 [S]


@dataclass
class _PaddedPrefill:
    """Prefill-like sequences as one padded batch with a causal-with-prefix mask."""
    num_seqs: int
    max_query_len: int
    read_rows: torch.Tensor      # int64 [L, 2, P, KVH, MB]
    q_index: torch.Tensor        # int64 [P*maxQ] token of each padded query slot
    out_index: torch.Tensor      # int64 [Tp] padded slot of each token
    mask: torch.Tensor           # bool [P, 1, maxQ, MB*BS]
    kv_len: int                  # MB * BS


@dataclass
class _PrefillPlan:
    num_tokens: int
    padded: _PaddedPrefill | None    # None: one prompt, no cached prefix: causal on new K/V


@dataclass
class TorchPagedPlan:
    pool: PlainPoolView | QuantPoolView
    write_tiles: torch.Tensor    # int64 [L, 2, T, KVH] tile of each new K/V row
    write_slots: torch.Tensor    # int64 [T, KVH] its token slot inside the tile
    prefill: _PrefillPlan | None
    decode: _DecodePlan | None


class TorchPagedAttention(AttentionBackend[TorchPagedPlan]):
    name = "torch_paged"
    _codec: KVCodec | None = None

    # ---- per-step planning -------------------------------------------------
    def _tile_rows(self, block_tables: torch.Tensor) -> torch.Tensor:
        """[S, MB] block ids -> [L, 2, S, KVH, MB] tile rows in the pool."""
        s = self.shape
        dev = block_tables.device
        per_block = s.num_layers * 2 * s.num_kv_heads
        offs = torch.arange(per_block, device=dev).view(s.num_layers, 2, 1, s.num_kv_heads, 1)
        return block_tables[None, None, :, None, :] * per_block + offs

    def _write_tiles(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tile ``[L, 2, T, KVH]`` and slot ``[T, KVH]`` of each new token's K/V row."""
        s = self.shape
        dev = slot_mapping.device
        blocks = torch.div(slot_mapping, s.block_size, rounding_mode="floor")
        per_block = s.num_layers * 2 * s.num_kv_heads
        offs = torch.arange(per_block, device=dev).view(s.num_layers, 2, 1, s.num_kv_heads)
        slots = (slot_mapping % s.block_size)[:, None].expand(-1, s.num_kv_heads)
        return (blocks * per_block)[None, None, :, None] + offs, slots

    def _plan_decode(self, attn: AttentionMetadata) -> _DecodePlan | None:
        n_pre = attn.num_prefills
        num = attn.query_lens.shape[0] - n_pre
        if num == 0:
            return None
        ctx = attn.context_lens[n_pre:]
        bs = self.shape.block_size
        max_ctx = int(ctx.max()) if n_pre else attn.max_context_len
        mb = -(-max_ctx // bs)
        rows = self._tile_rows(attn.block_tables[n_pre:, :mb])
        pos = torch.arange(mb * bs, device=ctx.device)
        mask = torch.zeros(num, 1, 1, mb * bs, dtype=torch.float32, device=ctx.device)
        mask.masked_fill_((pos[None, :] >= ctx[:, None]).view(num, 1, 1, mb * bs), float("-inf"))
        return _DecodePlan(rows, mask, num, mb * bs, ctx.contiguous())

    def _plan_prefill(self, attn: AttentionMetadata) -> _PrefillPlan | None:
        n = attn.num_prefills
        if n == 0:
            return None
        qlens = attn.query_lens[:n].tolist()
        ctxs = attn.context_lens[:n].tolist()
        max_q = max(qlens)
        if n == 1 and ctxs[0] == qlens[0]:
            return _PrefillPlan(qlens[0], padded=None)
        dev = attn.query_lens.device
        bs = self.shape.block_size
        mb = -(-max(ctxs) // bs)
        q_idx: list[int] = []
        out_idx: list[int] = []
        start = 0
        for i, ql in enumerate(qlens):
            q_idx.extend(range(start, start + ql))
            q_idx.extend([start] * (max_q - ql))
            out_idx.extend(range(i * max_q, i * max_q + ql))
            start += ql
        prefix = torch.tensor([c - q for c, q in zip(ctxs, qlens)], device=dev)
        last_key = prefix[:, None] + torch.arange(max_q, device=dev)[None, :]       # [P, maxQ]
        keys = torch.arange(mb * bs, device=dev)
        mask = (keys[None, None, :] <= last_key[:, :, None]).unsqueeze(1)
        return _PrefillPlan(start, _PaddedPrefill(
            n, max_q, read_rows=self._tile_rows(attn.block_tables[:n, :mb]),
            q_index=torch.tensor(q_idx, device=dev), out_index=torch.tensor(out_idx, device=dev),
            mask=mask, kv_len=mb * bs))

    def plan(self, attn: AttentionMetadata, kv_pool: torch.Tensor) -> TorchPagedPlan:
        s = self.shape
        assert attn.block_size == s.block_size, "metadata block size differs from the pool's"
        if self.kv_spec.quantized and (self._codec is None or self._codec.device != kv_pool.device):
            self._codec = KVCodec(self.kv_spec, kv_pool.device)
        tiles, slots = self._write_tiles(attn.slot_mapping)
        return TorchPagedPlan(
            pool=make_pool_view(kv_pool, s.block_size, s.head_dim, self.kv_spec, self._codec),
            write_tiles=tiles, write_slots=slots,
            prefill=self._plan_prefill(attn),
            decode=self._plan_decode(attn),
        )

    # ---- per-layer compute ---------------------------------------------------
    def _gather(self, plan: TorchPagedPlan, rows: torch.Tensor, num_seqs: int, kv_len: int):
        kv = plan.pool.gather(rows.reshape(-1))
        kv = kv.view(2, num_seqs, self.shape.num_kv_heads, kv_len, self.shape.head_dim)
        return kv[0], kv[1]

    def _decode(self, plan: TorchPagedPlan, d: _DecodePlan, layer: int, q: torch.Tensor) -> torch.Tensor:
        s = self.shape
        kv, scale = plan.pool.gather_unscaled(d.read_rows[layer].reshape(-1))
        kv = kv.view(2, d.num_seqs, s.num_kv_heads, d.kv_len, s.head_dim)
        k, v = kv[0], kv[1]
        qg = q.reshape(d.num_seqs, s.num_kv_heads, s.group_size, s.head_dim)
        # plain matmuls beat SDPA's flash kernel for one query per sequence (3x in bf16);
        # softmax in float32 as HF does
        scores = torch.matmul(qg, k.transpose(-1, -2)).float()
        if scale is not None:   # quantized: q.(s_t k_t) = s_t (q.k_t) and sum p_t (s_t v_t) = sum (p_t s_t) v_t
            scale = scale.view(2, d.num_seqs, s.num_kv_heads, 1, d.kv_len)
            scores.mul_(scale[0])
        scores = scores.mul_(s.scale).add_(d.mask)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        if scale is not None:
            probs = probs.mul_(scale[1])
        return torch.matmul(probs, v).reshape(d.num_seqs, s.num_heads * s.head_dim)

    def _prefill(self, plan: TorchPagedPlan, pre: _PrefillPlan, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        s, p = self.shape, pre.padded
        hd = s.num_heads * s.head_dim
        if p is None:
            k, v = plan.pool.roundtrip(k), plan.pool.roundtrip(v)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=s.scale, enable_gqa=True)
            return out[0].transpose(0, 1).reshape(pre.num_tokens, hd)
        kc, vc = self._gather(plan, p.read_rows[layer], p.num_seqs, p.kv_len)
        qp = q.index_select(0, p.q_index).view(p.num_seqs, p.max_query_len, s.num_heads, s.head_dim)
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), kc, vc, attn_mask=p.mask,
                                             scale=s.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, hd).index_select(0, p.out_index)

    def forward(self, plan: TorchPagedPlan, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        tiles = plan.write_tiles[layer]
        plan.pool.write(tiles[0], plan.write_slots, k)
        plan.pool.write(tiles[1], plan.write_slots, v)
        pre, dec = plan.prefill, plan.decode
        if pre is None or dec is None:
            if pre is not None:
                return self._prefill(plan, pre, layer, q, k, v)
            if dec is not None:
                return self._decode(plan, dec, layer, q)
            raise ValueError("an empty step: plan() needs at least one scheduled token")
        n = pre.num_tokens
        return torch.cat([self._prefill(plan, pre, layer, q[:n], k[:n], v[:n]),
                          self._decode(plan, dec, layer, q[n:])])
