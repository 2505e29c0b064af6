"""The flattened, tensorised input of one engine step (model runner -> model).

Sequences are ordered: all prefill-like sequences (query length > 1 or not
at the end of the known tokens) first, then decodes (query length 1). The
attention backend may treat the two groups differently; neither loops over
sequences in Python per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # per token (length T)
    slot_mapping: torch.Tensor        # int64: block_id * block_size + offset, where new K/V is written
    # per sequence (length S)
    query_lens: torch.Tensor          # int64 [S] tokens computed this step
    context_lens: torch.Tensor        # int64 [S] tokens of context after this step (cached + new)
    query_start_loc: torch.Tensor     # int64 [S+1] prefix sum of query_lens
    block_tables: torch.Tensor        # int64 [S, max_blocks] padded with 0
    num_prefills: int                 # sequences [0, num_prefills) are prefill-like
    num_prefill_tokens: int           # tokens [0, num_prefill_tokens) belong to them
    max_query_len: int
    max_context_len: int
    block_size: int


@dataclass
class BatchInput:
    input_ids: torch.Tensor           # int64 [T]
    positions: torch.Tensor           # int64 [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor      # int64 [num sampled seqs]: flat index of each sampled seq's last token
