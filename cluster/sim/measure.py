"""`--measure`: time real engine steps of pdserve's own `LLMEngine` on this
machine and fill a `TableCostModel` (the CPU profile).

Prefill cell (new n, cached c): cache a c-token prefix with one request, then
time the single step that prefills n fresh tokens after it (sampling
included). Decode cell (batch b, context x): admit b requests of x / b prompt
tokens, prefill them, then time pure decode steps. Each cell is the minimum
of ``repeats`` timings of the step's *thread CPU time* (torch runs with one
thread, in the caller's): on a machine shared with other processes wall time
mostly measures the OS scheduler, CPU time measures the step. Transfer costs are not measured here (see
benchmarks/kv_transfer.py); the profile carries assumed loopback figures.

    .venv/bin/python -m cluster.sim.measure --output cluster/sim/profiles/cpu.json [--model PATH]
"""
from __future__ import annotations

import argparse
import itertools
import random
import time
from dataclasses import dataclass

from cluster.sim.cost_model import Table2D, TableCostModel, TransferCost
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Grid:
    prefill_new: tuple[int, ...] = (16, 64, 256, 1024)
    prefill_cached: tuple[int, ...] = (0, 1024)
    decode_batch: tuple[int, ...] = (1, 4, 16)
    decode_context: tuple[int, ...] = (64, 1024, 4096)
    repeats: int = 3


class StepTimer:
    """Times single engine steps of a real `LLMEngine` with fresh random prompts."""

    def __init__(self, engine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = min(256, engine.tokenizer.vocab_size)
        self._ids = itertools.count()

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def _timed_step(self) -> tuple[float, int]:
        t0 = time.thread_time()
        self.engine.step()
        return time.thread_time() - t0, self.engine.last_step_tokens

    def prefill(self, new: int, cached: int) -> float:
        """Seconds of one step prefilling ``new`` tokens after ``cached`` cached ones."""
        prefix = self._tokens(cached)
        if cached:
            self.engine.add_request(f"m{next(self._ids)}", prefix + self._tokens(1), SamplingParams(max_tokens=1))
            self._drain()
        self.engine.add_request(f"m{next(self._ids)}", prefix + self._tokens(new), SamplingParams(max_tokens=1))
        seconds, tokens = self._timed_step()
        self._drain()
        if tokens != new:
            raise ValueError(f"prefill cell ({new}, {cached}) ran {tokens} tokens in one step: raise "
                             "max_num_batched_tokens above the largest prefill size or use block-aligned sizes")
        return seconds

    def decode(self, batch: int, context: int, steps: int = 3) -> list[float]:
        """Seconds of pure decode steps of ``batch`` sequences holding ``context`` tokens in all."""
        per = max(1, context // batch)
        for _ in range(batch):
            self.engine.add_request(f"m{next(self._ids)}", self._tokens(per),
                                    SamplingParams(max_tokens=steps + 2, ignore_eos=True))
        while self.engine.scheduler.num_waiting or any(
                r.num_output_tokens == 0 for r in self.engine.scheduler.running):
            self.engine.step()
        times = [self._timed_step()[0] for _ in range(steps)]
        self._drain()
        return times


def measure_engine(engine, grid: Grid = Grid(), name: str = "cpu", seed: int = 0) -> TableCostModel:
    timer = StepTimer(engine, seed)
    timer.prefill(16, 0)                                   # warm up
    prefill = [[min(timer.prefill(n, c) for _ in range(grid.repeats)) for c in grid.prefill_cached]
               for n in grid.prefill_new]
    decode = [[min(timer.decode(b, x, grid.repeats)) for x in grid.decode_context]
              for b in grid.decode_batch]
    mc = engine.runner.model_config
    dtype_bytes = engine.runner.dtype.itemsize
    overhead = min(min(row) for row in decode) * 0.5
    return TableCostModel(
        name, Table2D("prefill", grid.prefill_new, grid.prefill_cached, prefill),
        Table2D("decode", grid.decode_batch, grid.decode_context, decode), overhead,
        TransferCost(fixed_s=2e-4, per_descriptor_s=2e-5, bandwidth_bytes_per_s=1e9),
        mc.kv_bytes_per_token(dtype_bytes), engine.runner.num_blocks * engine.block_size,
        {"source": f"measured on this machine with `python -m cluster.sim.measure` ({time.strftime('%Y-%m-%d')}); "
                   "transfer figures assumed (loopback TCP order of magnitude)",
         "hardware": "this machine's CPU, 1 torch thread", "model": mc.name,
         "description": "real LLMEngine.step() thread CPU time (1 torch thread), minimum of repeats",
         "scheduler": {"max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
                       "max_num_seqs": engine.config.scheduler.max_num_seqs},
         "block_size": engine.block_size})


def make_engine(model: str | None, block_size: int = 16, num_blocks: int = 2048, max_model_len: int | None = None,
                max_num_batched_tokens: int = 2048):
    import torch

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    return LLMEngine(EngineConfig(model=model or "", cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                                            max_num_seqs=64, max_model_len=max_model_len)))


def measure_profile(output: str, model: str | None = None, grid: Grid = Grid()) -> TableCostModel:
    """Measure the default (SmolLM2) or given model and write the profile JSON."""
    profile = measure_engine(make_engine(model), grid, name="cpu")
    profile.save(output)
    print(f"wrote {output}")
    return profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default="cpu_measured.json")
    ap.add_argument("--model", help="HF directory or .gguf (default: SmolLM2-135M)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    measure_profile(args.output, args.model, Grid(repeats=args.repeats))


if __name__ == "__main__":
    main()
