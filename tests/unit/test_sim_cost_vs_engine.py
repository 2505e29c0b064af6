"""Per-step cost-model error against real CPU engine steps (tiny model).

Fills a table with `measure_engine` on a coarse grid, then times real
`LLMEngine.step()` calls at off-grid points and compares them with the
interpolated prediction. The error is printed (run with -s to see it); the
assertion is only a loose sanity bound, since wall time on a shared 2-core
machine is noisy. docs/simulator.md reports the measured error.
"""
import statistics

from cluster.sim.measure import Grid, StepTimer, make_engine, measure_engine

GRID = Grid(prefill_new=(16, 64, 256), prefill_cached=(0, 256), decode_batch=(1, 4, 8),
            decode_context=(64, 512), repeats=5)
PREFILL_POINTS = [(128, 0), (128, 256), (32, 128)]
DECODE_POINTS = [(2, 256), (6, 300)]


def test_interpolated_step_cost_tracks_real_engine_steps(tiny_llama_dir):
    engine = make_engine(str(tiny_llama_dir), num_blocks=512, max_model_len=2048, max_num_batched_tokens=512)
    model = measure_engine(engine, GRID)
    timer = StepTimer(engine, seed=1)
    errors = {}
    for n, c in PREFILL_POINTS:
        real = min(timer.prefill(n, c) for _ in range(5))
        errors[f"prefill n={n} c={c}"] = (model.pure_prefill(n, c), real)
    for b, x in DECODE_POINTS:
        real = min(timer.decode(b, x, 5))
        errors[f"decode b={b} ctx={x}"] = (model.pure_decode(b, x), real)
    rel = {k: abs(p - r) / r for k, (p, r) in errors.items()}
    for k, (p, r) in errors.items():
        print(f"{k}: predicted {p * 1e3:.2f} ms, real {r * 1e3:.2f} ms, error {rel[k]:.1%}")
    print(f"median |error| {statistics.median(rel.values()):.1%}")
    assert all(p > 0 for p, _ in errors.values())
    assert statistics.median(rel.values()) < 1.0
    engine.check_integrity()
