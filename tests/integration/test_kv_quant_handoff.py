"""Quantized KV across a hand-off: real prefill and decode workers in one process,
int8 blocks (codes and their in-block scales) moved by the tcp transfer engine.
The decode node continues token for token as a colocated int8 engine does, and a
pool that stores K/V differently is refused at start-up."""
from __future__ import annotations

import asyncio

import pytest

import torch

from cluster.orchestration.launcher import check_kv_agreement
from engine.block_hash import block_hashes
from engine import LLM
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from kvtransfer.settings import TransferSettings
from worker_api.messages import WorkItem

SETTINGS = TransferSettings(backend="tcp", lease_ttl=60.0, timeout=60.0)


def _cfg(model, kv: str) -> EngineConfig:
    return EngineConfig(model=str(model), cache=CacheConfig(block_size=16, num_blocks=64, kv_cache_dtype=kv),
                        scheduler=SchedulerConfig(max_model_len=512))


async def _decode_tokens(dw, rid: str) -> list[int]:
    tokens: list[int] = []
    async for batch in dw.output_stream():
        for d in batch:
            if d.request_id == rid:
                tokens.extend(d.new_token_ids)
                if d.finish_reason:
                    return tokens
    return tokens


def test_int8_blocks_hand_off_byte_for_byte(tiny_llama_dir):
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    pw = PrefillWorker("prefill-q", _cfg(tiny_llama_dir, "int8"), SETTINGS)
    dw = DecodeWorker("decode-q", _cfg(tiny_llama_dir, "int8"), SETTINGS)
    prompt = list(range(3, 60))                             # 3 full blocks + a partial one
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def go():
        infos = [await pw.ready(), await dw.ready()]
        check_kv_agreement([("prefill-q", infos[0]), ("decode-q", infos[1])])
        item = WorkItem(request_id="r", prompt_token_ids=tuple(prompt), sampling=params)
        res = await pw.prefill(item=item)
        src = pw.engine.kv_pool.tensor[list(res.handle.block_ids)].clone()
        stream = asyncio.ensure_future(_decode_tokens(dw, "r"))
        joined = await dw.submit(item=item, handle=res.handle, first_token=res.first_token)
        assert joined.joined, joined
        rest = await stream
        return infos, res, src, rest

    infos, res, src, rest = asyncio.run(go())
    assert infos[0].kv_cache_dtype == infos[1].kv_cache_dtype == "int8"
    assert infos[0].kv_bytes_per_block == 16 * 2 * 3 * 2 * (16 + 2)     # codes + bf16 scales, 3 layers
    tokens = list(res.first.new_token_ids) + rest
    colocated = LLM(str(tiny_llama_dir), kv_cache_dtype="int8", block_size=16, num_kv_blocks=64,
                    max_model_len=512).generate([prompt], params)[0].outputs[0].token_ids
    assert tokens == colocated
    # the decode node caches the prompt's full blocks under int8 hashes, holding exactly the
    # prefill node's bytes (codes and scales)
    hashes = block_hashes(prompt, 16, kv_cache_dtype="int8")
    assert len(hashes) == 3 and hashes != block_hashes(prompt, 16)
    cached = [dw.engine.scheduler.kv.pool.lookup(h) for h in hashes]
    assert all(b is not None for b in cached)
    assert torch.equal(dw.engine.kv_pool.tensor[[b.block_id for b in cached]], src[:3])


def test_a_pool_that_stores_kv_differently_is_refused_at_start_up(tiny_llama_dir):
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    pw = PrefillWorker("prefill-a", _cfg(tiny_llama_dir, "int8"), SETTINGS)
    dw = DecodeWorker("decode-b", _cfg(tiny_llama_dir, "auto"), SETTINGS)

    async def infos():
        return [("prefill-a", await pw.ready()), ("decode-b", await dw.ready())]

    with pytest.raises(ValueError, match=r"prefill-a: kv_cache_dtype=int8.*decode-b: kv_cache_dtype=auto.*"
                                         r"same --kv-cache-dtype"):
        check_kv_agreement(asyncio.run(infos()))
