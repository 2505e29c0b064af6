"""The decode engine says when a handed-off request joins its running batch: a tokenless
`admitted` delta, handed out before the forward of the step that computes its next token
(the frontend may hold the prefill node's first token until then)."""
from __future__ import annotations

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

P = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                                  scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=256)))


def _record_forwards(e: LLMEngine, log: list) -> None:
    execute = e.runner.execute

    def recorded(sched, on_layer=None):
        log.append(("forward", tuple(s.request.request_id for s in sched.seqs)))
        return execute(sched, on_layer)
    e.runner.execute = recorded


def test_a_landed_hand_off_is_announced_once_before_the_forward_that_computes_its_token(tiny_llama_dir):
    e, log = _engine(tiny_llama_dir), []
    _record_forwards(e, log)
    e.add_request("local", [5, 6, 7], P)
    e.step(lambda ds: log.append(("admitted", ds)))          # the local prompt: no announcement
    assert e.add_remote_request("handed", list(range(5, 40)), P, first_token=9) is not None
    e.step(lambda ds: log.append(("admitted", ds)))          # KV not in yet: not scheduled, not announced
    assert e.remote_kv_ready("handed")
    deltas = e.step(lambda ds: log.append(("admitted", ds)))
    e.step(lambda ds: log.append(("admitted", ds)))
    kinds = [k for k, _ in log]
    assert kinds == ["forward", "forward", "admitted", "forward", "forward"]
    [(_, announced)] = [x for x in log if x[0] == "admitted"]
    [a] = announced
    assert a.request_id == "handed" and a.admitted and a.new_token_ids == () and a.num_prompt_tokens == 35
    assert "handed" in log[3][1], "the announced request is in the very next forward"
    assert [d.request_id for d in deltas if d.new_token_ids] == ["local", "handed"]
    assert not any(d.admitted for d in deltas), "handed out once, through the callback"
    for rid in ("local", "handed"):
        e.abort_request(rid)


def test_without_a_callback_the_announcement_leads_the_steps_deltas(tiny_llama_dir):
    e = _engine(tiny_llama_dir)
    assert e.add_remote_request("handed", list(range(5, 30)), P, first_token=9) is not None
    e.remote_kv_ready("handed")
    first, second = e.step(), e.step()
    assert [(d.admitted, d.new_token_ids != ()) for d in first] == [(True, False), (False, True)]
    assert [d.admitted for d in second] == [False]
    e.abort_request("handed")


def test_a_failed_pull_recomputes_without_an_announcement(tiny_llama_dir):
    """The recompute prefills here: nothing was handed over, so nothing is announced."""
    e = _engine(tiny_llama_dir)
    assert e.add_remote_request("handed", list(range(5, 30)), P, first_token=9) is not None
    assert e.remote_kv_failed("handed")
    deltas = []
    while e.has_unfinished():
        deltas += e.step()
    assert deltas and not any(d.admitted for d in deltas)
    assert sum(len(d.new_token_ids) for d in deltas) == P.max_tokens - 1   # the first token came from elsewhere
