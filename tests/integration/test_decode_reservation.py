"""Decode blocks reserved while the prompt is prefilled (`DecodeWorker.reserve`):
the submit that follows pulls into them at once and decodes the same tokens as
an unreserved hand-off; every way a reservation can end without a pull (abort,
drain, a local prefill after all, no room, nobody claiming it) frees its blocks.
Pipelined hand-off (`read_ahead`): blocks completed by earlier prefill chunks
are read while later ones compute, the submit reads only the last chunk's, and
a block read ahead from what is no longer its source (another node, or
recomputed after a preemption) is read again. Real prefill and decode workers
in one process, KV over the tcp transfer engine (no Ray)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from kvtransfer.settings import TransferSettings
from worker_api.messages import WorkItem

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _cfg(model_dir, num_blocks: int = 160, max_model_len: int = 1024, chunk: int = 2048) -> EngineConfig:
    return EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_model_len=max_model_len, max_num_seqs=4,
                                                  max_num_batched_tokens=chunk))


@pytest.fixture
def workers(tiny_llama_dir):   # per test: a worker's engine loop belongs to one asyncio loop
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    settings = TransferSettings(backend="tcp", lease_ttl=60.0, timeout=60.0)
    # prompts prefill in chunks of 32 tokens (2 blocks): one engine step each
    return PrefillWorker("prefill-res", _cfg(tiny_llama_dir, chunk=32), settings), \
        DecodeWorker("decode-res", _cfg(tiny_llama_dir), settings)


async def _used(dw) -> int:
    return (await dw.check_integrity()).kv_blocks_used


def _item(rid: str, prompt: list[int]) -> WorkItem:
    return WorkItem(request_id=rid, prompt_token_ids=tuple(prompt), sampling=GREEDY)


async def _decode(dw, rid: str) -> list[int]:
    q = dw.aengine.subscribe(rid)
    try:
        tokens = []
        while True:
            d = await asyncio.wait_for(q.get(), 60)
            tokens.extend(d.new_token_ids)
            if d.finish_reason:
                return tokens
    finally:
        dw.aengine.unsubscribe(rid)


async def _hand_off(pw, dw, rid: str, prompt: list[int], reserve: bool, ahead: bool = False):
    if reserve:
        assert await dw.reserve(item=_item(rid, prompt))
    pre = await pw.prefill(item=_item(rid, prompt), read_ahead=dw if ahead else None)
    out = asyncio.ensure_future(_decode(dw, rid))
    sub = await dw.submit(item=_item(rid, prompt), handle=pre.handle, first_token=pre.first_token)
    return sub, list(pre.first.new_token_ids) + await out


def test_a_reserved_hand_off_pulls_into_its_blocks_and_decodes_the_same_tokens(workers):
    pw, dw = workers

    async def go():
        prompt = list(range(5, 75))
        plain, plain_tokens = await _hand_off(pw, dw, "plain", prompt, reserve=False)
        other = list(range(7, 77))
        held, held_tokens = await _hand_off(pw, dw, "held", other, reserve=True)
        again, again_tokens = await _hand_off(pw, dw, "again", prompt, reserve=True)
        return plain, plain_tokens, held, held_tokens, again, again_tokens, await _used(dw)

    plain, plain_tokens, held, held_tokens, again, again_tokens, used = asyncio.run(go())
    assert not plain.reserved and held.reserved and again.reserved
    assert held.transferred_blocks == 5 and held.error == "", held   # 70 tokens: 5 blocks of 16
    assert again_tokens == plain_tokens and len(plain_tokens) == GREEDY.max_tokens
    assert held_tokens != plain_tokens   # another prompt: not a copy of the first
    assert used == 0, "a finished reserved hand-off left blocks behind"


def test_a_pipelined_hand_off_reads_earlier_chunks_ahead_and_the_last_one_after(workers):
    pw, dw = workers

    async def go():
        prompt = list(range(11, 171))   # 160 tokens: 10 blocks, 5 chunks of 2 blocks
        plain, plain_tokens = await _hand_off(pw, dw, "plain", prompt, reserve=False)
        other = [t + 1 for t in prompt]   # nothing of it cached on the decode node
        ahead, ahead_tokens = await _hand_off(pw, dw, "ahead", other, reserve=True, ahead=True)
        unpiped, unpiped_tokens = await _hand_off(pw, dw, "unpiped", other, reserve=False)
        return plain, plain_tokens, ahead, ahead_tokens, unpiped_tokens, await _used(dw)

    plain, plain_tokens, ahead, ahead_tokens, unpiped_tokens, used = asyncio.run(go())
    assert plain.read_ahead_blocks == 0 and plain.transferred_blocks == 10
    assert ahead.transferred_blocks == 10, ahead
    # every chunk but the last was read while later ones computed: the submit read 2 blocks
    assert ahead.read_ahead_blocks == 8, ahead
    assert ahead_tokens == unpiped_tokens and ahead_tokens != plain_tokens
    assert used == 0


def test_blocks_told_before_the_reservation_is_made_are_read_once_it_is(workers):
    """The reserve call and the prefill run at once and nothing orders them: every chunk's
    notice may reach the decode node before its reservation. They are kept and read when
    the reservation is made, so the submit still reads only the last chunk's blocks. A
    request no reservation follows keeps nothing once its submit comes."""
    pw, dw = workers

    async def go():
        prompt = list(range(13, 173))   # 160 tokens: 10 blocks, 5 chunks of 2 blocks
        pre = await pw.prefill(item=_item("late", prompt), read_ahead=dw)   # every notice before the reserve
        kept = len(dw._early)
        assert await dw.reserve(item=_item("late", prompt))
        decoded = asyncio.ensure_future(_decode(dw, "late"))
        sub = await dw.submit(item=_item("late", prompt), handle=pre.handle, first_token=pre.first_token)
        tokens = list(pre.first.new_token_ids) + await decoded
        never = await pw.prefill(item=_item("never", [t + 2 for t in prompt]), read_ahead=dw)
        unreserved = asyncio.ensure_future(_decode(dw, "never"))
        plain = await dw.submit(item=_item("never", [t + 2 for t in prompt]), handle=never.handle,
                                first_token=never.first_token)
        await unreserved
        _, want = await _hand_off(pw, dw, "late-ref", prompt, reserve=False)
        return kept, sub, tokens, plain, want, len(dw._early), await _used(dw)

    kept, sub, tokens, plain, want, left, used = asyncio.run(go())
    assert kept == 1, "the notices ahead of the reservation were not kept"
    assert (sub.reserved, sub.read_ahead_blocks, sub.transferred_blocks) == (True, 8, 10), sub
    assert tokens == want
    assert (plain.reserved, plain.read_ahead_blocks, plain.transferred_blocks) == (False, 0, 10), plain
    assert left == 0, "notices of a request submitted without a reservation were kept"
    assert used == 0


def test_blocks_read_ahead_from_what_is_no_longer_their_source_are_read_again(workers):
    """The prefill node recomputed the prompt (a preemption) or another node
    prefilled it: what was read ahead is stale, and the submit must not trust it."""
    pw, dw = workers

    async def go():
        decoy = list(range(200, 264))
        d = await pw.prefill(item=_item("decoy", decoy))   # its blocks hold other KV
        peer = d.handle.peer
        out = {}
        cases = (("stale-count", list(range(20, 84)), 1), ("stale-blocks", list(range(30, 94)), 0))
        for rid, prompt, preemptions in cases:   # 64 tokens: 4 blocks each, none cached on the decode node
            assert await dw.reserve(item=_item(rid, prompt))
            pre = await pw.prefill(item=_item(rid, prompt))
            if preemptions:   # the right blocks, but read before a preemption the handle reports
                pre = replace(pre, handle=replace(pre.handle, preemptions=preemptions))
                await dw.read_ahead(request_id=rid, peer=peer, first_index=0, block_ids=pre.handle.block_ids,
                                    preemptions=0)
            else:             # another source's blocks (the decoy's), told as this prompt's
                await dw.read_ahead(request_id=rid, peer=peer, first_index=0, block_ids=d.handle.block_ids,
                                    preemptions=0)
            decoded = asyncio.ensure_future(_decode(dw, rid))
            sub = await dw.submit(item=_item(rid, prompt), handle=pre.handle, first_token=pre.first_token)
            out[rid] = (sub, list(pre.first.new_token_ids) + await decoded)
        await pw.release(request_id="decoy")
        for rid, prompt, _ in cases:   # the reference: a plain hand-off of the same prompt
            out[rid] += ((await _hand_off(pw, dw, rid + "-ref", prompt, reserve=False))[1],)
        return out

    out = asyncio.run(go())
    for rid in ("stale-count", "stale-blocks"):
        sub, tokens, want = out[rid]
        assert sub.read_ahead_blocks == 0 and sub.transferred_blocks == 4, (rid, sub)
        assert tokens == want, rid


def test_every_unclaimed_reservation_frees_its_blocks(workers):
    pw, dw = workers

    async def go():
        seen = {}
        assert await _used(dw) == 0
        assert await dw.reserve(item=_item("aborted", list(range(3, 40))))
        seen["reserved"] = await _used(dw)
        await dw.abort(request_id="aborted")
        seen["abort"] = await _used(dw)

        assert await dw.reserve(item=_item("drained", list(range(3, 40))))
        assert await dw.drain() == []
        seen["drain"] = await _used(dw)
        pre = await pw.prefill(item=_item("drained", list(range(3, 40))))
        seen["moved"] = await dw.submit(item=_item("drained", list(range(3, 40))), handle=pre.handle,
                                        first_token=pre.first_token)
        await pw.release(request_id="drained")
        dw.undrain()

        # the prefill node was lost: the decode node prefills itself after all
        assert await dw.reserve(item=_item("local", list(range(3, 40))))
        out = asyncio.ensure_future(_decode(dw, "local"))
        sub = await dw.submit(item=_item("local", list(range(3, 40))))
        seen["local"] = (sub, len(await out))
        seen["after_local"] = await _used(dw)
        return seen

    seen = asyncio.run(go())
    assert seen["reserved"] == 3   # 37 tokens: 3 blocks of 16
    assert seen["abort"] == 0 and seen["drain"] == 0 and seen["after_local"] == 0, seen
    assert seen["moved"].moved and not seen["moved"].joined
    sub, n = seen["local"]
    assert sub.local_prefill and sub.joined and n == GREEDY.max_tokens


def test_no_room_reserves_nothing_and_an_unclaimed_reservation_expires(tiny_llama_dir):
    from decode_worker.worker import RESERVATION_TTL_FACTOR, DecodeWorker

    timeout = 0.05
    dw = DecodeWorker("decode-ttl", _cfg(tiny_llama_dir, num_blocks=6, max_model_len=96),
                      TransferSettings(backend="tcp", lease_ttl=60.0, timeout=timeout))

    async def go():
        assert await dw.reserve(item=_item("orphan", list(range(3, 40))))   # 3 of the 6 blocks
        held = await _used(dw)
        too_big = await dw.reserve(item=_item("big", list(range(3, 73))))   # 5 blocks: 3 are free
        after_refusal = await _used(dw)
        counted = (await dw.report()).reservation_expiries
        await asyncio.sleep(RESERVATION_TTL_FACTOR * timeout)
        end = time.monotonic() + 60   # the expiry frees the blocks by the engine thread: a busy host delays it
        while await _used(dw) != 0 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return held, too_big, after_refusal, await _used(dw), counted, (await dw.report()).reservation_expiries

    held, too_big, after_refusal, expired, before, after = asyncio.run(go())
    assert held == 3 and too_big is False and after_refusal == 3
    assert expired == 0, "an unclaimed reservation outlived its time"
    assert (before, after) == (0, 1), "the decode worker's report counts the expiry (a refusal is no expiry)"



def test_a_layer_wise_hand_off_reads_the_last_chunk_by_layer_group_and_matches_transformers(
        tiny_llama_dir, tiny_llama_hf):
    """The last chunk's blocks move layer group by layer group while it computes (3
    layers: groups of one), the submit reads only the last group: the decode node's KV
    equals the prefill node's byte for byte and its greedy tokens equal transformers'.
    Layer groups read from blocks that are not the handle's are read again, whole."""
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker
    from tiny_models import hf_greedy

    settings = TransferSettings(backend="tcp", lease_ttl=60.0, timeout=60.0)
    pw = PrefillWorker("prefill-lw", replace(_cfg(tiny_llama_dir, chunk=32), prompt_layer_groups=4), settings)
    dw = DecodeWorker("decode-lw", _cfg(tiny_llama_dir), settings)
    prompt = [(i * 37) % 350 + 20 for i in range(150)]   # 5 chunks (32 x 4 + 22), 10 blocks (the last of 6 tokens)
    stale = [(i * 53) % 350 + 20 for i in range(40)]

    async def layer_wise():
        assert await dw.reserve(item=_item("lw", prompt))
        pre = await pw.prefill(item=_item("lw", prompt), read_ahead=dw)
        p_kv = pw.engine.kv_pool.tensor[list(pre.handle.block_ids)].clone()   # before anything can reuse them
        decoded = asyncio.ensure_future(_decode(dw, "lw"))
        sub = await dw.submit(item=_item("lw", prompt), handle=pre.handle, first_token=pre.first_token)
        d_kv = dw.engine.kv_pool.tensor[list(sub.block_ids)].clone()         # before the decode writes its tokens
        return sub, list(pre.first.new_token_ids) + await decoded, p_kv, d_kv

    async def stale_layers():
        decoy = await pw.prefill(item=_item("decoy", list(range(200, 264))))
        assert await dw.reserve(item=_item("stale", stale))
        pre = await pw.prefill(item=_item("stale", stale))
        await dw.read_ahead(request_id="stale", peer=pre.handle.peer, first_index=0,
                            block_ids=decoy.handle.block_ids, preemptions=0, layers=(0, 2))
        decoded = asyncio.ensure_future(_decode(dw, "stale"))
        sub = await dw.submit(item=_item("stale", stale), handle=pre.handle, first_token=pre.first_token)
        tokens = list(pre.first.new_token_ids) + await decoded
        await pw.release(request_id="decoy")
        return sub, tokens

    async def go():
        return await layer_wise(), await stale_layers(), await _used(dw)

    (sub, tokens, p_kv, d_kv), (stale_sub, stale_tokens), used = asyncio.run(go())
    assert torch.equal(d_kv[:9], p_kv[:9]), "a layer of a full block differs from the prefill node's"
    assert torch.equal(d_kv[9, ..., :6, :], p_kv[9, ..., :6, :]), "the last block's 6 prompt tokens differ"
    assert tokens == hf_greedy(tiny_llama_hf, prompt, GREEDY.max_tokens)
    assert (sub.read_ahead_blocks, sub.layer_read_ahead_blocks, sub.transferred_blocks) == (8, 2, 10), sub
    assert sub.transferred_bytes == 10 * pw.engine.kv_pool.bytes_per_block, "each byte of the prompt's KV once"
    assert (stale_sub.read_ahead_blocks, stale_sub.layer_read_ahead_blocks, stale_sub.transferred_blocks) == (0, 0, 3)
    # the bytes the reads reported: 2 of 3 layers of 3 blocks read ahead from the decoy (stale, read
    # again), then the 3 blocks whole
    assert stale_sub.transferred_bytes == 5 * pw.engine.kv_pool.bytes_per_block, stale_sub
    assert stale_tokens == hf_greedy(tiny_llama_hf, stale, GREEDY.max_tokens)
    assert used == 0


