"""`LLM`: the offline facade. `LLM().generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
from typing import Sequence, Union, cast

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput, StepDelta
from engine.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int]]


class LLM:
    """Run a model on this node. `LLM()` loads the default SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, *, device: str = "cpu", dtype: str = "float32",
                 block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_memory_bytes: int = 1 << 30, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 seed: int = 0, host_kv_memory_bytes: int = 0, num_host_kv_blocks: int | None = None,
                 disk_kv_dir: str = "", disk_kv_bytes: int = 0, preemption_mode: str = "auto",
                 kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                 packed_weights: bool = True, omp_threads_bind: str = "auto",
                 attention_backend: str = "auto", panel_weights: str = "auto") -> None:
        """``tensor_parallel_size`` N > 1 splits the model over N ranks: this process is rank 0
        and N - 1 processes are spawned (close() or the end of the program stops them).
        ``omp_threads_bind``: "auto" (default: when torch has one intra-op thread per core of the
        caller's mask), "off" or a core list such as "0-1": pin the OpenMP team of the thread that
        calls generate() one thread per core while it steps (engine/thread_pinning.py; EngineConfig
        keeps "off", so cluster workers are not pinned). "auto" is "off" with tensor_parallel_size > 1.
        ``attention_backend``: "auto" (engine/attention/backend.py says which one it picks here and
        why), "cpu_paged" or "torch_paged". ``panel_weights``: "auto", "on" or "off" (EngineConfig)."""
        config = EngineConfig(
            model=model or "", device=device, dtype=dtype, seed=seed, tensor_parallel_size=tensor_parallel_size,
            packed_weights=packed_weights, attention_backend=attention_backend, panel_weights=panel_weights,
            omp_threads_bind="off" if tensor_parallel_size > 1 and omp_threads_bind == "auto" else omp_threads_bind,
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                              kv_cache_memory_bytes=kv_cache_memory_bytes,
                              enable_prefix_caching=enable_prefix_caching,
                              host_kv_memory_bytes=host_kv_memory_bytes, num_host_blocks=num_host_kv_blocks,
                              disk_kv_dir=disk_kv_dir, disk_kv_bytes=disk_kv_bytes,
                              preemption_mode=preemption_mode, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill))
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine (stops tensor-parallel ranks); idempotent."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give a non-empty string or token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for every prompt in one continuous batch; outputs in prompt order.
        All prompts are validated before any runs: one bad prompt raises ValueError."""
        prompts = _prompt_list(prompts)
        params_list = ([params or SamplingParams()] * len(prompts) if params is None or isinstance(params, SamplingParams)
                       else list(params))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams: "
                             "give one, or one per prompt")
        token_lists = [self.encode(p) for p in prompts]
        results: dict[str, RequestOutput] = {}
        added: list[str] = []
        try:
            for ids, sp in zip(token_lists, params_list):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, ids, sp, cache_salt)
                added.append(rid)
                results[rid] = RequestOutput(rid, ids, [CompletionOutput(i, logprobs=[] if sp.logprobs is not None
                                                                         else None) for i in range(sp.n)])
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    _apply(results[delta.request_id], delta)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        finally:
            self.engine.thread_pinner.release()     # the caller's thread gets its own cores back
        for out in results.values():
            out.finished = True
        return [results[rid] for rid in added]

    def chat(self, conversations, params: SamplingParams | Sequence[SamplingParams] | None = None,
             cache_salt: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each message list, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.encode_chat(msgs) for msgs in conversations]
        return self.generate(prompts, params, cache_salt)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or token ids) or several, as a list of prompts."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [cast(Prompt, prompts)]
    return list(cast(Sequence[Prompt], prompts))


def _apply(out: RequestOutput, delta: StepDelta) -> None:
    comp = out.outputs[delta.index]
    comp.token_ids.extend(delta.new_token_ids)
    comp.text += delta.new_text
    if comp.logprobs is not None:
        comp.logprobs.extend(delta.logprobs)
    if delta.finish_reason:
        comp.finish_reason = delta.finish_reason
        comp.stop_reason = delta.stop_reason
    out.num_cached_tokens = max(out.num_cached_tokens, delta.num_cached_tokens)
