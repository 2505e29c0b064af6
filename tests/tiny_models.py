"""Tiny models for tests (made by cluster/tools/tiny_models.py, which benchmarks share) and
the transformers greedy reference the tests compare against."""
from __future__ import annotations

import torch

from cluster.tools.tiny_models import (CHAT_TEMPLATE, hf_llama_from_state, load_hf_model, make_tiny_model,
                                       make_tokenizer)

__all__ = ["CHAT_TEMPLATE", "hf_greedy", "hf_llama_from_state", "load_hf_model", "make_tiny_model",
           "make_tokenizer"]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers' model with its own KV cache, greedy, for exactly
    max_new_tokens (eos is neither suppressed nor final, as with ignore_eos;
    `generate` would suppress eos under min_new_tokens)."""
    out: list[int] = []
    with torch.no_grad():
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        past = None
        for _ in range(max_new_tokens):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]], dtype=torch.long)
    return out
