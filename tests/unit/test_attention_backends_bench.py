"""benchmarks/attention_backends.py: the layer case runs each backend on the same shape and
reports its time and GFLOPS beside SDPA on a contiguous copy (a guard against the script
drifting from the backend API; its figures are in docs/benchmarks.md, never asserted)."""
from __future__ import annotations

from bench_scripts import load_bench_script
from engine.attention.kernels import cpu_kernel_available


def test_layer_case_reports_every_backend_and_the_reference():
    bench = load_bench_script("attention_backends")
    backends = ("cpu_paged", "torch_paged") if cpu_kernel_available() else ("torch_paged",)
    out = bench.layer_case(24, 40, backends)          # a chunk after a prefix, blocks of 16
    for name in (*backends, "sdpa_contiguous"):
        assert out[f"{name}_ms"] > 0 and out[f"{name}_gflops"] > 0
    decode = bench.layer_case(1, 33, ("torch_paged",))
    assert set(decode) == {"torch_paged_ms", "torch_paged_gflops", "sdpa_contiguous_ms", "sdpa_contiguous_gflops"}

