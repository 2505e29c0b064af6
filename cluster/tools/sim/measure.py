"""`--measure`: time real engine steps of pdserve's own `LLMEngine` on this
machine and fill a `TableCostModel` (the CPU profile).

Prefill cell (new n, cached c): cache a c-token prefix with one request, then
time the single step that prefills n fresh tokens after it (sampling
included). Decode cell (batch b, context x): admit b requests of x / b prompt
tokens, prefill them, then time pure decode steps. Multi-prompt prefill and
mixed prefill+decode cells are timed too (they feed the fit, not the tables).
Every cell is timed ``repeats`` times in each of ``rounds`` shuffled passes
(after a warm-up pass) and the fastest timing of the step's *thread CPU
time* counts (torch runs with one thread, in the caller's): on a machine
shared with other processes wall time mostly measures the OS scheduler, CPU
time measures the step, and spreading a cell's timings lets bursts of load
miss some of them. A `StepFit` is then fitted to all cells (step_fit.py).
Transfer costs are not measured here (see benchmarks/kv_transfer.py); the
profile carries assumed loopback figures.

    .venv/bin/python -m cluster.tools.sim.measure --output cluster/tools/sim/profiles/cpu.json [--model PATH]
"""
from __future__ import annotations

import argparse
import itertools
import random
import time
from dataclasses import dataclass

from cluster.tools.sim.cost_model import Table2D, TableCostModel, TransferCost
from cluster.tools.sim.step_fit import StepFeatures, StepFit
from engine.sampling_params import SamplingParams
from engine.step_trace import StepShape


@dataclass(frozen=True)
class Grid:
    prefill_new: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    prefill_cached: tuple[int, ...] = (0, 256, 1024)
    # every small batch: on CPU a decode step's cost is not monotone there (batch 3 costs more
    # than 4), which no interpolation between powers of two can see (docs/simulator.md)
    decode_batch: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
    decode_context: tuple[int, ...] = (64, 512, 2048, 4096)
    # fitted too (not in the tables): multi-prompt prefills ((new, cached) each) and mixed steps
    # (decodes, their total context, new, cached)
    prefill_batches: tuple[tuple[tuple[int, int], ...], ...] = (
        ((32, 0),) * 2, ((32, 0),) * 4, ((128, 0),) * 4, ((16, 0),) * 8, ((64, 0), (16, 256)),
        ((16, 512),) * 3, ((128, 0), (32, 1024)))
    mixed: tuple[tuple[int, int, int, int], ...] = ((2, 256, 32, 0), (8, 1024, 64, 128), (16, 512, 128, 0),
                                                     (4, 2048, 16, 512))
    repeats: int = 3                 # benchmarks/sim_cost_error.py uses 5 x 4 (tiny model, ms steps)
    rounds: int = 2