def _hold_settle(dw):
    """Hold the decode worker's read-ahead settle open until the returned gate is set; also
    returns the real settle, to put back."""
    gate, settle = asyncio.Event(), dw.kv.settle

    async def held_settle(request_id: str):
        await gate.wait()
        return await settle(request_id)
    dw.kv.settle = held_settle
    return gate, settle


def test_a_submit_that_comes_while_its_reservation_expires_waits_for_the_expiry(workers):
    """A prompt that queued longer than its reservation lives: the expiry takes the reservation
    and frees it (first settling read-aheads, here held open, then aborting the engine's request),
    and the submit that comes meanwhile waits for it, then allocates anew, pulls and decodes the
    same tokens. It used to allocate beside the expiring request, which the engine refused
    ("request id ... already in use")."""
    pw, dw = workers

    async def go():
        prompt = list(range(5, 75))
        _, plain_tokens = await _hand_off(pw, dw, "plain", prompt, reserve=False)
        assert await dw.reserve(item=_item("late", prompt))
        alloc = dw._reserved["late"]
        pre = await pw.prefill(item=_item("late", prompt))
        gate, _ = _hold_settle(dw)   # as read-aheads still landing
        expiry = asyncio.ensure_future(dw._expire("late", alloc))
        await asyncio.sleep(0.05)            # the expiry has taken the reservation; it waits in settle
        assert "late" not in dw._reserved
        out = asyncio.ensure_future(_decode(dw, "late"))
        sub = asyncio.ensure_future(dw.submit(item=_item("late", prompt), handle=pre.handle,
                                              first_token=pre.first_token))
        await asyncio.sleep(0.3)
        waited = not sub.done()
        gate.set()
        result = await sub
        await expiry
        return plain_tokens, result, list(pre.first.new_token_ids) + await out, waited, await _used(dw), \
            (await dw.report()).reservation_expiries

    plain_tokens, result, tokens, waited, used, expiries = asyncio.run(go())
    assert waited, "the submit did not wait for the expiry freeing its reservation"
    assert result.error == "" and not result.reserved, result
    assert tokens == plain_tokens
    assert used == 0 and expiries == 1


