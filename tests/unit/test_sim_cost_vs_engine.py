"""Per-step cost-model error against real CPU engine steps (tiny model).

Measures a small grid with `measure_engine` (thread CPU time, by default the fastest of
rounds x repeats timings), and in the same shuffled rounds real steps at
off-grid probe shapes (pure, multi-prompt, mixed), then compares them with
the profile's prediction in each mode. The errors are printed (run with -s);
the assertion is only a loose sanity bound, since timings on a shared 2-core
machine are noisy. benchmarks/sim_cost_error.py measures the error on a
denser grid for docs/simulator.md.
"""
import statistics

from cluster.tools.sim.cost_model import FIT_MODES
from cluster.tools.sim.measure import Cell, Grid, make_engine, measure_engine
from cluster.tools.sim.step_fit import shape_sched

GRID = Grid(prefill_new=(16, 64, 256), prefill_cached=(0, 256), decode_batch=(1, 4, 8),
            decode_context=(64, 512), prefill_batches=(((32, 0),) * 2, ((16, 0), (16, 256)), ((64, 0),) * 3),
            mixed=((2, 256, 32, 0), (4, 512, 16, 256)), repeats=3, rounds=2)
PROBES = [Cell("prefill", ((128, 0),)), Cell("prefill", ((32, 128),)), Cell("decode", (6, 300)),
          Cell("prefill", ((48, 0), (16, 128))), Cell("mixed", (3, 300, 48, 0))]


def test_step_cost_tracks_real_engine_steps(tiny_llama_dir):
    engine = make_engine(str(tiny_llama_dir), num_blocks=512, max_model_len=2048, max_num_batched_tokens=512)
    profile, measured = measure_engine(engine, GRID, probes=PROBES)
    for mode in FIT_MODES:
        model = profile.with_mode(mode)
        rel = []
        for cell, (shape, real) in measured.items():
            pred = model.step_seconds(shape_sched(shape))
            assert pred > 0
            rel.append(abs(pred - real) / real)
            print(f"{mode} {cell.label}: predicted {pred * 1e3:.2f} ms, real {real * 1e3:.2f} ms, error {rel[-1]:.1%}")
        print(f"{mode}: median |error| {statistics.median(rel):.1%}")
        assert statistics.median(rel) < 1.0
    engine.check_integrity()


def test_pick_takes_the_fastest_or_the_median_rounds_fastest():
    import pytest

    from cluster.tools.sim.measure import pick
    from engine.step_trace import StepShape
    shapes = [StepShape((), (i,)) for i in range(5)]
    rounds = list(zip(shapes, (0.010, 0.006, 0.011, 0.012, 0.0105)))
    assert pick(rounds) == (shapes[1], 0.006)                           # one lucky round sets the minimum
    assert pick(rounds, "median_round_min") == (shapes[4], 0.0105)      # the middle of five rounds
    assert pick(rounds[:4], "median_round_min") == (shapes[0], 0.010)   # even: the lower middle, a real timing
    with pytest.raises(ValueError, match="estimator must be one of"):
        pick(rounds, "mean")
    with pytest.raises(ValueError, match="no timings"):
        pick([])


def test_a_grid_axis_on_the_command_line_is_distinct_increasing_counts():
    import argparse

    import pytest

    from cluster.tools.sim.measure import grid_axis

    assert grid_axis("0,1024,2048") == (0, 1024, 2048)
    for bad in ("1024,16", "16,16", "16,x", "", "-1,4"):
        with pytest.raises(argparse.ArgumentTypeError, match="increasing order"):
            grid_axis(bad)