class StepTimer:
    """Times single engine steps of a real `LLMEngine` with fresh random prompts.

    Every timed step also records its `StepShape` (what the scheduler put in
    it) and seconds in ``samples``, so the timings can be fitted."""

    def __init__(self, engine, seed: int = 0) -> None:
        self.engine = engine
        engine.record_step_shapes = True         # each step's shape: engine.last_step_shape
        self.rng = random.Random(seed)
        self.vocab = min(256, engine.tokenizer.vocab_size)
        self._ids = itertools.count()
        self.samples: list[tuple[StepShape, float]] = []

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def _timed_step(self) -> tuple[float, int]:
        t0 = time.thread_time()
        self.engine.step()
        seconds = time.thread_time() - t0
        self.samples.append((self.engine.last_step_shape, seconds))
        return seconds, self.engine.last_step_tokens

    def _cache(self, cached: int) -> list[int]:
        prefix = self._tokens(cached)
        if cached:
            self.engine.add_request(f"m{next(self._ids)}", prefix + self._tokens(1), SamplingParams(max_tokens=1))
            self._drain()
        return prefix

    def prefill(self, new: int, cached: int) -> float:
        """Seconds of one step prefilling ``new`` tokens after ``cached`` cached ones."""
        return self.prefill_multi([(new, cached)])

    def prefill_multi(self, chunks: list[tuple[int, int]]) -> float:
        """Seconds of one step prefilling several prompts, ``(new, cached)`` each."""
        prefixes = [self._cache(c) for _, c in chunks]
        for (n, _), prefix in zip(chunks, prefixes):
            self.engine.add_request(f"m{next(self._ids)}", prefix + self._tokens(n), SamplingParams(max_tokens=1))
        seconds, tokens = self._timed_step()
        self._drain()
        if tokens < sum(n for n, _ in chunks):   # (more: the cached prefix's partial last block)
            raise ValueError(f"prefill step {chunks} ran {tokens} tokens in one step: raise "
                             "max_num_batched_tokens above the largest prefill size")
        return seconds

    def _start_decoders(self, batch: int, context: int, steps: int) -> None:
        per = max(1, context // batch)
        for _ in range(batch):
            self.engine.add_request(f"m{next(self._ids)}", self._tokens(per),
                                    SamplingParams(max_tokens=steps + 2, ignore_eos=True))
        while self.engine.scheduler.num_waiting or any(
                r.num_output_tokens == 0 for r in self.engine.scheduler.running):
            self.engine.step()

    def decode(self, batch: int, context: int, steps: int = 3) -> list[float]:
        """Seconds of pure decode steps of ``batch`` sequences holding ``context`` tokens in all."""
        self._start_decoders(batch, context, steps)
        times = [self._timed_step()[0] for _ in range(steps)]
        self._drain()
        return times

    def mixed(self, batch: int, context: int, new: int, cached: int) -> float:
        """Seconds of one step with ``batch`` decodes (``context`` tokens in all) and
        one prefill of ``new`` tokens after ``cached`` cached ones."""
        prefix = self._cache(cached)
        self._start_decoders(batch, context, 3)
        self.engine.add_request(f"m{next(self._ids)}", prefix + self._tokens(new), SamplingParams(max_tokens=1))
        seconds, tokens = self._timed_step()
        self._drain()
        if tokens < batch + new:
            raise ValueError(f"mixed step ({batch} decodes + {new} new) ran {tokens} tokens: raise "
                             "max_num_batched_tokens")
        return seconds


@dataclass(frozen=True)
class Cell:
    """One measured step shape: ``prefill`` (chunks of (new, cached)), ``decode``
    (batch, total context) or ``mixed`` (batch, context, new, cached)."""
    kind: str
    args: tuple

    def __post_init__(self) -> None:
        if self.kind not in ("prefill", "decode", "mixed"):
            raise ValueError(f"cell kind must be prefill, decode or mixed, got {self.kind!r}")

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return "prefill " + " + ".join(f"n={n} c={c}" for n, c in self.args)
        if self.kind == "decode":
            return f"decode b={self.args[0]} ctx={self.args[1]}"
        b, x, n, c = self.args
        return f"mixed b={b} ctx={x} + n={n} c={c}"

    def time(self, timer: StepTimer, repeats: int) -> tuple[StepShape, float]:
        """The fastest of ``repeats`` timings of this shape, and the step it was."""
        start = len(timer.samples)
        if self.kind == "prefill":
            for _ in range(repeats):
                timer.prefill_multi(list(self.args))
        elif self.kind == "decode":
            timer.decode(*self.args, steps=repeats)
        else:
            for _ in range(repeats):
                timer.mixed(*self.args)
        return min(timer.samples[start:], key=lambda st: st[1])


def grid_cells(grid: Grid) -> tuple[list[Cell], list[Cell]]:
    prefill = [Cell("prefill", ((n, c),)) for n in grid.prefill_new for c in grid.prefill_cached]
    decode = [Cell("decode", (b, x)) for b in grid.decode_batch for x in grid.decode_context]
    return prefill, decode


ESTIMATORS = ("min", "median_round_min")


def pick(rounds: list[tuple[StepShape, float]], estimator: str = "min") -> tuple[StepShape, float]:
    """A cell's step from its per-round fastest timings: ``min`` the fastest
    of all (the step's cost without interference, but one lucky timing sets
    it), ``median_round_min`` the median round's fastest (the lower middle
    one, so it is a real timing; one lucky or one disturbed round moves it
    less)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if not rounds:
        raise ValueError("pick: no timings")
    ordered = sorted(rounds, key=lambda st: st[1])
    return ordered[0] if estimator == "min" else ordered[(len(ordered) - 1) // 2]


def time_rounds(timer: StepTimer, cells: list[Cell], repeats: int, rounds: int,
                seed: int = 0) -> dict[Cell, list[tuple[StepShape, float]]]:
    """Each cell's fastest step of every round: one warm-up pass, then
    ``rounds`` passes in a shuffled order timing each cell ``repeats`` times.
    Spreading a cell's timings over the run lets bursts of load from other
    processes on a shared machine miss some of them."""
    if repeats < 1 or rounds < 1:
        raise ValueError(f"repeats and rounds must be >= 1, got {repeats} and {rounds}")
    rng = random.Random(seed)
    for c in cells:
        c.time(timer, 1)
    got: dict[Cell, list[tuple[StepShape, float]]] = {c: [] for c in cells}
    for _ in range(rounds):
        order = list(cells)
        rng.shuffle(order)
        for c in order:
            got[c].append(c.time(timer, repeats))
    timer.samples.clear()
    return got


def time_cells(timer: StepTimer, cells: list[Cell], repeats: int, rounds: int,
               seed: int = 0, estimator: str = "min") -> dict[Cell, tuple[StepShape, float]]:
    """Each cell's step (`time_rounds`, then `pick`): by default the fastest of
    its ``rounds x repeats`` timings, the step's cost without interference."""
    return {c: pick(v, estimator) for c, v in time_rounds(timer, cells, repeats, rounds, seed).items()}


def measure_engine(engine, grid: Grid = Grid(), name: str = "cpu", seed: int = 0, fit_mode: str = "fit+residual",
                   probes: list[Cell] = (), estimator: str = "median_round_min",
                   ) -> tuple[TableCostModel, dict[Cell, tuple[StepShape, float]]]:
    """Time the grid's cells (and ``probes``, interleaved with them but not
    fitted), fit `StepFit` to the grid's cells, and return the profile
    (tables + fit, in ``fit_mode``) and the probes' measured steps. Each
    cell's cost is the median round's fastest timing by default: on the
    validation model it put all 14 off-grid probes under 5% in both of two
    runs, the fastest-of-all in one (docs/simulator.md)."""
    rounds = measure_rounds(engine, grid, seed, probes)
    return build_profile(engine, grid, rounds, estimator, name, fit_mode, probes)


def fitted_cells(grid: Grid) -> list[Cell]:
    """The cells a profile is fitted to: the grid's pure prefills and decodes,
    its multi-prompt prefills and its mixed steps."""
    p_cells, d_cells = grid_cells(grid)
    return (p_cells + d_cells + [Cell("prefill", chunks) for chunks in grid.prefill_batches]
            + [Cell("mixed", m) for m in grid.mixed])


def measure_rounds(engine, grid: Grid = Grid(), seed: int = 0,
                   probes: list[Cell] = ()) -> dict[Cell, list[tuple[StepShape, float]]]:
    """Every grid cell's and probe's fastest step of each round (`time_rounds`),
    so profiles can be built from them with any `pick` estimator."""
    return time_rounds(StepTimer(engine, seed), fitted_cells(grid) + list(probes), grid.repeats, grid.rounds, seed)


def build_profile(engine, grid: Grid, rounds: dict[Cell, list[tuple[StepShape, float]]],
                  estimator: str = "median_round_min", name: str = "cpu", fit_mode: str = "fit+residual",
                  probes: list[Cell] = ()) -> tuple[TableCostModel, dict[Cell, tuple[StepShape, float]]]:
    """The profile (tables + fit) from `measure_rounds`' timings, each cell's
    cost picked by ``estimator`` (`pick`), and the probes' steps picked alike."""
    timed = {c: pick(v, estimator) for c, v in rounds.items()}
    prefill = [[timed[Cell("prefill", ((n, c),))][1] for c in grid.prefill_cached] for n in grid.prefill_new]
    decode = [[timed[Cell("decode", (b, x))][1] for x in grid.decode_context] for b in grid.decode_batch]
    fitted = [timed[c] for c in fitted_cells(grid)]
    bs = engine.block_size
    fit = StepFit.fit([StepFeatures.from_shape(st, bs) for st, _ in fitted], [t for _, t in fitted], bs)
    mc = engine.runner.model_config
    dtype_bytes = engine.runner.dtype.itemsize
    profile = TableCostModel(
        name, Table2D("prefill", grid.prefill_new, grid.prefill_cached, prefill),
        Table2D("decode", grid.decode_batch, grid.decode_context, decode), fit.coef[0],
        TransferCost(fixed_s=2e-4, per_descriptor_s=2e-5, bandwidth_bytes_per_s=1e9),
        mc.kv_bytes_per_token(dtype_bytes), engine.runner.num_blocks * engine.block_size,
        {"source": f"measured on this machine with `python -m cluster.tools.sim.measure` ({time.strftime('%Y-%m-%d')}); "
                   "transfer figures assumed (loopback TCP order of magnitude)",
         "hardware": "this machine's CPU, 1 torch thread", "model": mc.name,
         "description": f"real LLMEngine.step() thread CPU time (1 torch thread): per cell "
                        + ("the fastest of " if estimator == "min" else "the median round's fastest of ")
                        + f"{grid.rounds} shuffled rounds x {grid.repeats} timings; fit: non-negative "
                        "least squares on relative error over the cells (incl. multi-prompt prefills)",
         "scheduler": {"max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
                       "max_num_seqs": engine.config.scheduler.max_num_seqs},
         "block_size": engine.block_size},
        fit, fit_mode)
    return profile, {c: timed[c] for c in probes}


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
    profile, _ = measure_engine(make_engine(model), grid, name="cpu")
    profile.save(output)
    print(f"wrote {output}")
    return profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default="cpu_measured.json")
    ap.add_argument("--model", help="HF directory or .gguf (default: SmolLM2-135M)")
    ap.add_argument("--repeats", type=int, default=3, help="timings per cell and round (the fastest counts)")
    ap.add_argument("--rounds", type=int, default=2, help="shuffled passes over the cells")
    g = Grid()
    for name in ("prefill_new", "prefill_cached", "decode_batch", "decode_context"):
        ap.add_argument("--" + name.replace("_", "-"), type=grid_axis, default=getattr(g, name),
                        help=f"the grid's {name} (comma-separated token counts; default {getattr(g, name)})")
    args = ap.parse_args()
    grid = Grid(prefill_new=args.prefill_new, prefill_cached=args.prefill_cached, decode_batch=args.decode_batch,
                decode_context=args.decode_context, repeats=args.repeats, rounds=args.rounds)
    measure_profile(args.output, args.model, grid)


def grid_axis(text: str) -> tuple[int, ...]:
    """A grid axis from the command line: comma-separated token counts, distinct, increasing."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 0 or list(out) != sorted(set(out)):
        raise argparse.ArgumentTypeError(f"give distinct non-negative integers in increasing order, "
                                         f"comma-separated (e.g. 16,64,256); got {text!r}")
    return out


if __name__ == "__main__":
    main()