def test_a_reserve_that_comes_while_the_same_ids_reservation_expires_waits_then_reserves_anew(workers):
    """A retry reserves the same request id again while its first reservation's expiry is still
    freeing it (read-aheads settling, here held open): the reserve waits for the expiry, then
    reserves anew, and the hand-off into the new reservation decodes the same tokens. Without
    the wait the engine refused the id still in use."""
    pw, dw = workers

    async def go():
        prompt = list(range(9, 80))
        _, plain_tokens = await _hand_off(pw, dw, "plain2", prompt, reserve=False)
        assert await dw.reserve(item=_item("again", prompt))
        alloc = dw._reserved["again"]
        gate, settle = _hold_settle(dw)
        expiry = asyncio.ensure_future(dw._expire("again", alloc))
        await asyncio.sleep(0.05)
        again = asyncio.ensure_future(dw.reserve(item=_item("again", prompt)))
        await asyncio.sleep(0.3)
        waited = not again.done()
        gate.set()
        reserved = await again
        await expiry
        dw.kv.settle = settle
        pre = await pw.prefill(item=_item("again", prompt))
        out = asyncio.ensure_future(_decode(dw, "again"))
        result = await dw.submit(item=_item("again", prompt), handle=pre.handle, first_token=pre.first_token)
        return plain_tokens, reserved, result, list(pre.first.new_token_ids) + await out, waited, await _used(dw)

    plain_tokens, reserved, result, tokens, waited, used = asyncio.run(go())
    assert waited, "the reserve did not wait for the expiry freeing the same id"
    assert reserved
    assert result.error == "" and result.reserved, result
    assert tokens == plain_tokens
    assert used == 0
